"""Check the planner's plans on this CPU: for budgets evenly spaced from the smallest
feasible peak to ``none``'s peak, each plan's *allocator* peak measured on a real training
step (``torch.profiler`` memory events, which see temporaries inside backward kernels that
MemTracker misses) against its budget and its prediction, its recompute FLOPs against every
fixed strategy that fits the same budget, and its gradients against ``none``.

    python scripts/plan_acceptance.py model=unet_resnet34 data.image_size=512 data.batch_size=2
    python scripts/plan_acceptance.py model=gpt_small +data.block_size=1024 data.batch_size=2

Any ``estimate``-config override is accepted; ``--budgets N`` (default 8), ``--objective``
(``flops`` default: the comparison is in FLOPs), ``--out FILE`` (markdown table appended).
Fixed strategies (none, full, sqrtn, every_k k=2/4, selective matmul, each on the model's
stages and on the whole network) are traced (their exact FLOPs) and run for real (their
allocator peak: a fixed strategy fits a budget when that peak does). Prints one markdown
table.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from remat.build import build_from_config
from remat.measure import ProfilerPeakMemory, format_bytes
from remat.measure.parity import compare_gradients, gradients_of
from remat.measure.step import autocast
from remat.measure.trace import optimizer_of, optimizer_steps, sized_batch
from remat.planner import InfeasibleBudget, Planner, PlanStrategy
from remat.strategies import FIXED_POINTS, NoCheckpoint, build_strategy

# the planner's fixed points but none (the reference): full, sqrtn, every_k 2/4, selective
FIXED = tuple((name, kwargs) for _, name, kwargs in FIXED_POINTS if name != "none")


def allocator_peak(build, strategy, batch_size, size, precision) -> int:
    """Allocator peak (bytes) of two real optimizer steps in Lightning's order, from the
    start (parameters and buffers held, everything else allocated inside)."""
    torch.manual_seed(0)
    model = build(strategy).train()
    optimizer = optimizer_of(model)
    device = torch.device("cpu")
    with ProfilerPeakMemory(device, modules=[model]) as meter:
        optimizer_steps(model, optimizer, batch_size, size, device, precision, seed=10)
    del model, optimizer
    gc.collect()
    return int(meter.peak_bytes)


def gradients(build, strategy, batch_size, size, precision, batch=None,
              device="cpu") -> dict[str, torch.Tensor]:
    """Gradients (on the CPU) of one real forward/backward on ``device`` from the same
    initial weights and batch (``batch``, or an example batch seeded 99) and dropout masks."""
    device = torch.device(device)
    torch.manual_seed(0)
    model = build(strategy).train().to(device)
    torch.manual_seed(99)
    if batch is None:
        batch = sized_batch(model, batch_size, size, device)
    torch.manual_seed(7)  # same dropout masks
    with autocast(device, precision):
        loss = model.training_loss(batch)
    loss.backward()
    grads = {k: v.cpu() for k, v in gradients_of(model).items()}
    del model, loss, batch
    gc.collect()
    return grads


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--budgets", type=int, default=8)
    parser.add_argument("--objective", default="flops")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from hydra import compose, initialize_config_dir

    from remat.config import config_dir

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("estimate", overrides=["device=cpu", *args.overrides])
    build_cfg, _, batch_size, size = build_from_config(cfg)
    build = build_cfg.with_strategy
    precision = str(cfg.precision)
    stages = list(cfg.model.get("stages") or [])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    planner = Planner(build, batch_size, size, precision, device="cpu",
                      objective=args.objective, default_stages=stages)
    setup = time.perf_counter() - start
    whole = [u.path for u in planner.profile.units]
    none = planner.none
    fixed = []
    for label, paths in (("stages", stages), ("whole", whole)):
        for name, kwargs in FIXED:
            traced = planner.trace(build_strategy(name, **kwargs),
                                   lambda s, st=paths: build(s, st), key=label)
            tag = f"{name}{'' if not kwargs or name == 'selective' else kwargs['k']}"
            alloc = allocator_peak(lambda s, st=paths: build(s, st),
                                   build_strategy(name, **kwargs), batch_size, size, precision)
            fixed.append((f"{tag}/{label}", alloc, traced.step_flops - none.step_flops,
                          traced.allocator_peak))
    none_alloc = allocator_peak(build, NoCheckpoint(), batch_size, size, precision)
    ref_grads = gradients(build, NoCheckpoint(), batch_size, size, precision)
    _, floor = planner.floor()
    low = planner.budget_for(floor.allocator_peak)
    high = planner.budget_for(none.allocator_peak)
    title = (f"{planner.profile.model} {cfg.model.get('encoder_name', '')} batch {batch_size}, "
             f"size {size}, {precision}, torch {torch.__version__}, CPU")
    lines = [f"### {title}", "",
             f"none: traced {format_bytes(none.peak_bytes)}, predicted allocator "
             f"{format_bytes(none.allocator_peak)}, allocator {format_bytes(none_alloc)} "
             f"({none_alloc / none.allocator_peak:.4f}); floor "
             f"{format_bytes(floor.allocator_peak)} ({floor.allocator_peak / none_alloc:.2f}x "
             f"none); margin {planner.margin:.3f}; planner setup {setup:.0f} s",
             "", "| budget | plan traced | plan predicted (allocator) | plan allocator | "
             "allocator / predicted | fits | plan FLOPs x none | best fixed that fits (FLOPs x "
             "none) | lower | grads = none | plan s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    strictly = only = 0
    for i in range(args.budgets):
        budget = low + (high - low) * i // max(1, args.budgets - 1)
        t0 = time.perf_counter()
        try:
            plan = planner.plan(budget).plan
        except InfeasibleBudget as err:
            lines.append(f"| {format_bytes(budget)} | infeasible: {str(err).splitlines()[0]} |")
            continue
        seconds = time.perf_counter() - t0
        strategy = PlanStrategy(plan)
        alloc = allocator_peak(build, strategy, batch_size, size, precision)
        parity = compare_gradients(ref_grads, gradients(build, strategy, batch_size, size,
                                                        precision))
        fits = [(lab, fl) for lab, pk, fl, _ in fixed if pk <= budget] + (
            [("none", 0)] if none_alloc <= budget else [])
        best = min(fits, key=lambda x: x[1]) if fits else None
        lower = best is not None and plan.recompute_flops < best[1]
        not_above = best is None or plan.recompute_flops <= best[1]
        strictly += lower
        only += best is None
        ratio = 1 + plan.recompute_flops / none.step_flops
        best_text = (f"{best[0]} {1 + best[1] / none.step_flops:.3f}" if best else "none fits")
        predicted = plan.predicted_allocator_peak_bytes
        lines.append(f"| {format_bytes(budget)} | {format_bytes(plan.predicted_peak_bytes)} | "
                     f"{format_bytes(predicted)} | {format_bytes(alloc)} | "
                     f"{alloc / predicted:.4f} | "
                     f"{'yes' if alloc <= budget else 'NO'} | {ratio:.3f} | {best_text} | "
                     f"{'yes' if lower else ('only plan' if best is None else 'no')}"
                     f"{'' if not_above else ' ABOVE'} | {'yes' if parity.match else 'NO'} "
                     f"({parity.max_abs_diff:.1e}) | {seconds:.0f} |")
    lines += ["", f"strictly lower recompute FLOPs than every fitting fixed strategy at "
              f"{strictly} of {args.budgets} budgets; no fixed strategy fits at {only} more",
              "", "fixed strategies (allocator peak "
              "/ predicted allocator peak / FLOPs x none): "
              + ", ".join(f"{lab} {format_bytes(pk)} / {format_bytes(tr)} / "
                          f"{1 + fl / none.step_flops:.3f}" for lab, pk, fl, tr in fixed), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with args.out.open("a") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
