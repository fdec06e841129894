"""The memory/recompute frontier of a model and the micro-batch search (``remat.plan``).

:func:`frontier` plans budgets evenly spaced from the floor to ``none``'s peak;
:func:`fixed_points` traces the registry's fixed strategies
(:data:`remat.strategies.FIXED_POINTS`) on the model's default stages and on the whole
network; :func:`write_frontier` writes them as ``frontier.csv`` and ``frontier.png``.
:func:`micro_batches` plans every micro-batch of an effective batch and models the
samples/s of each.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from remat import run_shape
from remat.measure import format_bytes
from remat.planner.memory import PlanInputError
from remat.planner.planner import InfeasibleBudget, Planner
from remat.planner.run import planner_for, run_shape_of
from remat.strategies import FIXED_POINTS, build_strategy

log = logging.getLogger(__name__)


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


def fixed_points(planner: Planner, build: Any, default_stages: list[str]) -> list[Point]:
    """One point per fixed strategy of :data:`remat.strategies.FIXED_POINTS`, traced on
    ``default_stages`` (none listed, ``model.stages=auto``, or stages that name every
    candidate unit: no such rows) and on the whole network (every candidate unit; ``none``
    once):
    its traced allocator peak (bytes), extra FLOPs over ``none`` and modelled step time x
    ``none`` (the same strategy written as a plan, :meth:`Planner.references`). A
    strategy that cannot apply to the stages is a point with its error as the note.
    ``build(strategy, stages)`` builds the model."""
    whole = [u.path for u in planner.profile.units]
    # modelled step time of each fixed strategy: the same strategy written as a plan
    modelled = {label: 1.0 + planner.modelled_time(plan) / max(planner.profile.step_time,
                                                                 1e-12)
                for label, plan in planner.references(default_stages)}
    points = []
    # model.stages=auto (no stages listed): the default stages are the found units, the
    # whole network's rows; building on an empty list wrapped nothing and named only that.
    # Stages naming every unit (a GPT's `blocks`) give the whole network's rows again: once
    sets = ([("default stages", default_stages)]
            if default_stages and not planner.names_every_unit(default_stages) else [])
    for first, (stages_label, stages) in enumerate([*sets, ("whole network", whole)]):
        def build_on(s: Any, st: list[str] = stages) -> Any:
            return build(s, st)

        strategies = [build_strategy(name, **kwargs) for _, name, kwargs in FIXED_POINTS
                      if name != "none"]
        try:  # side by side (one child process per CPU), cached for the loop below
            planner.trace_many(strategies, build_on, key=stages_label)
        except Exception:  # noqa: BLE001 - one that cannot apply is named below, alone
            log.debug("fixed strategies traced side by side failed", exc_info=True)
        for label, name, kwargs in FIXED_POINTS:
            if name == "none" and first:
                continue
            strategy = build_strategy(name, **kwargs)
            try:
                traced = planner.none if name == "none" else planner.trace(
                    strategy, build_on, key=stages_label)
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


#: Distinct plans the search traces per frontier point (a budget's own plan: the planner's
#: ``max_traces``, 6): each point also draws on every plan traced before it
#: (:meth:`Planner.traced_fitting`), the points run from the floor up.
FRONTIER_TRACES = 3


def frontier(planner: Planner, count: int) -> list[Point]:
    """Plans for ``count`` budgets evenly spaced from the floor (plus margin) to none's (the
    distinct ones: a single point where the floor is none's peak), or
    to the device's memory where none needs more (gpt_medium at 8192 tokens on an H100:
    154 GiB); one note instead where the floor needs more than the device has. The points
    are the search's plans without :meth:`Planner.refine` (its traces, per point, would
    double the frontier's cost), each from at most :data:`FRONTIER_TRACES` traces of its
    own: the plan made for a budget may sit below them."""
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
    # distinct budgets: where the floor is none's peak (an optimizer-step peak) they are one
    for budget in sorted({low + (high - low) * i // max(1, count - 1) for i in range(count)}):
        try:
            plan = planner.plan(budget, refine=False, max_traces=FRONTIER_TRACES).plan
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
    """Plain-text table of frontier points (MiB/GiB); ``peak`` is the predicted allocator
    peak (tensors, the batch and kernel temporaries: what a budget holds), which is above
    the tensor peak training's memory monitor and start-of-run estimate report."""
    lines = [f"{'':<36}{'budget':>12}{'peak':>12}{'FLOPs x none':>14}{'time x none':>13}"
             "   (peak: allocator, with the batch and kernel temporaries)"]
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


def write_frontier(points: list[Point], out: Path, title: str, objective: str = "time"
                   ) -> None:
    """``frontier.csv`` and ``frontier.png`` (:func:`frontier_figure`; ``objective``: what
    the plans minimised)."""
    with (out / "frontier.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["kind", "label", "budget_bytes", "peak_bytes", "recompute_flops",
                         "flops_x_none", "modelled_time_x_none", "note"])
        for p in points:
            writer.writerow([p.kind, p.label, p.budget_bytes, p.peak_bytes, p.recompute_flops,
                             p.flops_ratio, p.overhead, p.note])
    import matplotlib.pyplot as plt

    fig = frontier_figure(points, title, objective)
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)


def frontier_figure(points: list[Point], title: str, objective: str = "time") -> Any:
    """The frontier as a matplotlib ``Figure`` (Agg), two panels sharing the x axis (traced
    peak, MiB): step FLOPs x none, and modelled step time x none (the roofline the search
    minimises under ``objective=time``), so a plan is never drawn as dominated by a point it
    beats on what it was planned for; the panel of the ``objective`` is marked. The plans
    are a line, each fixed strategy has its own marker and colour, filled on the model's
    default stages and hollow (larger) on the whole network, so points that coincide still
    show. A legend beside the axes names them and ``title`` is wrapped to the figure's
    width (constrained layout)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained", sharex=True)
    panels = (("flops_ratio", "step FLOPs x none (recompute cost)", "flops"),
              ("overhead", "modelled step time x none (roofline)", "time"))
    for ax, (attr, label, name) in zip(axes, panels, strict=True):
        plans = [p for p in points if p.kind == "plan" and p.peak_bytes is not None
                 and getattr(p, attr) is not None]
        ax.plot([p.peak_bytes / 2**20 for p in plans], [getattr(p, attr) for p in plans],
                "o-", color="C0", label="remat plans (budgets)", zorder=3)
        colors: dict[str, str] = {}
        for p in points:
            if p.kind != "fixed" or p.peak_bytes is None or getattr(p, attr) is None:
                continue
            short, _, stages = p.label.partition(" (")
            first = short not in colors
            color = colors.setdefault(short, f"C{len(colors) + 1}")
            whole = stages.startswith("whole")
            ax.scatter(p.peak_bytes / 2**20, getattr(p, attr), marker=MARKERS.get(short, "o"),
                       s=80 if whole else 30, facecolors="none" if whole else color,
                       edgecolors=color, linewidths=1.2, label=short if first else None,
                       zorder=4 if whole else 5)
        ax.set_xlabel("traced peak of a training step (MiB)")
        ax.set_ylabel(label + ("  [the plans' objective]" if name == objective else ""))
        ax.grid(alpha=0.3)
    fig.suptitle(textwrap.fill(title, 120), fontsize=8)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
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
