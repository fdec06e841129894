"""Strategies side by side in one process: peak memory, step time, gradient parity.

``python -m remat.bench model=unet_resnet34 data.image_size=512 data.batch_size=2`` or
``python -m remat.bench model=gpt_small data.batch_size=2 'data.block_size=[512,1024,2048]'``
(a list of sizes runs one after another in one process; one table with a size column).

Protocol (GUIDE.md sec. 4): every strategy wraps a copy of the same model (same weights);
peak memory of one training step (forward, loss, backward; parameters and gradients
included, no optimizer state) is measured per strategy (CUDA allocator peak, or exact
tensor-level MemTracker on CPU); step times are interleaved across strategies after
``warmup`` rounds and the median of ``steps`` timed rounds is kept. A memory saving counts
only if the strategy's gradients match ``none`` on the same batch and seed.

On CUDA one model is on the device at a time: every model, and every stored gradient copy,
waits on the CPU; the measured one is moved in, measured (or timed: the moves are outside
the timed region) and moved out again, and the allocator cache is emptied, so a row's
``max_memory_allocated`` counts that model alone (:class:`DeviceSlot`). On the CPU nothing
moves.

Reference rows from outside remat, measured in the same run: torch's
``checkpoint_sequential`` with ceil(sqrt(N)) segments per ``nn.Sequential`` stage, timm's
``set_grad_checkpointing`` wherever a timm model holds the stages (``tu-`` encoders, timm
ViTs), and Hugging Face's own activation checkpointing wherever a ``transformers``
``PreTrainedModel`` holds them (:class:`HFGradientCheckpointing`); a reference that cannot
apply to the stages is skipped with a printed note; ``reference_points=false`` drops them.

``compiled=true`` adds rows measured on models compiled with ``torch.compile`` (backend
``compile_backend``, default ``inductor``; strategies ``compile_strategies``, default none,
full, sqrtn), with
ratios to ``none`` compiled and gradients compared with eager ``none``; they are timed in
the same interleaved rounds as the eager rows, so their ratios to eager ``none``
(``eager_time_ratio``) are interleaved too. On the CPU their
peak comes from ``torch.profiler`` memory events (:class:`ProfilerPeakMemory`): MemTracker
is a ``TorchDispatchMode``, under which dynamo runs the model eagerly. ``peak_by=profiler``
measures the eager rows that way as well (allocator events include kernels' temporaries,
which a tensor-level MemTracker does not see).
"""

from __future__ import annotations

import copy
import csv
import json
import logging
import platform
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

from remat import _compat, run_shape
from remat.config import config_dir
from remat.measure import (
    TOLERANCES,
    PeakMemory,
    StepTimer,
    allocation_levels,
    compare_gradients,
    device_name,
    format_bytes,
    training_step,
)
from remat.models.hf import is_hf_model
from remat.sharding import shard
from remat.strategies import (
    CheckpointStrategy,
    StageError,
    StrategyReport,
    TimmNative,
    build_strategy,
    resolve_stages,
    sqrt_segments,
    wrapping,
)
from remat.strategies.compiled import _trampoline

log = logging.getLogger(__name__)

# image side (px) when data.image_size is null (configs/bench.yaml)
DEFAULT_IMAGE_SIZE = 512
TIMM_REFERENCE = "timm_set_grad_checkpointing"
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


class DeviceSlot:
    """At most one benchmark model on the measuring device at a time (GUIDE.md sec. 4).

    With ``swap`` (default: on CUDA) models live on the host (CPU); :meth:`load` moves one
    in after moving the previous one out (its gradients dropped first) and emptying the
    CUDA cache, and :meth:`keep` stores gradient copies on the host. Without ``swap`` (the
    CPU, where there is nothing to move) models stay where they are and ``load`` only
    records which one runs. The three moves are methods (``_move_in``, ``_move_out``,
    ``_to_home``), so tests can stand in a fake device.

    Args:
        device: the measuring device.
        swap: move models in and out (default ``device.type == "cuda"``).
    """

    host = torch.device("cpu")

    def __init__(self, device: torch.device | str, swap: bool | None = None) -> None:
        self.device = torch.device(device)
        self.swap = self.device.type == "cuda" if swap is None else bool(swap)
        self.resident: torch.nn.Module | None = None

    @property
    def home(self) -> torch.device:
        """Where models wait between rows: the host with ``swap``, else the device."""
        return self.host if self.swap else self.device

    def load(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make ``model`` the one on the device (moving the previous one out); returns it."""
        if self.resident is not model:
            self.unload()
            if self.swap:
                self._move_in(model)
            self.resident = model
        return model

    def unload(self) -> None:
        """Move the resident model back to the host (gradients dropped) and empty the
        allocator cache; a no-op without ``swap``."""
        model, self.resident = self.resident, None
        if model is None or not self.swap:
            return
        model.zero_grad(set_to_none=True)
        self._move_out(model)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def keep(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` where they may wait between rows (the host with ``swap``)."""
        return {k: self._to_home(v.detach()) for k, v in tensors.items()}

    def _move_in(self, model: torch.nn.Module) -> None:
        model.to(self.device)

    def _move_out(self, model: torch.nn.Module) -> None:
        model.to(self.host)

    def _to_home(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.home, copy=True)


class ProfilerPeakMemory:
    """Peak memory of the work inside the block from ``torch.profiler`` memory events, in
    bytes: the highest running sum of the allocations and frees it records on ``device``
    (``profile_memory=True``; every allocation through the device's allocator, so compiled
    kernels too), plus the parameters and buffers of ``modules`` held at the start. On an
    eager step this equals MemTracker's peak to within rounding (``tests/test_bench.py``).

    Reads the profiler's allocation events in time order (``experimental_event_tree()``,
    each with its block's address and signed size; torch's public ``events()`` folds
    allocations into the ops that made them and loses the order). A free counts only when
    its block was allocated inside this block of work: the profiler also reports frees of
    blocks allocated during an *earlier* profiling session of the process (a model's
    gradients from the last measured step, freed by ``zero_grad``), which put the running
    sum that much too low (a 2-block GPT: 869,704 B instead of 987,976 B on every
    measurement after the first).

    After the block: ``peak_bytes`` (int), ``reserved_bytes`` (``None``).
    """

    def __init__(self, device: torch.device | str, modules: Iterable[torch.nn.Module] = ()):
        self.device = torch.device(device)
        self.modules = list(modules)
        self.peak_bytes: int | None = None
        self.reserved_bytes: int | None = None
        self._prof = None

    def __enter__(self) -> ProfilerPeakMemory:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(*exc)
        _, levels = allocation_levels(self._prof, self.device.type)
        peak = max(levels, default=0)
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in self.modules for t in (*m.parameters(), *m.buffers())
                if t.device.type == self.device.type}
        self.peak_bytes = int(sum(held.values()) + peak)
        self._prof = None


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


class RowBackend:
    """The ``torch.compile`` backend of one compiled row: the registered backend
    ``backend`` (``inductor``, ``aot_eager``, ...), under the partitioner's
    ``activation_memory_budget`` when one is given, counting the graphs it compiles.

    One object per row: dynamo checks a cache entry against the backend it was compiled
    with, so a row never reuses another row's graphs, and ``graphs`` says whether the row
    was compiled at all (dynamo may run a frame eagerly with only a warning, e.g. past its
    recompile limit; see :func:`compile_row`).
    """

    def __init__(self, backend: str, memory_budget: float | None = None) -> None:
        self.backend = backend
        self.memory_budget = memory_budget
        self.inner = _compat.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1
        if self.memory_budget is None:
            return self.inner(gm, example_inputs)
        with _compat.functorch_config().patch(activation_memory_budget=self.memory_budget):
            return self.inner(gm, example_inputs)


def compile_row(net: torch.nn.Module, backend: Callable) -> None:
    """``net.compile(backend=backend)`` (in place: parameter names, so the gradient
    comparison, stay) with a code object of the row's own. ``nn.Module.compile`` compiles
    ``Module._call_impl``, one code object shared by every module, and dynamo keeps at most
    ``torch._dynamo.config.recompile_limit`` (8) cache entries per code object, counting
    those of earlier rows (and of models already gone): past them a row would run eagerly,
    with only a warning. A trampoline per row (:func:`remat.strategies.compiled.
    _trampoline`, as the ``compile`` strategy's stages have) gives each row a cache of its
    own."""
    _compat.set_compiled_call_impl(
        net, torch.compile(_trampoline(_compat.call_impl(net)), backend=backend))


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
             mesh: Any = None, peak_by: str = "auto") -> _Group:
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
                strategy, "activation_memory_budget", None))
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


def _measure_groups(base: L.LightningModule, stages: Sequence[str],
                    strategies: dict[str, CheckpointStrategy],
                    compile_strategies: dict[str, CheckpointStrategy],
                    batch: dict[str, torch.Tensor], device: torch.device, precision: str,
                    warmup: int, steps: int, seed: int, slot: DeviceSlot,
                    compile_backend: str | None = None, notes: list[str] | None = None,
                    mesh: Any = None, peak_by: str = "auto") -> list[BenchRow]:
    """The eager rows, then (with ``compile_backend`` and ``compile_strategies``) the rows
    compiled with it, all timed interleaved in one loop (:func:`_time`). Eager rows'
    ratios are to eager ``none``, compiled rows' to compiled ``none``; every row's
    ``eager_peak_ratio``/``eager_time_ratio`` are to eager ``none``. Compiled rows'
    gradients are compared with eager ``none``'s."""
    args = (batch, device, precision, seed, slot)
    groups = [_prepare(base, stages, strategies, *args, mesh=mesh, peak_by=peak_by)]
    if compile_backend is not None and compile_strategies:
        groups.append(_prepare(base, stages, compile_strategies, *args, compile_backend,
                               notes, mesh, peak_by))
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


def _is_budget(spec: Any) -> bool:
    name = spec if isinstance(spec, str) else (spec.get("name") if hasattr(spec, "get") else None)
    return name == "budget"


def _fsdp_mesh(cfg: DictConfig, device: torch.device) -> Any:
    """The 1-D mesh of all ranks for ``fsdp=true`` (the process group initialised from the
    launcher's environment), or None.

    Raises:
        ValueError: ``fsdp=true`` outside a multi-process launch, or with rows it does not
            measure (``compiled``, ``budget``).
    """
    if not cfg.get("fsdp", False):
        return None
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError("bench fsdp=true measures each rank in its own process: launch it "
                         "with python -m torch.distributed.run --nproc-per-node 2 -m "
                         "remat.bench fsdp=true ...")
    if cfg.get("compiled", False):
        raise ValueError("bench fsdp=true measures eager rows only: set compiled=false")
    if any(_is_budget(s) for s in cfg.strategies):
        raise ValueError("bench fsdp=true: budget rows are planned per rank by "
                         "python -m remat.plan world_size=...; list fixed strategies here")
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    return init_device_mesh(device.type, (dist.get_world_size(),))


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
        return _measure_groups(base, stages, strategies, {}, batch, device, precision,
                               warmup, steps, seed, slot)
    rows = _measure_groups(base, stages, {"none": strategies["none"]}, strategies, batch,
                           device, precision, warmup, steps, seed, slot, compile_backend, notes)
    return rows[1:]  # eager none: the gradient reference, timed with them


class TorchCompileMemoryBudget(CheckpointStrategy):
    """Reference row: plain ``torch.compile`` of the whole network with the partitioner's
    activation memory budget (``torch._functorch.config.activation_memory_budget``: 1.0
    saves what the default partitioner saves, 0.0 recomputes as much as it can). It wraps
    nothing; the bench compiles the net with a :class:`RowBackend` that partitions under the
    budget. Only for ``compile_strategies`` (eager, it is ``none``). Below 1.0 the
    partitioner may recompute dropout in backward with other masks (pytorch/pytorch#190758),
    so its gradients can differ from ``none``'s; the row's ``grads match`` column shows it.

    Raises:
        ValueError: a budget outside [0, 1].
    """

    name = "torch_compile_budget"

    def __init__(self, memory_budget: float = 0.5) -> None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int | float) or not (
                0.0 <= float(memory_budget) <= 1.0):
            raise ValueError(f"bench: torch_compile_budget memory_budget must be a number in "
                             f"[0, 1], got {memory_budget!r}")
        self.activation_memory_budget = float(memory_budget)


class TorchCheckpointSequential(CheckpointStrategy):
    """Reference point from outside remat: ``torch.utils.checkpoint.checkpoint_sequential``
    with ceil(sqrt(N)) segments on each ``nn.Sequential`` stage (non-reentrant).

    Plain torch, so its recompute updates BatchNorm running statistics a second time; the
    benchmark compares gradients only.
    """

    name = "torch_checkpoint_sequential"

    def check_stage(self, path: str, module: torch.nn.Module) -> None:
        if not isinstance(module, torch.nn.Sequential):
            raise StageError(f"{self.name} needs nn.Sequential stages: '{path}' is a "
                             f"{type(module).__name__}")

    def wrap_stage(self, path: str, module: torch.nn.Module, report: StrategyReport) -> None:
        wrapping.install(module, wrapping.Wrap(self, path, self.run))
        report.segments[path] = sqrt_segments(len(module))
        report.wrapped.extend(f"{path}.{i}" for i in range(len(module)))

    def run(self, module: torch.nn.Sequential, wrap: wrapping.Wrap, forward, args: tuple,
            kwargs: dict):
        """``checkpoint_sequential`` over the chain's blocks (its one input)."""
        wrap.calls += 1
        return checkpoint_sequential(list(module), max(1, len(sqrt_segments(len(module)))),
                                     *args, use_reentrant=False)


class HFGradientCheckpointing(CheckpointStrategy):
    """Reference point from outside remat: Hugging Face's own activation checkpointing,
    ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
    False})`` (``activation_checkpointing_enable``, its non-deprecated name in transformers
    5, when present), called on the outermost ``transformers.PreTrainedModel`` that holds
    each stage.

    What is recomputed is HF's choice: every ``GradientCheckpointingLayer`` of that model
    (each decoder/encoder layer its own checkpoint, ``torch.utils.checkpoint`` without
    reentrance; the layer turns ``use_cache`` off while it checkpoints). The report lists
    those layers. ``remove`` calls ``gradient_checkpointing_disable()``
    (``activation_checkpointing_disable``) and removes the input-embedding hook that
    enabling added.

    Raises:
        StageError: no ``PreTrainedModel`` holds a stage, or the model does not support
            gradient checkpointing, or the stage holds none of its checkpointed layers.
    """

    name = "hf_gradient_checkpointing"

    def apply(self, model: torch.nn.Module, stages: Iterable[str]) -> StrategyReport:
        resolved = resolve_stages(model, stages)
        report = StrategyReport(strategy=self.name, stages=[p for p, _ in resolved])
        owners: dict[int, tuple[str, torch.nn.Module]] = {}
        for path, stage in resolved:
            owner = _outermost_hf_model(model, path)
            if owner is None:
                raise StageError(f"{self.name} needs a Hugging Face PreTrainedModel holding "
                                 f"stage '{path}'; {type(model).__name__} has none there")
            prefix, hf_model = owner
            if not getattr(hf_model, "supports_gradient_checkpointing", False):
                raise StageError(f"{self.name}: {type(hf_model).__name__} (holding stage "
                                 f"'{path}') does not support gradient checkpointing")
            if not any(_is_hf_checkpoint_layer(m) for m in stage.modules()):
                raise StageError(f"{self.name}: stage '{path}' holds no layer Hugging Face "
                                 "checkpoints (GradientCheckpointingLayer); list the layer "
                                 "chain, e.g. model.layers or transformer.h")
            owners[id(hf_model)] = (prefix, hf_model)
        wrapping.unwrap_all(model)  # replaces any strategy applied before, as every one does
        for prefix, hf_model in owners.values():
            wrapping.install(hf_model, wrapping.Wrap(self, prefix))  # undone by undo()
            kwargs = {"use_reentrant": False}
            if hasattr(hf_model, "activation_checkpointing_enable"):
                hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:  # transformers 4.35 - 4.x
                hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            for name, child in hf_model.named_modules():
                if _is_hf_checkpoint_layer(child) and child.gradient_checkpointing:
                    report.wrapped.append(".".join(p for p in (prefix, name) if p))
        for path, stage in resolved:
            blocks = [i for i, child in enumerate(stage.children())
                      if _is_hf_checkpoint_layer(child) and child.gradient_checkpointing]
            if blocks:
                report.segments[path] = [(i, i + 1) for i in blocks]
        return report

    def undo(self, module: torch.nn.Module, wrap: wrapping.Wrap) -> None:
        """Switch Hugging Face's checkpointing off again on the model ``apply`` switched on
        (asked by :func:`remat.strategies.unwrap_all`, so any later strategy replaces it)."""
        if hasattr(type(module), "activation_checkpointing_disable"):
            module.activation_checkpointing_disable()
        else:  # transformers 4.35 - 4.x
            module.gradient_checkpointing_disable()
        if hasattr(module, "_require_grads_hook"):
            module.disable_input_require_grads()
        wrapping.uninstall(module)


def _is_hf_checkpoint_layer(module: torch.nn.Module) -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module, GradientCheckpointingLayer)


def _outermost_hf_model(model: torch.nn.Module, path: str
                        ) -> tuple[str, torch.nn.Module] | None:
    """``(prefix, module)`` of the outermost ``PreTrainedModel`` on the way from ``model`` to
    ``path`` (the model itself, prefix ``""``, when it is one), or ``None``."""
    parts = path.split(".")
    for depth in range(len(parts) + 1):
        prefix = ".".join(parts[:depth])
        module = model.get_submodule(prefix) if prefix else model
        if is_hf_model(module):
            return prefix, module
    return None


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


def _sizes(cfg: DictConfig) -> tuple[str, list[int]]:
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
        value = DEFAULT_IMAGE_SIZE if value is None else value
    values = list(value) if isinstance(value, ListConfig | list | tuple) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
        raise ValueError(f"bench: {key} must be an integer >= 1 or a list of them, got "
                         f"{shown!r}")
    return key, [int(v) for v in values]


def reference_rows(base: L.LightningModule, stages: Sequence[str]
                   ) -> tuple[dict[str, CheckpointStrategy], list[str]]:
    """The reference rows that apply to ``base.net``'s ``stages``, and a note for each that
    does not: torch's ``checkpoint_sequential`` (``nn.Sequential`` stages only), timm's
    ``set_grad_checkpointing`` (a timm model holds the stages) and Hugging Face's activation
    checkpointing (a ``PreTrainedModel`` holds them). Each is tried on a copy of the net."""
    candidates: list[CheckpointStrategy] = [TorchCheckpointSequential(), TimmNative(),
                                            HFGradientCheckpointing()]
    names = {TimmNative: TIMM_REFERENCE}
    rows: dict[str, CheckpointStrategy] = {}
    notes: list[str] = []
    for strategy in candidates:
        name = names.get(type(strategy), strategy.name)
        try:
            strategy.apply(copy.deepcopy(base.net), list(stages))
        except StageError as err:
            reason = re.split(r" \(checked|; ", str(err))[0]  # the first clause says why
            notes.append(f"reference {name} skipped: {reason}")
            continue
        rows[name] = type(strategy)()
    return rows, notes


def _build_strategies(specs: Iterable[Any]) -> dict[str, CheckpointStrategy]:
    """Row label -> strategy for ``strategies``-style entries: a name, or ``{name: ...,
    arg: value}`` (label ``name(arg=value)``); ``{name: budget, memory: ...}`` is a memory
    budget, planned for each size when it is measured."""
    strategies: dict[str, CheckpointStrategy] = {}
    for spec in specs:
        name, overrides = (spec, {}) if isinstance(spec, str) else (
            spec["name"], {k: v for k, v in spec.items() if k != "name"})
        args = ", ".join(f"{k}={v}" for k, v in overrides.items())
        label = f"{name}({args})" if overrides else name
        if name == TorchCompileMemoryBudget.name:
            strategies[label] = TorchCompileMemoryBudget(**overrides)
            continue
        if name == "budget":  # planned per size in bench() (remat.planner)
            from remat.planner import BudgetStrategy

            try:
                strategies[label] = BudgetStrategy(**overrides)
            except TypeError as err:
                raise ValueError(f"bench: strategy budget does not take {sorted(overrides)}: "
                                 f"{err}") from err
            continue
        strategies[label] = build_strategy(name, **overrides)
    return strategies


def _planned(strategies: dict[str, CheckpointStrategy], model_cfg: DictConfig,
             batch_size: int, size: int, precision: str, stages: list[str], where: str,
             notes: list[str], known: dict[str, CheckpointStrategy] | None = None,
             ) -> dict[str, CheckpointStrategy]:
    """``strategies`` with each memory budget (``{name: budget, ...}``) planned for this
    batch and size (its plan noted in ``notes``). A budget with the same label in ``known``
    (the eager rows, already planned) takes that plan instead of planning again."""
    runs = dict(strategies)
    for label, strategy in strategies.items():
        if getattr(strategy, "needs_plan", False) and hasattr((known or {}).get(label), "plan"):
            from remat.planner import PlanStrategy

            runs[label] = PlanStrategy(known[label].plan)
            notes.append(f"{where}: {label}: the eager row's plan")
            continue
        if getattr(strategy, "needs_plan", False):
            from remat.planner import InfeasibleBudget

            try:
                runs[label] = strategy.planned(
                    lambda s, mc=model_cfg: instantiate(mc, strategy=s), batch_size, size,
                    precision, default_stages=stages)
            except InfeasibleBudget as err:  # one row that cannot be met: a note, not a stop
                del runs[label]
                notes.append(f"{where}: {label} skipped: {str(err).splitlines()[0]}")
                print(f"note: {where}: {label} skipped: {err}", flush=True)
                continue
            notes.append(f"{where}: {label}: " + runs[label].plan.summary().replace("\n", "; "))
    return runs


def bench(cfg: DictConfig) -> dict[str, Any]:
    """Run the benchmark the config describes, once per size in the size list; write
    ``bench.csv``, ``bench.json`` and ``bench.png`` (one table, a ``size`` column).

    Reference rows that cannot apply to the stages are skipped with a printed note (also
    in ``bench.json``, ``notes``); so are compiled rows whose compilation fails.

    Raises:
        ValueError: unknown strategy (lists valid ones), bad sizes (naming the key) or
            precision; ``compile_strategies`` without ``none``.
    """
    precision = run_shape.check_precision(cfg.precision, cfg.device, run_shape.TRACED_PRECISIONS,
                                          "bench precision")
    batch_size = cfg.data.get("batch_size")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"bench: data.batch_size must be an integer >= 1, got {batch_size!r}")
    size_key, sizes = _sizes(cfg)
    device = run_shape.resolve_device(cfg.device)
    strategies = _build_strategies(cfg.strategies)
    if any(isinstance(s, TorchCompileMemoryBudget) for s in strategies.values()):
        raise ValueError("bench: torch_compile_budget is a compiled reference row: list it in "
                         "compile_strategies (with compiled=true), not in strategies")
    if "none" not in strategies:
        raise ValueError("bench strategies must include 'none', the reference")
    if int(cfg.steps) < 1 or int(cfg.warmup) < 0:
        raise ValueError(f"bench needs steps >= 1 and warmup >= 0, got {cfg.steps}, "
                         f"{cfg.warmup}")
    compiled = bool(cfg.get("compiled", False))
    backend = str(cfg.get("compile_backend", "inductor"))
    compile_runs = _build_strategies(cfg.get("compile_strategies") or []) if compiled else {}
    peak_by = str(cfg.get("peak_by", "auto"))
    if peak_by not in ("auto", "profiler"):
        raise ValueError(f"bench: peak_by must be auto or profiler, got {peak_by!r}")
    if compiled and "none" not in compile_runs:
        raise ValueError(f"bench: compile_strategies must include 'none' (the compiled "
                         f"reference), got {list(compile_runs)}")
    mesh = _fsdp_mesh(cfg, device)
    primary = mesh is None or torch.distributed.get_rank() == 0
    slot = DeviceSlot(device)
    rows: list[BenchRow] = []
    notes: list[str] = []
    if mesh is not None:
        notes.append(f"FSDP2 over {mesh.size()} ranks (one process each), data.batch_size per "
                     "rank; peak: the highest rank's; gradients compared gathered")
    for size in sizes:
        L.seed_everything(cfg.seed, workers=False)
        run_cfg = copy.deepcopy(cfg)  # this size in data.*, so ${data...} in the model follow
        with open_dict(run_cfg):
            run_cfg.data[size_key.split(".")[1]] = size
            model_cfg = run_cfg.model  # one step, no optimizer: drop the scheduler
            model_cfg.scheduler = None
            if size_key == "data.block_size":
                model_cfg.block_size = size  # the model follows the data, as in training
        base = instantiate(model_cfg)  # no strategy: wraps nothing
        runs = _planned(strategies, model_cfg, batch_size, size, precision,
                        list(base.stage_paths), f"size {size}", notes)
        size_compile_runs = _planned(compile_runs, model_cfg, batch_size, size, precision,
                                     list(base.stage_paths), f"size {size}, compiled", notes,
                                     known=runs)
        if cfg.get("reference_points", True) and mesh is None:
            references, skipped = reference_rows(base, list(base.stage_paths))
            runs.update(references)
            for note in skipped:
                print(f"note: {note}", flush=True)
            notes.extend(f"size {size}: {n}" for n in skipped)
        generator = torch.Generator().manual_seed(cfg.seed)
        batch = {k: v.to(device)
                 for k, v in base.example_batch(batch_size, size, generator).items()}
        size_notes: list[str] = []
        size_rows = _measure_groups(base, list(base.stage_paths), runs, size_compile_runs,
                                    batch, device, precision, int(cfg.warmup), int(cfg.steps),
                                    int(cfg.seed), slot, backend if compiled else None,
                                    size_notes, mesh, peak_by)
        for note in size_notes:
            print(f"note: {note}", flush=True)
        notes.extend(f"size {size}: {n}" for n in size_notes)
        for row in size_rows:
            row.size = size
        rows.extend(size_rows)
        if primary:
            print(format_table(size_rows), flush=True)  # progress: one size at a time
        del base, batch
    model_name = cfg.model._target_.rsplit(".", 1)[-1]
    record = {
        "model": OmegaConf.to_container(cfg.model, resolve=False),
        "batch_size": batch_size, "size_key": size_key, "sizes": sizes,
        "precision": str(cfg.precision), "device": device_name(device),
        "torch_version": torch.__version__, "machine": platform.machine(),
        "warmup": int(cfg.warmup), "steps": int(cfg.steps), "peak_by": peak_by,
        "compiled": compiled, "compile_backend": backend if compiled else None,
        "one_model_on_device": slot.swap, "notes": notes,
        "fsdp_world_size": mesh.size() if mesh is not None else None,
        "rows": [asdict(r) for r in rows],
    }
    if not primary:
        return record  # rank 0 writes and prints
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(record, indent=2))
    title = (f"{model_name}, batch {batch_size}, {size_key} {', '.join(map(str, sizes))}, "
             f"{cfg.precision}, {record['device']}")
    plot(rows, out / "bench.png", title)
    with (out / "bench.csv").open("w", newline="") as f:
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
    print(f"{model_name} batch {batch_size}, {size_key} {sizes}, {cfg.precision}, "
          f"{record['device']}, torch {torch.__version__}")
    print(format_table(rows))
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {out / 'bench.csv'}, {out / 'bench.json'} and {out / 'bench.png'}")
    return record


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="bench")
def main(cfg: DictConfig) -> None:
    """Hydra app around :func:`bench`."""
    bench(cfg)


if __name__ == "__main__":
    main()
