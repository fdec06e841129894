"""What a training run does around Lightning's loop: the checkpoint to resume, the run's own
config on resume, the record of a run (or an attempt) that stopped before training, signals
before Lightning's handler is in place, exit codes.

:func:`remat.train.train` uses these; they live here so that the entry module only parses,
calls and prints.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from remat import run_shape
from remat.callbacks import LastCheckpoint, write_json
from remat.callbacks.run_dir import secondary_rank
from remat.callbacks.summary import read_summary
from remat.models.checks import check_sharded_resume, read_checkpoint
from remat.models.fsdp import recover_swapped_checkpoints
from remat.run_config import (
    attempt_dir,
    find_run_dir,
    record_trained_attempt,
    restore_run_config,
    user_overrides,
)

log = logging.getLogger(__name__)

# ckpt_path values Lightning resolves itself
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")
_LAST = re.compile(r"^last(-\d+)?\.ckpt$")  # Lightning's last checkpoints (ModelCheckpoint)


def instantiate_group(group: DictConfig | None, kind: str) -> list[Any]:
    """Instantiate every ``_target_`` entry of a ``callbacks``/``logger`` group (a mapping of
    name -> config; ``null`` entries are switched off).

    Raises:
        ValueError: the group is not a mapping (names ``kind``).
    """
    if not group:
        return []
    if not isinstance(group, DictConfig):
        raise ValueError(f"{kind} config must be a mapping of name -> config, got "
                         f"{type(group).__name__}")
    return [instantiate(conf) for _, conf in group.items()
            if isinstance(conf, DictConfig) and "_target_" in conf]


def hydra_choice(group: str) -> str | None:
    """The config group option chosen (``model=gpt_tiny`` -> ``gpt_tiny``), if under Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get(group)
    except ValueError:  # no Hydra app around this call
        return None


def _hydra_overrides() -> tuple[list[str], str | None]:
    """The task overrides Hydra composed with and its ``output_subdir`` (``[], None``
    without Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
    except ValueError:
        return [], None
    return list(hydra_cfg.overrides.task), hydra_cfg.get("output_subdir")


def exit_code(err: BaseException, callbacks: list[Any]) -> int | None:
    """128 + the signal number for a run stopped by SIGTERM/SIGINT (shell convention), else
    None (the error propagates as it is)."""
    if not isinstance(err, SIGTERMException | KeyboardInterrupt | SystemExit):
        return None
    last = next((c for c in callbacks if isinstance(c, LastCheckpoint)), None)
    name = getattr(last, "received_signal", None)
    if name is None:
        # Lightning answers a KeyboardInterrupt outside the training loop (e.g. during the
        # start-of-run estimate) with exit(1) raised inside its handler: the signal is the
        # SystemExit's context
        cause = (err.__context__ if type(err) is SystemExit and err.__context__ is not None
                 else err)
        if isinstance(cause, SIGTERMException):
            name = "SIGTERM"
        elif isinstance(cause, KeyboardInterrupt):
            name = "SIGINT"
        else:
            return None
    return 128 + int(getattr(signal, name))


def hand_on_preemption(callbacks: list[Any]) -> None:
    """After a run stopped by the scheduler's preemption signal, with its checkpoint
    written: call the handler :class:`~remat.callbacks.LastCheckpoint` held back (submitit's:
    on rank 0 it resubmits the job, :class:`remat.slurm.SlurmLauncher` with
    ``ckpt_path=last``, and exits). Nothing for any other stop."""
    last = next((c for c in callbacks if isinstance(c, LastCheckpoint)), None)
    deferred = getattr(last, "deferred", None)
    if deferred is None:
        return
    last.deferred = None
    signum, handler = deferred
    log.warning("%s: handing the job to the scheduler's handler (checkpoint written at "
                "global step %s)", signal.Signals(signum).name, last.saved_step)
    handler(signum, None)


def resolve_last(cfg: DictConfig) -> str | None:
    """The file ``ckpt_path=last`` names, found before the Trainer exists: the newest
    ``last.ckpt``/``last-<n>.ckpt`` in the checkpoint folders of the configured callbacks
    (``callbacks.<name>.dirpath``; ``<output_dir>/checkpoints`` by default), as Lightning
    looks for it among its checkpoint callbacks' folders; None when there is none (the
    name then goes to Lightning as it is, which starts from scratch: the first start of a
    requeued job; :func:`checkpoint_to_resume` warns)."""
    folders = {Path(cfg.paths.output_dir) / "checkpoints"}
    for conf in (cfg.get("callbacks") or {}).values():
        if isinstance(conf, DictConfig) and conf.get("dirpath"):
            folders.add(Path(str(conf.dirpath)))
    for folder in folders:
        recover_swapped_checkpoints(folder)
    found = [p for folder in folders if folder.is_dir() for p in folder.iterdir()
             if _LAST.match(p.name)]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def checkpoint_to_resume(cfg: DictConfig) -> tuple[Any, dict[str, Any] | None]:
    """``(ckpt_path, checkpoint)``: the path to pass to ``Trainer.fit`` (``last`` resolved
    by :func:`resolve_last` where it can be) and the checkpoint read once, with
    ``weights_only=True``, for the plan it keeps and the model check; ``(name, None)`` for
    Lightning's other names and for no checkpoint.

    Raises:
        ValueError, FileNotFoundError: see :func:`~remat.models.checks.read_checkpoint`
            and :func:`~remat.models.checks.check_sharded_resume`.
    """
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path and str(ckpt_path) == "last":
        resolved = resolve_last(cfg)
        if resolved is not None:
            log.info("ckpt_path=last: resuming from %s", resolved)
            ckpt_path = resolved
        else:  # Lightning's rule (a requeued job's first start): a new run, said loudly
            log.warning("ckpt_path=last: no last.ckpt in %s, so this is a new run from "
                        "scratch, not a resume. To resume a run, give its folder "
                        "(hydra.run.dir=<run>) or its file (ckpt_path=<run>/checkpoints/"
                        "last.ckpt)", Path(cfg.paths.output_dir) / "checkpoints")
    if not ckpt_path or str(ckpt_path) in LIGHTNING_CKPT_NAMES:
        return ckpt_path, None
    if not Path(str(ckpt_path)).exists():
        recover_swapped_checkpoints(Path(str(ckpt_path)).parent)
    check_sharded_resume(ckpt_path, run_shape.trains_sharded(cfg))
    return ckpt_path, read_checkpoint(ckpt_path)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Lightning's ``SIGTERMException`` here (main thread only), so a run
    stopped while it plans or builds writes ``status: interrupted``; Python's default would
    end the process at once, with no ``summary.json``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_sigterm(signum: int, frame: Any) -> None:
        log.warning("received SIGTERM before training started: stopping (no checkpoint, "
                    "nothing was trained)")
        raise SIGTERMException

    previous = signal.signal(signal.SIGTERM, raise_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class RunStart:
    """Where a training run keeps its own files: a new run in its folder; a resume into
    the folder of the run it resumes in an attempt folder (``resumes/<time>/``), so that
    the run's ``config.yaml``, ``.hydra/`` and ``summary.json`` stay as they are until the
    attempt trains.

    Attributes:
        out: the run folder (``paths.output_dir``).
        source: the folder whose ``config.yaml`` the run was rebuilt from (the run it
            resumes), or None for a new run.
        attempt: this attempt's folder, for a resume into its run's own folder; else None.
        typed: the overrides typed on the command line.
        writes: whether this process writes the run's records (False on a secondary rank
            resuming into the run's folder).
    """

    out: Path
    source: Path | None = None
    attempt: Path | None = None
    typed: tuple[str, ...] = ()
    writes: bool = True

    @classmethod
    def of(cls, cfg: DictConfig) -> RunStart:
        """The start of the run ``cfg`` configures (read before anything is written)."""
        out = Path(cfg.paths.output_dir)
        ckpt = cfg.get("ckpt_path")
        hydra_overrides, subdir = _hydra_overrides()
        typed = tuple(user_overrides(hydra_overrides))
        if not ckpt:
            return cls(out, typed=typed)
        source = find_run_dir(ckpt)
        if source is None and (out / "config.yaml").is_file():
            source = out  # ckpt_path=last (or a name) in the run's own folder
        same = source is not None and source.resolve() == out.resolve()
        if same and secondary_rank():
            # rank > 0 of a DDP/FSDP launch shares rank 0's attempt (Lightning gives it a
            # .pl_hydra_rank_<n> Hydra folder): it records nothing of its own
            return cls(out, source, None, typed, writes=False)
        return cls(out, source, attempt_dir(out, subdir) if same else None, typed)

    @property
    def config_path(self) -> Path:
        """Where this run writes its resolved ``config.yaml``."""
        return (self.attempt or self.out) / "config.yaml"

    def rebuild(self, cfg: DictConfig) -> None:
        """Set back, in ``cfg``, every value of the resumed run's ``config.yaml`` that the
        typed overrides do not change (see :func:`remat.run_config.restore_run_config`);
        log the keys changed."""
        if self.source is None:
            return
        restored, changed = restore_run_config(cfg, self.source / "config.yaml", self.typed)
        if restored:
            log.warning("resuming %s with its own config: %d value(s) composed differently "
                        "now are set back to the run's: %s", self.source, len(restored),
                        "; ".join(restored))
        if changed:
            log.info("resuming %s: the command line changes %s", self.source,
                     "; ".join(changed))
        # the resume goes on from the checkpoint's random state (global RNG, the loader's
        # generator): another seed draws nothing, and the summary recorded it while every
        # loss was the old seed's (trial)
        saved = self.source / "config.yaml"
        run = OmegaConf.load(saved) if saved.is_file() else None
        for key in ("seed", "data.seed"):
            was, now = (OmegaConf.select(run, key) if run is not None else None,
                        OmegaConf.select(cfg, key))
            if was is None or now == was:
                continue
            log.warning("resuming %s: %s=%s has no effect on a resume (the run goes on from "
                        "its checkpoint's random state, drawn from %s %s), so it stays %s; "
                        "train a new run (another hydra.run.dir) for another seed",
                        self.source, key, now, key, was, was)
            OmegaConf.update(cfg, key, was)

    def trained(self) -> None:
        """The attempt reached training: its typed overrides count for later resumes."""
        if self.attempt is not None and self.writes:
            record_trained_attempt(self.attempt, self.typed)

    def record_failure(self, failure: dict[str, Any]) -> None:
        """Write ``failure`` (a run that stopped before its Trainer ran): into the attempt
        folder for a resume (the run's ``summary.json`` keeps the trained run's record),
        else as the run's ``summary.json``; a folder whose summary records a trained run
        is never overwritten (the attempt is noted under ``last_attempt`` there only when
        this is no resume attempt, e.g. ``train(cfg)`` called twice on one folder)."""
        if not self.writes:
            return
        if self.attempt is not None:
            write_json(self.attempt / "summary.json", failure)
            return
        path = self.out / "summary.json"
        earlier = read_summary(path)
        if earlier is None or earlier.get("global_step") is None:
            write_json(path, failure)
            return
        earlier["last_attempt"] = {
            "status": failure["status"], "error": failure["error"],
            "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        write_json(path, earlier)

    def save_config(self, cfg: DictConfig) -> None:
        """Write the resolved config (:attr:`config_path`)."""
        if self.writes:
            OmegaConf.save(cfg, self.config_path, resolve=True)
