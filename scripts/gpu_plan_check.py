"""The planner on the device present: predicted against measured peak and step time of a few
plans (budgets between the floor and ``none``'s peak), planned for this device
(``device=auto``) and run for real.

    python scripts/gpu_plan_check.py model=unet_resnet34 data.image_size=1024 \
        data.batch_size=8 precision=bf16-mixed --out outputs/gpu_check/plans.md

Any ``estimate``-config override is accepted; ``--plans N`` (default 3) budgets, evenly
spaced strictly between the floor and ``none``'s predicted peak; ``--steps``/``--warmup``
timed steps (default 5/2); ``--out FILE`` (the markdown table; a ``.json`` beside it).

Per row (``none`` and each plan): the predicted allocator peak (the trace; on a GPU planned
without measured kernel temporaries, the margin covers them), the measured peak of two real
optimizer steps in Lightning's order (AdamW from the model's ``configure_optimizers``;
CUDA: ``torch.cuda.max_memory_allocated`` less what other rows hold; CPU:
``torch.profiler`` memory events), the modelled step time x ``none`` against the measured
one (medians of interleaved timed steps, one batch reused, all rows' models held), the
recompute FLOPs x ``none``, and the gradients against ``none``'s. Then ``none`` once more,
predicted by a planner that measures each operator's kernel temporaries on this device
(``temporaries=true``), against the same measured peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from plan_acceptance import gradients  # scripts/, beside this file

from remat.build import build_from_config
from remat.measure import ProfilerPeakMemory, format_bytes
from remat.measure.parity import TOLERANCES, compare_gradients
from remat.measure.step import autocast
from remat.measure.trace import optimizer_of, optimizer_steps, sized_batch
from remat.planner import InfeasibleBudget, Planner, PlanStrategy
from remat.strategies import NoCheckpoint


class Row:
    """One strategy on the device: its model and optimizer (held for the timed rounds)."""

    def __init__(self, label, build, strategy, device):
        self.label, self.strategy = label, strategy
        torch.manual_seed(0)  # every row starts from the same weights
        self.model = build(strategy).train().to(device)
        self.optimizer = optimizer_of(self.model)
        self.times: list[float] = []
        self.peak = 0


def measure_peak(row: Row, batch_size, size, device, precision) -> int:
    """Peak bytes of two optimizer steps of ``row`` from the start (its parameters held)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        others = torch.cuda.memory_allocated(device) - sum(
            t.untyped_storage().nbytes() for t in _held(row.model))
        torch.cuda.reset_peak_memory_stats(device)
        optimizer_steps(row.model, row.optimizer, batch_size, size, device, precision, seed=10)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - others)
    with ProfilerPeakMemory(device, modules=[row.model]) as meter:
        optimizer_steps(row.model, row.optimizer, batch_size, size, device, precision, seed=10)
    return int(meter.peak_bytes)


def _held(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``model`` (one per storage)."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t
    return list(seen.values())


def timed_step(row: Row, batch, device, precision) -> float:
    """One optimizer step on ``batch`` (ms)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with autocast(device, precision):
        loss = row.model.training_loss(batch)
    row.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    row.optimizer.step()
    del loss
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000



def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--plans", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from hydra import compose, initialize_config_dir

    from remat.config import config_dir

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("estimate", overrides=[f"device={device.type}", *args.overrides])
    build_cfg, _, batch_size, size = build_from_config(cfg)
    build = build_cfg.with_strategy
    precision = str(cfg.precision)
    stages = list(cfg.model.get("stages") or [])
    start = time.perf_counter()
    planner = Planner(build, batch_size, size, precision, device="auto", objective="time",
                      default_stages=stages)
    setup = time.perf_counter() - start
    _, floor = planner.floor()
    low, high = floor.allocator_peak, planner.none.allocator_peak
    plans, notes = [], []
    for i in range(1, args.plans + 1):
        budget = planner.budget_for(low + (high - low) * i // (args.plans + 1))
        t0 = time.perf_counter()
        try:
            plans.append((budget, planner.plan(budget).plan, time.perf_counter() - t0))
        except InfeasibleBudget as err:
            notes.append(f"budget {format_bytes(budget)}: {str(err).splitlines()[0]}")
    rows = [Row("none", build, NoCheckpoint(), device)]
    rows += [Row(f"plan {format_bytes(b)}", build, PlanStrategy(p), device) for b, p, _ in plans]
    for row in rows:
        row.peak = measure_peak(row, batch_size, size, device, precision)
    torch.manual_seed(11)
    batch = sized_batch(rows[0].model, batch_size, size, device)
    for r in range(args.warmup + args.steps):  # interleaved rounds: every row once a round
        for row in rows:
            ms = timed_step(row, batch, device, precision)
            if r >= args.warmup:
                row.times.append(ms)
    ref_grads = gradients(build, NoCheckpoint(), batch_size, size, precision, batch, device)
    rtol, atol = TOLERANCES.get(precision, TOLERANCES["32-true"])
    none_ms = statistics.median(rows[0].times)
    records = []
    for row, extra in zip(rows, [None, *plans], strict=True):
        plan = extra[1] if extra else None
        predicted = plan.predicted_allocator_peak_bytes if plan else planner.none.allocator_peak
        parity = (compare_gradients(ref_grads, gradients(build, row.strategy, batch_size, size,
                                                          precision, batch, device), rtol, atol)
                  if plan else None)
        records.append({
            "row": row.label, "budget_bytes": extra[0] if extra else None,
            "predicted_peak_bytes": int(predicted), "measured_peak_bytes": row.peak,
            "measured_over_predicted": row.peak / predicted,
            "fits": extra is None or row.peak <= extra[0],
            "modelled_time_x_none": plan.predicted_overhead if plan else 1.0,
            "measured_time_x_none": statistics.median(row.times) / none_ms,
            "median_step_ms": statistics.median(row.times),
            "recompute_flops_x_none": (1 + plan.recompute_flops / max(plan.step_flops, 1))
            if plan else 1.0,
            "grads_match": parity.match if parity else True,
            "grad_rel_error": parity.max_rel_error if parity else 0.0,
            "plan": plan.summary().replace("\n", "; ") if plan else "",
            "planned_s": extra[2] if extra else None})
    del rows, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    measured_none = records[0]["measured_peak_bytes"]
    temps = Planner(build, batch_size, size, precision, device="auto", temporaries=True,
                    default_stages=stages)
    with_temps = temps.none.allocator_peak
    name = (torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU")
    lines = [f"### Plans on {name}: {planner.profile.model} batch {batch_size}, size {size}, "
             f"{precision}, torch {torch.__version__}", "",
             f"planned for {planner.spec.name} ({planner.spec.title}); margin "
             f"{planner.margin:.3f}{'' if planner.temporaries else ' + largest conv tensor'}; "
             f"floor {format_bytes(low)}; setup {setup:.0f} s; {args.steps} timed rounds "
             f"after {args.warmup}, medians", "",
             "| row | budget | predicted peak | measured peak | measured / predicted | fits | "
             "modelled time x none | measured time x none | FLOPs x none | grads | plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['row']} | {format_bytes(r['budget_bytes']) if r['budget_bytes'] else '-'} | "
            f"{format_bytes(r['predicted_peak_bytes'])} | {format_bytes(r['measured_peak_bytes'])}"
            f" | {r['measured_over_predicted']:.4f} | {'yes' if r['fits'] else 'NO'} | "
            f"{r['modelled_time_x_none']:.3f} | {r['measured_time_x_none']:.3f} | "
            f"{r['recompute_flops_x_none']:.3f} | "
            f"{'match' if r['grads_match'] else 'DIFFER'} ({r['grad_rel_error']:.1e}) | "
            f"{r['plan'] or '-'} |")
    lines += ["", f"none with kernel temporaries measured on this device (temporaries=true): "
              f"predicted {format_bytes(with_temps)}, measured {format_bytes(measured_none)} "
              f"({measured_none / with_temps:.4f})", *(f"note: {n}" for n in notes), ""]
    text = "\n".join(lines)
    print(text, flush=True)
    result = {"device": name, "planned_for": planner.spec.name, "margin": planner.margin,
              "floor_bytes": low, "rows": records, "none_with_temporaries_bytes": with_temps,
              "notes": notes}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
