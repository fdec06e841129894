"""One folder per run: a lock that two live runs cannot both hold, taken before anything is
written into the folder.

:func:`claim_run_dir` takes an exclusive ``flock`` on ``<folder>/.lock`` (released by the
kernel when the process ends, however it ends, so a killed run never leaves a stale lock;
processes forked from the run, DataLoader workers, close their copy at once).
:class:`RunDirLock` is a Hydra callback that claims ``hydra.run.dir`` in ``on_run_start``
and ``hydra.sweep.dir`` in ``on_multirun_start``, before Hydra writes ``.hydra/`` or a log
file there; :func:`remat.train.train` claims its output folder too (the same process may
claim a folder again). Resuming into a folder whose run has ended is allowed.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from remat.callbacks.summary import read_summary

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, folders stay unguarded
    fcntl = None

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_held: dict[str, list[int]] = {}  # resolved folder -> [fd, claims]


#: environment variables that give a process's rank when a launcher started it (torchrun,
#: Lightning's subprocess launcher, SLURM); a non-zero one marks a secondary rank
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")


def secondary_rank() -> bool:
    """This process is rank > 0 of a multi-process run (torchrun, Lightning's ``ddp`` or
    ``fsdp`` launcher, SLURM tasks): it shares rank 0's run folder and does not lock it."""
    return any(os.environ.get(name, "0") not in ("", "0") for name in RANK_VARIABLES)


class RunDirInUse(RuntimeError):
    """The output folder is held by another live run (the message names it and the
    holder's pid and host)."""


def claim_run_dir(path: str | Path) -> Path:
    """Claim ``path`` for this process: create it if needed and lock ``path/.lock``.

    Returns the resolved folder. Claims by the same process are counted (release as often).
    A secondary rank (:func:`secondary_rank`) joins rank 0's run: it takes no lock.

    Raises:
        RunDirInUse: another live process holds the folder; nothing was written into it.
    """
    folder = Path(path).resolve()
    key = str(folder)
    if key in _held:
        _held[key][1] += 1
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None or secondary_rank():
        _held[key] = [-1, 1]
        return folder
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown process"
        os.close(fd)
        raise RunDirInUse(
            f"output folder {folder} is in use by another run ({holder}); runs never share a "
            "folder: wait for it to end, or pick another hydra.run.dir / hydra.sweep.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _held[key] = [fd, 1]
    return folder


def ended_here(path: str | Path) -> bool:
    """Whether the run that last claimed ``path`` ran on this machine and no process holds
    the folder any more (it ended, however: a ``summary.json`` still saying ``running`` was
    left by a run killed with SIGKILL or out of memory). False where that cannot be told
    here: no lock file, a claim from another host (a cluster's job: its lock may not reach
    this node), or no advisory locks."""
    lock = Path(path) / LOCK_NAME
    if fcntl is None or not lock.is_file():
        return False
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        holder = os.read(fd, 200).decode(errors="replace").split()
        if len(holder) < 4 or holder[0] != "pid" or holder[3] != socket.gethostname():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: the run is alive
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def _forget_claims_in_child() -> None:
    """In a process forked from a run (a DataLoader worker): close its copies of the lock
    files. A ``flock`` stays held while any copy of its descriptor is open, so workers
    orphaned by a killed run held the folder for the seconds they take to notice (a resume
    right after ``kill -9`` was refused, naming the dead run's pid); the child is not the
    run and claims nothing."""
    for fd, _ in _held.values():
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    _held.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_claims_in_child)


def release_run_dir(path: str | Path) -> None:
    """Undo one :func:`claim_run_dir`; the lock goes with the last claim (the ``.lock`` file
    stays, unlocked)."""
    key = str(Path(path).resolve())
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held[key]
        if entry[0] >= 0:
            os.close(entry[0])


@contextmanager
def run_dir_claimed(path: str | Path) -> Iterator[Path]:
    """:func:`claim_run_dir` for the duration of a ``with`` block."""
    folder = claim_run_dir(path)
    try:
        yield folder
    finally:
        release_run_dir(folder)


def _dir(config: DictConfig, key: str) -> str | None:
    value = OmegaConf.select(config, key, default=None)
    return str(value) if value else None


def earlier_run(folder: str | Path) -> str | None:
    """What an earlier training run left in ``folder`` (its ``summary.json`` status and step,
    or its checkpoints), or None when the folder holds no run."""
    folder = Path(folder)
    if (folder / "summary.json").is_file():
        data = read_summary(folder / "summary.json")
        if data is None:
            return "a run (its summary.json is unreadable)"
        return f"a run with status {data.get('status')!r} at global step {data.get('global_step')}"
    ckpts = folder / "checkpoints"
    if ckpts.is_dir() and any(ckpts.glob("*.ckpt")):
        return f"a run's checkpoints ({', '.join(sorted(p.name for p in ckpts.glob('*.ckpt')))})"
    return None


def _refuse_overwrite(config: DictConfig, path: str | None, key: str = "hydra.run.dir",
                      jobs: bool = False) -> None:
    """A new training run (no ``ckpt_path``) never writes over an earlier run's folder;
    with ``jobs``, ``path`` is a sweep folder and its job folders are looked at (a refused
    sweep must not reach Hydra's sweeper, which writes ``multirun.yaml`` over the earlier
    sweep's record)."""
    if path is None or OmegaConf.select(config, "ckpt_path", default=None) or secondary_rank():
        return  # a secondary rank finds rank 0's files of this very run
    folders = (sorted(p for p in Path(path).iterdir() if p.is_dir()) if jobs
               else [Path(path)])
    for folder in folders:
        found = earlier_run(folder)
        if not found:
            continue
        release_run_dir(path)
        last = folder.resolve() / "checkpoints" / "last.ckpt"
        how = (f"resume it with ckpt_path={last}, or pick another {key}"
               if last.is_file() else "it has no checkpoint to resume (checkpoints/last.ckpt): "
               f"pick another {key}, or delete the folder")
        raise SystemExit(
            f"error: output folder {folder.resolve()} already holds {found}. A new run "
            f"would overwrite its checkpoints and summary.json: {how}")


def _claim_or_exit(path: str | None) -> None:
    """Claim ``path``; Hydra turns a callback's ``Exception`` into a warning and goes on, so a
    folder in use ends the process here (``SystemExit`` with the message, exit code 1)."""
    if path is None:
        return
    try:
        claim_run_dir(path)
    except RunDirInUse as err:
        raise SystemExit(f"error: {err}") from None


class RunDirLock(Callback):
    """Hydra callback: claims the run folder (``on_run_start``), the sweep folder
    (``on_multirun_start``) and each job's folder (``on_job_start``) with
    :func:`claim_run_dir`, and releases them at the matching end. A folder in use makes the
    run fail before Hydra writes anything into it (exit code 1, the message names it).

    With ``protect_earlier_runs=True`` (training), a run or job folder that already holds an
    earlier run (:func:`earlier_run`) is refused the same way unless ``ckpt_path`` is set
    (a resume), so a finished run is never overwritten by a new one.
    """

    def __init__(self, protect_earlier_runs: bool = False) -> None:
        self.protect_earlier_runs = bool(protect_earlier_runs)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _claim_or_exit(_dir(config, "hydra.run.dir"))
        if self.protect_earlier_runs:
            _refuse_overwrite(config, _dir(config, "hydra.run.dir"))

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        if (path := _dir(config, "hydra.run.dir")) is not None:
            release_run_dir(path)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _claim_or_exit(_dir(config, "hydra.sweep.dir"))
        if self.protect_earlier_runs:
            _refuse_overwrite(config, _dir(config, "hydra.sweep.dir"), "hydra.sweep.dir",
                              jobs=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if (path := _dir(config, "hydra.sweep.dir")) is not None:
            release_run_dir(path)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        _claim_or_exit(_dir(config, "hydra.runtime.output_dir"))
        if self.protect_earlier_runs and OmegaConf.select(config, "hydra.mode",
                                                          default=None) is RunMode.MULTIRUN:
            _refuse_overwrite(config, _dir(config, "hydra.runtime.output_dir"),
                              "hydra.sweep.dir")

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if (path := _dir(config, "hydra.runtime.output_dir")) is not None:
            release_run_dir(path)
