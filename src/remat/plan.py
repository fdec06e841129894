"""Plan activation checkpointing for a memory budget on any device, from a CPU.

``python -m remat.plan model=unet_resnet34 data.image_size=2048 data.batch_size=8
precision=bf16-mixed strategy.memory=24GiB strategy.device=h100`` prints the plan (which
units are kept, recomputed in which segments, or recomputed selectively), its traced peak
and modelled step-time overhead, and the frontier: for budgets evenly spaced from the
smallest peak any plan reaches to ``none``'s peak, the best plan's peak and recompute
FLOPs, beside the fixed strategies (:data:`remat.strategies.FIXED_POINTS`, each on the
model's default stages and on the whole network). It writes ``plan.json`` (replay with
``strategy=plan strategy.path=plan.json``), ``frontier.csv`` and ``frontier.png``.

With ``effective_batch_size=E`` it also plans every micro-batch ``d`` dividing ``E``
(``accumulate_grad_batches = E / d``) and prints the modelled samples/s of each, marking
the fastest that fits: lower the batch, or recompute more? ``plan.json`` is then that
micro-batch's plan, printed with the ``data.batch_size=d accumulate_grad_batches=E/d``
command that trains with it.

Same config keys as training (``model``, ``data``, ``precision``,
``accumulate_grad_batches``, and ``strategy=budget``'s ``strategy.memory``,
``strategy.device``, ``strategy.margin``, ``strategy.units``, ...; without
``strategy.memory`` it prints the frontier only), plus ``budgets``, ``fixed``,
``effective_batch_size`` and the FSDP2 ``world_size``.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from remat import run_shape
from remat.config import config_dir
from remat.errors import exit_on_unknown_key, run_entry
from remat.measure import format_bytes
from remat.planner import (
    InfeasibleBudget,
    Plan,
    PlanInputError,
    parse_memory,
)
from remat.planner.frontier import (
    fixed_points,
    format_points,
    frontier,
    micro_batches,
    write_frontier,
)
from remat.planner.run import planner_for, run_shape_of
from remat.strategies.stages import listed_stages

log = logging.getLogger(__name__)
#: The planner's report (the plan, the frontier table, the micro-batch table). Under Hydra,
#: ``configs/plan.yaml`` sends it to the console as plain lines and into ``plan.log``.
report_log = logging.getLogger("remat.plan.report")

#: ``remat.plan`` keys that ``train.yaml`` does not have (left out of the train command).
PLAN_ONLY_KEYS = ("budgets", "fixed", "effective_batch_size", "world_size",
                  "reshard_after_forward", "strategy")


#: Config groups ``train.yaml``'s defaults list holds but ``plan.yaml``'s does not: added
#: with ``+`` to ``remat.plan``, chosen without it in ``train.py``.
TRAIN_GROUPS = ("experiment", "debug", "trainer", "callbacks", "logger")


def train_overrides(path: Path, micro_batch: int | None = None,
                    accumulate: int | None = None) -> list[str]:
    """The overrides that train with the plan at ``path``: this ``remat.plan`` call's own
    (model, data, sizes, precision; under Hydra) less the planner's keys, then, for a
    micro-batch of the search, ``data.batch_size=<micro_batch>
    accumulate_grad_batches=<accumulate>`` in place of the call's, and ``strategy=plan
    strategy.path=<path>``. A sequence model planned on synthetic tokens
    (``+data.block_size=N`` without ``data=``) trains on ``data=tinyshakespeare
    data.block_size=N``: the default data gives images."""
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
    keys = [o.split("=", 1)[0] for o in kept]
    if "+data.block_size" in keys and "data" not in keys:
        # a sequence model planned on synthetic tokens (no data= given: the default image
        # data with a block size added); training needs a text dataset, whose
        # data.block_size takes no '+'
        at = keys.index("+data.block_size")
        kept[at:at + 1] = ["data=tinyshakespeare", kept[at][1:]]
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


def _cost(planner: Any, plan: Plan) -> float:
    """What the planner minimised for ``plan``: modelled recompute time (s) or FLOPs."""
    return (planner.modelled_cost(plan) if planner.objective == "time"
            else float(plan.recompute_flops))


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
    """Plan, report, and write ``plan.json`` (with ``strategy.memory``), ``frontier.csv``,
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
        remat.planner.PlanInputError: ``effective_batch_size`` without ``strategy.memory``,
            or not a multiple of ``world_size``; a ``plan.json`` already in the output folder (a run
            may train with it).
        remat.planner.InfeasibleBudget: no plan fits ``strategy.memory`` (with
            ``effective_batch_size``: no micro-batch does; the message is the smallest
            micro-batch's).
    """
    effective = int(cfg.get("effective_batch_size") or 0)
    memory = cfg.strategy.get("memory")
    if effective and memory is None:
        raise PlanInputError("effective_batch_size needs strategy.memory=... (the budget to fit)")
    if memory is not None:  # its spelling, before minutes of profiling (the device's size later)
        parse_memory(memory, device_memory=2**62)
    out = Path(cfg.paths.output_dir)
    if memory is not None and (out / "plan.json").exists():
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
    measured = planner.temporaries is not None
    if memory is not None and not effective:
        planned = planner.plan(memory)
        planned.plan.save(path)
        result["train_overrides"] = train_overrides(path)
        report_log.info(_plan_lines(planned.plan, planned.seconds + planner.setup_seconds,
                                    measured)
                        + f"\nplan written to {path}; train with it:\n  python train.py "
                        + " ".join(shlex.quote(o) for o in result["train_overrides"]))
        result["plan"] = planned.plan.to_dict()
    started = time.perf_counter()
    points = frontier(planner, int(cfg.budgets)) if int(cfg.budgets) > 0 else []
    default_stages = listed_stages(cfg.model.get("stages"))
    if cfg.get("fixed", True):
        points += fixed_points(planner, build, default_stages)
    if points:
        report_log.info("frontier (plans for budgets from the floor to none) and fixed "
                        f"strategies, traced in {time.perf_counter() - started:.1f} s:\n"
                        + format_points(points))
        write_frontier(points, out, shape, planner.objective)
        result["frontier"] = [vars(p) for p in points]
    if memory is not None and not effective and points:
        # the frontier traced more plans; one that fits this budget and costs less replaces
        # the plan (the search's own traces come from the cache: no trace is repeated), so
        # the plan is never above a frontier point at a budget at most its own
        again = planner.plan(memory)
        if _cost(planner, again.plan) < _cost(planner, planned.plan):
            planned = again
            planned.plan.save(path)
            report_log.info("a plan traced for the frontier fits the budget and costs less: "
                            + _plan_lines(planned.plan, planned.seconds, measured)
                            + f"\nplan written to {path} (the same train command)")
            result["plan"] = planned.plan.to_dict()
    if effective:
        rows = micro_batches(cfg, memory, effective, planner)
        result["micro_batches"] = rows
        report_log.info(_micro_batch_table(rows, effective))
        marked = next((r for r in rows if r.get("fastest")), None)
        if marked is None:  # as without effective_batch_size: no plan fits, exit code 2
            raise InfeasibleBudget(f"effective_batch_size={effective}: no micro-batch fits "
                                   f"strategy.memory={memory}; micro-batch "
                                   f"{rows[0]['micro_batch']}: " + rows[0]["error"])
        plan = Plan.from_dict(marked["plan"])
        plan.save(path)
        micro, acc = marked["micro_batch"], marked["accumulate_grad_batches"]
        result["plan"] = marked["plan"]
        result["train_overrides"] = train_overrides(path, micro, acc)
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


def _app(cfg: DictConfig) -> None:
    """Hydra app around :func:`run`; an infeasible budget exits with code 2 and what would
    fit instead (on stderr); a bad planner setting (:class:`~remat.planner.PlanInputError`)
    or another user error (a config, data or model-build error,
    :func:`remat.errors.run_entry`) exits with code 1 and its message on one line
    (``error: ...``)."""
    def run_or_exit(cfg: DictConfig) -> None:
        try:
            run(cfg)
        except InfeasibleBudget as err:  # what would fit, on several lines: exit code 2
            print(str(err), file=sys.stderr)
            raise SystemExit(2) from None
        except PlanInputError as err:
            raise SystemExit(f"error: {err}") from None

    run_entry(run_or_exit, cfg)


_hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir()),
                         config_name="plan")(_app)


def main() -> None:
    """``python -m remat.plan`` / ``remat-plan``: a key the config lacks ends it with one
    line naming the closest keys (:func:`remat.errors.exit_on_unknown_key`), then the Hydra
    app (:func:`_app`)."""
    exit_on_unknown_key("plan")
    _hydra_main()


if __name__ == "__main__":
    main()
