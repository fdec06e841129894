"""A DDP run (2 CPU processes, gloo) stopped inside an epoch and resumed trains every rank on
the batches of the uninterrupted run: the same per-step losses on both ranks and the same
weights (tests/ddp_resume_script.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import launch_report, logged, rank_losses, subprocess_env

# 2-process gloo launches: one at a time, on one xdist worker (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("gloo")

SCRIPT = Path(__file__).with_name("ddp_resume_script.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp_resume")
    env = dict(subprocess_env(), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, launch_report(proc.stdout + proc.stderr)
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.parametrize("folder", ["killed", "killed_end"],
                         ids=["inside-an-epoch", "at-an-epoch-end"])
def test_kill_then_resume_repeats_every_rank_s_losses(runs, folder):
    straight, killed = runs / "straight", runs / folder
    # the stop: SIGTERM reached rank 1 alone, every rank saved step 4 (3) and exited 143
    assert [(killed / f"exit_rank{r}").read_text() for r in (0, 1)] == ["143", "143"]
    assert (killed / "stopped_at").read_text() == ("4" if folder == "killed" else "3")
    assert json.loads((killed / "summary.json").read_text())["global_step"] == 6
    for rank in (0, 1):
        reference = rank_losses(straight, rank)
        assert sorted(reference) == list(range(1, 7))  # 3 steps per epoch, 2 epochs
        resumed = rank_losses(killed, rank)  # steps 1-4 before the stop, 5-6 after it
        assert resumed == reference, (rank, {s: abs(resumed.get(s, float("nan")) - v)
                                             for s, v in reference.items()})
    # the ranks trained different batches (each its share of the epoch)
    assert rank_losses(straight, 0) != rank_losses(straight, 1)
    assert logged(killed, "train/loss_step") == logged(straight, "train/loss_step")
    ours, theirs = _weights(killed), _weights(straight)
    assert ours.keys() == theirs.keys() and len(ours) > 10
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
