"""Plan for a fraction of ``none``'s measured allocator peak on this CPU and run the plan:
``none``'s allocator peak (two real AdamW steps, ``torch.profiler`` memory events), the
floor, and, for ``--fraction`` of that peak, the plan's predicted and measured allocator
peak and FLOPs; with ``--monai`` also MONAI's own ``use_checkpoint=True`` and plans at its
measured peak and at the floor's least budget (SwinUNETR).

    python scripts/budget_fraction_check.py model=monai_swinunetr3d data.image_size=64 \
        data.batch_size=1 +data.num_classes=2 --fraction 0.6 --monai

Any ``estimate``-config override is accepted; prints JSON lines (MiB).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_acceptance import allocator_peak  # noqa: E402

from remat.build import build_from_config  # noqa: E402
from remat.config import config_dir  # noqa: E402
from remat.planner import InfeasibleBudget, Planner, PlanStrategy  # noqa: E402
from remat.strategies import MonaiUseCheckpoint, NoCheckpoint  # noqa: E402

MIB = 2**20


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--fraction", type=float, default=0.6)
    parser.add_argument("--monai", action="store_true")
    args = parser.parse_args(argv)
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("estimate", overrides=["device=cpu", *args.overrides])
    builder, _, batch, size = build_from_config(cfg)
    build, precision = builder.with_strategy, str(cfg.precision)
    none = allocator_peak(build, NoCheckpoint(), batch, size, precision)
    planner = Planner(build, batch, size, precision, device="cpu", objective="flops",
                      default_stages=list(cfg.model.get("stages") or []))
    floor_plan, floor = planner.floor()
    print(json.dumps({"units": [u.path for u in planner.profile.units],
                      "none_measured": none / MIB, "floor_predicted": floor.allocator_peak / MIB,
                      "floor_plan": floor_plan.summary()}), flush=True)

    def run(label: str, budget: int) -> None:
        try:
            plan = planner.plan(budget).plan
        except InfeasibleBudget as err:
            print(json.dumps({label: budget / MIB, "infeasible": str(err)}), flush=True)
            return
        measured = allocator_peak(build, PlanStrategy(plan), batch, size, precision)
        print(json.dumps({label: budget / MIB,
                          "predicted": plan.predicted_allocator_peak_bytes / MIB,
                          "measured": measured / MIB, "fits": measured <= budget,
                          "flops_x_none": 1 + plan.recompute_flops / planner.none.step_flops,
                          "plan": plan.summary()}), flush=True)

    run(f"budget_{args.fraction}", int(args.fraction * none))
    if args.monai:
        monai = allocator_peak(build, MonaiUseCheckpoint(), batch, size, precision)
        traced = planner.trace(MonaiUseCheckpoint())
        print(json.dumps({"monai_measured": monai / MIB,
                          "monai_predicted": traced.allocator_peak / MIB,
                          "monai_flops_x_none": traced.step_flops / planner.none.step_flops}),
              flush=True)
        run("at_monai", monai)
        run("floor_budget", planner.budget_for(floor.allocator_peak))


if __name__ == "__main__":
    main(sys.argv[1:])
