"""Strategies side by side on copies of one model: the measurement behind ``remat.bench``.

:func:`run_benchmark` measures one batch's training step for every strategy (peak memory,
interleaved step times, gradient parity with ``none``, FLOPs), as GUIDE.md sec. 4 asks;
:func:`reference_rows` adds the reference rows of :data:`remat.strategies.REFERENCES` that
apply to the stages; :func:`format_table`, :func:`plot` and :func:`write_csv` show the rows.
``python -m remat.bench`` (the entry) builds the models from a config and calls these.
"""

from __future__ import annotations

import copy
import csv
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from torch.utils.flop_counter import FlopCounterMode

from remat import run_shape
from remat.compiling import RowBackend, check_partitioner_budget, compile_row
from remat.measure import (
    TOLERANCES,
    DeviceSlot,
    PeakMemory,
    ProfilerPeakMemory,
    StepTimer,
    compare_gradients,
    format_bytes,
    training_step,
)
from remat.planner import BudgetStrategy, InfeasibleBudget, PlanStrategy
from remat.sharding import shard
from remat.strategies import (
    COMPILED_REFERENCES,
    REFERENCES,
    CheckpointStrategy,
    NoCheckpoint,
    StageError,
    build_strategy,
)

PEAK_METHODS = {"allocator": "cuda allocator", "memtracker": "MemTracker",
                "profiler": "torch.profiler"}


@dataclass
class BenchRow:
    """One strategy's result. Bytes and milliseconds; ratios are to ``none`` (to ``none``
    compiled for compiled rows); gradients are compared with eager ``none``.

    ``compiled`` is the ``torch.compile`` backend of a compiled row (else ``None``);
    ``peak_method`` says what measured the peak (:data:`PEAK_METHODS` values). ``flops`` are
    the FLOPs of one step (forward, backward and recompute, counted by
    ``torch.utils.flop_counter.FlopCounterMode``; eager rows only) and ``flops_ratio`` them
    over ``none``'s: the recompute cost, exact and device-independent.
    ``eager_peak_ratio`` and ``eager_time_ratio`` are to eager ``none`` of the same run,
    for every row (compiled rows are timed interleaved with the eager ones); on eager rows
    they equal ``peak_ratio`` and ``time_ratio``. ``grad_rel_error``: the largest relative
    error of one parameter's gradient against the reference (2-norm; ``grads_match`` is
    the stricter elementwise ``allclose``, which compiled kernels' reordered float sums
    can miss while the relative error stays ~1e-5).
    """

    strategy: str
    peak_bytes: int
    median_ms: float
    grads_match: bool
    max_grad_diff: float
    peak_ratio: float = float("nan")
    time_ratio: float = float("nan")
    step_ms: list[float] = field(default_factory=list)
    reserved_bytes: int | None = None
    size: int | None = None
    compiled: str | None = None
    peak_method: str = ""
    flops: int | None = None
    flops_ratio: float = float("nan")
    eager_peak_ratio: float = float("nan")
    eager_time_ratio: float = float("nan")
    grad_rel_error: float = 0.0


def _step(module: L.LightningModule, batch: dict, device: torch.device, precision: str) -> None:
    module.zero_grad(set_to_none=True)
    training_step(module, batch, None, device, precision)


def _peak_meter(device: torch.device, model: torch.nn.Module, profiler: bool
                ) -> tuple[Callable[[], Any], str]:
    """The peak-memory context for one row and its name: the CUDA allocator on CUDA; on
    the CPU torch.profiler where ``profiler`` (compiled rows, strategies MemTracker cannot
    see, ``peak_by=profiler``), else MemTracker."""
    if device.type == "cuda":
        return (lambda: PeakMemory(device, modules=[model])), PEAK_METHODS["allocator"]
    if profiler:
        return (lambda: ProfilerPeakMemory(device, modules=[model])), PEAK_METHODS["profiler"]
    return (lambda: PeakMemory(device, modules=[model])), PEAK_METHODS["memtracker"]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


@dataclass
class _Group:
    """One group of rows on copies of one model, all eager or all compiled with
    ``compile_backend``, after the untimed steps of :func:`_prepare`."""

    models: dict[str, L.LightningModule]
    grads: dict[str, dict[str, torch.Tensor]]
    flops: dict[str, int]
    peaks: dict[str, Any]
    methods: dict[str, str]
    compile_backend: str | None
    timers: dict[str, StepTimer] = field(default_factory=dict)


def _prepare(base: L.LightningModule, stages: Sequence[str],
             strategies: dict[str, CheckpointStrategy], batch: dict[str, torch.Tensor],
             device: torch.device, precision: str, seed: int, slot: DeviceSlot,
             compile_backend: str | None = None, notes: list[str] | None = None,
             mesh: Any = None, peak_by: str = "auto",
             compile_options: dict[str, Any] | None = None) -> _Group:
    """Wrap (and compile) a copy of ``base`` per strategy, then run each row's untimed
    steps: one for its gradients (and FLOPs, eager rows) under ``seed``, one for its peak.

    A compiled row whose first step fails, or that compiled no graph (it ran eagerly), is
    left out with a note in ``notes``; an eager row's error propagates. With a device
    ``mesh`` (``fsdp=true``, one process per rank) every row's network is sharded with
    FSDP2 after its strategy (:func:`remat.sharding.shard`); a row's peak is the highest of
    the ranks' peaks. ``peak_by="profiler"`` measures every CPU row's peak with
    torch.profiler (compiled rows, and strategies MemTracker cannot see, always are).
    """
    models: dict[str, L.LightningModule] = {}
    backends: dict[str, RowBackend] = {}
    for name, strategy in strategies.items():
        model = copy.deepcopy(base).to(slot.home).train()
        report = strategy.apply(model.net, list(stages))
        if mesh is not None:
            shard(model.net, mesh, report, stages=list(stages))
        if compile_backend is not None:  # in place: parameter names unchanged
            backends[name] = RowBackend(compile_backend, getattr(
                strategy, "activation_memory_budget", None), compile_options)
            compile_row(model.net, backends[name])
        models[name] = model

    grads: dict[str, dict[str, torch.Tensor]] = {}
    flops: dict[str, int] = {}
    for name in list(models):  # gradient parity (and FLOPs): same batch, same RNG
        model = slot.load(models[name])
        torch.manual_seed(seed)
        try:
            if compile_backend is None:
                with FlopCounterMode(display=False) as counter:
                    _step(model, batch, device, precision)
                flops[name] = int(counter.get_total_flops())
            else:
                _step(model, batch, device, precision)
                if not backends[name].graphs:
                    raise RuntimeError("torch.compile produced no graph: the row ran eagerly")
        except Exception as err:
            if compile_backend is None or name == "none":
                raise
            slot.unload()
            del models[name]
            if notes is not None:
                notes.append(f"{name} compiled ({compile_backend}) left out: "
                             f"{_first_line(err)}")
            continue
        grads[name] = slot.keep({n: _full(p.grad) for n, p in model.named_parameters()
                                 if p.grad is not None})
        model.zero_grad(set_to_none=True)
    peaks, methods = {}, {}
    for name, model in models.items():
        slot.load(model)
        model.zero_grad(set_to_none=True)
        profiler = (compile_backend is not None or peak_by == "profiler"
                    or not getattr(strategies[name], "measurable_on_cpu", True))
        meter, methods[name] = _peak_meter(device, model, profiler)
        with meter() as peak:
            _step(model, batch, device, precision)
        peaks[name] = peak
        if mesh is not None:  # the rank that needs the most is the one that must fit
            every: list[Any] = [None] * mesh.size()
            torch.distributed.all_gather_object(every, int(peak.peak_bytes),
                                                group=mesh.get_group())
            peak.peak_bytes = max(every)
        model.zero_grad(set_to_none=True)
    return _Group(models, grads, flops, peaks, methods, compile_backend)


def _time(groups: Sequence[_Group], batch: dict[str, torch.Tensor], device: torch.device,
          precision: str, warmup: int, steps: int, slot: DeviceSlot) -> None:
    """Time every row of every group interleaved: ``warmup + steps`` rounds, each one step
    of every row in turn (eager and compiled rows alike), so a drift of the machine's load
    falls on all rows; the first ``warmup`` rounds are not kept."""
    for group in groups:
        group.timers = {name: StepTimer(device, warmup=warmup) for name in group.models}
    for _ in range(warmup + steps):
        for group in groups:
            for name, model in group.models.items():
                slot.load(model)  # moves (CUDA) happen here, before the timer starts
                group.timers[name].start()
                _step(model, batch, device, precision)
                group.timers[name].stop()
    slot.unload()


def _rows(group: _Group, precision: str,
          reference_grads: dict[str, torch.Tensor] | None = None) -> list[BenchRow]:
    """One :class:`BenchRow` per row of a timed group, ratios to the group's ``none``,
    gradients compared with ``reference_grads`` (default: the group's ``none``)."""
    rtol, atol = TOLERANCES.get(precision, (1e-2, 1e-2))
    reference = group.grads["none"] if reference_grads is None else reference_grads
    backend = group.compile_backend
    rows = []
    for name in group.models:
        parity = compare_gradients(reference, group.grads[name], rtol=rtol, atol=atol)
        label = name if backend is None else f"{name} (compiled, {backend})"
        timer, peak = group.timers[name], group.peaks[name]
        rows.append(BenchRow(label, int(peak.peak_bytes), float(timer.median_ms),
                             parity.match, parity.max_abs_diff, step_ms=timer.times_ms,
                             grad_rel_error=parity.max_rel_error,
                             reserved_bytes=peak.reserved_bytes, compiled=backend,
                             peak_method=group.methods[name], flops=group.flops.get(name)))
    ref_row = rows[list(group.models).index("none")]
    for row in rows:
        row.peak_ratio = row.peak_bytes / ref_row.peak_bytes
        row.time_ratio = row.median_ms / ref_row.median_ms
        if row.flops is not None and ref_row.flops:
            row.flops_ratio = row.flops / ref_row.flops
    return rows


def measure_groups(base: L.LightningModule, stages: Sequence[str],
                    strategies: dict[str, CheckpointStrategy],
                    compile_strategies: dict[str, CheckpointStrategy],
                    batch: dict[str, torch.Tensor], device: torch.device, precision: str,
                    warmup: int, steps: int, seed: int, slot: DeviceSlot,
                    compile_backend: str | None = None, notes: list[str] | None = None,
                    mesh: Any = None, peak_by: str = "auto",
                    compile_options: dict[str, Any] | None = None) -> list[BenchRow]:
    """The eager rows, then (with ``compile_backend`` and ``compile_strategies``) the rows
    compiled with it (and inductor's ``compile_options``), all timed interleaved in one
    loop (:func:`_time`). Eager rows'
    ratios are to eager ``none``, compiled rows' to compiled ``none``; every row's
    ``eager_peak_ratio``/``eager_time_ratio`` are to eager ``none``. Compiled rows'
    gradients are compared with eager ``none``'s."""
    args = (batch, device, precision, seed, slot)
    groups = [_prepare(base, stages, strategies, *args, mesh=mesh, peak_by=peak_by)]
    if compile_backend is not None and compile_strategies:
        groups.append(_prepare(base, stages, compile_strategies, *args, compile_backend,
                               notes, mesh, peak_by, compile_options))
    _time(groups, batch, device, precision, warmup, steps, slot)
    eager = groups[0]
    rows = _rows(eager, precision)
    none = rows[list(eager.models).index("none")]
    for group in groups[1:]:
        rows += _rows(group, precision, reference_grads=eager.grads["none"])
    for row in rows:
        row.eager_peak_ratio = row.peak_bytes / none.peak_bytes
        row.eager_time_ratio = row.median_ms / none.median_ms
    return rows


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) gradient gathered; a plain one as it is."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def run_benchmark(base: L.LightningModule, stages: Sequence[str],
                  strategies: dict[str, CheckpointStrategy], batch: dict[str, torch.Tensor],
                  device: torch.device | str = "cpu", precision: str = "32-true",
                  warmup: int = 2, steps: int = 5, seed: int = 0,
                  compile_backend: str | None = None, slot: DeviceSlot | None = None,
                  notes: list[str] | None = None) -> list[BenchRow]:
    """Measure every strategy on copies of ``base`` (a module with ``training_loss(batch)``).

    Args:
        base: model without any strategy applied; each strategy wraps a deep copy.
        stages: stage paths inside ``base.net`` the strategies act on.
        strategies: name -> strategy; must include ``none`` (the reference).
        batch: one batch (same for every strategy).
        warmup, steps: untimed and timed interleaved rounds (>= 1 timed round).
        compile_backend: ``torch.compile`` backend (``inductor``, ``aot_eager``, ...) to
            compile every row's ``net`` with (``nn.Module.compile``, in place), or ``None``
            (eager). Compiled rows are compared with eager ``none``: it is measured and
            timed with them (interleaved), its gradients are the reference; ``peak_ratio``
            and ``time_ratio`` are to ``none`` compiled, ``eager_*_ratio`` to eager ``none``.
        slot: where models wait between rows (default ``DeviceSlot(device)``: one model on
            the device at a time on CUDA, nothing moved on the CPU).
        notes: list that receives a line for each compiled row left out.

    Returns:
        one :class:`BenchRow` per strategy, in the given order (compiled rows that failed
        left out).

    Raises:
        ValueError: ``none`` missing, ``steps < 1``, or unknown precision.
    """
    if "none" not in strategies:
        raise ValueError("bench strategies must include 'none', the reference")
    if steps < 1 or warmup < 0:
        raise ValueError(f"bench needs steps >= 1 and warmup >= 0, got {steps}, {warmup}")
    device = torch.device(device)
    slot = DeviceSlot(device) if slot is None else slot
    batch = {k: v.to(device) for k, v in batch.items()}
    if compile_backend is None:
        return measure_groups(base, stages, strategies, {}, batch, device, precision,
                               warmup, steps, seed, slot)
    rows = measure_groups(base, stages, {"none": strategies["none"]}, strategies, batch,
                           device, precision, warmup, steps, seed, slot, compile_backend, notes)
    return rows[1:]  # eager none: the gradient reference, timed with them


def reference_rows(base: L.LightningModule, stages: Sequence[str]
                   ) -> tuple[dict[str, CheckpointStrategy], list[str]]:
    """The reference rows that apply to ``base.net``'s ``stages``, and a note for each that
    does not: torch's ``checkpoint_sequential`` (``nn.Sequential`` stages only), timm's
    ``set_grad_checkpointing`` (a timm model holds the stages) and Hugging Face's activation
    checkpointing (a ``PreTrainedModel`` holds them). Each is tried on a copy of the net."""
    rows: dict[str, CheckpointStrategy] = {}
    notes: list[str] = []
    for name, cls in REFERENCES.items():
        strategy = cls()
        try:
            strategy.apply(copy.deepcopy(base.net), list(stages))
        except StageError as err:
            reason = re.split(r" \(checked|; ", str(err))[0]  # the first clause says why
            notes.append(f"reference {name} skipped: {reason}")
            continue
        rows[name] = type(strategy)()
    return rows, notes


class BudgetAtRow(BudgetStrategy):
    """A bench row ``{name: budget, at: <row>}``: the plan of least recompute whose training
    step fits where another row's does. For each size the planner traces that row's
    strategy (a training step in Lightning's order with the optimizer's state, as every
    budget is planned), takes its allocator peak as the budget (plus the planner's margin)
    and plans for it; so the table shows a reference point (``hf_gradient_checkpointing``,
    ``monai_use_checkpoint``, a ``selective`` policy) beside the plan at its peak.

    Args:
        at: the row's label, e.g. ``full``, ``selective(policy=matmul)``,
            ``hf_gradient_checkpointing``.
        **kwargs: :class:`~remat.planner.BudgetStrategy` settings but ``memory``
            (``device``, ``objective``, ``max_traces``, ...).

    Raises:
        ValueError: ``at`` is not a non-empty string, or ``memory`` is given too.
    """

    def __init__(self, at: Any, **kwargs: Any) -> None:
        if not isinstance(at, str) or not at.strip():
            raise ValueError(f"bench: budget at= must name another row (a label such as "
                             f"full or hf_gradient_checkpointing), got {at!r}")
        if "memory" in kwargs:
            raise ValueError("bench: a budget row takes memory= or at=, not both")
        super().__init__(memory=1.0, **kwargs)  # the budget is set per size, from the row
        self.at = at.strip()

    def planned_at(self, build: Callable[[CheckpointStrategy], torch.nn.Module],
                   row: CheckpointStrategy, batch_size: int, size: Any, precision: str,
                   default_stages: Sequence[str] = ()) -> tuple[Any, int, int]:
        """Trace ``row``'s training step, plan for its peak; returns the
        :class:`~remat.planner.PlanStrategy` (or a copy of ``row`` itself where it recomputes
        fewer FLOPs than the plan found), the row's traced allocator peak and the budget
        planned for (bytes).

        Raises:
            remat.planner.InfeasibleBudget: no plan reaches the row's peak.
        """
        planner = self.planner(build, batch_size, size, precision,
                               default_stages=default_stages)
        traced = planner.trace(row)
        peak = int(traced.allocator_peak)
        budget = planner.budget_for(peak)
        planned = planner.plan(budget)
        planned.seconds += planner.setup_seconds
        plan = planned.plan
        if (traced.step_flops / max(planner.none.step_flops, 1)
                < 1 + plan.recompute_flops / max(plan.step_flops, 1) - 1e-9):
            # the row's own schedule fits its peak and recomputes less than the plan found
            # (its units may be none the planner searches): it is the answer
            return copy.deepcopy(row), peak, budget
        return self.strategy_for(planned, budget, default_stages), peak, budget


# image side (px) when data.image_size is null (configs/bench.yaml)
DEFAULT_IMAGE_SIZE = 512


def bench_sizes(cfg: DictConfig) -> tuple[str, list[int]]:
    """The size key and its values: ``data.block_size`` for sequence models (default
    ``model.block_size``), ``data.image_size`` for image models (default
    :data:`DEFAULT_IMAGE_SIZE` px); one value or a list.

    Raises:
        ValueError: a missing size or one that is not an integer >= 1 (names the key); the
            size key of the other model kind set (``data.image_size`` for a GPT,
            ``data.block_size`` for an image model), naming both keys.
    """
    sequence = run_shape.is_sequence_model(cfg.model)
    other, used = (("data.image_size", "data.block_size") if sequence
                   else ("data.block_size", "data.image_size"))
    if cfg.data.get(other.split(".")[1]) is not None:
        kind = "sequence" if sequence else "image"
        raise ValueError(f"bench: {other} does not apply to this {kind} model "
                         f"(model._target_={cfg.model.get('_target_')}); set {used} instead")
    if sequence:
        key, value = "data.block_size", cfg.data.get("block_size")
        if value is None:  # the model config's own fallback, as without a data.block_size
            fallback = cfg.copy()
            with open_dict(fallback):
                del fallback.data["block_size"]
            value = fallback.model.block_size
    else:
        key, value = "data.image_size", cfg.data.get("image_size")
        patch = cfg.data.get("patch_size")
        if value is None and patch is not None:  # a data config with patches (data=msd)
            sides = (list(patch) if isinstance(patch, ListConfig | list | tuple) else [patch])
            if len(set(sides)) != 1:
                raise ValueError(f"bench: data.patch_size={OmegaConf.to_container(patch)} is "
                                 "not cubic/square; the bench measures one side per size: set "
                                 "data.image_size=<side> (a list for several)")
            key, value = "data.patch_size", sides[0]
        if value is None and int(cfg.model.get("spatial_dims", 2) or 2) == 3:
            raise ValueError("bench: a 3D model needs its patch side: set data.image_size="
                             "<voxels per side> (e.g. 64; a list for several)")
        value = DEFAULT_IMAGE_SIZE if value is None else value
    values = list(value) if isinstance(value, ListConfig | list | tuple) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
        raise ValueError(f"bench: {key} must be an integer >= 1 or a list of them, got "
                         f"{shown!r}")
    return key, [int(v) for v in values]


def build_strategies(specs: Iterable[Any]) -> dict[str, CheckpointStrategy]:
    """Row label -> strategy for ``strategies``-style entries: a name, or ``{name: ...,
    arg: value}`` (label ``name(arg=value)``); ``{name: budget, memory: ...}`` is a memory
    budget, planned for each size when it is measured. ``compile_memory_budget: 0.5`` in any
    entry (compiled rows) compiles that row under torch's partitioner budget too (the
    strategy's ``activation_memory_budget``, as a ``torch_compile_budget`` row's).

    Raises:
        ValueError: an unknown strategy or argument, or a partitioner budget outside [0, 1].
    """
    strategies: dict[str, CheckpointStrategy] = {}
    for spec in specs:
        name, overrides = (spec, {}) if isinstance(spec, str) else (
            spec["name"], {k: v for k, v in spec.items() if k != "name"})
        args = ", ".join(f"{k}={v}" for k, v in overrides.items())
        label = f"{name}({args})" if overrides else name
        partitioner = overrides.pop("compile_memory_budget", None)
        if partitioner is not None:
            strategies[label] = build_strategies([{"name": name, **overrides}]).popitem()[1]
            strategies[label].activation_memory_budget = check_partitioner_budget(
                partitioner, f"bench: {label}: compile_memory_budget")
            continue
        if name in COMPILED_REFERENCES:
            strategies[label] = COMPILED_REFERENCES[name](**overrides)
            continue
        if name in REFERENCES and overrides:  # e.g. {name: hf_gradient_checkpointing,
            try:                              # every_n_layers: 2}; bare names come anyway
                strategies[label] = REFERENCES[name](**overrides)
            except TypeError as err:
                raise ValueError(f"bench: reference {name} does not take "
                                 f"{sorted(overrides)}: {err}") from err
            continue
        if name == "budget":  # planned per size in bench() (remat.planner)
            try:
                strategies[label] = (BudgetAtRow(**overrides) if "at" in overrides
                                     else BudgetStrategy(**overrides))
            except TypeError as err:
                raise ValueError(f"bench: strategy budget does not take {sorted(overrides)}: "
                                 f"{err}") from err
            continue
        strategies[label] = build_strategy(name, **overrides)
    return strategies


def check_budget_rows(strategies: dict[str, CheckpointStrategy],
                      others: Iterable[str] = ()) -> None:
    """Refuse a ``{name: budget, at: <row>}`` whose row is not another row of the bench: a
    label of ``strategies`` (not itself a budget, nor a compiled-only reference such as
    ``torch_compile_budget``, whose peak an eager trace cannot give) or one of ``others``
    (reference rows).

    Raises:
        ValueError: naming the row asked for and the rows there are.
    """
    compiled_only = tuple(COMPILED_REFERENCES.values())  # not traceable eagerly
    rows = [label for label, s in strategies.items()
            if not getattr(s, "needs_plan", False) and not isinstance(s, compiled_only)]
    rows += [o for o in others if o not in rows]
    for label, strategy in strategies.items():
        if isinstance(strategy, BudgetAtRow) and strategy.at not in rows:
            raise ValueError(f"bench: {label}: at={strategy.at!r} is not a row a plan can be "
                             f"made at; rows: {', '.join(rows)} (budget rows and compiled rows "
                             "are not: the planner traces eager steps)")


def budget_rows_above_their_rows(rows: Sequence[BenchRow],
                                 strategies: dict[str, CheckpointStrategy]) -> list[str]:
    """A note for each ``{name: budget, at: <row>}`` row that peaks above its row in the
    table: the bench measures forward and backward without an optimizer, the plan holds
    the training step's peak, where it is at or below the row's."""
    peaks = {r.strategy: r.peak_bytes for r in rows if r.compiled is None}
    notes = []
    for label, strategy in strategies.items():
        if isinstance(strategy, BudgetAtRow) and peaks.get(label, 0) > peaks.get(
                strategy.at, float("inf")):
            notes.append(f"{label} peaks above {strategy.at} in this table "
                         f"({format_bytes(peaks[label])} against "
                         f"{format_bytes(peaks[strategy.at])}): these rows are forward and "
                         f"backward without an optimizer, the plan is for the training step "
                         f"(optimizer state, kernel temporaries), where it peaks at or below "
                         f"{strategy.at}")
    return notes


def planned_strategies(strategies: dict[str, CheckpointStrategy], model_cfg: DictConfig,
             batch_size: int, size: int, precision: str, stages: list[str], where: str,
             notes: list[str], known: dict[str, CheckpointStrategy] | None = None,
             rows: dict[str, CheckpointStrategy] | None = None, compiled: bool = False,
             ) -> dict[str, CheckpointStrategy]:
    """``strategies`` with each memory budget (``{name: budget, ...}``) planned for this
    batch and size (its plan noted in ``notes``). A budget with the same label in ``known``
    (the eager rows, already planned) takes that plan instead of planning again, unless
    the rows are ``compiled`` and the network draws random numbers (dropout): compiled
    recomputed segments keep its masks, so the budget is planned for the compiled step
    (``Planner(compiled=True)``). A budget ``at`` a row is planned for that row's strategy
    in ``rows`` (or ``strategies``); one whose row does not apply here (a skipped reference)
    is left out with a note."""
    if compiled and any(getattr(s, "needs_plan", False) for s in strategies.values()):
        from remat.compiling import random_modules

        if random_modules(instantiate(model_cfg, strategy=NoCheckpoint()).net):
            known = None  # the eager plans do not count the masks
    runs = dict(strategies)
    rows = {**strategies, **(rows or {})}
    for label, strategy in strategies.items():
        if isinstance(strategy, BudgetAtRow) and not hasattr((known or {}).get(label), "plan"):
            del runs[label]
            if strategy.at not in rows:
                notes.append(f"{where}: {label} skipped: row {strategy.at} does not apply")
                continue
            try:
                runs[label], peak, budget = strategy.planned_at(
                    lambda s, mc=model_cfg: instantiate(mc, strategy=s), rows[strategy.at],
                    batch_size, size, precision, default_stages=stages)
            except InfeasibleBudget as err:
                notes.append(f"{where}: {label} skipped: {str(err).splitlines()[0]}")
                print(f"note: {where}: {label} skipped: {err}", flush=True)
                continue
            planned = getattr(runs[label], "plan", None)
            own = (f", where the plan peaks at "
                   f"{format_bytes(planned.predicted_allocator_peak_bytes)}"
                   if planned is not None and planned.predicted_allocator_peak_bytes else "")
            notes.append(f"{where}: {label}: {strategy.at}'s training step peaks at "
                         f"{format_bytes(peak)} (traced, optimizer state included); planned "
                         f"for {format_bytes(budget)} (that peak plus the planner's margin, "
                         f"which a plan's peak must leave free){own}: "
                         + (planned.summary().replace("\n", "; ") if planned is not None else
                            f"no plan recomputes less than {strategy.at} itself there"))
            continue
        if getattr(strategy, "needs_plan", False) and hasattr((known or {}).get(label), "plan"):
            runs[label] = PlanStrategy(known[label].plan)
            notes.append(f"{where}: {label}: the eager row's plan")
            continue
        if getattr(strategy, "needs_plan", False):
            try:
                runs[label] = strategy.planned(
                    lambda s, mc=model_cfg: instantiate(mc, strategy=s), batch_size, size,
                    precision, default_stages=stages, compiled=compiled)
            except InfeasibleBudget as err:  # one row that cannot be met: a note, not a stop
                del runs[label]
                notes.append(f"{where}: {label} skipped: {str(err).splitlines()[0]}")
                print(f"note: {where}: {label} skipped: {err}", flush=True)
                continue
            notes.append(f"{where}: {label}: " + runs[label].plan.summary().replace("\n", "; "))
    for label, run in runs.items():  # a row's partitioner budget stays with its plan
        budget = getattr(strategies[label], "activation_memory_budget", None)
        if budget is not None:
            run.activation_memory_budget = budget
    return runs


def plot(rows: Sequence[BenchRow], path: Path, title: str) -> None:
    """Scatter of peak memory (MiB) against median step time (ms), one point per strategy,
    ``none`` marked; written as PNG with matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ref = r.strategy == "none"
        ax.scatter(r.median_ms, r.peak_bytes / 2**20, marker="*" if ref else "o",
                   s=160 if ref else 50, color="black" if ref else None, zorder=3)
        ax.annotate(r.strategy, (r.median_ms, r.peak_bytes / 2**20), fontsize=8,
                    xytext=(5, 4), textcoords="offset points")
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(rows: Sequence[BenchRow]) -> str:
    """Plain-text table: size, strategy, peak memory, x none, median step ms, x none,
    recompute FLOPs x none (step FLOPs over ``none``'s; ``-`` for compiled rows), grads
    match (yes/NO), peak by (what measured the peak). Compiled rows' ratios are to ``none``
    compiled with the same backend; with compiled rows three more columns give every row's
    peak and time over eager ``none``'s (``x eager``) and its gradients' largest relative
    error (``grad rel err``)."""
    w = max([len("strategy"), *(len(r.strategy) for r in rows)]) + 2
    eager = any(r.compiled for r in rows)
    lines = [f"{'size':>6}  {'strategy':<{w}}{'peak memory':>14}{'x none':>9}{'step time':>13}"
             f"{'x none':>9}" + (f"{'peak x eager':>14}{'time x eager':>14}" if eager else "")
             + f"{'recompute FLOPs x none':>24}{'grads match':>13}"
             + (f"{'grad rel err':>14}" if eager else "") + "  peak by"]
    for r in rows:
        flops = f"{r.flops_ratio:>24.3f}" if r.flops_ratio == r.flops_ratio else f"{'-':>24}"
        lines.append(f"{r.size if r.size is not None else '':>6}  {r.strategy:<{w}}"
                     f"{format_bytes(r.peak_bytes):>14}{r.peak_ratio:>9.2f}"
                     f"{r.median_ms:>10.1f} ms{r.time_ratio:>9.2f}"
                     + (f"{r.eager_peak_ratio:>14.2f}{r.eager_time_ratio:>14.2f}" if eager
                        else "")
                     + f"{flops}{'yes' if r.grads_match else 'NO':>13}"
                     + (f"{r.grad_rel_error:>14.1e}" if eager else "") + f"  {r.peak_method}")
    return "\n".join(lines)


def write_csv(rows: Sequence[BenchRow], path: Path) -> None:
    """Write ``rows`` to ``path`` as CSV, one line per row (bytes, milliseconds, ratios to
    ``none`` with 4 decimals; an empty cell for a value a row does not have)."""
    with Path(path).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["size", "strategy", "peak_bytes", "peak_ratio", "median_ms",
                         "time_ratio", "grads_match", "max_grad_diff", "reserved_bytes",
                         "compiled", "peak_method", "flops", "flops_ratio",
                         "eager_peak_ratio", "eager_time_ratio", "grad_rel_error"])
        for r in rows:
            writer.writerow([r.size, r.strategy, r.peak_bytes, f"{r.peak_ratio:.4f}",
                             f"{r.median_ms:.2f}", f"{r.time_ratio:.4f}", r.grads_match,
                             f"{r.max_grad_diff:.3g}", r.reserved_bytes or "",
                             r.compiled or "", r.peak_method, r.flops or "",
                             f"{r.flops_ratio:.4f}" if r.flops_ratio == r.flops_ratio else "",
                             f"{r.eager_peak_ratio:.4f}", f"{r.eager_time_ratio:.4f}",
                             f"{r.grad_rel_error:.3g}"])
