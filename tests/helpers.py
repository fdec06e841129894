"""Compose the real Hydra config tree the way ``python train.py`` does, for tests."""

from __future__ import annotations

import csv
import os
import re
import signal as signal_module
import subprocess
import sys
from pathlib import Path

import lightning as L
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from remat.config import config_dir

# Short runs: one epoch on CPU, checkpoints and measurement only, no progress bar.
TINY_TRAINER = [
    "trainer.max_epochs=1", "trainer.accelerator=cpu", "callbacks=minimal",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
]
# Plus small synthetic data: 64 px images, 8 train / 4 val, batch 4 (2 train batches).
TINY = ["data.image_size=64", "data.num_train=8", "data.num_val=4", "data.batch_size=4",
        *TINY_TRAINER]


def compose_app(config_name: str, output_dir: Path, overrides: list[str] = ()) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with overrides as its entry point does (Hydra
    config included); outputs go to ``output_dir``."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.job.num = 0
    HydraConfig().set_config(cfg)
    return cfg


def entry_exit(app: str, cfg: DictConfig) -> int:
    """Run ``python -m remat.<app>``'s Hydra main on ``cfg`` (composed by
    :func:`compose_app`) as a single run, in this process; the exit code it ends with."""
    import importlib

    import pytest
    from hydra.types import RunMode
    from omegaconf import read_write

    module = importlib.import_module(f"remat.{app}")
    # a main checks the command line (train's also completes a resume's) before its
    # Hydra app: train's _run, the others' _app where they have one
    run = (module._run if app == "train" else getattr(module, "_app", None)
           or module.main.__wrapped__)
    with read_write(cfg.hydra):
        cfg.hydra.mode = RunMode.RUN
    HydraConfig().set_config(cfg)
    with pytest.raises(SystemExit) as stop:
        run(cfg)
    return stop.value.code


def compose_train(output_dir: Path, overrides: list[str] = ()) -> DictConfig:
    """Compose ``configs/train.yaml`` with overrides; outputs go to ``output_dir``."""
    return compose_app("train", output_dir, overrides)


REPO = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    """The environment of subprocess runs: this one, warnings off, and the repository on
    ``PYTHONPATH`` so that configs can name ``tests.helpers`` classes."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=path)


_LAUNCH_ERRORS = re.compile(r"terminate called|what\(\)|Traceback|Error|Exception|"
                            r"remat-test:|Signal \d+|exitcode")


def leave_process_group() -> None:
    """End of a multi-process test script: every rank waits for the others, then closes its
    process group, so no rank's process exits while another still talks to it (gloo aborts
    a rank whose peer closed the connection under it: SIGABRT, no Python traceback)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch_report(output: str, tail: int = 1500) -> str:
    """What a failed ``torch.distributed.run`` printed that says why: every line naming an
    error, a signal or a ``remat-test:`` progress marker (the scripts print one per run
    and rank), then the last ``tail`` characters. A C++ abort (SIGABRT) prints its cause
    long before the launcher's summary that fills the tail."""
    lines = [line for line in output.splitlines() if _LAUNCH_ERRORS.search(line)]
    return "\n".join(lines[-80:]) + "\n--- tail ---\n" + output[-tail:]


def run_python(args: list[str], cwd: Path, timeout: int = 900,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python <args>`` with this interpreter in ``cwd`` (``env``: variables added);
    output captured as text."""
    env = {**subprocess_env(), **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def compose_config(name: str, output_dir: Path, overrides: list[str] = ()) -> DictConfig:
    """Compose ``configs/<name>.yaml`` (``estimate``, ``bench``) with overrides; outputs go
    to ``output_dir``."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        cfg = compose(name, overrides=list(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    return cfg


class SignalAtStep(L.Callback):
    """Test helper: the process sends ``signal`` to itself when the batch that makes
    optimizer step ``step + 1`` starts (a signal arriving mid-step, as ``kill`` sends it)."""

    def __init__(self, step: int, signal: str = "SIGTERM", rank: int | None = None,
                 once_file: str | None = None) -> None:
        self.step = step
        self.signal = getattr(signal_module, signal)
        self.sent = False
        self.rank = rank  # only this global rank signals itself (None: every rank)
        # with once_file, the signal is sent once over all processes (a resume that
        # inherits this callback from the run's overrides does not stop again)
        self.once_file = Path(once_file) if once_file else None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: object, batch_idx: int) -> None:
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        if self.once_file is not None and self.once_file.exists():
            return
        if not self.sent and trainer.global_step == self.step:
            self.sent = True
            if self.once_file is not None:
                self.once_file.write_text("sent")
            os.kill(os.getpid(), self.signal)


def logged(run_dir: Path, key: str) -> dict[int, float]:
    """``step -> value`` of every ``csv/metrics.csv`` row of ``run_dir`` that logged ``key``
    (a step logged twice is an error: a resumed run must not repeat steps)."""
    rows = list(csv.DictReader((Path(run_dir) / "csv" / "metrics.csv").open()))
    values: dict[int, float] = {}
    for row in rows:
        if row.get(key):
            step = int(row["step"])
            assert step not in values, f"{key} logged twice at step {step} in {run_dir}"
            values[step] = float(row[key])
    return values


class SigtermWhenBuilt(L.Callback):
    """Test helper: the process sends itself SIGTERM while the run's callbacks are built,
    after planning and the model build, before the Trainer exists."""

    def __init__(self) -> None:
        os.kill(os.getpid(), signal_module.SIGTERM)


class RecordLosses(L.Callback):
    """Test helper: every rank appends ``<global step> <loss>`` of each training batch to
    ``<folder>/losses_rank<r>.txt`` (the loss this rank computed, ``repr`` of the float, so
    values compare bit for bit), across a run and its resumes."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: object, batch: object, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / f"losses_rank{trainer.global_rank}.txt").open("a") as handle:
            handle.write(f"{trainer.global_step} {float(loss)!r}\n")


def rank_losses(folder: Path, rank: int) -> dict[int, float]:
    """``global step -> loss`` that :class:`RecordLosses` wrote for ``rank`` (a step written
    twice is an error: a resumed run must not repeat a step)."""
    values: dict[int, float] = {}
    for line in (Path(folder) / f"losses_rank{rank}.txt").read_text().splitlines():
        step, loss = line.split()
        assert int(step) not in values, f"step {step} trained twice on rank {rank} in {folder}"
        values[int(step)] = float(loss)
    return values


class SignalAtValidation(L.Callback):
    """Test helper: global rank ``rank`` sends ``signal`` to itself when validation batch
    ``batch`` of epoch ``epoch`` starts (not in the sanity check)."""

    def __init__(self, epoch: int, rank: int = 0, batch: int = 0,
                 signal: str = "SIGTERM") -> None:
        self.epoch, self.rank, self.batch = epoch, rank, batch
        self.signal = getattr(signal_module, signal)
        self.sent = False

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                  batch: object, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if (not self.sent and not trainer.sanity_checking and trainer.global_rank == self.rank
                and trainer.current_epoch == self.epoch and batch_idx == self.batch):
            self.sent = True
            os.kill(os.getpid(), self.signal)


class RecordException(L.Callback):
    """Test helper: every rank writes the name of the exception that ended its fit, or
    ``none`` after a fit that ended normally, to ``<folder>/ended_rank<r>.txt``."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def _write(self, trainer: L.Trainer, text: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"ended_rank{trainer.global_rank}.txt").write_text(text)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        self._write(trainer, type(exception).__name__)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._write(trainer, "none")
