"""Cost model of the planner's candidate units, from one fake training batch (no allocation).

:func:`profile_model` builds the model with no checkpointing under ``FakeTensorMode``, runs
forward, loss and backward of one batch, and records per op (a ``TorchDispatchMode``) its
FLOPs (``torch.utils.flop_counter`` formulas), the bytes it reads and writes, and which
candidate block runs it; per block (forward hooks) the storages of its inputs and outputs;
and per saved tensor (``torch.autograd.graph.saved_tensors_hooks``) which block saved it;
and per block, the decisions of the ``selective`` preset's own policy on
its forward ops. From that, :class:`BlockCost` gives for each block what keeping it,
recomputing it, or recomputing all but its matmul/convolution/SDPA outputs (the
``selective`` preset, which caches those outputs whether autograd saves them or not) costs in
bytes kept and in recompute time on a device (a roofline per op, see
:mod:`remat.planner.devices`).

Candidates (:func:`find_candidates`): every outermost chain (``nn.Sequential``,
``nn.ModuleList``, ``nn.ModuleDict``) of the network, and every outermost module with children
that holds no chain and lies in none (a head, a stem block): the whole network, not only the
model's default stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat._compat import TorchDispatchMode, tree_flatten
from remat.measure.step import autocast
from remat.measure.trace import run_built, sized_batch
from remat.planner.devices import DeviceSpec
from remat.rng import rng_kept
from remat.strategies.recompute import storage_key, written_tensors
from remat.strategies.segmented import CHAIN_TYPES, chain_members
from remat.strategies.selective import (
    RegionPolicy,
    SelectiveCheckpoint,
    op_flops,
)


@dataclass
class Unit:
    """A candidate unit: a chain (its members are the blocks) or one module (one block)."""

    path: str
    kind: str  # "chain" | "module"
    blocks: list[str]  # dotted paths of its blocks, in order
    # blocks that are chains themselves: a stage naming one is segmented inside it
    nested: tuple[str, ...] = ()


@dataclass
class BlockCost:
    """What one block costs (bytes; time in seconds on the planned device).

    Attributes:
        path: the block's dotted path.
        flops: forward FLOPs (what a recompute of the block adds).
        time: roofline forward time of its ops (s).
        selective_flops, selective_time: FLOPs and time of the ops the ``selective`` preset
            recomputes (the ops whose outputs it does not cache, but for those whose
            outputs nothing reads again).
        saved: storage key -> bytes of the tensors its ops save for backward (parameters
            excluded).
        selective_saved: storage key -> bytes of what the selective preset caches: the
            outputs of matmul, convolution and SDPA ops, whether autograd saves them or
            not (an attention score matrix that feeds a softmax), within the bytes
            autograd saves of the block's own tensors; at most ``saved_bytes`` in all
            (see ``_Recorder.selective_cost``).
        inputs: storage key -> bytes of the tensors it is called with.
        outputs: storage key -> bytes of the tensors it returns.
        mutated: storage key -> bytes of its inputs its own ops write in place (an
            ``nn.ReLU(inplace=True)`` member of a chain, ``x += self.pos``): a recompute
            segment keeps a copy of such an input, or joins the one before it (below).
        parameters: whether the block has parameters of its own: a segment starting at a
            parameterless writer joins the one before it at run time; any other writer's
            segment keeps a copy of what it writes (:func:`remat.planner.search.replayable`).
    """

    path: str
    flops: int = 0
    time: float = 0.0
    selective_flops: int = 0
    selective_time: float = 0.0
    saved: dict[Any, int] = field(default_factory=dict)
    selective_saved: dict[Any, int] = field(default_factory=dict)
    inputs: dict[Any, int] = field(default_factory=dict)
    outputs: dict[Any, int] = field(default_factory=dict)
    mutated: dict[Any, int] = field(default_factory=dict)
    parameters: bool = False

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())


@dataclass
class Profile:
    """Costs of every candidate of one model at one batch and size.

    Attributes:
        units: the candidate units.
        blocks: block path -> :class:`BlockCost`.
        step_flops: FLOPs of forward + backward of the batch (no recompute).
        step_time: roofline time of forward + backward (s).
        saved_elsewhere: storage key -> bytes of tensors saved by ops outside every block.
        fingerprint: module paths and parameter shapes of the network (plan files).
        model: the network's class name; ``kind``: ``image`` or ``sequence`` (its batch).
        largest_conv_bytes: the largest input or output of a convolution in the forward
            (bytes): the size of the temporaries CPU ``convolution_backward`` allocates
            beyond what a tensor-level trace sees (U-Net-R34, 512 px, batch 2: a 32 MiB
            tensor, 36 MiB seen by ``torch.profiler``).
        order: the unit paths in the order the forward first runs one of their blocks
            (units that did not run last): the backward meets them in reverse.
    """

    units: list[Unit]
    blocks: dict[str, BlockCost]
    step_flops: int
    step_time: float
    saved_elsewhere: dict[Any, int]
    fingerprint: str
    model: str = ""
    kind: str = "image"
    largest_conv_bytes: int = 0
    order: list[str] = field(default_factory=list)


def find_candidates(net: nn.Module, paths: Sequence[str] | None = None) -> list[Unit]:
    """The units the planner may wrap.

    Args:
        net: the network (for remat's modules, ``model.net``).
        paths: stage paths (globs allowed) to use instead of the automatic choice; a chain
            among them is a chain unit, anything else a module unit.

    Raises:
        remat.strategies.StageError: a path matches nothing.
        ValueError: the network has no unit (no chain and no module with children).
    """
    from remat.strategies.stages import StageError, child_path, resolve_stages

    if paths:
        try:
            found = resolve_stages(net, paths)
        except StageError as err:
            raise StageError(f"strategy.units={list(paths)}: {err}") from err
    else:
        from remat.strategies.stages import discover_units

        named = dict(net.named_modules())
        found = [(name, named[name]) for name in discover_units(net)]
        if not found and isinstance(net, CHAIN_TYPES) and len(net) > 1:
            found = [("", net)]  # an nn.Sequential of lone layers: the net is the chain
    units = []
    for name, module in found:
        if isinstance(module, CHAIN_TYPES):
            members = chain_members(module)
            units.append(Unit(name, "chain", [child_path(name, n) for n, _ in members],
                              tuple(child_path(name, n) for n, m in members
                                    if isinstance(m, CHAIN_TYPES))))
        else:
            units.append(Unit(name, "module", [name]))
    if not units:
        raise ValueError(f"planner: {type(net).__name__} has no unit the planner can wrap (no "
                         "nn.Sequential/ModuleList/ModuleDict and no module with children); "
                         "name the modules with strategy.units=[...]")
    return units


def fingerprint(net: nn.Module) -> str:
    """A short hash of the network's parameter names, shapes and dtypes."""
    import hashlib

    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in net.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return int(t.numel() * t.element_size())


def _tensor_bytes(values: Any) -> dict[Any, int]:
    out: dict[Any, int] = {}
    for t in tree_flatten(values)[0]:
        if isinstance(t, torch.Tensor):
            key = storage_key(t)
            if key is not None:
                out[key] = _nbytes(t)
    return out


class _ForwardContext:
    """What the selective policy reads of torch's ``SelectiveCheckpointContext`` in a
    block's forward."""

    is_recompute = False

    def __init__(self, op_output: Any) -> None:
        self.op_output = op_output


class _Recorder(TorchDispatchMode):
    """Per op: FLOPs, bytes read and written, the innermost block running it. Per block,
    the selective preset's own policy (:meth:`SelectiveCheckpoint.make_policy`) sees the
    block's forward ops and packs as it would in a checkpointed block, so the profile keeps
    what the preset keeps (:meth:`selective_cost`).

    Every tensor the forward makes is held until the recorder goes (fake tensors: no
    memory), so no freed storage's key is reused by a later one.
    """

    def __init__(self, device: DeviceSpec, precision: str, selective: SelectiveCheckpoint
                 ) -> None:
        super().__init__()
        self.flops_rate = device.flops_for(precision)
        self.bandwidth = device.bandwidth
        self.selective = selective
        self.stack: list[str] = []
        self.blocks: dict[str, BlockCost] = {}
        # block -> the preset's policy (None: the preset refuses the block) and, per op it
        # saw, (FLOPs, roofline s)
        self.policies: dict[str, RegionPolicy | None] = {}
        self.op_costs: dict[str, list[tuple[int, float]]] = {}
        self.alive: list[Any] = []
        self.step_flops = 0
        self.step_time = 0.0
        self.largest_conv = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            # ``prim.device`` of a fake tensor (asked by this profile's own hooks and by
            # Python code): metadata, no work, and no op a real run's policy sees
            return out
        flops = op_flops(func, args, kwargs, out)
        moved = sum(_nbytes(t) for t in tree_flatten((args, kwargs, out))[0]
                    if isinstance(t, torch.Tensor))
        seconds = max(flops / self.flops_rate, moved / self.bandwidth)
        self.step_flops += flops
        self.step_time += seconds
        block = self.stack[-1] if self.stack else None
        if block is not None and torch.is_grad_enabled():
            self._note_writes(func, args, kwargs, self.blocks[block])
        if not torch.is_grad_enabled():
            return out
        self.alive.append(out)
        if func.overloadpacket is torch.ops.aten.convolution:
            self.largest_conv = max(self.largest_conv, *(
                _nbytes(t) for t in tree_flatten((args[:2], out))[0]
                if isinstance(t, torch.Tensor)))
        if block is not None:
            cost = self.blocks[block]
            cost.flops += flops
            cost.time += seconds
            if block not in self.policies:
                self.policies[block] = self.selective.make_policy()
                self.op_costs[block] = []
            policy = self.policies[block]
            if policy is not None:
                try:
                    policy(_ForwardContext(out), func, *args, **kwargs)
                    self.op_costs[block].append((flops, seconds))
                except RuntimeError:  # an in-place op the preset cannot replay
                    self.policies[block] = None
        return out

    @staticmethod
    def _note_writes(func: Any, args: tuple, kwargs: dict, cost: BlockCost) -> None:
        """Record in ``cost.mutated`` the block's inputs ``func`` writes in place (its
        schema's mutable arguments: ``relu_``, ``add_``, ``out=``)."""
        for t in written_tensors(func, args, kwargs):
            key = storage_key(t)
            if key in cost.inputs:
                cost.mutated[key] = cost.inputs[key]

    def packed(self, t: torch.Tensor) -> None:
        """Autograd saves ``t`` now (a saved-tensor hook): tell the running block's policy,
        as the selective preset's own hook (``_record_packs``) does."""
        policy = self.policies.get(self.stack[-1]) if self.stack else None
        if policy is not None:
            policy.packed.add(policy.key(t))

    def selective_cost(self, cost: BlockCost) -> None:
        """Fill ``cost.selective_saved``, ``selective_flops`` and ``selective_time`` (its
        ``saved`` known) from what the preset's policy settles for the block
        (:meth:`remat.strategies.selective.RegionPolicy.settle`): the outputs of the
        matmul, convolution and SDPA ops it caches (those autograd saves, and those it does
        not where the block's recompute stays within what ``none`` holds for it); its
        recompute is every other op but those whose outputs nothing reads again.

        A block whose cache would hold everything autograd saves runs without a checkpoint
        (``saves_nothing``): it keeps ``saved`` and recomputes nothing. A block the preset
        refuses (an in-place op it cannot replay) is modelled as keeping ``saved`` and
        recomputing everything, so the search never prefers it to ``keep``.
        """
        policy = self.policies.get(cost.path)
        if policy is None:
            cost.selective_saved = dict(cost.saved) if cost.path in self.policies else {}
            cost.selective_flops, cost.selective_time = (
                (cost.flops, cost.time) if cost.path in self.policies else (0, 0.0))
            return
        cached, dead_ops, dead = policy.settle()
        kept = policy.kept(cached, dead)
        if all(k in kept for k in policy.produced if k in policy.packed):
            cost.selective_saved = dict(cost.saved)
            cost.selective_flops, cost.selective_time = 0, 0.0
            return
        # the policy's keys are (storage key, generation); with every storage held alive,
        # the storage key alone is unique, as in ``saved``, ``inputs`` and ``outputs``
        selective = {k[0]: n for k, n in kept.items()}
        total = cost.saved_bytes
        if sum(selective.values()) > total:  # never more than autograd itself keeps
            selective = dict(cost.saved)
        cost.selective_saved = selective
        recomputed = [c for i, c in enumerate(self.op_costs[cost.path])
                      if i not in cached and i not in dead_ops]
        cost.selective_flops = sum(f for f, _ in recomputed)
        cost.selective_time = sum(t for _, t in recomputed)


def _profile_fn(paths: Sequence[str] | None, device: DeviceSpec, batch_size: int, size: Any,
                precision: str, torch_device: torch.device) -> Callable[[nn.Module], Profile]:
    def fn(model: nn.Module) -> Profile:
        model.train()
        net = getattr(model, "net", model)
        units = find_candidates(net, paths)
        # every name of a module used in several places (MONAI's SegResNet puts its one
        # activation module in its final nn.Sequential: named act_mod and conv_final.1)
        named = dict(net.named_modules(remove_duplicate=False))
        recorder = _Recorder(device, precision, SelectiveCheckpoint("matmul"))
        handles = []
        owners: dict[int, list[tuple[str, str]]] = {}  # module -> (unit, block) it is
        for unit in units:
            for path in unit.blocks:
                recorder.blocks[path] = BlockCost(
                    path, parameters=next(named[path].parameters(), None) is not None)
                owners.setdefault(id(named[path]), []).append((unit.path, path))
        running: list[str] = []  # the chain units running now, innermost last
        unit_of = {path: unit.path for unit in units for path in unit.blocks}
        first_run: dict[str, None] = {}  # unit paths in the order the forward reaches them

        def enter(mod, args, kwargs, unit):
            running.append(unit)

        def leave(mod, args, kwargs, output):
            running.pop()

        for unit in units:
            if unit.kind == "chain":
                chain = named[unit.path]
                handles.append(chain.register_forward_pre_hook(
                    lambda m, a, k, u=unit.path: enter(m, a, k, u), with_kwargs=True))
                handles.append(chain.register_forward_hook(leave, with_kwargs=True))

        def block_of(owned: list[tuple[str, str]]) -> str | None:
            """The block a call of a (possibly shared) module is: the one whose chain runs
            it; a module that is one block only is that block wherever it runs."""
            if len(owned) == 1:
                return owned[0][1]
            for unit in reversed(running):
                for owner, path in owned:
                    if owner == unit:
                        return path
            return next((p for u, p in owned if u == p), None)  # a module unit

        for owned in owners.values():
            module = named[owned[0][1]]

            def pre(mod, args, kwargs, owned=owned):
                path = block_of(owned)
                if path is not None and torch.is_grad_enabled():
                    recorder.blocks[path].inputs.update(_tensor_bytes((args, kwargs)))
                    first_run.setdefault(unit_of[path], None)
                recorder.stack.append(path)

            def post(mod, args, kwargs, output):
                path = recorder.stack.pop()
                if path is not None and torch.is_grad_enabled():
                    recorder.blocks[path].outputs.update(_tensor_bytes(output))

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        params = {storage_key(p) for p in [*model.parameters(), *model.buffers()]}
        saved_by: dict[Any, tuple[str | None, int]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            recorder.packed(t)
            key = storage_key(t)
            if key is not None and key not in params and key not in saved_by:
                saved_by[key] = (recorder.stack[-1] if recorder.stack else None, _nbytes(t))
            return t

        batch = sized_batch(model, batch_size, size, torch_device)
        with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with autocast(torch_device, precision):
                loss = model.training_loss(batch)
        with recorder:
            loss.backward()
        for h in handles:
            h.remove()
        elsewhere: dict[Any, int] = {}
        for key, (block, nbytes) in saved_by.items():
            if block is None:
                elsewhere[key] = nbytes
                continue
            recorder.blocks[block].saved[key] = nbytes
        for cost in recorder.blocks.values():
            recorder.selective_cost(cost)
        return Profile(units=units, blocks=recorder.blocks, step_flops=recorder.step_flops,
                       step_time=recorder.step_time, saved_elsewhere=elsewhere,
                       fingerprint=fingerprint(net), model=type(net).__name__,
                       kind="image" if "image" in batch else "sequence",
                       largest_conv_bytes=recorder.largest_conv,
                       order=[*first_run, *(u.path for u in units if u.path not in first_run)])
    return fn


def profile_model(build: Callable[[], nn.Module], paths: Sequence[str] | None,
                  device: DeviceSpec, batch_size: int, size: Any, precision: str,
                  torch_device: torch.device | None = None) -> Profile:
    """Profile the candidate units of ``build()`` (a model without checkpointing, with
    ``net``, ``example_batch`` and ``training_loss``) for one batch under ``FakeTensorMode``.

    Args:
        paths: candidate unit paths (globs), or ``None`` for :func:`find_candidates`'s choice.
        device: the device whose roofline times the ops.

    Raises:
        remat.strategies.StageError, ValueError: see :func:`find_candidates`.
    """
    torch_device = torch_device or torch.device("cpu")
    return run_built(build, profile_fn(paths, device, batch_size, size, precision,
                                       torch_device), torch_device, fake=True)


def profile_fn(paths: Sequence[str] | None, device: DeviceSpec, batch_size: int, size: Any,
               precision: str, torch_device: torch.device | None = None
               ) -> Callable[[nn.Module], Profile]:
    """The work of :func:`profile_model` on a built model (to run in a child process with
    :func:`remat.measure.trace.built_fn`); its result pickles."""
    return _picklable(_profile_fn(paths, device, batch_size, size, precision,
                                  torch_device or torch.device("cpu")))


def _picklable(fn: Callable[[nn.Module], Profile]) -> Callable[[nn.Module], Profile]:
    """Replace the (device, 'fake', cdata) storage keys by ints, consistently (the profile
    is pickled out of the tracing child)."""
    def wrapped(model: nn.Module) -> Profile:
        profile = fn(model)
        ids: dict[Any, int] = {}

        def remap(table: dict[Any, int]) -> dict[int, int]:
            return {ids.setdefault(k, len(ids)): v for k, v in table.items()}

        for cost in profile.blocks.values():
            cost.saved = remap(cost.saved)
            cost.selective_saved = remap(cost.selective_saved)
            cost.inputs = remap(cost.inputs)
            cost.outputs = remap(cost.outputs)
            cost.mutated = remap(cost.mutated)
        profile.saved_elsewhere = remap(profile.saved_elsewhere)
        return profile
    return wrapped


def calibrate_profile(profile: Profile, build: Callable[[], nn.Module], batch_size: int,
                      size: Any, precision: str, device: torch.device,
                      rounds: int = 3) -> Profile:
    """Replace the roofline times of ``profile`` by times measured on ``device`` (real
    tensors at the planned size: run it on the device planned for).

    Each block's forward is timed by forward hooks (synchronising CUDA), the median of
    ``rounds`` training forwards after one warm-up; the selective preset's time keeps its
    roofline share of the block's time; the step time is the median forward + backward.
    Returns ``profile`` (changed in place). The global RNGs are as they were after it (it
    builds a model seeded 0 and runs it).
    """
    with rng_kept():
        return _calibrate_profile(profile, build, batch_size, size, precision, device, rounds)


def _calibrate_profile(profile: Profile, build: Callable[[], nn.Module], batch_size: int,
                       size: Any, precision: str, device: torch.device, rounds: int) -> Profile:
    import statistics
    import time as _time

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.manual_seed(0)
    model = build().to(device).train()
    net = getattr(model, "net", model)
    named = dict(net.named_modules(remove_duplicate=False))
    times: dict[str, list[float]] = {b: [] for b in profile.blocks}
    starts: dict[str, float] = {}
    handles = []
    for path in profile.blocks:
        def pre(mod, args, path=path):
            sync()
            starts[path] = _time.perf_counter()

        def post(mod, args, out, path=path):
            sync()
            times[path].append(_time.perf_counter() - starts[path])

        handles += [named[path].register_forward_pre_hook(pre),
                    named[path].register_forward_hook(post)]
    batch = sized_batch(model, batch_size, size, device)
    steps = []
    try:
        for i in range(rounds + 1):
            model.zero_grad(set_to_none=True)
            sync()
            start = _time.perf_counter()
            with autocast(device, precision):
                loss = model.training_loss(batch)
            loss.backward()
            sync()
            if i == 0:
                for v in times.values():
                    v.clear()
            else:
                steps.append(_time.perf_counter() - start)
    finally:
        for h in handles:
            h.remove()
    for path, cost in profile.blocks.items():
        if not times[path]:
            continue
        measured = statistics.median(times[path])
        share = cost.selective_time / cost.time if cost.time else 0.0
        cost.time, cost.selective_time = measured, measured * share
    profile.step_time = statistics.median(steps)
    del model, batch, loss
    return profile
