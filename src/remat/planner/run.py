"""A training run's plan, from its config: made, replayed, resumed and checked.

``remat.train`` asks :func:`resumed_replay` and :func:`plan_for_run` for the strategy to
train with before it builds the model; ``remat.plan`` makes its :class:`~remat.planner.Planner`
with :func:`planner_for`. The config keys read are the training config's: ``model``,
``data``, ``precision``, ``accumulate_grad_batches``, ``trainer`` (FSDP2 ranks, the
accelerator) and the ``strategy`` group's planner keys (``configs/strategy/budget.yaml``).
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from remat import run_shape
from remat.build import build_from_config
from remat.measure import format_bytes
from remat.planner.budget import BudgetStrategy
from remat.planner.devices import known_devices, present_device_name
from remat.planner.memory import PlanInputError
from remat.planner.plan import SAVED_STATE_VERSION, Plan, PlanMismatch, PlanStrategy
from remat.planner.planner import Planner
from remat.strategies.base import STRATEGY_STATE_KEY
from remat.strategies.stages import listed_stages

log = logging.getLogger(__name__)


def run_shape_of(cfg: DictConfig) -> tuple[Any, int, Any, str, int]:
    """``(build, batch_size, size, precision, accumulate)`` of a training/plan config, where
    ``build(strategy, stages=None)`` instantiates the model.

    Raises:
        ValueError: bad sizes or precision (naming the key).
    """
    build, _, batch_size, size = build_from_config(cfg)
    accumulate = run_shape.normalize_size(cfg.get("accumulate_grad_batches", 1),
                                          "accumulate_grad_batches")
    return build.with_strategy, batch_size, size, str(cfg.precision), accumulate


def plan_for_run(cfg: DictConfig, strategy: Any, ckpt: dict[str, Any] | None = None,
                 ckpt_path: Any = None) -> Any:
    """The strategy to train with: a :class:`~remat.planner.BudgetStrategy` becomes the
    :class:`~remat.planner.PlanStrategy` of its plan (planned here, before the model is
    built); a replayed plan is checked against the run; anything else is returned as it is.
    Either warns when the plan is for another device than the run trains on
    (:func:`warn_if_other_device`). Planning builds and runs models, which draws from the
    global RNGs: the caller keeps them (``remat.train`` builds the strategy under
    :func:`remat.rng.rng_kept`).

    Resuming (``ckpt``: the checkpoint at ``ckpt_path``, as
    :func:`remat.models.checks.read_checkpoint` read it), a budget takes the plan saved in
    the checkpoint instead of planning again when the checkpoint's plan answered the same
    request (budget bytes, device, margin, units, objective, calibration, search size,
    ``model.stages``) for the same run shape (batch size, size, precision, accumulation,
    FSDP2 ranks): the run then trains on with the plan its earlier steps trained with, even
    where planning again would pick another one (timed or calibrated unit times). Otherwise
    it plans again and logs why. The network's fingerprint is checked when the plan is
    applied: a checkpoint of another network does not fit the model either. Lightning's
    names (``ckpt_path=last``, ...) are resolved by :func:`remat.train.train` first where
    it can; ``ckpt=None`` plans as without a checkpoint. A replayed plan taken from the
    checkpoint (:func:`resumed_replay`) gets the same run-shape check, naming the checkpoint.

    Raises:
        remat.planner.PlanMismatch: a replayed plan made for another batch size, input size
            or precision (naming ``strategy.path``, or the checkpoint, and the key).
        remat.planner.InfeasibleBudget: the budget cannot be met.
    """
    if isinstance(strategy, BudgetStrategy):
        default_stages = listed_stages(cfg.model.get("stages"))
        sharding = run_shape.sharding_of(cfg)
        planned = (_saved_plan(cfg, strategy, ckpt, ckpt_path, default_stages,
                               sharding.reshard_after_forward) if ckpt is not None else None)
        if planned is None:
            build, batch_size, size, precision, accumulate = run_shape_of(cfg)
            planned = strategy.planned(
                build, batch_size, size, precision, accumulate,
                default_stages=default_stages, world_size=sharding.world_size,
                reshard_after_forward=sharding.reshard_after_forward,
                size_key=run_shape.size_key_of(cfg.data, cfg.model),
                compiled=bool(cfg.get("compile", False)))
        warn_if_other_device(planned.plan, cfg, None,
                             where=f"strategy.device={strategy.device}")
        return planned
    if isinstance(strategy, PlanStrategy):
        where = strategy.origin if strategy.resumed else None
        check_plan_fits(strategy.plan, cfg, strategy.path, where)
        warn_if_other_device(strategy.plan, cfg, strategy.path, where)
        if not strategy.resumed:  # resumed_replay logged it, with what became of the file
            log.info(f"training with the plan of {strategy.origin}:\n"
                     f"{strategy.plan.summary()}")
    return strategy


def resumed_replay(cfg: DictConfig, ckpt: dict[str, Any] | None,
                   ckpt_path: Any) -> PlanStrategy | None:
    """Resuming a ``strategy=plan`` run, the plan saved in its checkpoint, as the strategy
    to train with; call it before ``cfg.strategy`` is instantiated (which reads the file).

    The checkpoint is the source of truth: the file at ``strategy.path`` may have been
    re-planned, replaced or removed since. An INFO line says the checkpoint's plan is used
    and what became of the file; a WARNING names ``strategy.path`` when it no longer holds
    that plan (train with the file's plan in a new run). None, so that the file is read as
    without a checkpoint, for another strategy, no ``ckpt``, a checkpoint without a usable
    plan (older ones, with an INFO line) and one whose plan was planned for a budget (the
    run switched from ``strategy=budget`` to this file, as to any other strategy).
    """
    path = OmegaConf.select(cfg, "strategy.path")
    if ckpt is None or path is None or not issubclass(
            get_class(str(cfg.strategy._target_)), PlanStrategy):
        return None
    where = f"ckpt_path={ckpt_path}"
    saved = _read_saved_plan(ckpt, where)
    if isinstance(saved, str):
        log.info("strategy=plan: %s; reading strategy.path=%r", saved, path)
        return None
    plan, request = saved
    if request is not None:
        log.info("strategy=plan: the plan saved in %s was planned for a budget "
                 "(strategy=budget); training with strategy.path=%r as asked", where, path)
        return None
    try:
        differs = Plan.load(path).to_dict() != plan.to_dict()
        now = "holds another plan than it trained with" if differs else "holds the same plan"
    except FileNotFoundError:
        differs, now = False, "is gone (no such file)"
    except ValueError as err:
        differs, now = True, f"no longer holds a plan ({err})"
    log.info("strategy=plan: resuming with the plan saved in %s, the one this run trained "
             "with (strategy.path=%r %s)\n%s", where, path, now, plan.summary())
    if differs:
        log.warning("strategy.path=%r %s: resuming with the plan saved in %s, not the file's; "
                    "to train with the file's plan, start a new run (without ckpt_path)",
                    path, now, where)
    return PlanStrategy(plan, origin=f"the plan saved in {where}", resumed=True)


def warn_if_other_device(plan: Plan, cfg: DictConfig, path: str | None,
                         where: str | None = None) -> str | None:
    """Log a warning when ``plan`` was made for another device kind than the one this run
    trains on (``trainer.accelerator``, :func:`remat.planner.devices.present_device_name`):
    its predicted peak and step time hold on the planned device only. A plan without a
    device, or made for this one, is silent. ``where`` names the plan instead of
    ``strategy.path`` (a checkpoint's). Returns the warning (None if none)."""
    planned = str(plan.device or "").strip().lower().replace("-", "_")
    if not planned:
        return None
    present = present_device_name(OmegaConf.select(cfg, "trainer.accelerator",
                                                   default="auto"))
    if planned == present:
        return None
    again = (f"strategy=budget strategy.device={present} (or python -m remat.plan ... "
             f"strategy.device={present})" if present in known_devices() else
             "strategy=budget strategy.device={name: ..., memory_bytes: ..., fp32_flops: ..., "
             "bf16_flops: ..., bandwidth: ...} (this device is not in the device table)")
    message = (f"{where or f'strategy.path={path!r}'}: the plan was made for device "
               f"{plan.device}, this run "
               f"trains on {present}; its predicted peak "
               f"({format_bytes(plan.predicted_allocator_peak_bytes)}) holds on "
               f"{plan.device} only. Plan again for this device: {again}")
    log.warning(message)
    return message


def _saved_plan(cfg: DictConfig, strategy: BudgetStrategy, ckpt: dict[str, Any],
                ckpt_path: Any, default_stages: list[str],
                reshard_after_forward: bool) -> PlanStrategy | None:
    """The plan saved in ``ckpt`` as a strategy, if it answers ``strategy``'s request for
    this run; else None, with an INFO line saying why it is planned again."""
    where = f"ckpt_path={ckpt_path}"
    saved = _read_saved_plan(ckpt, where)
    if isinstance(saved, str):
        log.info("strategy=budget: %s; planning again", saved)
        return None
    plan, request = saved
    differ = strategy.differences(request, default_stages, reshard_after_forward,
                                  bool(cfg.get("compile", False)))
    differ += [f"{key}: {planned} -> {running}"
               for key, planned, running in plan_mismatches(plan, cfg)]
    if differ:
        log.info("strategy=budget: not reusing the plan saved in %s, made for another run "
                 "than this one (%s); planning again", where, "; ".join(differ))
        return None
    log.info("strategy=budget: resuming with the plan saved in %s (planned for %s on %s, "
             "predicted peak %s, modelled step time x%.3f), not planning again\n%s", where,
             format_bytes(plan.budget_bytes), plan.device,
             format_bytes(plan.predicted_allocator_peak_bytes), plan.predicted_overhead,
             plan.summary())
    return PlanStrategy(plan, origin=f"the plan saved in {where}", request=request,
                        resumed=True)


def _read_saved_plan(ckpt: dict[str, Any], where: str) -> tuple[Plan, dict | None] | str:
    """``(plan, request)`` saved in ``ckpt`` (:meth:`~remat.planner.PlanStrategy.
    state_for_checkpoint`; ``request``: the budget's, None for a replayed file), or why there
    is none to use: no plan, another record version, or a malformed plan (naming ``where``)."""
    saved = ckpt.get(STRATEGY_STATE_KEY)
    if not isinstance(saved, dict) or "plan" not in saved:
        return (f"{where} holds no plan (written before checkpoints kept their plan, or by a "
                "run under another strategy)")
    if saved.get("version") != SAVED_STATE_VERSION:
        return (f"{where} holds a saved plan of version {saved.get('version')!r}, this remat "
                f"reads version {SAVED_STATE_VERSION}")
    try:
        return Plan.from_dict(saved["plan"], f"the plan saved in {where}"), saved.get("request")
    except ValueError as err:
        return str(err)


def plan_mismatches(plan: Plan, cfg: DictConfig) -> list[tuple[str, Any, Any]]:
    """``(key, planned, running)`` for each run-shape key (``data.batch_size``, the size
    key, ``precision``, ``accumulate_grad_batches``, ``world_size``) where ``plan`` was
    made for another value than ``cfg`` has; a key the plan does not record is skipped."""
    shape = run_shape.shape_of(cfg.data, cfg.model)
    size = shape.size if not isinstance(shape.size, list) else tuple(shape.size)
    plan_size = tuple(plan.size) if isinstance(plan.size, list) else plan.size
    checks = (("data.batch_size", plan.batch_size, shape.batch_size),
              (shape.size_key or "size", plan_size, size),
              ("precision", plan.precision, str(cfg.get("precision"))),
              ("accumulate_grad_batches", plan.accumulate_grad_batches,
               int(cfg.get("accumulate_grad_batches", 1) or 1)),
              ("world_size", plan.world_size, run_shape.sharding_of(cfg).world_size))
    return [(key, planned, running) for key, planned, running in checks
            if planned and running is not None and planned != running]


def check_plan_fits(plan: Plan, cfg: DictConfig, path: str | None,
                    where: str | None = None) -> None:
    """Raise if ``plan`` was made for another run shape than ``cfg``'s
    (:func:`plan_mismatches`). ``where`` names the plan instead of ``strategy.path`` (the
    plan saved in the checkpoint a run resumes).

    Raises:
        remat.planner.PlanMismatch: (a ``ValueError``) names ``strategy.path`` (or
            ``where``), the key, the plan's and the run's values.
    """
    mismatches = plan_mismatches(plan, cfg)
    if mismatches:
        key, planned, running = mismatches[0]
        todo = (f"set {key} back (a resumed run trains on with the plan it trained with; "
                "for another plan start a new run)" if where else
                f"plan again for this run (python -m remat.plan ... {key}={running}) or set "
                f"{key} back")
        raise PlanMismatch(f"{where or f'strategy.path={path!r}'}: the plan was made for "
                           f"{key}={planned}, this run has {key}={running}; {todo}")


def planner_for(cfg: DictConfig, build: Any, batch_size: int, size: Any, precision: str,
                accumulate: int) -> Planner:
    """The :class:`~remat.planner.Planner` of this config's ``strategy=budget`` keys
    (``strategy.device``, ``units``, ``margin``, ``temporaries``, ``max_traces``,
    ``objective``, ``calibrate``; ``configs/strategy/budget.yaml``), ``model.stages``,
    FSDP2 ``world_size`` and ``compile`` (the compiled step's random draws kept), for one
    micro-batch and accumulation.

    Raises:
        remat.planner.PlanInputError: ``cfg.strategy`` is not a budget (names the target).
        ValueError: a bad planner setting (naming its ``strategy.`` key).
    """
    budget = cfg.strategy
    if not issubclass(get_class(str(budget.get("_target_"))), BudgetStrategy):
        raise PlanInputError(f"strategy={budget.get('_target_')}: planning reads the keys of "
                             "strategy=budget (strategy.memory, strategy.device, ...); keep "
                             "strategy=budget")
    sharding = run_shape.sharding_of(cfg)
    margin, temporaries = budget.get("margin"), budget.get("temporaries")
    return Planner(build, batch_size, size, precision, accumulate, device=budget.device,
                   units=budget.get("units"), margin=None if margin is None else float(margin),
                   temporaries=None if temporaries is None else bool(temporaries),
                   max_traces=int(budget.get("max_traces", 6)),
                   objective=str(budget.get("objective", "time")),
                   default_stages=listed_stages(cfg.model.get("stages")),
                   calibrate=bool(budget.get("calibrate", False)), key="strategy",
                   world_size=sharding.world_size,
                   reshard_after_forward=sharding.reshard_after_forward,
                   size_key=run_shape.size_key_of(cfg.data, cfg.model),
                   compiled=bool(cfg.get("compile", False)))
