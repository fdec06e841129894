"""A run killed between the two renames of a sharded-checkpoint swap keeps its checkpoint:
``last.ckpt`` is restored when the run starts again (``ckpt_path=last`` finds it)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from remat.models.fsdp import recover_swapped_checkpoints
from remat.runs import checkpoint_to_resume, resolve_last


def _shard_folder(path, text):
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_text(text)
    return path


def _cfg(out):
    return OmegaConf.create({"paths": {"output_dir": str(out)}, "callbacks": {},
                             "ckpt_path": "last"})


def test_ckpt_path_last_restores_the_written_copy_when_last_ckpt_is_missing(tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    _shard_folder(folder / ".last.ckpt.old", "step 4")
    _shard_folder(folder / ".last.ckpt.writing", "step 8")  # written by every rank
    assert resolve_last(_cfg(tmp_path)) == str(folder / "last.ckpt")
    assert (folder / "last.ckpt" / "__0_0.distcp").read_text() == "step 8"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
    assert "restored it from .last.ckpt.writing" in caplog.text


def test_the_previous_copy_is_restored_when_no_written_copy_is_left(tmp_path):
    folder = tmp_path / "checkpoints"
    _shard_folder(folder / ".last.ckpt.old", "step 4")
    assert recover_swapped_checkpoints(folder) == [folder / "last.ckpt"]
    assert (folder / "last.ckpt" / "__0_0.distcp").read_text() == "step 4"


def test_a_stale_previous_copy_beside_its_checkpoint_is_removed(tmp_path):
    folder = tmp_path / "checkpoints"
    _shard_folder(folder / "last.ckpt", "step 8")
    _shard_folder(folder / ".last.ckpt.old", "step 4")
    assert recover_swapped_checkpoints(folder) == []
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
    assert (folder / "last.ckpt" / "__0_0.distcp").read_text() == "step 8"


def test_an_explicit_ckpt_path_to_the_missing_checkpoint_is_restored(tmp_path):
    """``ckpt_path=<run>/checkpoints/last.ckpt`` given by hand: restored before it is read
    (this fake shard folder then fails as a shard folder, not as a missing file)."""
    folder = tmp_path / "checkpoints"
    _shard_folder(folder / ".last.ckpt.old", "step 4")
    (folder / ".last.ckpt.old" / ".metadata").write_bytes(b"")
    cfg = _cfg(tmp_path)
    cfg.ckpt_path = str(folder / "last.ckpt")
    with pytest.raises(Exception) as err:
        checkpoint_to_resume(cfg)
    assert "no such file" not in str(err.value)
    assert (folder / "last.ckpt" / "__0_0.distcp").read_text() == "step 4"
