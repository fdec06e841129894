"""Memory-budget planner: the least recompute that fits a budget, planned on a CPU for any
device (no Lightning imports here).

>>> from remat.planner import make_plan
>>> planned = make_plan(lambda s: MyModule(strategy=s), batch_size=2, size=512,
...                     memory="12GiB", device="h100")  # doctest: +SKIP
>>> planned.plan.summary()  # doctest: +SKIP
"""

from remat.planner.budget import BudgetStrategy
from remat.planner.devices import DEVICES, DeviceSpec, get_device, known_devices
from remat.planner.memory import PlanInputError, parse_memory
from remat.planner.plan import Plan, PlanMismatch, PlanStrategy, UnitPlan
from remat.planner.planner import InfeasibleBudget, Planned, Planner, make_plan

__all__ = [
    "DEVICES",
    "BudgetStrategy",
    "DeviceSpec",
    "InfeasibleBudget",
    "Plan",
    "PlanInputError",
    "PlanMismatch",
    "PlanStrategy",
    "Planned",
    "Planner",
    "UnitPlan",
    "get_device",
    "known_devices",
    "make_plan",
    "parse_memory",
]
