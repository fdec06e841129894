"""Checkpoints under trainer=fsdp: sharded and full ``last.ckpt``, resumed on 2 processes and
on 1, with the loss curve of an uninterrupted run (tests/fsdp_resume_script.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from remat.models.checks import (
    check_checkpoint_fits,
    is_sharded_checkpoint,
    read_checkpoint,
    sharded_weights,
)
from remat.train import train
from tests.fsdp_resume_script import overrides
from tests.helpers import (
    compose_train,
    launch_report,
    logged,
    rank_losses,
    run_python,
    subprocess_env,
)

SCRIPT = Path(__file__).with_name("fsdp_resume_script.py")
# multi-process runs (gloo ports, 2 processes each) run one at a time under xdist
pytestmark = pytest.mark.xdist_group("gloo")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shakespeare_root) -> Path:
    out = tmp_path_factory.mktemp("fsdp_resume")
    env = dict(subprocess_env(), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(SCRIPT), str(out), str(shakespeare_root)], env=env, capture_output=True,
        text=True, timeout=600)
    assert proc.returncode == 0, launch_report(proc.stdout + proc.stderr)
    return out


def _state(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    if is_sharded_checkpoint(ckpt):
        file = tmp / f"{ckpt.parent.parent.name}.pt"
        dcp_to_torch_save(ckpt, file)
        return torch.load(file, weights_only=True)["state_dict"]
    return torch.load(ckpt, weights_only=True)["state_dict"]


def test_sharded_resume_on_2_processes_repeats_the_uninterrupted_run(runs, tmp_path):
    straight, resumed = runs / "straight", runs / "first"
    losses = logged(straight, "train/loss_step")
    assert sorted(losses) == list(range(6))
    # the resumed folder logged epoch 1 before the stop and epoch 2 after it: the same values
    # (dropout 0.1: each rank's RNG is restored, not only rank 0's)
    assert logged(resumed, "train/loss_step") == losses
    assert is_sharded_checkpoint(straight / "checkpoints" / "last.ckpt")
    ours = _state(resumed / "checkpoints" / "last.ckpt", tmp_path)
    theirs = _state(straight / "checkpoints" / "last.ckpt", tmp_path)
    assert ours.keys() == theirs.keys() and len(ours) > 10
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    assert not list((resumed / "checkpoints").glob(".*"))  # no staging folder left behind
    import json

    sharding = json.loads((straight / "summary.json").read_text())["sharding"]
    assert sharding == {"units": [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]],
                        "world_size": 2, "reshard_after_forward": True}
    # the run's measured peak is the highest rank's; each rank's is kept beside it
    summary = json.loads((straight / "summary.json").read_text())
    ranks = summary["peak_memory_per_rank_bytes"]
    assert len(ranks) == 2 and all(isinstance(p, int) and p > 0 for p in ranks)
    assert summary["peak_memory_bytes"] == max(ranks)


def test_kill_inside_an_epoch_then_resume_repeats_every_rank_s_losses(runs, tmp_path):
    """The text loader's windows (a WindowSampler) shared over 2 FSDP ranks: after a stop
    inside epoch 1 each rank trains the rest of its share of that epoch's windows."""
    straight, killed = runs / "straight", runs / "killed"
    assert [(killed / f"exit_rank{r}").read_text() for r in (0, 1)] == ["143", "143"]
    for rank in (0, 1):
        reference = rank_losses(straight, rank)
        assert sorted(reference) == list(range(1, 7))
        assert rank_losses(killed, rank) == reference, rank
    assert rank_losses(straight, 0) != rank_losses(straight, 1)
    ours = _state(killed / "checkpoints" / "last.ckpt", tmp_path)
    theirs = _state(straight / "checkpoints" / "last.ckpt", tmp_path)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_full_checkpoint_resumes_on_one_process_without_fsdp(runs, tmp_path,
                                                             shakespeare_root):
    ckpt = runs / "full" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    data = read_checkpoint(ckpt)
    optimizer = data["optimizer_states"][0]
    assert all(isinstance(k, int) for k in optimizer["state"])  # plain torch layout
    # 1 process, the batch of both ranks: continues from global step 3 to 6
    cfg = compose_train(tmp_path / "one", overrides(
        str(shakespeare_root), 2, "trainer=cpu", "data.batch_size=8", f"ckpt_path={ckpt}"))
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["global_step"] == 6
    assert sorted(logged(tmp_path / "one", "train/loss_step")) == [3, 4, 5]


def test_sharded_checkpoint_read_without_loading_and_refused_by_a_plain_trainer(
        runs, tmp_path, shakespeare_root):
    ckpt = runs / "straight" / "checkpoints" / "last.ckpt"
    data = read_checkpoint(ckpt)
    assert data["global_step"] == 6
    assert all(t.device.type == "meta" for t in data["state_dict"].values())
    cfg = compose_train(tmp_path / "plain", overrides(str(shakespeare_root), 3, "trainer=cpu",
                                                      f"ckpt_path={ckpt}"))
    from hydra.utils import instantiate

    model = instantiate(cfg.model)
    check_checkpoint_fits(model, data, ckpt)  # keys and shapes fit
    # remat.eval gathers the shards on one process and loads them strictly
    weights = sharded_weights(ckpt)
    model.load_state_dict(weights)
    assert torch.equal(model.state_dict()["net.tok_emb.weight"], weights["net.tok_emb.weight"])
    assert all(t.device.type == "cpu" for t in weights.values())
    with pytest.raises(ValueError, match=r"sharded checkpoint.*trainer=fsdp on any number "
                                         r"of processes.*save_distributed_checkpoint=false"):
        train(cfg)


def test_sigterm_on_rank_0_alone_stops_every_rank_with_a_checkpoint(runs):
    """Without agreement rank 1 would wait in its next collective for rank 0 (a hang)."""
    import json

    folder = runs / "signalled"
    assert [(folder / f"exit_rank{r}").read_text() for r in (0, 1)] == ["143", "143"]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["global_step"] == 2
    assert read_checkpoint(folder / "checkpoints" / "last.ckpt")["global_step"] == 2


@pytest.mark.slow
def test_python_train_py_fsdp_then_resume_sharded_on_one_process(tmp_path, shakespeare_root,
                                                                  runs):
    """The command line: Lightning's launcher starts rank 1 itself, and a sharded checkpoint
    of 2 ranks resumes on 1 (the shards are redistributed)."""
    ckpt = runs / "first" / "checkpoints" / "last.ckpt"
    args = [str(Path(__file__).parents[1] / "train.py"),
            *overrides(str(shakespeare_root), 3, "trainer.devices=1", f"ckpt_path={ckpt}",
                       f"paths.output_dir={tmp_path / 'one'}")]
    proc = run_python(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(logged(tmp_path / "one", "train/loss_step")) == [6, 7, 8]
    proc = run_python([args[0], *overrides(str(shakespeare_root), 1,
                                           f"paths.output_dir={tmp_path / 'two'}")],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(logged(tmp_path / "two", "train/loss_step")) == [0, 1, 2]
    assert is_sharded_checkpoint(tmp_path / "two" / "checkpoints" / "last.ckpt")
    assert os.path.isfile(tmp_path / "two" / "summary.json")
