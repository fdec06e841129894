"""Resume with nothing repeated: ``python train.py ckpt_path=<run>/checkpoints/last.ckpt``
rebuilds the run from its own overrides and config.yaml (real subprocess runs), keeps the
run's files, and a resume that fails leaves them byte for byte as they were."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from remat.run_config import restore_run_config, resume_args, run_group_args, run_overrides
from tests.helpers import REPO, logged, run_python

# a run made with its own overrides (none of them the defaults), killed once at step 3
RUN = ["data.image_size=32", "data.num_train=8", "trainer.max_epochs=2",
       "model.arch_kwargs.decoder_channels=[16,16,8,8,8]", "data.num_val=2",
       "data.batch_size=2", "trainer.log_every_n_steps=1", "callbacks=minimal",
       "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def files_of(run: Path) -> dict[str, bytes]:
    """Every file of a run folder but its lock and the attempt folders, by relative path."""
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*")
            if p.is_file() and p.name != ".lock" and "resumes" not in p.relative_to(run).parts}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run, and the same run killed (SIGTERM) at step 3 and resumed with
    ``ckpt_path`` alone."""
    root = tmp_path_factory.mktemp("resume")
    train_py = str(REPO / "train.py")
    reference = run_python([train_py, *RUN, f"hydra.run.dir={root / 'ref'}"], cwd=root)
    assert reference.returncode == 0, reference.stderr[-3000:]
    kill = ["+callbacks.kill._target_=tests.helpers.SignalAtStep", "+callbacks.kill.step=3",
            f"+callbacks.kill.once_file={root / 'killed'}"]
    run = root / "run"
    first = run_python([train_py, *RUN, *kill, f"hydra.run.dir={run}"], cwd=root)
    assert first.returncode == 143, first.stderr[-3000:]
    stopped = json.loads((run / "summary.json").read_text())
    stopped["checkpoint_step"] = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu",
                                            weights_only=False)["global_step"]
    kept = files_of(run)
    resumed = run_python([train_py, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"],
                         cwd=root)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    yield root / "ref", run, kept, stopped
    shutil.rmtree(root, ignore_errors=True)  # three runs' checkpoints: about 500 MB


def test_sigterm_saves_the_step_it_interrupted_and_says_so(runs):
    _, run, _, stopped = runs
    assert stopped["status"] == "interrupted" and stopped["signal"] == "SIGTERM"
    assert stopped["error"] == "stopped by SIGTERM"
    # the signal arrived while step 4 ran: that step completes, is saved, then the run stops
    assert stopped["global_step"] == 4 == stopped["checkpoint_step"]
    assert stopped["last_model_path"] == str(run / "checkpoints" / "last.ckpt")


def test_ckpt_path_alone_continues_the_run_exactly(runs):
    reference, run, _, _ = runs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 8
    losses = logged(reference, "train/loss_step")
    assert sorted(losses) == list(range(8))
    assert logged(run, "train/loss_step") == losses  # the same 8 steps, bit for bit
    assert logged(run, "val/loss") == logged(reference, "val/loss")
    ours, theirs = (torch.load(r / "checkpoints" / "last.ckpt", map_location="cpu",
                               weights_only=False) for r in (run, reference))
    assert ours["global_step"] == theirs["global_step"] == 8
    for key, value in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key


def test_a_resume_keeps_the_runs_files_and_records_its_attempt(runs):
    _, run, kept, _ = runs
    now = files_of(run)
    for name in ("config.yaml", ".hydra/config.yaml", ".hydra/overrides.yaml",
                 ".hydra/hydra.yaml"):
        assert now[name] == kept[name], name  # the run's own record, untouched
    (attempt,) = (run / "resumes").iterdir()
    typed = OmegaConf.to_container(OmegaConf.load(attempt / "overrides.yaml"))
    assert typed == [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"]
    assert (attempt / ".hydra" / "overrides.yaml").is_file() and (attempt / "train.log").is_file()
    composed = OmegaConf.load(attempt / "config.yaml")
    assert composed.data.image_size == 32 and composed.trainer.max_epochs == 2
    assert composed.model.arch_kwargs.decoder_channels == [16, 16, 8, 8, 8]


def test_a_failed_resume_leaves_every_file_byte_identical(runs, tmp_path):
    _, run, _, _ = runs
    before = files_of(run)
    bad = run_python([str(REPO / "train.py"), "ckpt_path=last", f"hydra.run.dir={run}",
                      "precision=bogus"], cwd=tmp_path)
    assert bad.returncode == 1
    last_line = bad.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: precision='bogus' is not supported")
    assert "Traceback" not in bad.stderr
    assert files_of(run) == before
    failed = [p for p in (run / "resumes").iterdir() if (p / "summary.json").is_file()]
    assert len(failed) == 1 and "precision" in json.loads(
        (failed[0] / "summary.json").read_text())["error"]
    # a later resume does not take over the failed attempt's overrides
    assert "precision=bogus" not in run_overrides(run)


def test_resume_args_put_the_runs_overrides_first_and_typed_ones_win(tmp_path, monkeypatch):
    monkeypatch.delenv("REMAT_USER_OVERRIDES", raising=False)  # resume_args sets it
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "config.yaml").write_text("seed: 1\n")
    OmegaConf.save(OmegaConf.create(["model=gpt_tiny", "trainer.max_epochs=3",
                                     "+callbacks.kill._target_=x.Y", "+callbacks.kill.step=2",
                                     "ckpt_path=/elsewhere.ckpt"]),
                   run / ".hydra" / "overrides.yaml")
    ckpt = f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
    args = resume_args([ckpt, "trainer.max_epochs=5", "~callbacks.kill"])
    assert args[:2] == ["model=gpt_tiny", ckpt]  # kill added by the run and deleted: both go
    assert "trainer.max_epochs=5" in args and "trainer.max_epochs=3" not in args
    assert f"hydra.run.dir={run}" in args
    assert any(a.startswith("hydra.output_subdir=resumes/") for a in args)
    assert resume_args(args) == args  # completed once (a DDP rank re-runs the command)
    assert resume_args(["-m", ckpt]) == ["-m", ckpt]
    assert resume_args(["ckpt_path=/no/run/last.ckpt"]) == ["ckpt_path=/no/run/last.ckpt"]


def test_restore_sets_back_what_a_newer_default_changed(tmp_path):
    run_config = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create({"a": 1, "b": {"c": [1, 2]}, "size": 32, "d": 32,
                                     "paths": {"output_dir": "/old"}, "ckpt_path": None}),
                   run_config)
    cfg = OmegaConf.create({"a": 2, "b": {"c": [1, 3]}, "size": 64, "d": "${size}",
                            "paths": {"output_dir": "/new"}, "ckpt_path": "x"})
    restored, changed = restore_run_config(cfg, run_config, ["size=64"])
    assert cfg.a == 1 and list(cfg.b.c) == [1, 2]  # defaults of the run, set back
    assert cfg.size == 64 and cfg.d == 64  # typed, and what follows it
    assert cfg.paths.output_dir == "/new" and cfg.ckpt_path == "x"
    assert restored == ["a: 2 -> 1", "b.c: [1, 3] -> [1, 2]"]
    assert changed == ["size: 32 -> 64"]


def test_eval_and_predict_refuse_a_data_key_the_runs_data_lacks(tmp_path):
    """A run trained on synthetic data has no data.root: ``data.root=<folder>`` alone used to
    end in Hydra's "Key 'root' is not in struct"; now the error names the run's data and the
    fix, and the same override with the dataset given (or added with +) passes through."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    (run / ".hydra").mkdir()
    OmegaConf.save({"hydra": {"runtime": {"choices": {"data": "synthetic_seg",
                                                      "model": "unet_resnet18"}}}},
                   run / ".hydra" / "hydra.yaml")
    OmegaConf.save({"data": {"_target_": "x", "num_val": 4}, "model": {"lr": 1e-3}},
                   run / "config.yaml")
    ckpt = f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
    with pytest.raises(ValueError, match=r"data.root: the run was trained with "
                                         r"data=synthetic_seg.*data=folder data.root="):
        run_group_args([ckpt, "data.root=/x", "split=all"])
    with pytest.raises(ValueError, match=r"model.width: .*model=unet_resnet18.*model=<name>"):
        run_group_args([ckpt, "model.width=3"])
    assert run_group_args([ckpt, "data=folder", "data.root=/x"]) == [
        "model=unet_resnet18", ckpt, "data=folder", "data.root=/x"]
    assert run_group_args([ckpt, "data.num_val=2", "+data.extra=1"])[:2] == [
        "data=synthetic_seg", "model=unet_resnet18"]
    # a key the run's saved config lacks but today's synthetic_seg has (a newer setting)
    assert run_group_args([ckpt, "data.num_train=3"])[-1] == "data.num_train=3"


def test_a_seed_typed_on_a_resume_is_set_back_and_said(tmp_path, caplog):
    """The resume goes on from the checkpoint's random state: seed=7 drew nothing (every
    loss was seed 42's) while summary.json recorded 7."""
    from remat.runs import RunStart

    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(OmegaConf.create({"seed": 42, "precision": "32-true", "data": {"seed": 42}}),
                   run / "config.yaml")
    cfg = OmegaConf.create({"seed": 7, "precision": "32-true", "data": {"seed": 5}})
    with caplog.at_level("WARNING", logger="remat.runs"):
        RunStart(run, source=run, typed=("seed=7", "data.seed=5")).rebuild(cfg)
    assert cfg.seed == 42 and cfg.data.seed == 42  # the loader's generator is restored too
    assert "seed=7 has no effect on a resume" in caplog.text and "stays 42" in caplog.text
    assert "data.seed=5 has no effect on a resume" in caplog.text
