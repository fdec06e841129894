"""Training entry point: ``python train.py ...``, ``python -m remat.train ...`` or
``remat-train ...``.

``train(cfg)`` is a plain function (the tests call it with a composed config); ``main`` is
the thin Hydra wrapper around it. The run's bookkeeping lives in callbacks
(:mod:`remat.callbacks`): ``summary.json`` (:class:`~remat.callbacks.RunSummary`), the last
checkpoint and signal handling (:class:`~remat.callbacks.LastCheckpoint`), the RNG and
loader state for resuming (:class:`~remat.callbacks.ResumeState`), the monitor check
(:class:`~remat.callbacks.MonitorCheck`).
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from remat import run_shape
from remat.callbacks import LastCheckpoint, RunSummary, failure_summary, write_json
from remat.callbacks.run_dir import run_dir_claimed
from remat.callbacks.summary import read_summary
from remat.config import check_top_level, config_dir
from remat.models.checks import (
    check_checkpoint_fits,
    check_model_fits_data,
    check_sharded_resume,
    read_checkpoint,
)
from remat.planner import InfeasibleBudget, PlanInputError, PlanMismatch
from remat.planner.run import plan_for_run, resumed_replay

log = logging.getLogger(__name__)

# ckpt_path values Lightning resolves itself
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


def instantiate_group(group: DictConfig | None, kind: str) -> list[Any]:
    """Instantiate every ``_target_`` entry of a ``callbacks``/``logger`` group (a mapping of
    name -> config; ``null`` entries are switched off).

    Raises:
        TypeError: the group is not a mapping (names ``kind``).
    """
    if not group:
        return []
    if not isinstance(group, DictConfig):
        raise TypeError(f"{kind} config must be a mapping of name -> config, got "
                        f"{type(group).__name__}")
    return [instantiate(conf) for _, conf in group.items()
            if isinstance(conf, DictConfig) and "_target_" in conf]


def _choice(group: str) -> str | None:
    """The config group option chosen (``model=gpt_tiny`` -> ``gpt_tiny``), if under Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get(group)
    except ValueError:  # no Hydra app around this call
        return None


def _exit_code(err: BaseException, callbacks: list[Any]) -> int | None:
    """128 + the signal number for a run stopped by SIGTERM/SIGINT (shell convention), else
    None (the error propagates as it is)."""
    if not isinstance(err, SIGTERMException | KeyboardInterrupt | SystemExit):
        return None
    last = next((c for c in callbacks if isinstance(c, LastCheckpoint)), None)
    name = getattr(last, "received_signal", None)
    if name is None:
        if isinstance(err, SIGTERMException):
            name = "SIGTERM"
        elif isinstance(err, KeyboardInterrupt):
            name = "SIGINT"
        else:
            return None
    return 128 + int(getattr(signal, name))


def _strategy(cfg: DictConfig, ckpt: dict[str, Any] | None = None,
              ckpt_path: Any = None) -> Any:
    """``cfg.strategy`` instantiated; a memory budget (``strategy=budget``) is planned here,
    before the model is built, or, resuming, takes the plan saved in ``ckpt`` where that
    plan answers the same budget for the same run; a replayed plan (``strategy=plan``) is
    resumed with the plan saved in ``ckpt``, not the file
    (:func:`remat.planner.run.resumed_replay`), and checked against the run
    (:func:`remat.planner.run.plan_for_run`)."""
    strategy = resumed_replay(cfg, ckpt, ckpt_path) or instantiate(cfg.strategy)
    return plan_for_run(cfg, strategy, ckpt, ckpt_path)


_LAST = re.compile(r"^last(-\d+)?\.ckpt$")  # Lightning's last checkpoints (ModelCheckpoint)


def resolve_last(cfg: DictConfig) -> str | None:
    """The file ``ckpt_path=last`` names, found before the Trainer exists: the newest
    ``last.ckpt``/``last-<n>.ckpt`` in the checkpoint folders of the configured callbacks
    (``callbacks.<name>.dirpath``; ``<output_dir>/checkpoints`` by default), as Lightning
    looks for it among its checkpoint callbacks' folders; None when there is none (the
    name then goes to Lightning as it is, which starts from scratch with a warning)."""
    folders = {Path(cfg.paths.output_dir) / "checkpoints"}
    for conf in (cfg.get("callbacks") or {}).values():
        if isinstance(conf, DictConfig) and conf.get("dirpath"):
            folders.add(Path(str(conf.dirpath)))
    found = [p for folder in folders if folder.is_dir() for p in folder.iterdir()
             if _LAST.match(p.name)]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def _checkpoint_to_resume(cfg: DictConfig) -> tuple[Any, dict[str, Any] | None]:
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
    if not ckpt_path or str(ckpt_path) in LIGHTNING_CKPT_NAMES:
        return ckpt_path, None
    check_sharded_resume(ckpt_path, run_shape.trains_sharded(cfg))
    return ckpt_path, read_checkpoint(ckpt_path)


@contextmanager
def _sigterm_raises() -> Iterator[None]:
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


def _record_failure(path: Path, failure: dict[str, Any]) -> None:
    """Write ``failure`` (a run that stopped before its Trainer ran) as ``summary.json``;
    where the folder already holds an earlier run's summary (a resume that failed: bad
    config, infeasible budget, plan mismatch), keep that record and note the attempt under
    ``last_attempt`` (status, error, time), so the trained run's numbers are not lost."""
    earlier = read_summary(path)
    if earlier is None or earlier.get("global_step") is None:
        write_json(path, failure)
        return
    earlier["last_attempt"] = {"status": failure["status"], "error": failure["error"],
                               "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_json(path, earlier)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train the configured model; return the run summary (also in ``summary.json``).

    Writes into ``cfg.paths.output_dir`` (claimed for this process first, see
    :func:`remat.callbacks.claim_run_dir`): ``config.yaml`` (resolved), logs,
    ``checkpoints/last.ckpt`` and the best checkpoint by ``cfg.monitor``, ``summary.json``.
    A run that fails still writes ``summary.json`` with ``status: failed`` and the error (a
    resume that fails before training keeps the folder's earlier summary and notes the
    attempt under ``last_attempt``);
    one stopped by SIGTERM/SIGINT writes ``status: interrupted`` and a checkpoint, and exits
    with ``128 + signal number`` (``SystemExit``).

    Raises:
        remat.callbacks.RunDirInUse: another live run holds the output folder.
        ValueError: bad top-level keys (``seed``, ``precision``, ``accumulate_grad_batches``),
            a model that does not fit the data (kinds, ``num_classes``, ``in_channels``), a
            ``ckpt_path`` of another model, a ``monitor`` key not logged in validation (after
            the first validation), or any error of the data, model or strategy configs.
        SystemExit: the run was stopped by a signal.
    """
    out = Path(cfg.paths.output_dir)
    with run_dir_claimed(out):
        callbacks: list[Any] = []
        trainer_started = False
        try:
            with _sigterm_raises():  # until Lightning's own handler takes over in fit
                check_top_level(cfg)
                OmegaConf.save(cfg, out / "config.yaml", resolve=True)
                L.seed_everything(cfg.seed, workers=True)
                datamodule = instantiate(cfg.data)
                ckpt_path, ckpt = _checkpoint_to_resume(cfg)
                model = instantiate(cfg.model, strategy=_strategy(cfg, ckpt, ckpt_path))
                check_model_fits_data(model, datamodule, _choice("model"), _choice("data"))
                if ckpt is not None:
                    check_checkpoint_fits(model, ckpt, ckpt_path)
                    del ckpt  # Lightning reads the file again in fit, with the optimizer state
                callbacks = instantiate_group(cfg.get("callbacks"), "callbacks")
                trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=instantiate_group(
                    cfg.get("logger"), "logger") or False)
            trainer_started = True
            trainer.fit(model=model, datamodule=datamodule, ckpt_path=ckpt_path,
                        weights_only=True)  # a checkpoint is read as data, never run
        except BaseException as err:
            summary_cb = next((c for c in callbacks if isinstance(c, RunSummary)), None)
            if not trainer_started or summary_cb is None or summary_cb.summary is None:
                _record_failure(out / "summary.json", failure_summary(cfg, err))
            code = _exit_code(err, callbacks)
            if code is not None:
                raise SystemExit(code) from err
            raise
        summary_cb = next((c for c in callbacks if isinstance(c, RunSummary)), None)
        if summary_cb is None or summary_cb.summary is None:
            raise RuntimeError("callbacks.run_summary is missing: summary.json was not written "
                               "(keep the run_summary callback in the callbacks config)")
        return summary_cb.summary


def _single_run() -> bool:
    """True under a Hydra run (not ``-m``); False in a multirun or without Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().mode is RunMode.RUN
    except ValueError:  # no Hydra app around this call
        return False


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Hydra app; returns the monitored metric's best value (for sweepers).

    A replayed plan made for another run shape (:class:`~remat.planner.PlanMismatch`) or a
    bad planner setting (:class:`~remat.planner.PlanInputError`: ``strategy.memory``,
    ``strategy.device``, ...) ends a single run with its message on one line (``error:
    ...``, exit code 1), as a run folder in use does; a budget no plan meets
    (:class:`~remat.planner.InfeasibleBudget`) prints what would fit and exits with code 2,
    as ``python -m remat.plan`` does. In a multirun they fail that job only, so the other
    jobs still run.
    """
    try:
        summary = train(cfg)
    except Exception as err:
        known = _planner_error(err)
        if known is not None and _single_run():
            if isinstance(known, InfeasibleBudget):
                print(str(known), file=sys.stderr)
                raise SystemExit(2) from None
            raise SystemExit(f"error: {known}") from None
        raise
    return summary.get("best_model_score")


def _planner_error(err: BaseException | None) -> ValueError | None:
    """``err`` or the error it was raised from (Hydra's ``instantiate`` wraps what a model
    or strategy constructor raises), if it is a planner's input error: a
    :class:`~remat.planner.PlanMismatch`, :class:`~remat.planner.PlanInputError` or
    :class:`~remat.planner.InfeasibleBudget`."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, PlanMismatch | PlanInputError | InfeasibleBudget):
            return err
        err = err.__cause__ or err.__context__
    return None


if __name__ == "__main__":
    main()
