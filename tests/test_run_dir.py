"""One folder per run (unique names, a lock no two live runs share), Hydra callbacks and the
console scripts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest
import tomllib

from remat.callbacks import RunDirInUse, claim_run_dir, release_run_dir
from remat.train import train
from tests.helpers import REPO, TINY, compose_train, subprocess_env

FAST = ["data.image_size=32", "data.num_train=2", "data.num_val=2", "data.batch_size=2",
        "trainer.max_steps=1", "trainer.accelerator=cpu", "callbacks=minimal",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "model.arch_kwargs.decoder_channels=[16,16,8,8,8]"]


def _start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *FAST, *args], cwd=cwd,
                            env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # two concurrent train.py runs, 17 s: the in-use tests below stay
def test_two_runs_started_at_once_get_two_folders(tmp_path):
    procs = [_start(tmp_path), _start(tmp_path)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:]
    runs = sorted(p.parent for p in (tmp_path / "outputs").glob("*/*/summary.json"))
    assert len(runs) == 2 and runs[0] != runs[1]
    for run in runs:  # each folder holds one run's files, each complete
        assert json.loads((run / "summary.json").read_text())["status"] == "completed"
        assert (run / "checkpoints" / "last.ckpt").is_file()
        assert (run / ".hydra" / "config.yaml").is_file()


def test_a_run_whose_folder_is_in_use_fails_before_writing_anything(tmp_path):
    busy = tmp_path / "busy"
    claim_run_dir(busy)  # a live run (this process) holds the folder
    try:
        proc = _start(tmp_path, f"hydra.run.dir={busy}")
        _, err = proc.communicate(timeout=600)
    finally:
        release_run_dir(busy)
    assert proc.returncode != 0
    assert f"output folder {busy} is in use by another run (pid" in err
    assert sorted(p.name for p in busy.iterdir()) == [".lock"]  # no .hydra/, no log


def test_a_finished_run_is_neither_overwritten_nor_wiped_by_a_resume(tmp_path, caplog):
    run = tmp_path / "run"
    first = train(compose_train(run, TINY))  # to trainer.max_epochs, as a user's run ends
    files = {p.name: p.read_bytes() for p in [run / "summary.json", run / "config.yaml",
                                              run / "checkpoints" / "last.ckpt"]}
    assert first["metrics"] and json.loads(files["summary.json"])["metrics"]

    # a new run (no ckpt_path) into the finished run's folder: refused by the Hydra
    # callback before Hydra writes anything there
    again = _start(tmp_path, f"hydra.run.dir={run}")
    _, err = again.communicate(timeout=600)
    assert again.returncode != 0
    assert f"output folder {run} already holds a run with status 'completed'" in err
    assert "ckpt_path=" in err and not (run / ".hydra").exists()

    # resuming the finished run trains nothing and keeps its summary as it was
    last = run / "checkpoints" / "last.ckpt"
    with caplog.at_level("WARNING", logger="remat.callbacks.summary"):
        kept = train(compose_train(run, [*TINY, f"ckpt_path={last}"]))
    assert "nothing to train" in caplog.text
    assert kept == first
    assert (run / "summary.json").read_bytes() == files["summary.json"]
    assert last.read_bytes() == files["last.ckpt"]


def test_train_claims_its_folder_and_the_same_process_may_claim_again(tmp_path):
    folder = claim_run_dir(tmp_path / "a")
    assert claim_run_dir(tmp_path / "a") == folder  # counted, not refused
    release_run_dir(folder)
    summary = train(compose_train(tmp_path / "a", [*TINY, "trainer.max_steps=1"]))
    assert summary["status"] == "completed"
    release_run_dir(folder)
    assert (tmp_path / "a" / ".lock").read_text().startswith("pid ")


def test_in_use_error_names_the_holder(tmp_path):
    # a second process holding the lock: this one is refused, naming it
    code = ("import sys, time; from remat.callbacks import claim_run_dir; "
            f"claim_run_dir({str(tmp_path / 'x')!r}); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], env=subprocess_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse, match=rf"in use by another run \(pid {holder.pid} on"):
            claim_run_dir(tmp_path / "x")
    finally:
        holder.kill()
        holder.wait()
    claim_run_dir(tmp_path / "x")  # the holder is gone: the folder is free again
    release_run_dir(tmp_path / "x")


def test_every_entry_point_has_a_console_script():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"remat-train", "remat-bench", "remat-estimate", "remat-report",
                            "remat-eval", "remat-plan", "remat-predict"}
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(import_module(module), func)), name
    from remat.report import main

    assert main([str(REPO / "no-such-dir")]) == 1


def test_torch_requirement_has_no_patch_level_cap():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_spec = next(d for d in deps if d.startswith("torch") and not d.startswith("torchv"))
    assert torch_spec == "torch>=2.13,<2.15"  # the oldest and newest minor release CI tests
    makefile = (REPO / "Makefile").read_text()
    assert "torch==2.14.1" in makefile  # what this machine installs (make test)
    assert "torch===2.13.0" in makefile  # the oldest-torch job (make test-oldest)


def test_csv_and_tensorboard_loggers_side_by_side(tmp_path):
    summary = train(compose_train(tmp_path, [*TINY, "trainer.max_steps=1",
                                             "logger=[csv,tensorboard]"]))
    assert summary["status"] == "completed"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "csv" / "metrics.csv").is_file()


def test_refusing_a_failed_runs_folder_without_a_checkpoint_does_not_offer_a_resume(tmp_path):
    """A run that failed before its first checkpoint: the refusal must not point at a
    last.ckpt that does not exist."""
    from omegaconf import OmegaConf

    from remat.callbacks.run_dir import _refuse_overwrite

    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "global_step": None}))
    with pytest.raises(SystemExit, match=r"status 'failed'.*no checkpoint to resume.*pick "
                                         r"another hydra.run.dir, or delete the folder"):
        _refuse_overwrite(OmegaConf.create({}), str(tmp_path))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")
    with pytest.raises(SystemExit, match=r"resume it with ckpt_path=.*last.ckpt"):
        _refuse_overwrite(OmegaConf.create({}), str(tmp_path))


def test_a_killed_runs_forked_children_do_not_hold_its_folder(tmp_path):
    """A run's DataLoader workers are forked from it: killed with kill -9, its orphaned
    workers held the lock for the seconds they take to notice, and a resume at once was
    refused, naming the dead run's pid."""
    code = ("import multiprocessing as mp, os, time; from remat.callbacks import claim_run_dir\n"
            f"claim_run_dir({str(tmp_path / 'x')!r})\n"
            "child = mp.get_context('fork').Process(target=time.sleep, args=(60,))\n"
            "child.start(); print(child.pid, flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], env=subprocess_env(),
                              stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(RunDirInUse):  # the run itself holds it
            claim_run_dir(tmp_path / "x")
        holder.kill()
        holder.wait()
        os.kill(child, 0)  # the orphan lives on
        claim_run_dir(tmp_path / "x")  # and the folder is free
        release_run_dir(tmp_path / "x")
    finally:
        holder.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_sweep_into_an_earlier_sweeps_folder_is_refused_before_hydra_writes(tmp_path):
    """Refused at its first job before, after Hydra's sweeper had written multirun.yaml
    over the earlier sweep's (recording a sweep that never ran), naming hydra.run.dir."""
    from omegaconf import OmegaConf

    from remat.callbacks.run_dir import RunDirLock

    sweep = tmp_path / "sweep"
    (sweep / "1").mkdir(parents=True)
    (sweep / "1" / "summary.json").write_text(json.dumps({"status": "completed",
                                                          "global_step": 8}))
    (sweep / "multirun.yaml").write_text("the earlier sweep\n")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}, "ckpt_path": None})
    with pytest.raises(SystemExit, match=r"sweep/1 already holds a run with status "
                                         r"'completed' at global step 8.*pick another "
                                         r"hydra.sweep.dir, or delete"):
        RunDirLock(protect_earlier_runs=True).on_multirun_start(config)
    assert (sweep / "multirun.yaml").read_text() == "the earlier sweep\n"
    claim_run_dir(sweep)  # the refused sweep let its claim go
    release_run_dir(sweep)
    # an empty sweep folder, or a resume, starts
    RunDirLock(protect_earlier_runs=True).on_multirun_start(
        OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "new")}}, "ckpt_path": None}))
    release_run_dir(tmp_path / "new")
