"""Kill and resume: real subprocess runs stopped by SIGTERM/SIGINT, resumed into the same
folder, against an uninterrupted run with the same seed (fp32, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, logged, subprocess_env

QUIET = ["callbacks=minimal", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false"]


def gpt(root: Path) -> list[str]:
    """A 2-epoch run of 6 steps each: tiny GPT with dropout (global RNG), random windows
    from a seeded sampler, warm-up + cosine LR per step."""
    return ["experiment=shakespeare_gpt", f"data.root={root}", "data.block_size=32",
            "data.batch_size=8", "data.train_windows=48", "data.val_windows=4",
            "model.n_layer=2", "model.n_embd=32", "model.sample_tokens=8",
            "model.scheduler.warmup_steps=3", "trainer.max_epochs=2",
            "trainer.log_every_n_steps=1", *QUIET]


# U-Net on the synthetic set: 8 images, batch 2 -> 4 shuffled batches per epoch (the
# loader's own generator), 2 epochs
UNET = ["data.image_size=32", "data.num_train=8", "data.num_val=2", "data.batch_size=2",
        "trainer.max_epochs=2", "trainer.accelerator=cpu", "trainer.log_every_n_steps=1",
        "model.arch_kwargs.decoder_channels=[16,16,8,8,8]", *QUIET]


def train_proc(run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    env = dict(subprocess_env(), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(REPO / "train.py"), *overrides,
                           f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=env,
                          capture_output=True, text=True, timeout=600)


def kill_at(step: int, name: str = "SIGTERM", once: Path | None = None) -> list[str]:
    """The callback that stops the run at ``step``; with ``once`` (a file it creates), only
    the first time, so a resume that inherits it from the run's overrides trains on."""
    return ["+callbacks.kill._target_=tests.helpers.SignalAtStep", f"+callbacks.kill.step={step}",
            f"+callbacks.kill.signal={name}"] + (
        [f"+callbacks.kill.once_file={once}"] if once else [])


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def ckpt(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False,
                      map_location="cpu")


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory, shakespeare_root):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    proc = train_proc(run_dir, gpt(shakespeare_root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def assert_same_run(reference: Path, resumed: Path, steps: int) -> None:
    losses = logged(reference, "train/loss_step")
    assert sorted(losses) == list(range(steps))  # CSV steps are 0-based logger steps
    assert logged(resumed, "train/loss_step") == losses  # every step, bit for bit
    assert logged(resumed, "val/loss") == logged(reference, "val/loss")
    ref, res = ckpt(reference), ckpt(resumed)
    assert res["global_step"] == ref["global_step"] == steps
    assert summary(resumed)["global_step"] == steps
    for key, value in ref["state_dict"].items():
        assert torch.equal(res["state_dict"][key], value), key


# 3 subprocess train runs each (the reference too), so test-all. In `make test`,
# tests/test_resume_run_config.py stops a run by SIGTERM and resumes it bit for bit through
# the command line, and test_a_max_steps_stop_inside_an_epoch_resumes_that_epoch resumes this
# GPT (dropout, seeded sampler) bit for bit in process.
@pytest.mark.slow
@pytest.mark.parametrize("step", [
    pytest.param(2, id="mid-epoch"),
    pytest.param(5, id="last-batch-of-epoch"),
])
def test_sigterm_then_resume_gives_the_uninterrupted_losses(tmp_path, shakespeare_root,
                                                            gpt_reference, step):
    run_dir = tmp_path / "run"
    killed = train_proc(run_dir, [*gpt(shakespeare_root),
                                  *kill_at(step, once=tmp_path / "killed")])
    assert killed.returncode == 128 + signal.SIGTERM, killed.stderr[-3000:]
    stopped = summary(run_dir)
    assert stopped["status"] == "interrupted" and stopped["signal"] == "SIGTERM"
    assert stopped["error"] == "stopped by SIGTERM"
    # the signal arrived while step+1 ran: that step completes, is saved, then the run stops
    assert stopped["global_step"] == step + 1 == ckpt(run_dir)["global_step"]
    assert stopped["last_model_path"] == str(run_dir / "checkpoints" / "last.ckpt")
    rows_before = logged(run_dir, "train/loss_step")
    assert sorted(rows_before) == list(range(step + 1))

    resumed = train_proc(run_dir, [*gpt(shakespeare_root),
                                   f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["status"] == "completed"
    assert summary(run_dir)["resumed_from"].endswith("last.ckpt")
    assert_same_run(gpt_reference, run_dir, steps=12)


def test_a_max_steps_stop_inside_an_epoch_resumes_that_epoch(tmp_path, shakespeare_root):
    """A run stopped by ``trainer.max_steps`` inside its first epoch (step 4 of 6), then
    resumed with the limit lifted (``trainer.max_steps=-1``), trains the rest of that epoch
    and the next: the uninterrupted run's losses and weights. Written at train end instead,
    the checkpoint counted the epoch as finished, and the resumed run trained 8 steps in
    all, not 12. (No LR schedule here: warm-up + cosine runs over ``max_steps``, so a first
    run with another limit has other learning rates.) In process: no signal is involved."""
    from remat.train import train
    from tests.helpers import compose_train

    overrides = [*gpt(shakespeare_root), "model.scheduler=null"]
    train(compose_train(tmp_path / "reference", overrides))
    run_dir = tmp_path / "run"
    first = train(compose_train(run_dir, [*overrides, "trainer.max_steps=4"]))
    assert first["global_step"] == 4 == ckpt(run_dir)["global_step"]
    assert ckpt(run_dir)["epoch"] == 0  # the epoch is still open in the checkpoint
    # the resume keeps the run's own config, limit included, unless the command line lifts it
    train(compose_train(run_dir, [*overrides, "trainer.max_steps=-1",
                                  f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"]))
    assert_same_run(tmp_path / "reference", run_dir, steps=12)


@pytest.fixture(scope="module")
def unet_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    proc = train_proc(run_dir, UNET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow  # ~40 s each
@pytest.mark.parametrize("step", [1, 3], ids=["mid-epoch", "last-batch-of-epoch"])
def test_sigint_then_resume_of_a_shuffled_loader_is_exact(tmp_path, unet_reference, step):
    """The synthetic set's loader shuffles with its own generator; the U-Net's cosine LR
    steps per epoch (the epoch-end case checks it is stepped once)."""
    run_dir = tmp_path / "run"
    reference = unet_reference
    killed = train_proc(run_dir, [*UNET, *kill_at(step, "SIGINT", tmp_path / "killed")])
    assert killed.returncode == 128 + signal.SIGINT, killed.stderr[-3000:]
    assert summary(run_dir)["status"] == "interrupted"
    assert summary(run_dir)["signal"] == "SIGINT"
    assert summary(run_dir)["error"] == "stopped by SIGINT"  # not Lightning's SIGTERMException
    assert ckpt(run_dir)["global_step"] == step + 1
    resumed = train_proc(run_dir, [*UNET, f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(reference, run_dir, steps=8)


@pytest.mark.slow  # 33 s; the same handler's promise runs by default in
# tests/test_resume_run_config.py (SIGTERM at step 3: exit 143, the step saved, resumed exactly)
def test_sigterm_from_outside_saves_a_checkpoint_and_exits_non_zero(tmp_path):
    """``kill -TERM <pid>`` while the run trains: status interrupted, last.ckpt at the last
    completed step, exit code 143."""
    run_dir = tmp_path / "run"
    env = dict(subprocess_env(), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *UNET,
                             "trainer.max_epochs=1000", f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            path = run_dir / "summary.json"
            if path.is_file() and json.loads(path.read_text())["status"] == "running":
                break
            time.sleep(0.2)
        time.sleep(1.0)  # a few steps in
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped = summary(run_dir)
    assert stopped["status"] == "interrupted" and stopped["signal"] == "SIGTERM"
    assert stopped["error"] == "stopped by SIGTERM"
    assert stopped["global_step"] == ckpt(run_dir)["global_step"] >= 1


def test_ctrl_c_before_the_training_loop_exits_130_not_lightnings_1():
    """Lightning turns a KeyboardInterrupt outside its loop (the start-of-run estimate) into
    exit(1) inside its handler; the run still ends with the shell's 128 + SIGINT."""
    from remat.runs import exit_code

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise SystemExit(1)  # noqa: B904 - as Lightning's _call_and_handle_interrupt
    except SystemExit as err:
        assert exit_code(err, []) == 130
    assert exit_code(SystemExit(0), []) is None  # a plain exit stays what it was
    assert exit_code(ValueError("x"), []) is None


@pytest.mark.slow  # 4 subprocess runs with DataLoader workers, ~2 min
def test_a_resume_with_workers_draws_the_uninterrupted_augmentation(tmp_path):
    """A folder of images, random crops, flips and jitter drawn inside 2 DataLoader workers:
    the resumed run's workers start afresh at the checkpoint (before, they carried their RNG
    on from the epoch's start: every step after the resume was off, 0.38287 against
    0.38112), and the run equals one without workers."""
    from tests.data.test_folder import write_folder

    root = tmp_path / "images"
    write_folder(root, n=10, size=(40, 48))
    run = ["data=folder", f"data.root={root}", "data.patch_size=32", "data.batch_size=2",
           "data.val_fraction=0.2", "trainer.max_epochs=2", "trainer.accelerator=cpu",
           "trainer.log_every_n_steps=1", "model.arch_kwargs.decoder_channels=[16,16,8,8,8]",
           *QUIET]
    workers = [*run, "data.num_workers=2"]
    reference, plain, run_dir = tmp_path / "ref", tmp_path / "plain", tmp_path / "run"
    for where, overrides in ((reference, workers), (plain, [*run, "data.num_workers=0"])):
        done = train_proc(where, overrides)
        assert done.returncode == 0, done.stderr[-3000:]
    killed = train_proc(run_dir, [*workers, *kill_at(5, once=tmp_path / "killed")])
    assert killed.returncode == 128 + signal.SIGTERM, killed.stderr[-3000:]
    resumed = train_proc(run_dir, [*workers,
                                   f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(reference, run_dir, steps=8)  # 4 batches of 2 an epoch (8 train images)
    assert logged(plain, "train/loss_step") == logged(reference, "train/loss_step")
