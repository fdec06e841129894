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
from remat.config import config_dir
from remat.measure import format_bytes
from remat.planner import (
    InfeasibleBudget,
    Plan,
    PlanInputError,
    Planner,
)
from remat.planner.run import planner_for, run_shape_of
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
