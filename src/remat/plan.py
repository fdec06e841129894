"""Plan activation checkpointing for a memory budget on any device, from a CPU.

``python -m remat.plan model=unet_resnet34 data.image_size=2048 data.batch_size=8
precision=bf16-mixed memory=24GiB device=h100`` prints the plan (which units are kept,
recomputed in which segments, or recomputed selectively), its traced peak and modelled
step-time overhead, and the frontier: for budgets evenly spaced from the smallest peak any
plan reaches to ``none``'s peak, the best plan's peak and recompute FLOPs, beside the fixed
strategies (``none``, ``full``, ``sqrtn``, ``every_k`` k=2/4, ``selective``, each on the
model's default stages and on the whole network). It writes ``plan.json`` (replay with
``strategy=plan strategy.path=plan.json``), ``frontier.csv`` and ``frontier.png``.

With ``effective_batch_size=E`` it also plans every micro-batch ``d`` dividing ``E``
(``accumulate_grad_batches = E / d``) and prints the modelled samples/s of each, marking
the fastest that fits: lower the batch, or recompute more? ``plan.json`` is then that
micro-batch's plan, printed with the ``data.batch_size=d accumulate_grad_batches=E/d``
command that trains with it.

Same config keys as training (``model``, ``data``, ``precision``,
``accumulate_grad_batches``) plus ``memory``, ``device``, ``margin``, ``units``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from remat import run_shape
from remat.build import build_from_config
from remat.config import config_dir
from remat.measure import format_bytes
from remat.planner import (
    InfeasibleBudget,
    Plan,
    PlanInputError,
    PlanMismatch,
    Planner,
    PlanStrategy,
)
from remat.planner.budget import BudgetStrategy
from remat.planner.devices import known_devices, present_device_name
from remat.planner.plan import SAVED_STATE_VERSION
from remat.strategies import build_strategy

log = logging.getLogger(__name__)
#: The planner's report (the plan, the frontier table, the micro-batch table). Under Hydra,
#: ``configs/plan.yaml`` sends it to the console as plain lines and into ``plan.log``.
report_log = logging.getLogger("remat.plan.report")

#: The fixed strategies the frontier compares against: (label, registry name, arguments).
FIXED = (("none", "none", {}), ("full", "full", {}), ("sqrtn", "sqrtn", {}),
         ("every_k k=2", "every_k", {"k": 2}), ("every_k k=4", "every_k", {"k": 4}),
         ("selective matmul", "selective", {"policy": "matmul"}))


@dataclass
class Point:
    """One point of the frontier: a plan for a budget or a fixed strategy (bytes, FLOPs)."""

    kind: str  # "plan" | "fixed"
    label: str
    budget_bytes: int | None
    peak_bytes: int | None
    recompute_flops: int | None
    flops_ratio: float | None
    overhead: float | None
    note: str = ""


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


@contextlib.contextmanager
def _rng_kept() -> Any:
    """Put torch's, numpy's and Python's global RNG back as they were after the block."""
    from remat.callbacks.resume import rng_state, set_rng_state

    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def plan_for_run(cfg: DictConfig, strategy: Any, ckpt: dict[str, Any] | None = None,
                 ckpt_path: Any = None) -> Any:
    """The strategy to train with: a :class:`~remat.planner.BudgetStrategy` becomes the
    :class:`~remat.planner.PlanStrategy` of its plan (planned here, before the model is
    built); a replayed plan is checked against the run; anything else is returned as it is.
    Either warns when the plan is for another device than the run trains on
    (:func:`warn_if_other_device`).

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
        default_stages = list(cfg.model.get("stages") or [])
        sharding = run_shape.sharding_of(cfg)
        planned = (_saved_plan(cfg, strategy, ckpt, ckpt_path, default_stages,
                               sharding.reshard_after_forward) if ckpt is not None else None)
        if planned is None:
            build, batch_size, size, precision, accumulate = run_shape_of(cfg)
            with _rng_kept():  # planning builds models: the run's weights must not change
                planned = strategy.planned(
                    build, batch_size, size, precision, accumulate,
                    default_stages=default_stages, world_size=sharding.world_size,
                    reshard_after_forward=sharding.reshard_after_forward)
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
    from hydra.utils import get_class

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
             f"device={present})" if present in known_devices() else
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
    differ = strategy.differences(request, default_stages, reshard_after_forward)
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
    from remat.models.base import STRATEGY_STATE_KEY

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


def _fixed_points(planner: Planner, build: Any, default_stages: list[str]) -> list[Point]:
    whole = [u.path for u in planner.profile.units]
    # modelled step time of each fixed strategy: the same strategy written as a plan
    modelled = {label: 1.0 + planner.modelled_time(plan) / max(planner.profile.step_time,
                                                                 1e-12)
                for label, plan in planner.references(default_stages)}
    points = []
    for stages_label, stages in (("default stages", default_stages), ("whole network", whole)):
        for label, name, kwargs in FIXED:
            if name == "none" and stages_label == "whole network":
                continue
            strategy = build_strategy(name, **kwargs)
            try:
                traced = planner.none if name == "none" else planner.trace(
                    strategy, lambda s, st=stages: build(s, st), key=stages_label)
            except Exception as err:  # noqa: BLE001 - one strategy that cannot apply
                points.append(Point("fixed", f"{label} ({stages_label})", None, None, None,
                                    None, None, f"{type(err).__name__}: {err}"[:200]))
                continue
            extra = max(0, traced.step_flops - planner.none.step_flops)
            full_label = f"{label} ({stages_label})" if name != "none" else "none"
            points.append(Point("fixed", full_label, None, traced.allocator_peak, extra,
                                1 + extra / max(planner.none.step_flops, 1),
                                1.0 if name == "none" else modelled.get(full_label)))
    return points


def _margin(cfg: DictConfig) -> float | None:
    """``margin`` of the config; null: the planner's default for the device."""
    value = cfg.get("margin")
    return None if value is None else float(value)


def _temporaries(cfg: DictConfig) -> bool | None:
    """``temporaries`` of the config (null: measured only when planning for this CPU)."""
    value = cfg.get("temporaries")
    return None if value is None else bool(value)


def planner_for(cfg: DictConfig, build: Any, batch_size: int, size: Any, precision: str,
                accumulate: int) -> Planner:
    """The :class:`~remat.planner.Planner` of this config's planner keys (``device``,
    ``units``, ``margin``, ``temporaries``, ``max_traces``, ``objective``, ``calibrate``,
    ``model.stages``, FSDP2 ``world_size``) for one micro-batch and accumulation."""
    sharding = run_shape.sharding_of(cfg)
    return Planner(build, batch_size, size, precision, accumulate, device=cfg.device,
                   units=cfg.get("units"), margin=_margin(cfg), temporaries=_temporaries(cfg),
                   max_traces=int(cfg.get("max_traces", 6)),
                   objective=str(cfg.get("objective", "time")),
                   default_stages=list(cfg.model.get("stages") or []),
                   calibrate=bool(cfg.get("calibrate", False)), key="",
                   world_size=sharding.world_size,
                   reshard_after_forward=sharding.reshard_after_forward)


def frontier(planner: Planner, count: int) -> list[Point]:
    """Plans for ``count`` budgets evenly spaced from the floor (plus margin) to none's, or
    to the device's memory where none needs more (gpt_medium at 8192 tokens on an H100:
    154 GiB); one note instead where the floor needs more than the device has."""
    _, floor = planner.floor()
    low = planner.budget_for(floor.allocator_peak)
    high = planner.budget_for(planner.none.allocator_peak)
    device = planner.spec.memory_bytes
    if device and high > device:
        if low > device:
            return [Point("plan", "plan", low, None, None, None, None,
                          f"the floor plus margin is more than the device's memory "
                          f"({format_bytes(device)})")]
        high = device
    points = []
    for i in range(count):
        budget = low + (high - low) * i // max(1, count - 1)
        try:
            plan = planner.plan(budget).plan
        except InfeasibleBudget as err:
            points.append(Point("plan", "plan", budget, None, None, None, None,
                                str(err).splitlines()[0]))
            continue
        points.append(Point("plan", "plan", budget, plan.predicted_allocator_peak_bytes,
                            plan.recompute_flops,
                            1 + plan.recompute_flops / max(plan.step_flops, 1),
                            plan.predicted_overhead))
    return points


def format_points(points: list[Point]) -> str:
    """Plain-text table of frontier points (MiB/GiB)."""
    lines = [f"{'':<36}{'budget':>12}{'peak':>12}{'FLOPs x none':>14}{'time x none':>13}"]
    for p in points:
        def fmt(v: int | None) -> str:
            return format_bytes(v) if v is not None else "-"

        lines.append(f"{p.label:<36}{fmt(p.budget_bytes):>12}{fmt(p.peak_bytes):>12}"
                     + (f"{p.flops_ratio:>14.3f}" if p.flops_ratio is not None else f"{'-':>14}")
                     + (f"{p.overhead:>13.3f}" if p.overhead is not None else f"{'-':>13}")
                     + (f"  {p.note}" if p.note else ""))
    return "\n".join(lines)


#: Marker of each fixed strategy in ``frontier.png`` (by its label without the stages).
MARKERS = {"none": "s", "full": "v", "sqrtn": "^", "every_k k=2": "<", "every_k k=4": ">",
           "selective matmul": "D"}


def write_frontier(points: list[Point], out: Path, title: str) -> None:
    """``frontier.csv`` and ``frontier.png`` (:func:`frontier_figure`)."""
    with (out / "frontier.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["kind", "label", "budget_bytes", "peak_bytes", "recompute_flops",
                         "flops_x_none", "modelled_time_x_none", "note"])
        for p in points:
            writer.writerow([p.kind, p.label, p.budget_bytes, p.peak_bytes, p.recompute_flops,
                             p.flops_ratio, p.overhead, p.note])
    import matplotlib.pyplot as plt

    fig = frontier_figure(points, title)
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)


def frontier_figure(points: list[Point], title: str) -> Any:
    """The frontier as a matplotlib ``Figure`` (Agg): traced peak (MiB) against step FLOPs
    x none, the plans as a line, each fixed strategy with its own marker and colour, filled
    on the model's default stages and hollow (larger) on the whole network, so points that
    coincide still show. A legend beside the axes names them (no text at the points, which
    overlapped) and ``title`` is wrapped to the figure's width (constrained layout)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    plans = [p for p in points if p.kind == "plan" and p.peak_bytes is not None]
    ax.plot([p.peak_bytes / 2**20 for p in plans], [p.flops_ratio for p in plans], "o-",
            color="C0", label="remat plans (budgets)", zorder=3)
    colors: dict[str, str] = {}
    for p in points:
        if p.kind != "fixed" or p.peak_bytes is None:
            continue
        name, _, stages = p.label.partition(" (")
        first = name not in colors
        color = colors.setdefault(name, f"C{len(colors) + 1}")
        whole = stages.startswith("whole")
        ax.scatter(p.peak_bytes / 2**20, p.flops_ratio, marker=MARKERS.get(name, "o"),
                   s=80 if whole else 30, facecolors="none" if whole else color,
                   edgecolors=color, linewidths=1.2, label=name if first else None,
                   zorder=4 if whole else 5)
    ax.set_xlabel("traced peak of a training step (MiB)")
    ax.set_ylabel("step FLOPs x none (recompute cost)")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
              title="fixed strategies:\nfilled: model.stages\nhollow: whole network",
              title_fontsize=7, alignment="left")
    return fig


def micro_batches(cfg: DictConfig, memory: Any, effective: int,
                  planner: Planner | None = None) -> list[dict[str, Any]]:
    """Plan every micro-batch dividing ``effective / world_size`` (the samples one rank
    sees per optimizer step); modelled samples/s of each. ``planner``: one already made
    for this config, used for the micro-batch of its own batch size and accumulation
    (its profile is not traced again).

    Each row has ``micro_batch``, ``accumulate_grad_batches`` and ``fits``; a row that fits
    also ``peak_bytes`` (predicted allocator peak), ``overhead`` (modelled step time x
    none), ``samples_per_s`` (modelled), ``seconds`` (planning time), ``summary`` and
    ``plan`` (:meth:`Plan.to_dict`, what ``plan.json`` holds); one that does not, ``note``
    (first line) and ``error`` (the planner's whole message). The fastest row that fits has
    ``fastest: True``.

    Raises:
        ValueError: ``world_size`` does not divide ``effective_batch_size`` (names both).
    """
    rows = []
    build, _, size, precision, _ = run_shape_of(cfg)
    sharding = run_shape.sharding_of(cfg)
    if effective % sharding.world_size:
        raise PlanInputError(f"effective_batch_size={effective} is not a multiple of world_size="
                         f"{sharding.world_size}: every rank trains the same number of "
                         "samples per optimizer step (micro-batch x accumulate_grad_batches x "
                         "world_size); pick an effective_batch_size divisible by world_size")
    per_rank = effective // sharding.world_size
    for micro in [d for d in range(1, per_rank + 1) if per_rank % d == 0]:
        accumulate = per_rank // micro
        row: dict[str, Any] = {"micro_batch": micro, "accumulate_grad_batches": accumulate}
        try:
            if planner is not None and (planner.batch_size, planner.accumulate) == (
                    micro, accumulate):
                micro_planner = planner
            else:
                micro_planner = planner_for(cfg, build, micro, size, precision, accumulate)
            planned = micro_planner.plan(memory)
        except InfeasibleBudget as err:
            row.update(fits=False, note=str(err).splitlines()[0], error=str(err))
            rows.append(row)
            continue
        plan = planned.plan
        step_s = micro_planner.profile.step_time * plan.predicted_overhead * accumulate
        row.update(fits=True, peak_bytes=plan.predicted_allocator_peak_bytes,
                   overhead=plan.predicted_overhead, samples_per_s=effective / step_s,
                   seconds=planned.seconds + micro_planner.setup_seconds,
                   summary=plan.summary(), plan=plan.to_dict())
        rows.append(row)
    fitting = [r for r in rows if r.get("fits")]
    if fitting:
        max(fitting, key=lambda r: r["samples_per_s"])["fastest"] = True
    return rows


#: ``remat.plan`` keys that ``train.yaml`` does not have (left out of the train command).
PLAN_ONLY_KEYS = ("memory", "device", "margin", "units", "budgets", "fixed", "max_traces",
                  "calibrate", "objective", "effective_batch_size", "world_size",
                  "reshard_after_forward", "strategy")


#: Config groups ``train.yaml``'s defaults list holds but ``plan.yaml``'s does not: added
#: with ``+`` to ``remat.plan``, chosen without it in ``train.py``.
TRAIN_GROUPS = ("experiment", "debug", "trainer", "callbacks", "logger")


def train_overrides(path: Path, micro_batch: int | None = None,
                    accumulate: int | None = None, sequence: bool = False) -> list[str]:
    """The overrides that train with the plan at ``path``: this ``remat.plan`` call's own
    (model, data, sizes, precision; under Hydra) less the planner's keys, then, for a
    micro-batch of the search, ``data.batch_size=<micro_batch>
    accumulate_grad_batches=<accumulate>`` in place of the call's, for a ``sequence``
    model without an experiment or monitor of its own ``monitor=val/loss
    monitor_mode=min`` (``train.yaml`` monitors a segmentation model's ``val/dice``), and
    ``strategy=plan strategy.path=<path>``."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task)
    except ValueError:  # no Hydra app around this call
        task = []
    replaced = ("data.batch_size", "accumulate_grad_batches") if micro_batch else ()
    kept = []
    for override in task:
        key = override.split("=", 1)[0].lstrip("+~")
        if (key.split(".")[0] in PLAN_ONLY_KEYS or key.startswith("hydra.")
                or key in replaced):
            continue
        if override.startswith("+") and key in TRAIN_GROUPS:
            override = override[1:]  # a group train.yaml lists (+experiment= is refused there)
        kept.append(override)
    if micro_batch:
        kept += [f"data.batch_size={micro_batch}", f"accumulate_grad_batches={accumulate}"]
    keys = {o.split("=", 1)[0].lstrip("+~") for o in kept}
    if sequence and not keys & {"experiment", "monitor", "monitor_mode"}:
        kept += ["monitor=val/loss", "monitor_mode=min"]
    return [*kept, "strategy=plan", f"strategy.path={path}"]


def _plan_lines(plan: Plan, seconds: float, temporaries: bool = True) -> str:
    """What is printed for the plan: its budget, predicted peaks, costs and units
    (``temporaries``: whether kernel temporaries were measured into the peak)."""
    extra = "the batch and kernel temporaries" if temporaries else "the batch"
    return (f"budget {format_bytes(plan.budget_bytes)} (margin {format_bytes(plan.margin_bytes)}"
            f"): predicted peak {format_bytes(plan.predicted_allocator_peak_bytes)} with "
            f"{extra}, {format_bytes(plan.predicted_peak_bytes)} in "
            f"tensors (none {format_bytes(plan.none_peak_bytes)}), recompute FLOPs x"
            f"{1 + plan.recompute_flops / max(plan.step_flops, 1):.3f} of none, modelled "
            f"step time x{plan.predicted_overhead:.3f} (planned in {seconds:.1f} s)\n"
            + plan.summary())


def _micro_batch_table(rows: list[dict[str, Any]], effective: int) -> str:
    lines = [f"micro-batch search, effective batch {effective}:"]
    for r in rows:
        mark = "  <- fastest that fits" if r.get("fastest") else ""
        head = f"  batch {r['micro_batch']:>4} x accumulate {r['accumulate_grad_batches']:>4}: "
        if r.get("fits"):
            lines.append(f"{head}peak {format_bytes(r['peak_bytes']):>10}, time "
                         f"x{r['overhead']:.3f}, {r['samples_per_s']:.1f} samples/s "
                         f"(modelled){mark}")
        else:
            lines.append(f"{head}does not fit ({r['note']})")
    return "\n".join(lines)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Plan, report, and write ``plan.json`` (with ``memory``), ``frontier.csv``,
    ``frontier.png`` and ``plan_report.json`` into ``cfg.paths.output_dir``.

    The report (the plan, the frontier table, the micro-batch table) goes to the
    ``remat.plan.report`` logger: under Hydra, plain lines on the console and the same in
    ``plan.log`` (``configs/plan.yaml``, ``hydra.job_logging``). With
    ``effective_batch_size=E`` the plan written and reported is the one of the micro-batch
    the table marks (the fastest that fits), with the overrides that train with it
    (``train_overrides`` in the result).

    Returns:
        What was reported, as data.

    Raises:
        remat.planner.PlanInputError: ``effective_batch_size`` without ``memory``, or not a
            multiple of ``world_size``; a ``plan.json`` already in the output folder (a run
            may train with it).
        remat.planner.InfeasibleBudget: no plan fits ``memory`` (with
            ``effective_batch_size``: no micro-batch does; the message is the smallest
            micro-batch's).
    """
    effective = int(cfg.get("effective_batch_size") or 0)
    if effective and cfg.get("memory") is None:
        raise PlanInputError("effective_batch_size needs memory=... (the budget to fit)")
    out = Path(cfg.paths.output_dir)
    if cfg.get("memory") is not None and (out / "plan.json").exists():
        raise PlanInputError(f"{out / 'plan.json'} exists: a run may train with it (strategy=plan "
                             "strategy.path=...) and would no longer match it; plan into "
                             "another folder (hydra.run.dir=...) or remove that file")
    out.mkdir(parents=True, exist_ok=True)
    build, batch_size, size, precision, accumulate = run_shape_of(cfg)
    sharding = run_shape.sharding_of(cfg)
    planner = planner_for(cfg, build, batch_size, size, precision, accumulate)
    spec = planner.spec
    shape = (f"{planner.profile.model}, batch {batch_size}, size {size}, {precision}"
             + (f", accumulate_grad_batches={accumulate}" if accumulate > 1 else "")
             + (f", one of {sharding.world_size} FSDP2 ranks" if sharding.world_size > 1
                else "")
             + f", on {spec.title}")
    report_log.info(f"plan for {shape} ({spec.name}; {spec.source})")
    result: dict[str, Any] = {"device": spec.to_dict(), "none_peak_bytes": planner.none.peak_bytes,
                              "none_allocator_peak_bytes": planner.none.allocator_peak}
    path = out / "plan.json"
    sequence = planner.profile.kind != "image"
    measured = planner.temporaries is not None
    if cfg.get("memory") is not None and not effective:
        planned = planner.plan(cfg.memory)
        planned.plan.save(path)
        result["train_overrides"] = train_overrides(path, sequence=sequence)
        report_log.info(_plan_lines(planned.plan, planned.seconds + planner.setup_seconds,
                                    measured)
                        + f"\nplan written to {path}; train with it:\n  python train.py "
                        + " ".join(shlex.quote(o) for o in result["train_overrides"]))
        result["plan"] = planned.plan.to_dict()
    points = frontier(planner, int(cfg.budgets)) if int(cfg.budgets) > 0 else []
    default_stages = list(cfg.model.get("stages") or [])
    if cfg.get("fixed", True):
        points += _fixed_points(planner, build, default_stages)
    if points:
        report_log.info("frontier (plans for budgets from the floor to none) and fixed "
                        "strategies:\n" + format_points(points))
        write_frontier(points, out, shape)
        result["frontier"] = [vars(p) for p in points]
    if effective:
        rows = micro_batches(cfg, cfg.memory, effective, planner)
        result["micro_batches"] = rows
        report_log.info(_micro_batch_table(rows, effective))
        marked = next((r for r in rows if r.get("fastest")), None)
        if marked is None:  # as without effective_batch_size: no plan fits, exit code 2
            raise InfeasibleBudget(f"effective_batch_size={effective}: no micro-batch fits "
                                   f"memory={cfg.memory}; micro-batch {rows[0]['micro_batch']}: "
                                   + rows[0]["error"])
        plan = Plan.from_dict(marked["plan"])
        plan.save(path)
        micro, acc = marked["micro_batch"], marked["accumulate_grad_batches"]
        result["plan"] = marked["plan"]
        result["train_overrides"] = train_overrides(path, micro, acc, sequence)
        ranks = (f" on each of {sharding.world_size} FSDP2 ranks (trainer=fsdp, "
                 "trainer.devices x trainer.num_nodes = world_size)"
                 if sharding.world_size > 1 else "")
        report_log.info(f"plan for micro-batch {micro} x accumulate_grad_batches {acc} (the "
                        f"fastest that fits{ranks}):\n"
                        + _plan_lines(plan, marked["seconds"], measured)
                        + f"\nplan written to {path}; train with it:\n  python train.py "
                        + " ".join(shlex.quote(o) for o in result["train_overrides"]))
    (out / "plan_report.json").write_text(json.dumps(
        result | {"config": OmegaConf.to_container(cfg, resolve=False)}, indent=2,
        default=str))
    return result


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="plan")
def main(cfg: DictConfig) -> None:
    """Hydra app around :func:`run`; an infeasible budget exits with code 2 and what would
    fit instead (on stderr); a bad planner setting (:class:`~remat.planner.PlanInputError`)
    exits with code 1 and its message on one line (``error: ...``)."""
    try:
        run(cfg)
    except InfeasibleBudget as err:
        print(str(err), file=sys.stderr)
        sys.exit(2)
    except PlanInputError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
