"""How a recomputing strategy runs its units in training: checkpointed segments formed by
the real calls of the modules, whatever the parent's loop looks like.

A *unit* is a wrapped module (a block of a chain, or a whole stage). Each training call of a
unit runs inside a *region*: torch's non-reentrant checkpoint machinery
(``torch.utils.checkpoint``'s ``_CheckpointFrame`` and ``_checkpoint_hook``, the code behind
``checkpoint(..., use_reentrant=False)``) drops every tensor the call saves for backward,
and a tape of the region's calls recomputes them when backward first needs one. A single
module is one region per call. The blocks of one segment of a chain share a region, which
the calls themselves form:

- every call of a segment's blocks (in increasing block order) joins the segment's open
  region; each call runs for real, at the time and with the arguments the parent gives,
  and returns its true output, which the parent may keep, append to a list or transform;
- each argument of a call that *is* (same object, unmodified) an output of an earlier call
  of the region is recomputed in backward, not kept; every other tensor argument (the
  segment's input, an attention mask, a tensor the parent computed between two calls) is
  kept as it is. So ``x = blk(x)`` loops keep one input per segment (Chen et al. 2016,
  arXiv 1604.06174), Hugging Face layers get their keyword arguments, a MONAI UNETR that
  collects every block's output for its skips gets those outputs, parallel heads fed the
  same input share it;
- the parent's own code between two calls runs outside the region (nothing it saves is
  dropped), and the replay sets the forward's RNG state and autocast state again before
  each call, so dropout masks are the same even when the parent draws random numbers
  between blocks (layer drop).

What the replay keeps from the forward:

- norm running statistics: modules with ``running_mean``/``running_var`` (BatchNorm,
  SyncBatchNorm, InstanceNorm with ``track_running_stats=True``, LazyBatchNorm once
  initialised) write into throw-away copies during the replay, so each forward updates
  them once; batch statistics still normalise, so the recomputed values are the same;
- other buffers the unit's forward changes in place (learned at its first call: e.g. the
  power-iteration vectors of spectral norm) are replayed from their values before the
  call, and the replay's writes are discarded;
- a kept input the call itself writes in place (``nn.ReLU(inplace=True)`` as a unit of its
  own, ``x += pos`` at the top of a block; learned at the unit's first call, watched at
  every later one) is copied just before the first write, and the replay starts from the
  copy. In a chain of a fixed strategy (``full``, ``sqrtn``, ``every_k``, ``selective``)
  the segment that starts at such a block without parameters (an in-place activation)
  joins the segment before it, whose recompute makes the block's input again (no copy
  from the next forward on), or, at the chain's start, the block runs without a
  checkpoint, as the planner models it (:func:`remat.planner.search.replayable_segments`);
  a block with parameters keeps the copy (a chain of ``x += pos`` blocks joined into one
  segment peaked 1.05x ``none``, with copies 0.68x: 4 such blocks, 64 px, CPU);
- the settings among the unit's modules' attributes (numbers, strings, booleans, enum
  members, dtypes, ``None``, tensors of a few elements, tuples of them: a scale the parent
  sets before each call, a counter the forward increments, ``training``, a flag a first
  call sets) are set, before each call's replay, to their values before that call in the
  forward (a setting the call added is taken away), and put back after the replay: a
  parent that changes them between calls, or after the forward, no longer changes what
  the replay computes. Lists, dicts and larger tensors the forward reads are the replay's
  as they are then (a reference would show their later changes; a copy would keep memory);
- SyncBatchNorm in a recomputed unit would all-reduce again during the replay (one more
  collective per layer per step): a call that would do so is refused naming the module;
- a key/value cache passed to a recomputed layer in training would be appended to twice;
  as Hugging Face's own gradient checkpointing does (``transformers`` ``modeling_layers``),
  the call gets ``use_cache=False`` and no cache object (``cache``, ``past_key_value(s)``,
  ``layer_past``, any ``transformers`` ``Cache``), with a one-time warning;
- a replay whose saved tensors differ from the forward's raises :class:`RecomputeError`
  naming the unit and the likely causes, and :func:`is_recomputing` tells hooks that run
  inside a replay from the forward.

Under ``torch.compile`` (dynamo tracing a wrapped model) each call is
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which dynamo turns into its
activation-checkpoint operator; the compiler then decides what to recompute. A unit called
inside someone else's checkpoint (a model with its own gradient checkpointing switched on,
or a replay) runs as it is: only the outermost checkpoint recomputes.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import numbers
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as _ckpt

from remat import _compat
from remat._compat import FakeTensor, tree_flatten, tree_unflatten
from remat.strategies.stages import StageError

_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
_CACHE_ARGS = ("cache", "past_key_value", "past_key_values", "layer_past")

_local = threading.local()
# every compiled segment passes a context_fn to checkpoint (_compile_context_fn)
_compat.quiet_context_fn_notice()


class RecomputeError(_ckpt.CheckpointError):
    """The recompute of a unit did not reproduce what its forward saved for backward."""


class PolicyRefusal(RecomputeError):
    """A strategy's saving policy refuses an op of a unit's forward (``selective``: an
    in-place change of a tensor a recomputed op read before); :class:`Region` raises it
    again naming the unit."""


def is_recomputing() -> bool:
    """Whether the calling code runs inside a remat recompute (the replay of a checkpointed
    unit during backward), e.g. in a forward hook that should count or log only real
    forwards. Thread-local: backward on CUDA runs in autograd's device threads, and so does
    the replay and every hook it calls."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _inside_checkpoint() -> bool:
    """Whether a torch checkpoint (forward or recompute) is active around this call."""
    return _compat.inside_checkpoint()


# --- arguments: key/value caches ------------------------------------------------------

_warned: set[str] = set()


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal(a, b)``; tensors without values (FakeTensorMode traces: the estimate
    and the planner) count as equal, since only a change of version or storage shows
    there (e.g. SwinUNETR's relative position index buffers)."""
    try:
        return torch.equal(a, b)
    except RuntimeError as err:
        if "DataDependentOutput" in type(err).__name__ or "DataDependentOutput" in str(err):
            return True
        raise


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


_POSITIONAL_NAMES: dict[type, tuple[str, ...]] = {}


# under torch.compile dynamo calls it while tracing and keeps the names as constants (a
# functools.cache wrapper would be traced through, with a warning per process)
@torch.compiler.assume_constant_result
def _positional_names(cls: type) -> tuple[str, ...]:
    """Names of the positional parameters of ``cls.forward`` after ``self``."""
    names = _POSITIONAL_NAMES.get(cls)
    if names is None:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]
        except (TypeError, ValueError):
            params = []
        found: list[str] = []
        for p in params:
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                break
            found.append(p.name)
        names = _POSITIONAL_NAMES[cls] = tuple(found)
    return names


def _is_cache_object(value: Any) -> bool:
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_cls = getattr(cache_utils, "Cache", None)
    return cache_cls is not None and isinstance(value, cache_cls)


def drop_cache(module: nn.Module, path: str, args: tuple, kwargs: dict
               ) -> tuple[tuple, dict]:
    """The call's arguments without a key/value cache (see the module docstring).

    A layer that declares ``_can_checkpoint_with_cache = True`` (``transformers``) keeps its
    cache object; ``use_cache`` is switched off either way, as Hugging Face does.
    """
    keep_cache = getattr(module, "_can_checkpoint_with_cache", False) is True
    changed: list[str] = []

    def drop(name: str | None, value: Any) -> Any:
        if name == "use_cache" and value is True:
            changed.append("use_cache=False")
            return False
        if not keep_cache and value is not None and (name in _CACHE_ARGS
                                                     or _is_cache_object(value)):
            changed.append(f"{name or type(value).__name__}=None")
            return None
        return value

    names = _positional_names(type(module))
    new_args = tuple(drop(names[i] if i < len(names) else None, v) for i, v in enumerate(args))
    new_kwargs = {k: drop(k, v) for k, v in kwargs.items()}
    if changed:
        why = ("a key/value cache would be appended to twice" if changed != ["use_cache=False"]
               else "a cache it filled would be filled again by the recompute")
        _warn_once(type(module).__qualname__,
                   f"remat: {type(module).__name__} at '{path}' is recomputed in training, and "
                   f"{why}; it runs with {', '.join(changed)} (as Hugging Face's own "
                   "gradient checkpointing does)")
    return new_args, new_kwargs


# --- norms and other state ------------------------------------------------------------


def refuse_sync_batchnorm(module: nn.Module, path: str) -> None:
    """Raise if recomputing ``module`` would run a SyncBatchNorm collective a second time.

    Raises:
        StageError: names the SyncBatchNorm module and what to do instead.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    for name, m in module.named_modules():
        if isinstance(m, nn.SyncBatchNorm) and m.training and (
                dist.get_world_size(m.process_group) > 1):
            where = f"{path}.{name}" if name else path
            raise StageError(
                f"'{where}' is a SyncBatchNorm inside the recomputed unit '{path}': the "
                "recompute in backward would all-reduce its batch statistics again (one more "
                "collective per layer and step). Train without trainer.sync_batchnorm, leave "
                "this stage out of model.stages, or use strategy=offload (no recompute)")


def fsdp_unit(module: nn.Module) -> Any:
    """The FSDP2 state of ``module`` if it is itself an FSDP unit (``fully_shard``), else
    ``None`` (its parameters belong to an enclosing unit, or none)."""
    return _compat.fsdp_state(module)


def check_fsdp_segment(label: str, first: nn.Module, first_path: str, module: nn.Module,
                       path: str) -> None:
    """Raise if two blocks of one checkpointed segment are in different FSDP units.

    In backward FSDP gathers a unit's parameters when the gradient reaches that unit's
    output; a segment's recompute runs all its blocks as soon as the gradient reaches the
    segment's last block, before the earlier blocks' units are gathered.

    Raises:
        StageError: names the segment and both blocks, and how to shard instead.
    """
    if fsdp_unit(module) is not fsdp_unit(first):
        raise StageError(
            f"segment '{label}' is recomputed as one unit, but its blocks '{first_path}' and "
            f"'{path}' are in different FSDP units (fully_shard): FSDP would not have "
            "gathered the earlier block's parameters when the recompute runs it. Apply the "
            "strategy first and shard afterwards with remat.sharding.shard (one FSDP unit per "
            "segment; trainer=fsdp does this), or use strategy=full or selective (one block "
            "per segment)")


@dataclass(eq=False)
class UnitState:
    """Per-unit knowledge kept between calls (rebuilt after pickling): the buffers its
    forward changes that are not norm statistics (learned at the first call), and whether
    its checkpoint frees nothing (``plain``: the strategy's forward context said
    ``saves_nothing`` after a call), so later calls run without one, and whether a call
    wrote into one of its kept inputs (``writes_inputs``: later calls are watched)."""

    learned: bool = False
    stateful: set[tuple[int, str]] = field(default_factory=set)
    plain: bool = False
    writes_inputs: bool = False  # a call wrote into a kept input (:class:`_InputWrites`)


def _is_norm_stat(module: nn.Module, name: str) -> bool:
    return (name in _STAT_BUFFERS and isinstance(module, _compat.NormBase)
            and module.track_running_stats)


_ABSENT = object()
_OTHER = object()  # an attribute that is not a setting: present, left as it is


#: a tensor attribute up to this many elements is a setting (a scale, a temperature)
_SETTING_NUMEL = 64


def _setting(value: Any) -> bool:
    """A value a forward may read as a setting, which a replay can hand back by reference
    without keeping memory alive: ``None``, a number (numpy's and ``Fraction`` too), string,
    bytes, enum member, ``torch.dtype`` or ``torch.device``, a tensor of at most
    :data:`_SETTING_NUMEL` elements, or a tuple or frozenset of them. Not a list, dict, set
    (changed in place, a reference shows the changes) or larger tensor (a cache)."""
    if value is None or isinstance(value, numbers.Number | str | bytes | enum.Enum
                                   | torch.dtype | torch.device):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() <= _SETTING_NUMEL
    return isinstance(value, tuple | frozenset) and all(_setting(v) for v in value)


def _initialised(buf: Any) -> bool:
    return isinstance(buf, torch.Tensor) and not isinstance(
        buf, torch.nn.parameter.UninitializedBuffer)


class _StateGuard:
    """Before/after one forward call: what its replay must protect (module docstring).

    Args:
        module: the unit called.
        state: what earlier calls of the unit learned.
        generators: ``torch.Generator`` objects passed to the call as arguments (the
            unit's modules' own generators are found here).
    """

    def __init__(self, module: nn.Module, state: UnitState,
                 generators: tuple[torch.Generator, ...] = ()) -> None:
        self.state = state
        # norm modules, not their buffers: a lazy norm creates its statistics in the call
        self.norms: list[nn.Module] = []
        self.snapshot: dict[tuple[nn.Module, str], torch.Tensor] = {}
        self._watch: list[tuple[nn.Module, str, torch.Tensor, int, int]] = []
        # the parameters and buffers the call runs with (functional_call swaps in others
        # and restores the module's own before backward): references, no copies
        self.tensors: list[tuple[dict, str, Any]] = []
        self.scripted = False  # the unit runs TorchScript modules
        # each module's settings before the call (_setting), for the replay
        self.attributes: list[tuple[dict, dict[str, Any]]] = []
        seen: dict[int, torch.Generator] = {id(g): g for g in generators}
        for m in module.modules():
            if isinstance(m, torch.jit.ScriptModule):
                self.scripted = True
                continue  # its state lives in TorchScript's tables (no functional_call)
            table = vars(m)
            self.attributes.append((table, {k: v if _setting(v) else _OTHER
                                            for k, v in table.items()}))
            if isinstance(m, _compat.NormBase) and m.track_running_stats and m.training:
                self.norms.append(m)
            params, buffers = _compat.parameter_table(m), _compat.buffer_table(m)
            self.tensors.extend((params, name, p) for name, p in params.items())
            self.tensors.extend((buffers, name, b) for name, b in buffers.items())
            for value in vars(m).values():
                if isinstance(value, torch.Generator):
                    seen.setdefault(id(value), value)
            for name, buf in buffers.items():
                if not _initialised(buf) or _is_norm_stat(m, name):
                    continue
                self._watch.append((m, name, buf, _compat.tensor_version(buf), buf.data_ptr()))
                if not state.learned or (id(m), name) in state.stateful:
                    self.snapshot[(m, name)] = buf.detach().clone()
        # a generator's state before the call: the replay draws the same numbers
        self.generators = [(g, g.get_state()) for g in seen.values()]

    def finish(self) -> None:
        """After the forward call: learn which buffers it changed. A change through
        ``.data`` bumps no version counter: the first call compares values too, later
        calls the storage (``.data = ...`` assigns a new one)."""
        changed = set()
        for m, name, buf, version, ptr in self._watch:
            if (_compat.buffer_table(m).get(name) is not buf
                    or _compat.tensor_version(buf) != version or buf.data_ptr() != ptr):
                changed.add((id(m), name))
            elif not self.state.learned and not _same_values(buf, self.snapshot[(m, name)]):
                changed.add((id(m), name))
        if not self.state.learned:
            self.state.learned = True
            self.state.stateful = changed
            self.snapshot = {k: v for k, v in self.snapshot.items()
                             if (id(k[0]), k[1]) in changed}
        else:
            self.state.stateful |= changed
        self._watch = []

    def rewind_generators(self) -> None:
        """Set every generator the call drew from back to its state before the call."""
        for gen, before in self.generators:
            gen.set_state(before)

    def rewind_attributes(self, originals: dict[tuple[int, str], tuple[dict, str, Any]]
                          ) -> None:
        """Set the modules' settings to their values before the call, and take away the
        settings the call added (a flag set at a first call, ``self.warm = True``); the
        value each had before the replay goes into ``originals`` (once per attribute), to
        be put back with :func:`_put_back_attributes`."""
        for table, before in self.attributes:
            for name in [n for n in table if n not in before and _setting(table[n])]:
                originals.setdefault((id(table), name), (table, name, table[name]))
                del table[name]
            for name, value in before.items():
                if value is _OTHER:
                    continue
                originals.setdefault((id(table), name), (table, name,
                                                         table.get(name, _ABSENT)))
                table[name] = value


def _put_back_attributes(originals: dict[tuple[int, str], tuple[dict, str, Any]]) -> None:
    for table, name, value in originals.values():
        if value is _ABSENT:
            table.pop(name, None)
        else:
            table[name] = value


@contextlib.contextmanager
def _replaying(guards: list[_StateGuard], norms: bool = True) -> Iterator[None]:
    """During the replay of a region's calls (``guards`` in call order): the parameters and
    buffers each call ran with are in place (``torch.func.functional_call`` restored the
    module's own after the forward), norm statistics write into copies, changed buffers
    start from their values before the first call that changed them; everything restored
    after, the generators the calls drew from included. The copies are made before the
    replay runs (outside any dispatch mode a strategy enters for the recompute), and a
    buffer shared by several calls gets one copy, so later calls see the earlier calls'
    replayed updates as the forward did. ``norms=False`` skips the norm copies, for a
    recompute that runs no op writing them (a strategy's recompute context says so with
    ``rewrites_state``)."""
    swaps: dict[tuple[int, str], tuple[dict, str, Any]] = {}
    for guard in guards:
        for m in guard.norms if norms else ():
            for name in _STAT_BUFFERS:
                table = _compat.buffer_table(m)
                key = (id(table), name)
                if key not in swaps and _initialised(table.get(name)):
                    swaps[key] = (table, name, table[name].clone())
        for (m, name), before in guard.snapshot.items():
            table = _compat.buffer_table(m)
            swaps.setdefault((id(table), name), (table, name, before.clone()))
        for table, name, tensor in guard.tensors:
            if table.get(name) is not tensor:
                swaps.setdefault((id(table), name), (table, name, tensor))
    originals = []
    for table, name, value in swaps.values():
        originals.append((table, name, table.get(name)))
        table[name] = value
    generators = {id(g): (g, g.get_state()) for guard in guards for g, _ in guard.generators}
    try:
        yield
    finally:
        for table, name, value in reversed(originals):
            table[name] = value
        for gen, state in generators.values():
            gen.set_state(state)


# --- regions --------------------------------------------------------------------------


def _autocast_state(device_type: str) -> tuple:
    types = dict.fromkeys((device_type, "cpu"))
    return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types
                 if torch.amp.is_autocast_available(t)) + (torch.is_autocast_cache_enabled(),)


@contextlib.contextmanager
def _autocast(state: tuple) -> Iterator[None]:
    *per_device, cache = state
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in per_device:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                               cache_enabled=cache))
        yield


def _device_type(tensors: list[torch.Tensor]) -> str:
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            return t.device.type
    return "cpu"


def written_tensors(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an ATen op call writes into: its schema's mutable arguments (``self`` of
    ``relu_`` and ``add_``, ``out=``, the running statistics of ``native_batch_norm``)."""
    schema = _compat.op_schema(op, missing_ok=True)
    if schema is None or not schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


def storage_key(t: Any) -> tuple | None:
    """Identity of the memory a tensor lives in (views share it); ``None`` if unknown."""
    if not isinstance(t, torch.Tensor):
        return None
    if isinstance(t, FakeTensor):  # no data pointer (remat.estimate): the storage object's id
        return (t.device, "fake", _compat.storage_id(t))
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # fake, meta, sparse, subclass
        return None
    return (t.device, ptr) if ptr else None


class _InputWrites(_compat.TorchDispatchMode):
    """Over one call of a region: copy each kept input (a tape external) just before an op
    first writes into its storage, and put the copy on the tape, so the replay starts from
    the values the region was given (module docstring). Every kept input of the region is
    watched, not only the call's own: a call may write one through a view an earlier call
    made (``x[:, :, ::1]``, then ``add_``); views of one storage are all copied when any
    of them is written.

    Args:
        tape: the region's tape.
    """

    def __init__(self, tape: _Tape) -> None:
        super().__init__()
        self.tape = tape
        self.watched: dict[tuple, list[int]] = {}
        for i, kept in enumerate(tape.externals):
            key = storage_key(kept)
            if key is not None:
                self.watched.setdefault(key, []).append(i)
        self.copied: dict[int, torch.Tensor] = {}  # external index -> the tensor copied

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.watched:
            for t in written_tensors(func, args, kwargs):
                for i in self.watched.pop(storage_key(t), ()):
                    kept = self.tape.externals[i]
                    if _compat.tensor_version(kept) == self.tape.versions[i]:
                        # below autograd (no graph); later modes (memory trackers) see it
                        self.tape.externals[i] = kept.clone()
                        self.copied[i] = kept
        return func(*args, **kwargs)

    def finish(self) -> None:
        """After the call: the tape knows its copies (no one else holds them, so no
        version check) and whether the tensors copied required grad."""
        for i, kept in self.copied.items():
            self.tape.copies[i] = kept.requires_grad
            self.tape.versions[i] = None


def _writable_copy(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A copy of ``t`` for a replay to write into: with ``requires_grad`` a non-leaf that
    requires grad (the replay then saves what the forward saved; autograd refuses in-place
    writes into a leaf that requires grad), through :class:`_Attach`."""
    copy = t.detach().clone()
    if not requires_grad:
        return copy
    with torch.enable_grad():
        return _Attach.apply(copy, torch.zeros((), device=copy.device, requires_grad=True))


class _Attach(torch.autograd.Function):
    """``copy`` itself, marked written in place by a node that takes ``anchor``: a tensor
    without grad becomes a non-leaf that requires grad, sharing its storage (the replay may
    write into it in place, which autograd refuses on a leaf). Its backward never runs (a
    replay's graph is not differentiated)."""

    @staticmethod
    def forward(ctx: Any, copy: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(copy)
        return copy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


@dataclass(eq=False)
class _Call:
    """One recorded call of a region: how to run it again."""

    path: str
    fn: Callable[..., Any]
    spec: Any
    sources: list[tuple]  # ("c", constant) | ("e", external index) | ("o", call, leaf)
    cpu_rng: torch.Tensor
    device_type: str
    devices: list[int]
    device_rng: list[torch.Tensor]
    autocast: tuple
    guard: _StateGuard


class _Tape:
    """What a region's replay needs. Held by the checkpoint frame (``recompute_fn``); holds
    no reference to the frame or the region, so freeing the autograd graph frees it."""

    def __init__(self, label: str, strategy: str, recompute_ctx: Any,
                 unpack: Callable[[Any], torch.Tensor] | None) -> None:
        self.label = label
        self.strategy = strategy
        self.recompute_ctx = recompute_ctx
        self.unpack = unpack
        self.calls: list[_Call] = []
        self.externals: list[Any] = []
        self.versions: list[int | None] = []
        self.current = label
        self.kept: list[torch.Tensor] = []  # a compiled region's random draws (traces)
        # external index -> requires_grad of the input a call wrote in place (_InputWrites)
        self.copies: dict[int, bool] = {}
        # the forward context's settle while the region's forward may go on (Region.finish)
        self.finish_forward: Callable[[], None] | None = None

    def replay(self, *_inputs: Any) -> None:
        """Run the region's calls again (torch calls this from its unpack hook)."""
        # a compiled region's kept draws (traces) stand for what its recompute makes again
        self.kept.clear()
        if self.finish_forward is not None:  # backward before the segment's last call
            finish, self.finish_forward = self.finish_forward, None
            finish()
        with _recomputing():
            try:
                self._replay()
            except (_compat.StopRecomputationError, RecomputeError):
                raise
            except _ckpt.CheckpointError as err:
                self.raise_named(err)
            except RuntimeError as err:
                if "backward an extra time" not in str(err):
                    self._note(err)
                    raise
                raise RecomputeError(
                    f"remat: '{self.current}' (strategy '{self.strategy}') was recomputed for "
                    "a second backward through the same forward (backward(retain_graph=True) "
                    "run twice, or higher-order gradients, e.g. "
                    "torch.autograd.grad(..., create_graph=True) as MAML's inner step uses): "
                    "selective activation checkpointing keeps each saved op output for one "
                    "backward only (torch's rule). Use strategy=full, sqrtn or every_k for "
                    "this model, or leave this module out of model.stages.") from err
            except Exception as err:
                self._note(err)
                raise

    def _note(self, err: BaseException) -> None:
        if hasattr(err, "add_note"):
            err.add_note(f"remat: raised while recomputing '{self.current}' "
                         f"(strategy '{self.strategy}')")

    def _replay(self) -> None:
        values = []
        for i, (kept, version) in enumerate(zip(self.externals, self.versions, strict=True)):
            value = self.unpack(kept) if self.unpack is not None else kept
            if version is not None and _compat.tensor_version(value) != version:
                raise RecomputeError(
                    f"remat: an input (argument tensor {i}) of the recomputed unit "
                    f"'{self.label}' (strategy '{self.strategy}') was changed in place after "
                    "its forward call, so its recompute would see other values. Make the "
                    "in-place operation out-of-place (e.g. inplace=False, x = x + y).")
            if i in self.copies:  # the replay writes into it again: into a copy of the copy
                value = _writable_copy(value, self.copies[i])
            values.append(value)
        devices = sorted({d for call in self.calls for d in call.devices})
        device_type = next((c.device_type for c in self.calls if c.devices), "cuda")
        outputs: list[list[Any]] = []
        attributes: dict[tuple[int, str], tuple[dict, str, Any]] = {}
        with torch.random.fork_rng(devices=devices, device_type=device_type), \
                _replaying([call.guard for call in self.calls],
                           getattr(self.recompute_ctx, "rewrites_state", True)), \
                self.recompute_ctx, contextlib.ExitStack() as stack:
            stack.callback(_put_back_attributes, attributes)
            for call in self.calls:
                self.current = call.path
                torch.set_rng_state(call.cpu_rng)
                call.guard.rewind_generators()
                call.guard.rewind_attributes(attributes)
                if call.devices:
                    _ckpt.set_device_states(call.devices, call.device_rng,
                                            device_type=call.device_type)
                leaves = [s[1] if s[0] == "c" else values[s[1]] if s[0] == "e"
                          else outputs[s[1]][s[2]] for s in call.sources]
                args, kwargs = tree_unflatten(leaves, call.spec)
                with _autocast(call.autocast):
                    out = call.fn(*args, **kwargs)
                outputs.append(tree_flatten(out)[0])

    def raise_named(self, err: BaseException) -> None:
        """``unpack_error_cb`` of the frame: torch's mismatch error, naming the unit."""
        if isinstance(err, RecomputeError):
            raise err
        raise RecomputeError(
            f"remat: recomputing '{self.current}' (strategy '{self.strategy}') did not save "
            "the same tensors as its forward did. Likely causes: the unit's forward depends "
            "on data or state that changed between forward and backward (a data-dependent "
            "router or branch, a counter, cache or buffer the forward mutates, a module "
            "switched between train() and eval() before backward), or a nondeterministic op. "
            "Leave this module out of model.stages, or make its forward depend only on its "
            f"inputs and parameters. torch said: {err}") from err


class Region:
    """One checkpointed segment: the calls that share a checkpoint frame (module
    docstring). ``label`` names it in errors (a unit path, or ``chain[start:end]``)."""

    def __init__(self, strategy: Any, label: str, segment: int | None = None) -> None:
        contexts = strategy.checkpoint_contexts
        forward_ctx, recompute_ctx = (contexts() if contexts is not None
                                      else (contextlib.nullcontext(), contextlib.nullcontext()))
        hooks = strategy.boundary_hooks()
        self._pack = hooks[0] if hooks is not None else None
        self.tape = _Tape(label, strategy.name, recompute_ctx,
                          hooks[1] if hooks is not None else None)
        self.forward_ctx = forward_ctx
        self.frame = _compat.new_checkpoint_frame(self.tape.replay, self.tape.raise_named)
        self.segment = segment
        self.last_index = -1
        # whether the current call is the region's last (a chain's segment sets it per call)
        self.closing = True
        self.wraps: list[Any] = []
        self.tape.finish_forward = getattr(forward_ctx, "finish", None)
        self._first: tuple[nn.Module, str] | None = None  # its first block (FSDP check)
        self._outputs: list[list[tuple[weakref.ref, int] | None]] = []
        self._externals: dict[int, tuple[weakref.ref, int]] = {}

    def _source(self, t: torch.Tensor) -> tuple:
        for ci in range(len(self._outputs) - 1, -1, -1):
            for li, entry in enumerate(self._outputs[ci]):
                if entry is not None and entry[0]() is t and _compat.tensor_version(t) == entry[1]:
                    return ("o", ci, li)
        hit = self._externals.get(id(t))
        if hit is not None and hit[0]() is t:
            return ("e", hit[1])
        tape = self.tape
        index = len(tape.externals)
        packed = self._pack(t) if self._pack is not None else t
        if packed is not t:
            tape.externals.append(packed)
            tape.versions.append(None)  # a copy: later in-place changes do not reach it
        else:  # kept as it is (offload: a tensor already in host memory stays itself)
            tape.externals.append(t)
            tape.versions.append(_compat.tensor_version(t))
        self._externals[id(t)] = (weakref.ref(t), index)
        return ("e", index)

    def call(self, module: nn.Module, wrap: Any, forward: Callable[..., Any], args: tuple,
             kwargs: dict) -> Any:
        """Run one call of a unit inside this region and record how to replay it."""
        if self._first is None:
            self._first = (module, wrap.path)
        elif self._first[0] is not module:
            check_fsdp_segment(self.tape.label, *self._first, module, wrap.path)
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        sources = [self._source(leaf) if isinstance(leaf, torch.Tensor) else ("c", leaf)
                   for leaf in leaves]
        device_type = _device_type(tensors)
        devices, device_rng = (_ckpt.get_device_states(*tensors) if device_type != "cpu"
                               else ([], []))
        if wrap.state is None:
            wrap.state = UnitState()
        guard = _StateGuard(module, wrap.state, tuple(
            leaf for leaf in leaves if isinstance(leaf, torch.Generator)))
        self.tape.calls.append(_Call(wrap.path, forward, spec, sources, torch.get_rng_state(),
                                     device_type, devices, device_rng,
                                     _autocast_state(device_type), guard))
        if guard.scripted:
            # torch's early stop ends a recompute by raising inside it; the TorchScript
            # interpreter turns that into an empty RuntimeError, so run the replay through
            self.frame.early_stop = False
        # a call that may write into a kept input (a unit's first call, and every call of a
        # unit that did): copied before the write. Entered below the strategy's own modes,
        # so a selective region's cache does not see the copy.
        writes: Any = contextlib.nullcontext()
        if not wrap.state.learned or wrap.state.writes_inputs:
            watch = _InputWrites(self.tape)
            writes = watch if watch.watched else writes
        note_inputs = getattr(self.forward_ctx, "note_inputs", None)
        if note_inputs is not None:  # selective: in-place ops on them run again
            note_inputs([leaf for leaf, source in zip(leaves, sources, strict=True)
                         if source[0] == "e" and isinstance(leaf, torch.Tensor)])
        draws = _CompiledDraws() if _as_compiled.on else contextlib.nullcontext()
        try:
            with _compat.checkpoint_hook(self.frame), writes, self.forward_ctx, draws:
                out = forward(*args, **kwargs)
        except PolicyRefusal as err:
            raise RecomputeError(f"remat: unit '{wrap.path}' (strategy "
                                 f"'{self.tape.strategy}'): {err}") from err
        if isinstance(writes, _InputWrites) and writes.copied:
            writes.finish()
            for kept in writes.copied.values():
                self._externals.pop(id(kept), None)  # its later values are not the copy's
            wrap.state.writes_inputs = True
            # a parameterless writer (an in-place activation) joins the segment before it,
            # which then recomputes its input instead of keeping a copy; a block with
            # parameters keeps the copy: blocks that each write their input (x += pos)
            # would join the whole chain into one segment, whose recompute peaks above none
            if (wrap.chain is not None and len(self.tape.calls) == 1
                    and next(module.parameters(), None) is None):
                wrap.chain.join_writer(wrap, self)
        if isinstance(draws, _CompiledDraws) and draws.nbytes:
            # what the compiled region keeps of its random draws, alive until its backward
            self.tape.kept.append(torch.empty(draws.nbytes, dtype=torch.uint8,
                                              device=draws.device))
        self.frame.forward_completed = True
        guard.finish()
        self.wraps.append(wrap)
        if self.closing:
            self.finish()
        self._outputs.append([(weakref.ref(t), _compat.tensor_version(t))
                              if isinstance(t, torch.Tensor) else None
                              for t in tree_flatten(out)[0]])
        return out

    def finish(self) -> None:
        """The region's forward is over (its last call ran, or the chain moved on): the
        strategy's forward context settles what it keeps (selective), and if the region
        keeps what autograd would have anyway (``saves_nothing``), its units run without a
        checkpoint from the next call on."""
        finish, self.tape.finish_forward = self.tape.finish_forward, None
        if finish is not None:
            finish()
        if self.wraps and getattr(self.forward_ctx, "saves_nothing", False):
            for wrap in self.wraps:
                wrap.state.plain = True
        self.wraps = []


class ChainPlan:
    """The planned segments of one chain stage and the segment region open now.

    Args:
        path: the chain's dotted path.
        bounds: half-open member ranges, one per segment, partitioning the chain.
        joins: every segment recomputes with the same strategy (a fixed strategy's chain,
            not a plan's mix of kept, offloaded and recomputed segments): a segment whose
            first block writes its input in place may join the one before it
            (:meth:`join_writer`).
    """

    def __init__(self, path: str, bounds: list[tuple[int, int]], joins: bool = False) -> None:
        self.path = path
        self.joins = joins
        self.bounds: list[tuple[int, int]] = []
        self._set_bounds(bounds)
        self._open: Region | None = None
        self.position = -1  # the member position of the chain's last call in this forward

    def _set_bounds(self, bounds: list[tuple[int, int]]) -> None:
        # in place: the strategy's report holds this list (segments joined later show)
        self.bounds[:] = bounds
        self.segment_of = [i for i, (start, end) in enumerate(self.bounds)
                           for _ in range(start, end)]

    def join_declared_writers(self, members: list[nn.Module]) -> None:
        """Before the first forward, join each segment but the first whose first block is a
        parameterless module that declares ``inplace=True`` (``nn.ReLU(inplace=True)``,
        ``nn.Hardswish(inplace=True)``, ``nn.Dropout(inplace=True)``) to the one before it:
        what :meth:`join_writer` does once such a block has written its input, here without
        the copy of that input the first step would keep until its backward (``full`` on a
        chain of convolution, BatchNorm and ``ReLU(inplace=True)`` layers, 128 px: 56.1 MiB at
        the first step against 40.1 at the later ones and under ``none``). Blocks that write
        without declaring it are still found at their first call.

        Args:
            members: the chain's blocks, in member order (``len(members)`` members).
        """
        if not self.joins:
            return
        bounds = list(self.bounds)
        segment = 1
        while segment < len(bounds):
            first = members[bounds[segment][0]]
            if (getattr(first, "inplace", False) is True
                    and next(first.parameters(), None) is None):
                bounds[segment - 1:segment + 1] = [(bounds[segment - 1][0], bounds[segment][1])]
            else:
                segment += 1
        self._set_bounds(bounds)

    def join_writer(self, wrap: Any, region: Region) -> None:
        """Member ``wrap`` starts segment ``region.segment`` and wrote its input in place
        (:class:`_InputWrites` copied it for this call): from the next forward on, its
        segment joins the one before it, whose replay makes that input again, or, at the
        chain's start, the member runs without a checkpoint and the rest of its segment
        stays one. The same as :func:`remat.planner.search.replayable_segments`."""
        segment = region.segment
        if not self.joins or segment is None or self.bounds[segment][0] != region.last_index:
            return
        start, end = self.bounds[segment]
        bounds = list(self.bounds)
        if segment > 0:
            bounds[segment - 1:segment + 1] = [(bounds[segment - 1][0], end)]
            done = f"joins the one before it, {self.path}[{bounds[segment - 1][0]}:{start}]"
        else:
            bounds[0:1] = [(0, 1)] + ([(1, end)] if end > 1 else [])
            wrap.state.plain = True
            done = "runs without a checkpoint (the chain's first block)"
        self._set_bounds(bounds)
        if self._open is not None:
            self._open.finish()
        self._open = None
        # once per chain: a chain of ReLU(inplace=True) blocks would give a line per block
        _warn_once(f"writer:{id(self)}:{self.path}",
                   f"remat: '{wrap.path}' writes its input in place (e.g. inplace=True): "
                   f"its segment {self.path}[{start}:{end}] {done}, so its recompute "
                   "starts from values the forward did not overwrite; the segments of "
                   f"{repr(self.path) if self.path else 'the model'} are now {self.bounds} "
                   "(later blocks of this chain that write their input join the same way, "
                   "without another warning)")

    def member_index(self, wrap: Any) -> int:
        """The chain position of this call of ``wrap``'s module: its own, or, for a module
        the chain holds several times, the first of its positions after the chain's last
        call (back to its first position once the chain has gone past them all)."""
        if not wrap.indices:
            return wrap.index
        return next((i for i in wrap.indices if i > self.position), wrap.indices[0])

    def region_for(self, strategy: Any, wrap: Any) -> Region:
        """The region a call of member ``wrap`` joins (at :meth:`member_index`): the open
        region of its segment if the call moves forward in it, else a new one."""
        index = self.member_index(wrap)
        self.position = index
        segment = self.segment_of[index]
        start, end = self.bounds[segment]
        region = self._open
        if region is None or region.segment != segment or index <= region.last_index:
            if region is not None:
                region.finish()
            label = (f"{wrap.path}" if end - start == 1 and not wrap.indices
                     else f"{self.path}[{start}:{end}]")
            region = Region(strategy, label, segment)
        region.last_index = index
        region.closing = index >= end - 1
        self._open = None if region.closing else region
        return region

    def close(self) -> None:
        """End the open segment (after the model's forward): later calls start new ones."""
        if self._open is not None:
            self._open.finish()
        self._open = None
        self.position = -1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": None, "position": -1}


def _checkpoint_call(forward: Callable[..., Any], args: tuple, kwargs: dict,
                     context_fn: Callable[[], tuple] | None) -> Any:
    """``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` of one call (keyword
    arguments bound first, so they cannot clash with checkpoint's own)."""
    fn = functools.partial(forward, **kwargs) if kwargs else forward
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return _ckpt.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **extra)


def draws_random_numbers(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an ATen op call draws from the RNG: tagged ``nondeterministic_seeded`` and
    not switched off by a zero ``p``/``dropout_p`` or ``train=False`` (attention ops carry
    the tag even without dropout)."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    schema = _compat.op_schema(op, missing_ok=True)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        value = kwargs.get(arg.name, args[i] if i < len(args) else arg.default_value)
        if arg.name == "train" and value is False:
            return False
        if (arg.name in ("p", "dropout_p") and isinstance(value, numbers.Real)
                and not isinstance(value, bool) and value == 0):
            return False
    return True


def kept_draw_bytes(op: Any, args: tuple, out: Any) -> int:
    """Bytes a compiled recomputed region keeps of one call of ``op`` that draws random
    numbers (:func:`compiled_region_contexts`: the draw and what is computed from it alone):
    a dropout's bool mask (one byte an element of its output, also for the ``bernoulli_``
    eager dropout draws with on the CPU; an attention kernel's dropout: one per score,
    ``batch x heads x queries x keys`` from its query and key), else the op's output itself
    (noise from ``randn``: its bytes)."""
    name = str(getattr(op, "__name__", op))
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if "attention" in name and len(args) > 1 and all(isinstance(a, torch.Tensor)
                                                     for a in args[:2]):
        query, key = args[0], args[1]
        return int(query.shape[:-1].numel() * key.shape[-2])
    if not tensors:
        return 0
    if "dropout" in name or "bernoulli" in name:  # eager CPU dropout: bernoulli_ of floats
        return int(tensors[0].numel())
    return int(tensors[0].numel() * tensors[0].element_size())


class _CompiledDraws(_compat.TorchDispatchMode):
    """Counts, over one region's forward, :func:`kept_draw_bytes` of its random ops."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.device: torch.device | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if draws_random_numbers(func, args, kwargs):
            self.nbytes += kept_draw_bytes(func, args, out)
            first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)),
                         None)
            if first is not None and self.device is None:
                self.device = first.device
        return out


class _AsCompiled(threading.local):
    on = False


_as_compiled = _AsCompiled()


def trace_as_compiled(on: bool) -> None:
    """Make the eager recomputed regions of this thread hold, from their forward to their
    backward, the bytes a compiled region keeps of its random draws
    (:func:`kept_draw_bytes`): a trace (``remat.measure``) of an eager step then sees the
    compiled step's memory. The planner sets it in its trace processes for ``compile=true``
    (``gpt_small``, 512 tokens, batch 2, dropout 0.1: compiled ``full`` 185.4 MiB, eager
    143.4, the attention masks)."""
    _as_compiled.on = bool(on)


def _keep_random(policy: Callable[..., Any], ctx: Any, op: Any, *args: Any,
                 **kwargs: Any) -> Any:
    if draws_random_numbers(op, args, kwargs):
        return _ckpt.CheckpointPolicy.MUST_SAVE
    return policy(ctx, op, *args, **kwargs)


def compiled_region_contexts(context_fn: Callable[[], tuple] | None, segment: str | None,
                             position: int) -> tuple:
    """The ``context_fn`` of one recomputed call under ``torch.compile`` (dynamo takes it
    as a ``functools.partial`` of constants): the SAC pair of ``context_fn`` (``None``: the
    pair dynamo gives a plain checkpoint, every op ``PREFER_RECOMPUTE``), with

    - every op that draws random numbers ``MUST_SAVE``: recomputed, it would run again in
      the backward, where inductor's replay of the forward's RNG state does not give the
      numbers its own forward kernels drew (a ViT with stochastic depth, compiled with
      inductor, plan of selective and kept blocks: gradients 2.2 relative error off
      eager's; torch's partitioner under a memory budget has the same fault,
      pytorch/pytorch#190758); the ``compile`` strategy keeps them for the same reason.
      Only the random numbers and what is computed from them alone are kept (a dropout's
      bool mask, :func:`remat._compat.region_context`), the rest of the op's call is
      recomputed (kept whole, a dropout kept its float output, and an attention call with
      dropout every intermediate of its decomposed kernel);
    - for a member of a segment of several blocks (``segment``, its chain ``position``),
      the segment's region id (:func:`remat._compat.region_context`): the partitioner would
      keep every value passed between two checkpointed calls, every block's input, as
      ``full`` does (compiled ``sqrtn`` kept ``full``'s inputs: 96.6 against 71.4 MiB
      eager on a 36-block MLP; 71.1 with one region per segment)."""
    forward_mode, recompute_mode = (context_fn() if context_fn is not None
                                    else _compat.prefer_recompute_contexts())
    rest = getattr(forward_mode, "policy_fn", None)
    for mode in (forward_mode, recompute_mode):
        policy = getattr(mode, "policy_fn", None)
        if policy is not None:
            mode.policy_fn = functools.partial(_keep_random, policy)
    _compat.region_context(forward_mode, segment, position, draws_random_numbers, rest)
    return forward_mode, recompute_mode


def _compile_context_fn(strategy: Any, wrap: Any) -> Callable[[], tuple]:
    """The ``context_fn`` of one call under ``torch.compile``:
    :func:`compiled_region_contexts` of the strategy's, joined to its segment where the
    call is a member of a segment of several blocks."""
    context_fn = strategy.compile_context_fn()
    chain, segment = wrap.chain, None
    if chain is not None and not wrap.indices:
        index = chain.segment_of[wrap.index]
        start, end = chain.bounds[index]
        if end - start > 1:
            segment = f"{id(chain)}:{index}"
    return functools.partial(compiled_region_contexts, context_fn, segment, wrap.index)


def run_recomputed(strategy: Any, module: nn.Module, wrap: Any, forward: Callable[..., Any],
                   args: tuple, kwargs: dict) -> Any:
    """The runner of every recomputing strategy (``full``, ``sqrtn``, ``every_k``,
    ``selective``, ``offload`` with segments): one training call with grad of a unit.

    Raises:
        StageError: the unit holds a SyncBatchNorm that would sync again in the recompute.
    """
    args, kwargs = drop_cache(module, wrap.path, args, kwargs)
    if torch.compiler.is_compiling():
        return _checkpoint_call(forward, args, kwargs, _compile_context_fn(strategy, wrap))
    if _inside_checkpoint():
        return forward(*args, **kwargs)
    wrap.calls += 1
    refuse_sync_batchnorm(module, wrap.path)
    if wrap.state is not None and wrap.state.plain:
        return forward(*args, **kwargs)
    region = (wrap.chain.region_for(strategy, wrap) if wrap.chain is not None
              else Region(strategy, wrap.path))
    return region.call(module, wrap, forward, args, kwargs)
