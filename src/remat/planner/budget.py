"""``strategy=budget``: a memory budget that is turned into a plan before the model is built."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from remat.measure import format_bytes
from remat.planner.devices import get_device
from remat.planner.memory import parse_memory
from remat.planner.plan import PlanStrategy
from remat.planner.planner import Planner, check_options, make_plan
from remat.strategies.base import CheckpointStrategy, StrategyReport

log = logging.getLogger(__name__)

#: The keys of :meth:`BudgetStrategy.request` and the config keys that set them.
_REQUEST_KEYS = (("budget_bytes", "strategy.memory"), ("device", "strategy.device"),
                 ("margin", "strategy.margin"), ("units", "strategy.units"),
                 ("objective", "strategy.objective"), ("calibrate", "strategy.calibrate"),
                 ("max_traces", "strategy.max_traces"), ("temporaries", "strategy.temporaries"),
                 ("default_stages", "model.stages"), ("compiled", "compile"),
                 ("reshard_after_forward", "trainer.strategy.reshard_after_forward"))


class BudgetStrategy(CheckpointStrategy):
    """Train with the least recompute whose predicted peak fits ``memory``.

    It is a request, not a strategy that wraps anything: ``remat.train`` (and
    ``python -m remat.plan``) call :meth:`planned` with a model builder and the run shape
    before the model is built, and train with the :class:`~remat.planner.PlanStrategy` it
    returns. Plain PyTorch users call :func:`remat.planner.make_plan` themselves.

    Args:
        memory: ``12GiB``, ``"12 GB"``, bytes, or a fraction of the device's memory (``0.8``).
        device: the device planned for: ``auto`` (the one present), a name
            (:data:`remat.planner.DEVICES`: ``h100``, ``a100_80gb``, ``l4``, ...), ``cpu``, or
            a mapping of figures (see :func:`remat.planner.get_device`).
        margin: fraction of the budget kept free for what the trace does not see; ``None``:
            0.5% where kernel temporaries are measured (planning for this CPU), else 2% and
            the largest convolution tensor (see :class:`remat.planner.Planner`).
        units: candidate unit paths (globs); ``None``: the whole network.
        max_traces: traced plans per budget before the best one is taken.
        objective: ``time`` (modelled recompute time on ``device``) or ``flops``.
        calibrate: time each unit on the device present instead of the roofline table.
        temporaries: measure each operator's kernel temporaries (see
            :class:`remat.planner.Planner`); ``None``: when planning for the CPU.

    Raises:
        ValueError: a bad ``memory`` (unparseable, <= 0, above the device's memory) or an
            unknown ``device``, at construction (before any training).
    """

    name = "budget"
    needs_plan = True
    recomputes = True

    def __init__(self, memory: Any = 0.8, device: Any = "auto", margin: float | None = None,
                 units: Sequence[str] | None = None, max_traces: int = 6,
                 objective: str = "time", calibrate: bool = False,
                 temporaries: bool | None = None) -> None:
        check_options(objective, 0.0 if margin is None else margin)
        parse_memory(memory, 2**62)  # its form, before the device (a CPU is timed first)
        self.calibrate = bool(calibrate)
        self.objective = objective
        self.spec = get_device(device)
        self.memory = memory
        self.budget_bytes = parse_memory(memory, self.spec.memory_bytes or None)
        self.device = device if isinstance(device, str) else self.spec.name
        self.margin = None if margin is None else float(margin)
        self.units = list(units) if units else None
        self.max_traces = int(max_traces)
        self.temporaries = None if temporaries is None else bool(temporaries)

    def planned(self, build: Callable[[CheckpointStrategy], nn.Module], batch_size: int,
                size: Any, precision: str, accumulate_grad_batches: int = 1,
                default_stages: Sequence[str] = (), world_size: int = 1,
                reshard_after_forward: bool = True,
                size_key: str | None = None, compiled: bool = False) -> PlanStrategy:
        """Plan for this budget and return the strategy that applies the plan (its
        ``planned`` attribute holds the :class:`~remat.planner.Planned` result). With
        ``world_size > 1`` the budget is one FSDP2 rank's (``trainer=fsdp``); ``size_key``
        names the size's config key in the messages; ``compiled``: plan for the step
        ``compile=true`` runs (both: :class:`~remat.planner.Planner`).

        Raises:
            remat.planner.InfeasibleBudget: no plan fits (what would fit is in the message).
        """
        planned = make_plan(build, batch_size, size, self.budget_bytes, precision,
                            **self._planner_kwargs(accumulate_grad_batches, default_stages,
                                                   world_size, reshard_after_forward, size_key,
                                                   compiled))
        return self.strategy_for(planned, self.budget_bytes, default_stages,
                                 reshard_after_forward, compiled)

    def _planner_kwargs(self, accumulate_grad_batches: int, default_stages: Sequence[str],
                        world_size: int, reshard_after_forward: bool,
                        size_key: str | None, compiled: bool = False) -> dict[str, Any]:
        return {"device": self.spec, "units": self.units, "margin": self.margin,
                "max_traces": self.max_traces, "objective": self.objective,
                "default_stages": default_stages, "calibrate": self.calibrate,
                "accumulate_grad_batches": accumulate_grad_batches, "world_size": world_size,
                "reshard_after_forward": reshard_after_forward,
                "temporaries": self.temporaries, "size_key": size_key,
                "compiled": bool(compiled)}

    def planner(self, build: Callable[[CheckpointStrategy], nn.Module], batch_size: int,
                size: Any, precision: str, accumulate_grad_batches: int = 1,
                default_stages: Sequence[str] = (), world_size: int = 1,
                reshard_after_forward: bool = True, size_key: str | None = None,
                compiled: bool = False) -> Planner:
        """The :class:`~remat.planner.Planner` of this request for one run shape (arguments
        as :meth:`planned`); it profiles the model once."""
        return Planner(build, batch_size, size, precision,
                       **self._planner_kwargs(accumulate_grad_batches, default_stages,
                                              world_size, reshard_after_forward, size_key,
                                              compiled))

    def strategy_for(self, planned: Any, budget_bytes: int,
                     default_stages: Sequence[str] = (),
                     reshard_after_forward: bool = True,
                     compiled: bool = False) -> PlanStrategy:
        """The strategy that applies ``planned`` (a :class:`~remat.planner.Planned` result
        for ``budget_bytes``; kept as its ``planned`` attribute), its request recorded."""
        request = self.request(default_stages, reshard_after_forward, compiled)
        request["budget_bytes"] = int(budget_bytes)
        plan = planned.plan
        # a compiled step's plan: its none is still the eager step's (not traced compiled)
        log.info("plan for %s on %s (%.1f s): predicted peak %s (allocator; tensors %s, "
                 "%s %s), recompute FLOPs x%.3f of none, modelled step time x%.3f\n%s",
                 format_bytes(budget_bytes), self.spec.name, planned.seconds,
                 format_bytes(plan.predicted_allocator_peak_bytes),
                 format_bytes(plan.predicted_peak_bytes),
                 "eager none" if compiled else "none", format_bytes(plan.none_peak_bytes),
                 1 + plan.recompute_flops / max(plan.step_flops, 1), plan.predicted_overhead,
                 plan.summary())
        strategy = PlanStrategy(plan, origin=f"strategy=budget, planned for "
                                f"{format_bytes(budget_bytes)} on {self.spec.name}",
                                request=request)
        strategy.planned = planned
        return strategy

    def request(self, default_stages: Sequence[str] = (),
                reshard_after_forward: bool = True, compiled: bool = False) -> dict[str, Any]:
        """What this budget asks the planner for, as plain data: the budget in bytes, the
        device's name and every search setting, with the model's default stages (candidate
        plans), for FSDP2 ``reshard_after_forward``, and whether the step is compiled
        (``compile=true``). A plan saved in a checkpoint is reused on resume only for the
        same request (:meth:`differences`)."""
        return {"budget_bytes": int(self.budget_bytes), "device": self.spec.name,
                "margin": self.margin, "units": self.units, "objective": self.objective,
                "calibrate": self.calibrate, "max_traces": self.max_traces,
                "temporaries": self.temporaries, "default_stages": list(default_stages),
                "reshard_after_forward": bool(reshard_after_forward),
                "compiled": bool(compiled)}

    def differences(self, saved: dict[str, Any] | None, default_stages: Sequence[str] = (),
                    reshard_after_forward: bool = True, compiled: bool = False) -> list[str]:
        """How this budget's :meth:`request` differs from ``saved`` (a checkpoint's), one
        ``<config key>: <saved> -> <now>`` per key; empty when the same plan is asked for."""
        if saved is None:
            return ["the saved plan was replayed from a file (strategy=plan), not planned "
                    "for a budget"]
        now = self.request(default_stages, reshard_after_forward, compiled)
        out = []
        for key, name in _REQUEST_KEYS:
            # a plan saved before a key existed was made as its default asks
            then, here = saved.get(key, False if key == "compiled" else None), now[key]
            if then != here:
                if key == "budget_bytes" and then is not None:
                    then, here = format_bytes(then), format_bytes(here)
                out.append(f"{name}: {then} -> {here}")
        return out

    def apply(self, model: nn.Module, stages: Any = ()) -> StrategyReport:
        """Refuse: a budget is planned before the model is built.

        Raises:
            RuntimeError: always (use ``remat.train``, ``python -m remat.plan`` or
                :func:`remat.planner.make_plan`).
        """
        raise RuntimeError("strategy budget has no plan yet: remat.train plans it before it "
                           "builds the model; in Python call remat.planner.make_plan(build, "
                           "batch_size, size, memory=...) and use the PlanStrategy it returns")
