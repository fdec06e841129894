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
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig

from remat.callbacks import RunSummary, failure_summary
from remat.callbacks.run_dir import run_dir_claimed
from remat.compiling import training_options
from remat.config import check_top_level, config_dir
from remat.errors import exit_on_unknown_key, mark_in_loop, run_entry
from remat.models.checks import (
    check_checkpoint_fits,
    check_lora_supported,
    check_model_fits_data,
    check_monitor,
    check_optimizer_settings,
)
from remat.planner import InfeasibleBudget, PlanInputError, PlanMismatch
from remat.planner.run import plan_for_run, resumed_replay
from remat.rng import rng_kept
from remat.run_config import resume_args
from remat.run_shape import check_spatial_dims
from remat.runs import (  # noqa: F401 - instantiate_group, resolve_last: part of this API
    RunStart,
    checkpoint_to_resume,
    exit_code,
    hand_on_preemption,
    hydra_choice,
    instantiate_group,
    resolve_last,
    sigterm_raises,
)

log = logging.getLogger(__name__)


def _strategy(cfg: DictConfig, ckpt: dict[str, Any] | None = None,
              ckpt_path: Any = None) -> Any:
    """``cfg.strategy`` instantiated; a memory budget (``strategy=budget``) is planned here,
    before the model is built, or, resuming, takes the plan saved in ``ckpt`` where that
    plan answers the same budget for the same run; a replayed plan (``strategy=plan``) is
    resumed with the plan saved in ``ckpt``, not the file
    (:func:`remat.planner.run.resumed_replay`), and checked against the run
    (:func:`remat.planner.run.plan_for_run`)."""
    with rng_kept():  # building a strategy (or its plan) must not move the weights' draws
        strategy = resumed_replay(cfg, ckpt, ckpt_path) or instantiate(cfg.strategy)
        return plan_for_run(cfg, strategy, ckpt, ckpt_path)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train the configured model; return the run summary (also in ``summary.json``).

    Writes into ``cfg.paths.output_dir`` (claimed for this process first, see
    :func:`remat.callbacks.claim_run_dir`): ``config.yaml`` (resolved), logs,
    ``checkpoints/last.ckpt`` and the best checkpoint by ``cfg.monitor``, ``summary.json``.
    A run that fails still writes ``summary.json`` with ``status: failed`` and the error.
    A resume rebuilds the run from its own ``config.yaml`` (the typed overrides on top,
    :class:`remat.runs.RunStart`); resumed into the run's folder, its ``config.yaml``,
    ``summary.json`` (until training starts) and ``.hydra/`` stay as they were, and the
    attempt's config and, if it fails before training, its record go to
    ``resumes/<time>/``;
    one stopped by SIGTERM/SIGINT writes ``status: interrupted`` and a checkpoint, and exits
    with ``128 + signal number`` (``SystemExit``).

    Raises:
        remat.callbacks.RunDirInUse: another live run holds the output folder.
        ValueError: bad top-level keys (``seed``, ``precision``, ``accumulate_grad_batches``),
            a model that does not fit the data (kinds, 2D/3D, ``num_classes``,
            ``in_channels``), a
            ``ckpt_path`` of another model, a ``monitor`` key not logged in validation (after
            the first validation), or any error of the data, model or strategy configs.
        SystemExit: the run was stopped by a signal.
    """
    out = Path(cfg.paths.output_dir)
    with run_dir_claimed(out):
        start = RunStart.of(cfg)
        callbacks: list[Any] = []
        trainer_started = False
        try:
            with sigterm_raises():  # until Lightning's own handler takes over in fit
                start.rebuild(cfg)
                check_top_level(cfg)
                check_spatial_dims(cfg.model, cfg.data, hydra_choice("model"),
                                   hydra_choice("data"))  # before any volume is read
                start.save_config(cfg)
                L.seed_everything(cfg.seed, workers=True)
                # a missing or foreign checkpoint is named before the data check decodes
                # every file (minutes on a large folder)
                ckpt_path, ckpt = checkpoint_to_resume(cfg)
                datamodule = instantiate(cfg.data)
                datamodule.setup("fit")  # layout, splits, data check: before Lightning runs
                check_lora_supported(cfg.model)
                model = instantiate(cfg.model, strategy=_strategy(cfg, ckpt, ckpt_path))
                if cfg.get("compile", False):
                    model.compile_net(training_options(cfg.get("compile_options")),
                                      memory_budget=cfg.get("compile_memory_budget"))
                check_model_fits_data(model, datamodule, hydra_choice("model"),
                                      hydra_choice("data"))
                check_monitor(cfg, model)
                check_optimizer_settings(model)
                if ckpt is not None:
                    check_checkpoint_fits(model, ckpt, ckpt_path)
                    del ckpt  # Lightning reads the file again in fit, with the optimizer state
                callbacks = instantiate_group(cfg.get("callbacks"), "callbacks")
                if cfg.trainer.get("enable_progress_bar") is False:
                    # the switch wins over the callback group's bar: Lightning refuses both
                    callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
                trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=instantiate_group(
                    cfg.get("logger"), "logger") or False)
            trainer_started = True
            start.trained()
            with mark_in_loop():
                trainer.fit(model=model, datamodule=datamodule, ckpt_path=ckpt_path,
                            weights_only=True)  # a checkpoint is read as data, never run
        except BaseException as err:
            summary_cb = next((c for c in callbacks if isinstance(c, RunSummary)), None)
            if not trainer_started or summary_cb is None or summary_cb.summary is None:
                start.record_failure(failure_summary(cfg, err))
            code = exit_code(err, callbacks)
            if code is not None:
                hand_on_preemption(callbacks)  # a preempted SLURM job is resubmitted here
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


def _run(cfg: DictConfig) -> float | None:
    """The Hydra app: :func:`train`, with the entry point's error handling; returns the
    monitored metric's best value (for sweepers)."""
    single = _single_run()

    def train_or_exit_2(cfg: DictConfig) -> dict[str, Any]:
        try:
            return train(cfg)
        except Exception as err:
            known = _planner_error(err)
            if isinstance(known, InfeasibleBudget) and single:
                print(str(known), file=sys.stderr)
                raise SystemExit(2) from None
            raise

    return run_entry(train_or_exit_2, cfg, single_run=single).get("best_model_score")


_hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir()),
                         config_name="train")(_run)


def main() -> None:
    """``python train.py`` / ``remat-train``: compose the config and train.

    Resuming (``ckpt_path=<run>/checkpoints/last.ckpt``, or ``ckpt_path=last
    hydra.run.dir=<run>``) completes the command line from the run's own overrides
    (:func:`remat.run_config.resume_args`), so nothing needs repeating. A config, data,
    model-build or planner-input error of a single run ends it with ``error: <message>`` and
    exit code 1 before Lightning starts (:func:`remat.errors.run_entry`;
    ``HYDRA_FULL_ERROR=1`` shows the traceback); a budget no plan meets
    (:class:`~remat.planner.InfeasibleBudget`) prints what would fit and exits with code 2,
    as ``python -m remat.plan`` does. In a multirun they fail that job only, so the other
    jobs still run.
    """
    sys.argv[1:] = resume_args(sys.argv[1:], "train")
    exit_on_unknown_key("train")  # Hydra's four lines named the key, not the one meant
    _hydra_main()


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
