"""The memory-budget planner: the least recompute that fits a budget, planned on any machine.

:func:`make_plan` profiles the candidate units of the network (one fake batch,
:mod:`remat.planner.profile`), searches their segments and modes under the modelled peak
(:mod:`remat.planner.search`), then *traces* the plan's training step (FakeTensorMode +
MemTracker, two optimizer steps, as ``remat.estimate``) and corrects the search's target by
what the trace shows, until the traced peak plus the margin fits the budget. Every plan
returned has been traced; its ``predicted_peak_bytes`` is that trace.

A budget must hold what the *allocator* reaches, not only the tensors a tensor-level trace
sees: the batch, and the buffers kernels allocate and free inside one call (oneDNN's
reorders on this CPU: 36 MiB of 930 MiB inside ``convolution_backward`` of a U-Net-R34 at
512 px, seen by ``torch.profiler`` memory events). Planning for this CPU, each operator
call of the step is run once for real and its temporaries measured
(:mod:`remat.measure.kernels`); every trace adds them after each operator, so a plan's
``predicted_allocator_peak_bytes`` is the allocator's peak, and only ``margin`` (default
0.5%) is kept free. Planning for a GPU on a CPU, they cannot be measured: the margin is 2%
(cuDNN/cuBLAS workspaces, the caching allocator's rounding) plus the largest convolution
tensor.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat.measure import format_bytes
from remat.measure.kernels import KernelTemporaries, measured_temporaries, signatures_fn
from remat.measure.trace import built_fn, in_children, side_by_side, step_fn, trace_steps
from remat.planner.devices import DeviceSpec, get_device
from remat.planner.memory import PlanInputError, parse_memory
from remat.planner.plan import Plan, PlanStrategy, UnitPlan
from remat.planner.profile import Profile, calibrate_profile, profile_fn
from remat.planner.search import (
    Option,
    best_plan,
    cap_values,
    chain_frontier,
    cheaper_within,
    evaluate_chain,
    least_kept,
    modelled_peak,
    ordered_peak,
    replayable_segments,
    to_block,
)
from remat.strategies.base import CheckpointStrategy
from remat.strategies.none import NoCheckpoint
from remat.strategies.recompute import trace_as_compiled
from remat.strategies.registry import FIXED_POINTS, build_strategy
from remat.strategies.segments import every_k_segments, sqrt_segments
from remat.strategies.stages import path_matches

log = logging.getLogger(__name__)

Builder = Callable[[CheckpointStrategy], nn.Module]

# The default ``margin`` (fraction of the budget kept free): on a device whose kernel
# temporaries are not measured here (a GPU planned on a CPU: cuDNN/cuBLAS workspaces, the
# caching allocator's rounding) 2%, and the largest convolution tensor besides; where they
# are measured (this CPU), 0.5%: the traced allocator peak of a U-Net-R34 step is within
# 0.01% of the allocator's (``scripts/plan_acceptance.py``).
DEFAULT_MARGIN = 0.02
MEASURED_MARGIN = 0.005

#: :meth:`Planner.floor` does not trace a candidate whose modelled peak is more than this
#: times the smallest traced peak of the candidates traced before it: it would have to
#: trace below half its modelled peak to be the floor. The model's largest error on a
#: floor candidate seen so far is 16% over the trace (U-Net-R34 at 2048 px, batch 8, bf16,
#: 4-block segments: modelled 15.1 GiB, traced 13.0 GiB).
FLOOR_SKIP_RATIO = 2.0

#: Traces :meth:`Planner.plan` spends at most on lowering its plan's recompute by the
#: units' forward order (:meth:`Planner.refine`).
REFINE_TRACES = 2


def keep_segments(n: int) -> list[tuple[int, int, str]]:
    return [(i, i + 1, "keep") for i in range(n)]


def full_segments(n: int) -> list[tuple[int, int, str]]:
    return [(i, i + 1, "recompute") for i in range(n)]


def sqrt_segments_of(n: int) -> list[tuple[int, int, str]]:
    return [(a, b, "recompute") for a, b in sqrt_segments(n)]


def k_segments(n: int, k: int) -> list[tuple[int, int, str]]:
    return [(a, b, "recompute") for a, b in every_k_segments(n, k)]


def one_segment(n: int) -> list[tuple[int, int, str]]:
    return [(0, n, "recompute")]


def check_options(objective: str, margin: float, key: str = "strategy") -> None:
    """Raise if ``objective`` or ``margin`` is not one the planner takes.

    Raises:
        ValueError: ``objective`` not ``time``/``flops``, or ``margin`` outside [0, 1); the
            message names ``<key>.objective`` / ``<key>.margin``.
    """
    prefix = f"{key}." if key else ""
    if objective not in ("time", "flops"):
        raise PlanInputError(f"{prefix}objective={objective!r}: use time (roofline on the "
                             "device) or flops (recompute FLOPs, device-independent)")
    if not (0 <= float(margin) < 1):
        raise PlanInputError(f"{prefix}margin={margin!r}: a fraction of the budget in [0, 1)")


class InfeasibleBudget(ValueError):
    """No plan fits the budget; the message gives the smallest peak any plan reaches, its
    parts, and what would fit instead."""


@dataclass
class Traced:
    """A traced step: the tensor-level peak (bytes; what MemTracker measures in training),
    its categories, FLOPs of one batch, and ``allocator_peak`` (bytes): that peak with the
    batch and, where they were measured, each operator's kernel temporaries
    (:mod:`remat.measure.kernels`): what the allocator reaches, what a budget must hold."""

    peak_bytes: int
    categories: dict[str, int]
    step_flops: int
    allocator_peak: int = 0


@dataclass
class Planned:
    """What :func:`make_plan` found: the plan, the floor (smallest traced peak), the traces
    made (``(target, traced peak, time)``), and the seconds it took."""

    plan: Plan
    floor_bytes: int
    traces: list[tuple[int, int, float]] = field(default_factory=list)
    seconds: float = 0.0


def _traced(result: tuple[str, Any]) -> Traced:
    _, peak = result
    return Traced(int(peak.peak_bytes), dict(peak.categories), int(peak.step_flops or 0),
                  int(getattr(peak, "allocator_peak_bytes", None) or peak.peak_bytes))


class Planner:
    """Profile once, then plan for any number of budgets (the frontier reuses the profile).

    Args:
        build: ``strategy -> model`` (a model with ``net``, ``example_batch``,
            ``training_loss``, ``configure_optimizers``; remat's LightningModules).
        batch_size, size, precision, accumulate_grad_batches: the run shape.
        device: a device name, mapping or :class:`DeviceSpec` (see
            :func:`remat.planner.devices.get_device`).
        units: candidate unit paths (globs), or ``None`` for the whole network.
        margin: fraction of the budget kept free for what the trace does not see;
            ``None``: :data:`MEASURED_MARGIN` where kernel temporaries are measured, else
            :data:`DEFAULT_MARGIN`, and then the largest convolution tensor as well.
        temporaries: measure each operator call's kernel temporaries and trace the
            allocator's peak with them (:mod:`remat.measure.kernels`; runs every operator
            of a step once, for real, at the planned size): on the GPU present when
            planning for a GPU and one is here (the caching allocator's peak counter;
            not yet run on a GPU), else on this CPU; ``None``: only when planning for the
            CPU (``device=cpu``, or ``auto`` without a GPU).
        max_traces: traces per budget before giving the best one found.
        max_segment: longest recompute segment (blocks).
        objective: ``time`` (modelled recompute time) or ``flops``.
        default_stages: the model's own stages (the fixed strategies' reference plans).
        calibrate: replace the roofline times by times measured on the device present
            (:func:`~remat.planner.profile.calibrate_profile`; real tensors at full size).
        world_size, reshard_after_forward: plan for one rank of an FSDP2 run
            (``trainer=fsdp``): every trace is that rank's step (sharded parameters,
            gradients and optimizer state, each unit gathered while it runs;
            :func:`remat.measure.trace.step_fn`), ``batch_size`` is per rank.
        size_key: the config key ``size`` was read from, for messages (``data.patch_size``
            under ``data=folder``); None: ``data.image_size`` or ``data.block_size``.
        compiled: plan for the step ``compile=true`` runs (``torch.compile`` after the
            strategy): every trace's recomputed regions hold what the compiled regions keep
            of their random draws (dropout masks;
            :func:`remat.strategies.recompute.trace_as_compiled`); the rest of a compiled
            plan's peak is at or below the eager trace's.

    Raises:
        ValueError: bad ``margin`` or ``objective``; ``calibrate`` for a device other than
            the one present.
    """

    def __init__(self, build: Builder, batch_size: int, size: Any, precision: str = "32-true",
                 accumulate_grad_batches: int = 1, device: str | dict | DeviceSpec = "auto",
                 units: Sequence[str] | None = None, margin: float | None = None,
                 max_traces: int = 6, max_segment: int | None = None,
                 objective: str = "time", default_stages: Sequence[str] = (),
                 calibrate: bool = False, key: str = "strategy", world_size: int = 1,
                 reshard_after_forward: bool = True, temporaries: bool | None = None,
                 size_key: str | None = None, compiled: bool = False) -> None:
        self.compiled = bool(compiled)
        self.key = key  # config prefix of memory/device/units in messages ("": none)
        # the config key of ``size`` in messages (data.patch_size for folder data, ...);
        # None: data.image_size for images, data.block_size for sequences
        self.size_key = size_key
        check_options(objective, 0.0 if margin is None else margin, key)
        self.objective = objective
        self.default_stages = list(default_stages or [])
        self.build = build
        self.batch_size, self.size = batch_size, size
        self.precision, self.accumulate = precision, accumulate_grad_batches
        self.spec = get_device(device, key=self._key("device"))
        self.units_paths = list(units) if units else None
        # kernel temporaries are measured where the plan will run: on this CPU
        self.measured = (self.spec.name == "cpu") if temporaries is None else bool(temporaries)
        self.margin = float(margin if margin is not None else
                            (MEASURED_MARGIN if self.measured else DEFAULT_MARGIN))
        self.max_traces = int(max_traces)
        self.max_segment = max_segment
        self.world_size, self.reshard = int(world_size), bool(reshard_after_forward)
        self.cache: dict[str, Traced] = {}
        # cache key -> the plan traced under it (the candidate units' plans only)
        self.traced_plans: dict[str, Plan] = {}
        start = time.perf_counter()
        profile_job = built_fn(lambda: build(NoCheckpoint()), profile_fn(
            self.units_paths, self.spec, batch_size, size, precision), torch.device("cpu"))
        self.temporaries: KernelTemporaries | None = None
        if self.measured:
            # the profile and the step's operator calls side by side (fake), the calls' kernel
            # temporaries measured here (real kernels, this process's threads), then none
            profile, calls = in_children([profile_job, signatures_fn(
                lambda: build(NoCheckpoint()), batch_size, size, precision)])
            here = _measuring_device(self.spec)
            self.temporaries = measured_temporaries(calls, here)
            if here.type == "cuda":
                torch.cuda.empty_cache()  # the stand-in tensors' blocks, before training
            none = in_children([step_fn(**self._job(NoCheckpoint()))])[0]
        else:  # the profile and the trace of none, side by side
            profile, none = in_children([profile_job, step_fn(**self._job(NoCheckpoint()))])
        trace_as_compiled(False)  # traces ran in this process where CUDA is up
        self.profile: Profile = profile
        self.cache[repr(NoCheckpoint())] = _traced(none)
        if calibrate:
            present = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if (present.type == "cpu") != (self.spec.name == "cpu"):
                here = "cpu" if present.type == "cpu" else "auto"
                raise PlanInputError(f"{self._key('calibrate')}=true times the units on the "
                                     f"device present ({present.type}), not on "
                                     f"{self.spec.name}: plan with {self._key('device')}={here}"
                                     " or without calibrate")
            calibrate_profile(self.profile, lambda: build(NoCheckpoint()), batch_size, size,
                              precision, present)
        self.none = self.cache[repr(NoCheckpoint())]
        self._prepare()
        self.setup_seconds = time.perf_counter() - start

    # -- model -------------------------------------------------------------------------
    def _job(self, strategy: CheckpointStrategy, build: Builder | None = None
             ) -> dict[str, Any]:
        """:func:`remat.measure.trace.step_fn`'s arguments for a fake step of this run
        shape with ``strategy`` (FLOPs counted, kernel temporaries added when measured)."""
        build = build or self.build
        if isinstance(strategy, PlanStrategy) and strategy.offloads:
            # traces are fake CPU steps: offloaded inputs leave the traced device for meta
            strategy = PlanStrategy(strategy.plan, host="meta")
        compiled = self.compiled

        def built() -> nn.Module:  # in the trace's process
            trace_as_compiled(compiled)
            return build(strategy)

        return {"build": built, "batch_size": self.batch_size,
                "size": self.size, "device": torch.device("cpu"),
                "precision": self.precision, "fake": True,
                "accumulate_grad_batches": self.accumulate, "count_flops": True,
                "world_size": self.world_size, "reshard_after_forward": self.reshard,
                "temporaries": self.temporaries}

    def trace(self, strategy: CheckpointStrategy, build: Builder | None = None,
              key: str = "") -> Traced:
        """Trace a step of the model with ``strategy`` (``build``: another builder, e.g.
        with other stages; ``key`` names it in the cache)."""
        return self.trace_many([strategy], build, key)[0]

    def trace_many(self, strategies: Sequence[CheckpointStrategy],
                   build: Builder | None = None, key: str = "") -> list[Traced]:
        """:meth:`trace` for several strategies, traced side by side (one child process per
        CPU), cached."""
        keys = [key + (repr(s.plan.units) if isinstance(s, PlanStrategy) else repr(s))
                for s in strategies]
        todo = {k: s for k, s in zip(keys, strategies, strict=True) if k not in self.cache}
        if todo:
            results = self._trace_jobs([self._job(s, build) for s in todo.values()])
            for k, result in zip(todo, results, strict=True):
                self.cache[k] = _traced(result)
        if build is None and not key:  # plans of this model's own units: the pool
            for k, s in zip(keys, strategies, strict=True):
                if isinstance(s, PlanStrategy):
                    self.traced_plans.setdefault(k, s.plan)
        return [self.cache[k] for k in keys]

    @staticmethod
    def _trace_jobs(jobs: list[dict[str, Any]]) -> list[Any]:
        """:func:`trace_steps` of ``jobs`` (:meth:`_job`'s); where they run in this process
        (CUDA up) the compiled-trace flag their builds set is not left set."""
        try:
            return trace_steps(jobs)
        finally:
            trace_as_compiled(False)

    def traced_fitting(self, allowed: int) -> list[tuple[Plan, Traced]]:
        """Every plan of the candidate units traced so far (by any budget's search, the
        floor, the fixed strategies, a refinement) whose traced allocator peak is at most
        ``allowed`` bytes, with its trace, in the order traced."""
        return [(plan, self.cache[k]) for k, plan in self.traced_plans.items()
                if self.cache[k].allocator_peak <= allowed]

    def _prepare(self) -> None:
        prof = self.profile
        host = self.spec.host_bandwidth  # 0 on a CPU: no offload segments
        self.blocks = {u.path: [to_block(prof.blocks[b], self.objective, host)
                                for b in u.blocks] for u in prof.units}
        self.time_blocks = ({u.path: [to_block(prof.blocks[b], "time", host) for b in u.blocks]
                             for u in prof.units} if self.objective != "time" else self.blocks)
        # a tensor two units refer to (a U-Net skip, a stage output feeding the next stage)
        # stays alive whatever either does: it counts once, in the base
        users: dict[Any, set[str]] = {}
        for u in prof.units:
            for b in u.blocks:
                cost = prof.blocks[b]
                for key in [*cost.inputs, *cost.saved]:
                    users.setdefault(key, set()).add(u.path)
        free = dict(prof.saved_elsewhere)
        for u in prof.units:
            for b in u.blocks:
                cost = prof.blocks[b]
                for table in (cost.inputs, cost.saved):
                    free.update({k: v for k, v in table.items() if len(users[k]) > 1})
        self.free = free
        keep_all = {p: evaluate_chain(bl, [(i, i + 1, "keep") for i in range(len(bl))], free)
                    for p, bl in self.blocks.items()}
        self.base = self.none.peak_bytes - sum(o.kept for o in keep_all.values())
        # Lightning's zero_grad after the forward frees the previous step's gradients before
        # the backward (not while gradients accumulate over batches)
        self.release = (self.none.categories.get("gradients", 0)
                        if self.accumulate == 1 else 0)
        transients = [o.transient for bl in self.blocks.values()
                      for o in chain_frontier(bl, None, free, self.max_segment)]
        transients += [sum(b.saved.values()) for bl in self.blocks.values() for b in bl]
        self.transients = sorted({t for t in transients if t > 0})
        self.caps = cap_values(self.transients, 12)
        self.frontiers = {p: {cap: chain_frontier(bl, cap, free, self.max_segment)
                              for cap in [*self.caps, None]}
                          for p, bl in self.blocks.items()}
        self.granularity = max(1, self.none.peak_bytes // 4096)

    def _plan_of(self, choice: dict[str, Option]) -> Plan:
        kinds = {u.path: u.kind for u in self.profile.units}
        units = [UnitPlan(p, kinds[p], list(opt.segments)) for p, opt in choice.items()]
        plan = Plan(units=units, model=self.model_name, fingerprint=self.profile.fingerprint,
                    batch_size=self.batch_size, size=self.size, precision=self.precision,
                    accumulate_grad_batches=self.accumulate, world_size=self.world_size,
                    device=self.spec.name,
                    none_peak_bytes=self.none.peak_bytes, step_flops=self.none.step_flops,
                    objective=self.objective, compiled=self.compiled,
                    device_figures=self.spec.to_dict())
        plan.predicted_overhead = 1.0 + self.modelled_time(plan) / max(
            self.profile.step_time, 1e-12)
        return plan

    @property
    def model_name(self) -> str:
        return self.profile.model

    def _finish(self, plan: Plan, traced: Traced, budget: int, margin: int) -> Plan:
        # a copy: the same plan may be the answer to several budgets of this planner
        plan = dataclasses.replace(plan, units=list(plan.units), notes=list(plan.notes))
        plan.budget_bytes = budget
        plan.margin_bytes = margin
        plan.predicted_peak_bytes = traced.peak_bytes
        plan.predicted_allocator_peak_bytes = traced.allocator_peak
        plan.recompute_flops = max(0, traced.step_flops - self.none.step_flops)
        return plan

    def floor_candidates(self) -> list[Plan]:
        """The plans :meth:`floor` traces, in this order: the least modelled peak, and
        every unit recomputed block by block, in sqrt(n) segments, as one segment, in
        segments of 2 or 4 blocks (offloaded segments on a device with a host link).

        The least modelled peak is searched over every transient size a segment has (the
        largest recompute of the step), each unit keeping the least it can within it
        (:func:`~remat.planner.search.least_kept`): units whose blocks are small may then
        recompute in long segments for free. U-Net-R34 at 512 px, batch 2: the decoder's
        last block recomputes 192 MiB, so every encoder layer can be one segment; traced
        681.1 MiB, below every fixed strategy (sqrtn over the whole network: 698.1 MiB).
        Over the search's 12 caps only, the 192 MiB size was missed (708.8 MiB)."""
        if getattr(self, "_candidates", None) is None:
            best = None
            for cap in [*self.transients, None]:
                choice = {p: least_kept(bl, cap, self.free, self.max_segment)
                          for p, bl in self.blocks.items()}
                peak = modelled_peak(self.base, sum(o.kept for o in choice.values()), max(
                    (o.transient for o in choice.values()), default=0), self.release)
                if best is None or peak < best[0]:
                    best = (peak, choice)
            plans = [self._plan_of(best[1])]
            # where the search may offload (to_block priced it), an offloaded segment keeps
            # less than the same recompute segment and replays the same: the fixed
            # partitions offload theirs
            mode = "offload" if any(b.host_seconds_per_byte > 0 for bl in self.blocks.values()
                                    for b in bl) else "recompute"
            for segments in (full_segments, sqrt_segments_of, one_segment,
                             lambda n: k_segments(n, 2), lambda n: k_segments(n, 4)):
                plans.append(self._plan_of({u.path: self._option(u.path, [
                    (a, b, mode) for a, b, _ in segments(len(u.blocks))])
                    for u in self.profile.units}))
            self._candidates = plans
        return self._candidates

    def floor(self) -> tuple[Plan, Traced]:
        """The plan with the least traced peak among :meth:`floor_candidates` (so no fixed
        segment strategy over the whole network is below it; ties: the first), traced.

        A trace costs seconds (gpt_medium at 8192 tokens: 6 s here), so the two distinct
        candidates of least modelled peak are traced first, side by side, and of the
        others only those whose modelled peak is at most :data:`FLOOR_SKIP_RATIO` times
        the smallest peak traced so far (gpt_medium: sqrt(n) segments, 4-block segments
        and one segment, modelled at 3-16x the floor, are not traced).

        Where no candidate peaks below ``none`` (units too coarse: MONAI's 3D UNet is one
        ``nn.Sequential`` of three blocks, the middle one nearly the whole net, whose
        recompute holds as much as ``none`` keeps and more), the floor is ``none``'s own
        step: no plan is ever above ``none``."""
        if getattr(self, "_floor", None) is None:
            plans = self.floor_candidates()
            keys = [repr(p.units) for p in plans]
            modelled = {k: self.modelled(p) for k, p in zip(keys, plans, strict=True)}
            order = sorted(modelled, key=lambda k: modelled[k])  # distinct, stable
            peaks: dict[str, int] = {}

            def trace(todo: list[str]) -> None:
                chosen = [plans[keys.index(k)] for k in todo]
                for k, t in zip(todo, self.trace_many([PlanStrategy(p) for p in chosen]),
                                strict=True):
                    peaks[k] = t.allocator_peak

            trace(order[:2])
            trace([k for k in order[2:]
                   if modelled[k] <= FLOOR_SKIP_RATIO * min(peaks.values())])
            i = min((i for i, k in enumerate(keys) if k in peaks),
                    key=lambda i: peaks[keys[i]])
            self._floor = (plans[i], self.trace(PlanStrategy(plans[i])))
            if self._floor[1].allocator_peak >= self.none.allocator_peak:
                self._floor = (self._keep_all(), self.none)
        return self._floor

    def lowest(self) -> tuple[Plan, Traced]:
        """The plan of least traced allocator peak this planner knows: the :meth:`floor`'s,
        or one traced since that peaks lower (a refined plan; ties: the floor's)."""
        best = self.floor()
        for plan, traced in self.traced_fitting(best[1].allocator_peak - 1):
            if traced.allocator_peak < best[1].allocator_peak:
                best = (plan, traced)
        return best

    def _keep_all(self) -> Plan:
        """The plan that checkpoints nothing (``none``'s step)."""
        return self._plan_of({u.path: self._option(u.path, keep_segments(len(u.blocks)))
                              for u in self.profile.units})

    def _option(self, path: str, segments: list[tuple[int, int, str]]) -> Option:
        """A fixed choice of segments for one unit, with segments that may not replay (a
        block writing its input in place) joined or kept (:func:`replayable_segments`)."""
        blocks = self.blocks[path]
        return evaluate_chain(blocks, replayable_segments(blocks, segments), self.free)

    def references(self, default_stages: Sequence[str] = ()) -> list[tuple[str, Plan]]:
        """The fixed strategies of :data:`remat.strategies.FIXED_POINTS` (``none`` aside:
        ``full``, ``sqrtn``, ``every_k`` k=2/4, ``selective``) written as plans of the
        candidate units, over the whole network and over ``default_stages``; labels
        ``"<label> (whole network)"`` and ``"<label> (default stages)"``.

        A stage that names a candidate unit gets the segments the strategy gives a chain of
        its blocks (``segments_for``, in its ``segment_mode``); a stage that names a block of
        a unit (``downsamples.*`` where ``downsamples`` is the unit) is a chain of one, one
        segment of that block; other blocks are kept. Where a stage names neither (a module
        inside a block, or one holding several units) or a block that is a chain itself
        (the strategy would segment inside it), the default stages have no plan of these
        units and only the whole-network references are returned."""
        whole = [u.path for u in self.profile.units]
        sets = [("whole network", {p: None for p in whole})]
        staged = self._staged_blocks(default_stages)
        if staged is not None and not self.names_every_unit(default_stages):  # else the
            sets.append(("default stages", staged))  # same plans as the whole network's
        fixed = [(label, build_strategy(name, **kwargs)) for label, name, kwargs in FIXED_POINTS
                 if name != "none"]
        out = []
        for label, stages in sets:
            for name, strategy in fixed:
                choice = {}
                for u in self.profile.units:
                    n = len(u.blocks)
                    if u.path not in stages:
                        segments = keep_segments(n)
                    elif stages[u.path] is None:  # the unit is a stage
                        segments = [(a, b, strategy.segment_mode)
                                    for a, b in strategy.segments_for(n)]
                    else:  # some of its blocks are stages, each a chain of one
                        segments = [(i, i + 1, strategy.segment_mode if i in stages[u.path]
                                     else "keep") for i in range(n)]
                    choice[u.path] = self._option(u.path, segments)
                out.append((f"{name} ({label})", self._plan_of(choice)))
        return out

    def names_every_unit(self, stages: Sequence[str]) -> bool:
        """Whether ``stages`` name every candidate unit and nothing else (a GPT's
        ``blocks``): a fixed strategy on them is the same as on the whole network."""
        return self._staged_blocks(stages) == {u.path: None for u in self.profile.units}

    def _staged_blocks(self, stages: Sequence[str]) -> dict[str, set[int] | None] | None:
        """Unit path -> None where a stage pattern names the unit, else the indices of its
        blocks that one names (units no stage reaches are left out); None where a pattern
        names no unit and no block, or names a block that is a chain itself."""
        if not stages:
            return None
        out: dict[str, set[int] | None] = {}
        for pattern in stages:
            hit = False
            for u in self.profile.units:
                if path_matches(pattern, u.path):
                    out[u.path], hit = None, True
                    continue
                for i, block in enumerate(u.blocks):
                    if u.kind == "chain" and path_matches(pattern, block):
                        if block in u.nested:
                            return None
                        hit = True
                        if out.get(u.path, set()) is not None:
                            out.setdefault(u.path, set()).add(i)
            if not hit:
                return None
        return out

    # -- search ------------------------------------------------------------------------
    def plan(self, memory: Any, refine: bool = True, max_traces: int | None = None
             ) -> Planned:
        """The plan with the least modelled recompute time whose traced peak plus margin fits
        ``memory`` (see :func:`remat.planner.memory.parse_memory`); ``refine``: lower its
        recompute by the units' forward order afterwards (:meth:`refine`, up to
        :data:`REFINE_TRACES` more traces; the frontier's points go without);
        ``max_traces``: distinct plans the search traces (``None``: the planner's).

        Raises:
            ValueError: a bad ``memory`` (names ``strategy.memory``).
            InfeasibleBudget: not even the floor plan fits.
        """
        start = time.perf_counter()
        budget = parse_memory(memory, self.spec.memory_bytes or None, key=self._key("memory"))
        margin = self.margin_for(budget)
        allowed = budget - margin
        if self.none.allocator_peak <= allowed:
            plan = self._keep_all()
            return Planned(self._finish(plan, self.none, budget, margin),
                           self.none.allocator_peak, [], time.perf_counter() - start)
        floor_plan, floor = self.floor()
        traces: list[tuple[int, int, float]] = []
        if floor.allocator_peak > allowed:
            # below the floor's candidates, a plan traced before may fit (a refined plan:
            # SwinUNETR 3D at 96^3, refined at the floor's budget, peaked at 2994.4 MiB
            # where the floor's candidates reach 3021.7), else the floor refined once
            below = self.traced_fitting(allowed)
            if not below:
                self.refine(floor_plan, floor, allowed, traces=traces)
                below = self.traced_fitting(allowed)
            if not below:
                lowest_plan, lowest = self.lowest()
                raise InfeasibleBudget(self.infeasible_message(budget, margin, lowest_plan,
                                                               lowest))
            plan, traced = min(below, key=self._rank)
            return Planned(self._finish(plan, traced, budget, margin),
                           self.lowest()[1].allocator_peak, traces,
                           time.perf_counter() - start)
        # the additive model (tensor bytes; none's is its trace) is calibrated on two traced
        # points, none and the floor plan: modelled bytes per traced allocator byte
        modelled_floor = self.modelled(floor_plan)
        none_peak = self.none.allocator_peak
        scale = ((self.none.peak_bytes - modelled_floor) / (none_peak - floor.allocator_peak)
                 if none_peak > floor.allocator_peak else 1.0)
        target = max(modelled_floor, int(self.none.peak_bytes
                                         - (none_peak - allowed) * scale))
        pool: list[tuple[Plan, Traced]] = [(floor_plan, floor)]
        # bracket on the modelled target: (target, traced peak) of the best fitting and the
        # least overshooting plan; the floor plan fits
        low, high = (modelled_floor, floor.allocator_peak), None
        # ``max_traces`` distinct plans; a target whose plan was traced already costs no
        # trace, and bisects (regula falsi next to a fitting point far below stalls on one
        # plan just over the budget: U-Net-R34 at 512 px spent 4 of 6 traces on one)
        distinct: set[str] = set()
        limit = self.max_traces if max_traces is None else max(1, int(max_traces))
        for _ in range(4 * limit):
            if len(distinct) >= limit:
                break
            found = best_plan(self.frontiers, self.base, target, self.granularity,
                              self.release)
            if found is None:
                target = (target + (high[0] if high else self.none.peak_bytes)) // 2
                continue
            modelled_time, _, choice = found
            plan = self._plan_of(choice)
            repeat = repr(plan.units) in distinct
            distinct.add(repr(plan.units))
            traced = self._trace_first(plan) if not traces else self.trace(PlanStrategy(plan))
            traces.append((target, traced.allocator_peak, modelled_time))
            if traced.allocator_peak <= allowed:
                pool.append((plan, traced))
                low = max(low, (target, traced.allocator_peak))
                if allowed - traced.allocator_peak < 0.01 * allowed:
                    break
                nxt = target + int((allowed - traced.allocator_peak) * scale)
            else:
                high = min(high, (target, traced.allocator_peak)) if high else (target,
                                                                            traced.allocator_peak)
                nxt = target - int((traced.allocator_peak - allowed) * scale) - self.granularity
            if high is not None:  # bracketed: regula falsi between the two, else bisect
                if high[0] - low[0] <= self.granularity:
                    break
                span = high[1] - low[1]
                nxt = (low[0] + int((allowed - low[1]) * (high[0] - low[0]) / span)
                       if span > 0 else (low[0] + high[0]) // 2)
                if repeat or not (low[0] < nxt < high[0]) or nxt in (t for t, _, _ in traces):
                    nxt = (low[0] + high[0]) // 2
            if nxt == target:
                break
            target = nxt
        # every plan traced before that fits (another budget's search, the floor's
        # candidates) is a candidate too: in one planner a larger budget never gets a plan
        # that ranks costlier than a smaller one's (the frontier, remat.plan's table).
        # Without it, unet_resnet18 (64 px, batch 2) planned 1.128x none's FLOPs for a
        # budget 0.2 MiB above one planned at 1.110x.
        pool += self.traced_fitting(allowed)
        plan, traced = min(pool, key=self._rank)
        # the fixed strategies, written as plans: one that fits and costs less wins
        refs = [ref for _, ref in self.references(self.default_stages)
                if self.modelled_cost(ref) < self._rank((plan, traced))[0]]
        for ref, ref_traced in zip(refs, self.trace_many([PlanStrategy(r) for r in refs]),
                                   strict=True):
            if ref_traced.allocator_peak <= allowed and self._rank(
                    (ref, ref_traced)) < self._rank((plan, traced)):
                plan, traced = ref, ref_traced
        if refine:
            plan, traced = self.refine(plan, traced, allowed, scale, traces)
        return Planned(self._finish(plan, traced, budget, margin), floor.allocator_peak, traces,
                       time.perf_counter() - start)

    def unit_order(self) -> list[str]:
        """The candidate units in the order the forward runs them (the profile's)."""
        order = [p for p in self.profile.order if p in self.blocks]
        return [*order, *(p for p in self.blocks if p not in order)]

    def _unit_options(self) -> dict[str, list[Option]]:
        """Per unit, every distinct option of its frontiers (all caps) and ``keep``."""
        if getattr(self, "_options", None) is None:
            self._options = {}
            for path, by_cap in self.frontiers.items():
                seen = {repr(o.segments): o for front in by_cap.values() for o in front}
                keep = self._option(path, keep_segments(len(self.blocks[path])))
                seen.setdefault(repr(keep.segments), keep)
                self._options[path] = list(seen.values())
        return self._options

    def refine(self, plan: Plan, traced: Traced, allowed: int, scale: float = 1.0,
               traces: list[tuple[int, int, float]] | None = None) -> tuple[Plan, Traced]:
        """Lower ``plan``'s recompute where the units' forward order says the peak allows it,
        and keep the result only if its trace fits ``allowed`` (allocator bytes) and it
        ranks cheaper.

        The search's model (:func:`~remat.planner.search.modelled_peak`) charges every
        recompute with all that is kept, so near the floor it misses cheap plans whose peak
        is set elsewhere: MONAI SwinUNETR 3D (64^3, batch 1), whose peak is the backward of
        its last full-resolution decoder block whatever the Swin stages do, planned at
        MONAI's own peak with 1.33x ``none``'s FLOPs where a plan of 1.02x fits (Swin
        stages recomputed, convolution blocks selective). Here each unit in turn takes the
        cheaper option that keeps :func:`~remat.planner.search.ordered_peak` within the
        plan's own plus the room left to the budget (``scale``: modelled bytes per
        allocator byte), then without that room if the first result does not fit; at most
        :data:`REFINE_TRACES` traces, each appended to ``traces`` as ``(ordered modelled
        peak, traced peak, modelled time)``."""
        order = self.unit_order()
        options = self._unit_options()
        tries = 0
        room = max(0, allowed - traced.allocator_peak)
        while tries < REFINE_TRACES:
            current = self._choice_of(plan)
            limit = ordered_peak(self.base, [current[p] for p in order], self.release)
            choice = cheaper_within(current, options, order, self.base,
                                    limit + int(room * scale), self.release)
            candidate = self._plan_of(choice)
            if repr(candidate.units) == repr(plan.units):
                if room == 0:
                    break
                room = 0
                continue
            tries += 1
            found = self.trace(PlanStrategy(candidate))
            if traces is not None:
                traces.append((ordered_peak(self.base, [choice[p] for p in order],
                                            self.release), found.allocator_peak,
                               self.modelled_time(candidate)))
            if found.allocator_peak <= allowed and self._rank(
                    (candidate, found)) < self._rank((plan, traced)):
                plan, traced = candidate, found
                room = max(0, allowed - traced.allocator_peak)
            elif room > 0:
                room = 0
            else:
                break
        return plan, traced

    def _trace_first(self, plan: Plan) -> Traced:
        """Trace the search's first plan, and beside it, on the CPUs a lone trace leaves
        idle, the fixed strategies modelled cheaper than it: those :meth:`plan` traces at
        its end when this plan is the one it keeps (gpt_medium at 8192 tokens: selective
        over the whole network), which then come from the cache. Only the time changes:
        a trace gives the same result whenever it is made."""
        cost = self.modelled_cost(plan)
        cheaper = sorted((self.modelled_cost(ref), i, ref) for i, (_, ref) in enumerate(
            self.references(self.default_stages)) if repr(ref.units) not in self.cache)
        extra = [PlanStrategy(ref) for c, _, ref in cheaper if c < cost][:side_by_side() - 1]
        if extra:
            try:
                return self.trace_many([PlanStrategy(plan), *extra])[0]
            except Exception:  # noqa: BLE001 - an extra that fails costs this plan nothing
                log.debug("a fixed strategy traced beside the first plan failed",
                          exc_info=True)
        return self.trace(PlanStrategy(plan))

    def budget_for(self, peak: int) -> int:
        """The smallest budget (bytes) whose :meth:`margin_for` leaves ``peak`` bytes (an
        allocator peak, :attr:`Traced.allocator_peak`)."""
        return math.ceil((peak + self._conv_margin()) / (1 - self.margin)) + 1

    def _conv_margin(self) -> int:
        return 0 if self.temporaries is not None else int(self.profile.largest_conv_bytes)

    def _key(self, name: str) -> str:
        return f"{self.key}.{name}" if self.key else name

    def margin_for(self, budget: int) -> int:
        """Bytes of ``budget`` kept free: ``margin`` of it, plus, where kernel temporaries
        were not measured (a GPU planned on a CPU), the largest convolution tensor (about
        what a backward convolution allocates beyond its outputs)."""
        return int(budget * self.margin) + self._conv_margin()

    def modelled_cost(self, plan: Plan) -> float:
        """The search's objective for ``plan``: modelled recompute time (s) or FLOPs."""
        return sum(o.time for o in self._choice_of(plan).values())

    def _choice_of(self, plan: Plan) -> dict[str, Option]:
        """Unit path -> the search's :class:`Option` for ``plan``'s segments of it."""
        return {u.path: evaluate_chain(self.blocks[u.path], u.segments, self.free)
                for u in plan.units}

    def _rank(self, item: tuple[Plan, Traced]) -> tuple[float, float]:
        plan, traced = item
        flops = traced.step_flops - self.none.step_flops
        if self.objective == "flops":
            return (float(flops), self.modelled_time(plan))
        return (self.modelled_cost(plan), float(flops))

    def modelled(self, plan: Plan) -> int:
        """The additive model's peak of ``plan`` (bytes)."""
        options = list(self._choice_of(plan).values())
        return modelled_peak(self.base, sum(o.kept for o in options),
                             max((o.transient for o in options), default=0), self.release)

    def modelled_time(self, plan: Plan) -> float:
        """The modelled recompute time of ``plan`` (s, roofline on the planned device)."""
        return sum(evaluate_chain(self.time_blocks[u.path], u.segments, self.free).time
                   for u in plan.units)

    def infeasible_message(self, budget: int, margin: int, plan: Plan, floor: Traced) -> str:
        """What the smallest plan needs, its parts, and what would fit instead."""
        cats = floor.categories
        static = sum(cats.get(k, 0) for k in ("parameters", "buffers", "gradients",
                                              "optimizer_state"))
        largest = max((sum(b.saved.values()) for bl in self.blocks.values() for b in bl),
                      default=0)
        dynamic = max(1, floor.allocator_peak - static)
        room = budget - margin - static
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in cats.items()
                          if k != "total" and v)
        if floor.allocator_peak > floor.peak_bytes:
            parts += (f", the batch and kernel temporaries "
                      f"{format_bytes(floor.allocator_peak - floor.peak_bytes)}")
        # the least budget, rounded up to 0.1 MiB (a whole MiB overstated it by up to 1 MiB,
        # on a job whose plannable range was 1.6 MiB), and the margin that budget keeps
        least = math.ceil(self.budget_for(floor.allocator_peak) / 2**20 * 10) / 10
        # a CPU run reports its tensors' peak: a budget above that number read as refused
        # for nothing (a tiny net measured 2.57 MiB under none, refused 2 MiB "2.7 MiB")
        tensors = (f" ({format_bytes(floor.peak_bytes)} of it tensors, the peak a CPU run "
                   "reports; the rest the batch and kernel temporaries the allocator holds) "
                   if floor.allocator_peak > floor.peak_bytes else " ")
        lines = [f"{self._key('memory')}={format_bytes(budget)}: no plan fits. The smallest "
                 f"peak any plan reaches is {format_bytes(floor.allocator_peak)}{tensors}"
                 f"at batch {self.batch_size}, size {self.size}, "
                 f"{self.precision}, on {self.spec.name}: the least budget that holds it "
                 f"with its margin ({format_bytes(self.margin_for(int(least * 2**20)))}) is "
                 f"{self._key('memory')}={least:g}MiB.",
                 f"  at that peak: {parts}",
                 f"  largest unit's internals (recomputed one at a time): "
                 f"{format_bytes(largest)}",
                 "  that plan: " + plan.summary().replace("\n", "; ")]
        if room <= 0:
            lines.append(f"  parameters, gradients and optimizer state alone take "
                         f"{format_bytes(static)}: use a smaller model or shard it (FSDP)")
        else:
            lines += self._smaller_shapes(plan, budget - margin, room / dynamic)
        return "\n".join(lines)


    def _smaller_shapes(self, plan: Plan, allowed: int, scale: float) -> list[str]:
        """Lines of the infeasible message: the largest smaller batch, a smaller size, and
        ``bf16-mixed`` (from ``32-true``) that the floor plan fits at ``allowed`` allocator
        bytes. Each starts from a guess (what is not parameters, gradients or optimizer
        state scaled by ``scale``) and is traced at that shape (the batch bisected, at most
        :data:`SHAPE_TRACES` traces), so what is suggested fits as traced: the guess alone
        said "batch 1 needs about 185.8 MiB" where its floor is 219.1 (the optimizer step's
        own temporaries do not shrink with the batch), offered a U-Net side of 32 px that
        parameters, gradients and AdamW state alone do not fit, and bf16 "at best about
        92.2 MiB" for a GPT whose bf16 floor is 180.8."""
        lines = []

        def peak_at(batch_size: int, size: Any, precision: str | None = None) -> int | None:
            """The traced allocator peak, or ``None`` where the network refuses the shape
            (a BatchNorm after global pooling at batch 1, a size its strides do not
            divide): that suggestion is left out, the budget's own message stays."""
            job = {**self._job(PlanStrategy(plan)), "batch_size": batch_size, "size": size}
            if precision is not None:
                job["precision"] = precision
            try:
                return int(_traced(self._trace_jobs([job])[0]).allocator_peak)
            except Exception as err:  # noqa: BLE001 - any refusal: no suggestion of it
                log.debug("no trace at batch %s, size %s, %s: %s", batch_size, size,
                          precision or self.precision, err)
                return None

        if self.batch_size > 1:
            guess = min(self.batch_size - 1, max(1, math.floor(self.batch_size * scale)))
            low, high, best = 1, self.batch_size - 1, None  # the largest fitting, bisected
            for _ in range(SHAPE_TRACES):
                if low > high:
                    break
                peak = peak_at(guess, self.size)
                if peak is None:  # refused (batch 1 under BatchNorm): try a larger one
                    low = guess + 1
                elif peak <= allowed:
                    best, low = (guess, peak), guess + 1
                else:
                    high = guess - 1
                guess = (low + high) // 2 if best is None else (low + high + 1) // 2
            lines.append(f"  would fit instead: data.batch_size={best[0]} (traced: "
                         f"{format_bytes(best[1])} with this plan)" if best is not None else
                         "  no smaller data.batch_size fits with this plan")
        if isinstance(self.size, int):
            image = self.profile.kind == "image"
            step = 32 if image else 8
            smaller = (math.floor(self.size * math.sqrt(min(scale, 1.0)) / step) * step
                       if image else math.floor(self.size * min(scale, 1.0) / step) * step)
            key = self.size_key or ("data.image_size" if image else "data.block_size")
            if step <= smaller < self.size:
                peak = peak_at(self.batch_size, smaller)
                if peak is not None and peak <= allowed:
                    lines.append(f"  or {key}={smaller} (traced: {format_bytes(peak)} with "
                                 "this plan)")
        if self.precision == "32-true":
            peak = peak_at(self.batch_size, self.size, "bf16-mixed")
            if peak is not None and peak <= allowed:
                lines.append(f"  or precision=bf16-mixed (traced: {format_bytes(peak)} with "
                             "this plan; parameters, gradients and optimizer state stay fp32)")
        return lines


#: Traces :meth:`Planner._smaller_shapes` spends on the batch an infeasible budget offers.
SHAPE_TRACES = 3


def _measuring_device(spec: DeviceSpec) -> torch.device:
    """Where kernel temporaries are measured for a plan on ``spec``: the GPU present when
    ``spec`` is a GPU and one is here (its kernels, cuDNN/cuBLAS workspaces included),
    else this CPU."""
    if spec.name != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_plan(build: Builder, batch_size: int, size: Any, memory: Any,
              precision: str = "32-true", device: str | dict | DeviceSpec = "auto",
              **kwargs: Any) -> Planned:
    """Plan for one budget (:class:`Planner` then :meth:`Planner.plan`).

    Args:
        build: ``strategy -> model`` (see :class:`Planner`).
        memory: the budget: ``12GiB``, ``"12 GB"``, bytes, or a fraction of the device's
            memory such as ``0.8``.
        **kwargs: :class:`Planner` arguments (``units``, ``margin``, ...).

    Raises:
        ValueError: a bad budget, device or unit list (naming the key).
        InfeasibleBudget: nothing fits (the message says what would).
    """
    planner = Planner(build, batch_size, size, precision, device=device, **kwargs)
    planned = planner.plan(memory)
    planned.seconds += planner.setup_seconds
    return planned
