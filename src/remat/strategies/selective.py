"""``selective``: inside each block, save the outputs of expensive ops and recompute the rest.

Every block of every chain is its own checkpointed segment (as in ``full``), but the
checkpoint runs under ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with a
``CheckpointPolicy`` per op: an op marked ``MUST_SAVE`` keeps its output from the forward
pass, an op marked ``PREFER_RECOMPUTE`` runs again in backward (PyTorch documentation,
"torch.utils.checkpoint", selective activation checkpoint,
https://docs.pytorch.org/docs/stable/checkpoint.html).

Presets (``policy``):

``matmul``
    Save the outputs of matrix multiplies, convolutions and scaled-dot-product attention;
    recompute norms, activations, dropout and other pointwise ops, which cost few FLOPs per
    byte they would keep. torchtitan's "selective op" activation checkpointing saves a
    similar set (``aten.mm`` and the SDPA kernels; pytorch/torchtitan).
``attention``
    Recompute only the attention core (SDPA kernels, softmax, the attention ``bmm`` /
    ``baddbmm``, and the cheap ops applied to their results before the next matmul: score
    scaling, masking, attention dropout) and save everything else. This is Megatron-LM's
    selective activation recompute (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", arXiv 2205.05198, sec. 4.2): the attention
    core keeps O(s^2) activations per head but costs few FLOPs to redo.
``ops``
    Save the outputs of the ops listed in ``ops`` (``"aten.mm"``, ``"aten.convolution"``,
    ...), recompute every other op.

Never more than ``none``. Whatever the preset, a block keeps at most what autograd itself
would have kept for it: the policy's "save" decisions are candidates, and at the end of the
block's forward, a candidate whose output autograd did not save for backward (seen through a
saved-tensor hook under the checkpoint's) is turned into a recompute, and so is a saved op
whose output a recomputed op needs but autograd does not (:meth:`RegionPolicy.settle`). A
matmul output autograd does not save stays cached only where a simulation of the block's
recompute in backward (when every tensor autograd saved comes back) finds it held no longer
than the block's bytes under ``none`` allow. So ``attention`` on
a fused-SDPA block saves the projections and keeps no softmax statistics, and on a
convolution block (no attention core) it saves what autograd saves and recomputes the rest.

Autocast. Under ``torch.autocast`` the block runs with the autocast weight cache off, in the
forward and in the recompute alike, so a weight cast before the block (a tied embedding, a
``no_grad`` teacher or EMA pass in the same autocast region) is cast again inside it and the
recompute sees the same ops as the forward.

A few more rules keep the function the same:

- ops that draw random numbers (dropout, SDPA with ``dropout_p > 0``) are recomputed, so the
  recompute, which starts from the forward's RNG state, draws the same numbers in the same
  order (a saved random op would shift the stream for the random ops after it);
- views and tensor factories (``empty_like``, ``ones``, ...) are recomputed: they keep no
  information worth memory;
- an in-place op is saved when it changes a saved tensor (its result is then the saved
  value) and recomputed when it changes a recomputed one, so the recompute sees the same
  values as the forward. The ``clone`` autograd takes of a saved tensor (or of a view of one)
  before an in-place op whose backward needs the old values (``silu_``, ``hardtanh_``, as in
  EfficientNet and MobileNet blocks, ``mul_`` on a chunk of a GRU cell's gates) is saved
  too. Views whose schema does not say so (``unsafe_chunk``, ``_unsafe_view``) count as
  views of the storage they live in. Any other recomputed op that read a
  saved tensor before an in-place op changed it cannot be replayed: the forward raises
  :class:`RuntimeError` naming both ops. (Changes made to a block's output after the block
  returns are outside the policy's view.)
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import flop_registry as _flop_registry

from remat import _compat
from remat._compat import tree_flatten, tree_map, tree_unflatten
from remat.strategies.recompute import PolicyRefusal, storage_key
from remat.strategies.segmented import RecomputeStrategy
from remat.strategies.segments import every_k_segments

POLICIES = ("matmul", "attention", "ops")

_SAVE = CheckpointPolicy.MUST_SAVE
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


def _sdpa_names() -> list[str]:
    """Every forward SDPA op of the running torch (fused kernels and the math fallback)."""
    names = [n for n in dir(torch.ops.aten)
             if n.startswith("_scaled_dot_product_") and not n.endswith("_backward")]
    return ["scaled_dot_product_attention", *sorted(names)]


def _packets(names: Iterable[str]) -> frozenset:
    """The ``torch.ops.aten`` overload packets of ``names`` that exist in this torch."""
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


# Matmul-like ops as they reach the dispatcher (``linear`` and ``matmul`` usually decompose
# into ``addmm``/``mm``/``bmm`` above it, ``conv2d`` into ``convolution``).
_MATMUL = _packets(["mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "matmul", "linear",
                    "convolution", "_convolution"])
_SDPA = _packets(_sdpa_names())
_SOFTMAX = _packets(["softmax", "_softmax", "_safe_softmax", "_masked_softmax"])
# The attention core: its outputs are recomputed under ``attention``.
_ATTENTION_CORE = _SDPA | _SOFTMAX | _packets(["bmm", "baddbmm"])
# Matmuls outside the attention core: they end the core's reach under ``attention``.
_PROJECTIONS = _MATMUL - _ATTENTION_CORE
# Factories that read at most the metadata of their tensor arguments.
_FACTORIES = _packets(["empty_like", "zeros_like", "ones_like", "full_like", "new_empty",
                       "new_empty_strided", "new_zeros", "new_ones", "new_full"])


def _op_name(op) -> str:
    return f"aten.{op.__name__}" if hasattr(op, "__name__") else str(op)


def resolve_ops(names: Sequence[str]) -> frozenset:
    """Resolve op names to ``torch.ops.aten`` overload packets (or single overloads).

    Accepted spellings: ``"aten.mm"``, ``"torch.ops.aten.mm"``, ``"mm"``, and
    ``"aten.add.Tensor"`` for one overload.

    Raises:
        ValueError: a name that is not an aten op (the message names it and close names),
            or an op that draws random numbers (those are always recomputed).
    """
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ValueError(f"strategy selective: ops must be a list of op names such as "
                         f"['aten.mm', 'aten.convolution'], got {names!r}")
    resolved = set()
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"strategy selective: op names must be non-empty strings, "
                             f"got {name!r}")
        parts = name.removeprefix("torch.ops.").removeprefix("aten.").split(".")
        op = getattr(torch.ops.aten, parts[0], None) if len(parts) <= 2 else None
        if op is not None and len(parts) == 2:
            op = getattr(op, parts[1], None)
        if not isinstance(op, _compat.OpOverloadPacket | _compat.OpOverload):
            close = difflib.get_close_matches(parts[0], dir(torch.ops.aten), n=4, cutoff=0.7)
            hint = f"; close names: {', '.join('aten.' + c for c in close)}" if close else ""
            raise ValueError(f"strategy selective: unknown op '{name}' in ops (expected "
                             f"'aten.<name>' or 'aten.<name>.<overload>'){hint}")
        overloads = ([getattr(op, o) for o in op.overloads()]
                     if isinstance(op, _compat.OpOverloadPacket) else [op])
        if any(torch.Tag.nondeterministic_seeded in o.tags and "dropout_p" not in
               [a.name for a in _compat.op_schema(o).arguments] for o in overloads):
            raise ValueError(f"strategy selective: op '{name}' draws random numbers; it is "
                             "always recomputed (the recompute replays the forward's random "
                             "stream), so it cannot be listed in ops")
        resolved.add(op)
    return frozenset(resolved)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _is_random(op, args, kwargs) -> bool:
    """Whether the op draws from the RNG (SDPA only when its ``dropout_p`` is not zero)."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for i, arg in enumerate(_compat.op_schema(op).arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return bool(value)
    return True


def _is_backup_of_saved(policy: RegionPolicy, args, kwargs) -> bool:
    """Whether ``clone`` copies a saved tensor, or a view of one, as it is (the backup
    autograd takes before an in-place op: a GRU cell's ``mul_`` on a chunk of its saved
    gates), not into another layout (``.contiguous()``)."""
    t = args[0] if args else None
    if not isinstance(t, torch.Tensor) or not policy.saved.get(policy.key(t)):
        return False
    return kwargs.get("memory_format") in (None, torch.preserve_format)


@dataclass(eq=False)
class _Op:
    """One op of a block's forward as the policy saw it (for :meth:`RegionPolicy.finish`):
    where torch's SAC storage files its output, the storages it made, read and wrote, the
    shapes of its output (for a placeholder) and its FLOPs."""

    key: object
    index: int
    save: bool
    made: list[tuple]
    reads: list[tuple]
    writes: list[tuple]
    meta: Any
    flops: int
    alias: bool
    random: bool


def op_flops(op, args, kwargs, out) -> int:
    """FLOPs of one op by torch's own formulas (``torch.utils.flop_counter``), 0 if none."""
    formula = _flop_registry.get(op.overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that does not fit this overload
        return 0


def _meta(out, key: Callable[[torch.Tensor], tuple | None]) -> Any:
    return tree_map(lambda t: _Unread(t, key(t)) if isinstance(t, torch.Tensor) else t, out)


class _Unread:
    """A cached SAC entry for an op output the recompute never reads: instead of running
    the op again, the recompute gets an uninitialised tensor of the same shape, strides,
    dtype and device (strides matter: ops such as ``reshape`` copy or view by them). It is
    allocated only when the recompute asks, so the forward keeps nothing for it. Duck-types
    torch's ``_VersionWrapper`` (``get_val``)."""

    __slots__ = ("shape", "stride", "dtype", "device", "storage")

    def __init__(self, t: torch.Tensor, storage: tuple | None) -> None:
        self.shape, self.stride = tuple(t.shape), tuple(t.stride())
        self.dtype, self.device = t.dtype, t.device
        self.storage = storage

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


class _Value:
    """A non-tensor output in the SAC cache (torch's ``_VersionWrapper`` for a constant)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def get_val(self, allow_cache_entry_mutation: bool) -> Any:
        return self.value


def _placeholder(meta: Any) -> Any:
    return tree_map(lambda leaf: leaf if isinstance(leaf, _Unread) else _Value(leaf), meta)


def _without(entry: Any, op: _Op, dead: set[tuple]) -> Any:
    """A cached SAC entry with the outputs in ``dead`` storages replaced by placeholders."""
    leaves, spec = tree_flatten(entry)
    metas = tree_flatten(op.meta)[0]
    return tree_unflatten([m if isinstance(m, _Unread) and m.storage in dead else leaf
                           for leaf, m in zip(leaves, metas, strict=True)], spec)


class RegionPolicy:
    """The policy function of one checkpointed block: per-op decisions of one forward.

    It tracks, per storage, whether the block saved or will recompute it, so that in-place
    ops and the ``attention`` core can be decided consistently, and which storages autograd
    saved for backward (``packed``, filled by :func:`_record_packs`), so that
    :meth:`finish` keeps no more than autograd would have (see the module docstring).
    """

    def __init__(self, decide: Callable[[object, bool], bool], follow_core: bool) -> None:
        self.decide = decide          # (op overload, reads the attention core) -> save?
        self.follow_core = follow_core
        self.saved: dict[tuple, bool] = {}     # storage -> saved (True) or recomputed
        self.core: set[tuple] = set()          # storages derived from the attention core
        self.read_by_recompute: dict[tuple, str] = {}
        self.decisions: list[CheckpointPolicy] = []
        self.replayed = 0
        self.produced: dict[tuple, int] = {}   # storage made by an op of the block -> bytes
        self.written: set[tuple] = set()       # storages changed in place
        self.packed: set[tuple] = set()        # storages autograd saved for backward
        self.inputs: set[tuple] = set()        # storages of the block's kept inputs
        self.ops: list[_Op] = []
        # a freed storage's address is reused by later tensors: a storage is its address
        # plus how many storages were made there before (see key())
        self._generation: dict[tuple, int] = {}
        self.rewrites_state = True  # until finish() knows better
        self.saves_nothing = False
        self._counts: dict[object, int] = {}
        self._last: tuple[list, list] = ([], [])
        self._views: list[bool] = []  # per return of the last op: in an argument's storage

    def note_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """The tensors a call of the block gets that its region keeps (not outputs of its
        earlier calls): an in-place op on one of them runs again in the replay."""
        self.inputs.update(k for k in map(self.key, tensors) if k is not None)

    def key(self, t, new: bool = False) -> tuple | None:
        """Identity of the storage ``t`` lives in for this block's forward; ``new`` when an
        op has just made it (the address may have held an earlier, freed storage)."""
        raw = storage_key(t)
        if raw is None:
            return None
        if new:
            self._generation[raw] = self._generation.get(raw, 0) + 1
        return (raw, self._generation.get(raw, 0))

    def __call__(self, ctx: SelectiveCheckpointContext, op, *args, **kwargs):
        if ctx.is_recompute:  # torch versions that ask again in recompute: same answers
            self.replayed += 1
            return self.decisions[self.replayed - 1]
        out = getattr(ctx, "op_output", None)
        decision = self._decide(op, args, kwargs, out)
        self.decisions.append(decision)
        key = _compat.sac_storage_key(op, args)
        index = self._counts.get(key, 0)
        self._counts[key] = index + 1
        reads, writes = self._last
        if op.overloadpacket in _FACTORIES:
            # empty_like(x) and kin read only x's shape, strides and dtype, which a
            # placeholder for an unread x has too (_Unread): x need not be kept for them
            reads = []
        schema = _compat.op_schema(op)
        views = self._views
        made = [k for view, value in zip(views, _tensors_per_return(out, schema),
                                         strict=False) if not view
                for k in map(self.key, value) if k is not None]
        self.ops.append(_Op(key, index, decision is _SAVE, made, reads, writes,
                            _meta(out, self.key),
                            op_flops(op, args, kwargs, out),
                            any(views), _is_random(op, args, kwargs)))
        return decision

    def settle(self) -> tuple[set[int], set[int], set[tuple]]:
        """After the block's forward, what the block keeps (module docstring):

        1. the "save" decisions with an output autograd saved for backward (or that an
           in-place op changed) stay cached;
        2. an output nothing in the recompute reads (every op reading it is cached, or
           itself unread) is not kept: a cached op keeps only its other outputs (a
           BatchNorm its statistics), an op with no output left read gets a placeholder
           instead of running again;
        3. a cached op that would still keep an output autograd did not save (one a
           recomputed op reads: a norm's output feeding a recomputed drop-path product)
           runs again instead, as long as it changes nothing in place and reads nothing
           changed in place later; repeated until no such op is left;
        4. a "save" decision left to run again (an output autograd does not save: a
           projection feeding a residual sum, attention scores feeding a softmax) stays
           cached after all, most FLOPs per byte first, where a simulation of the
           recompute (the cache, each recomputed output until its last reader, the saved
           tensors as they come back) finds its fullest moment no higher than the larger
           of the bytes autograd saves for the block and that moment with no such output
           cached, and the cache leaves free the bytes by which that moment (with none
           cached) exceeds what autograd saves; every other "save" decision runs again.

        So the block holds no more than ``none`` does for it, in the forward and in its
        recompute: caching every such output within the forward's bytes alone (as this
        method once did) held the scores beside the recomputed tensors in backward, and
        ``selective`` peaked 2% above ``none`` on MONAI's SwinUNETR 3D.

        Returns ``(cached, dead_ops, dead)``: indices into ``ops`` of the ops whose outputs
        stay cached, of the ops that get a placeholder, and the storages not kept. Reads
        only what the forward recorded, so the planner's profile
        (:mod:`remat.planner.profile`) asks it too.
        """
        needed = self.packed | self.written
        ops = self.ops
        cached = {i for i, op in enumerate(ops)
                  if op.save and any(k in needed for k in op.made + op.writes)}
        readers: dict[tuple, list[int]] = {}
        for i, op in enumerate(ops):
            if op.alias and not op.writes:
                continue  # a view: its readers read the same storage
            for k in op.reads + op.writes:
                readers.setdefault(k, []).append(i)

        def unread() -> tuple[set[int], set[tuple]]:
            """Ops with no output read in the recompute, and unread storages."""
            dead_ops: set[int] = set()
            dead: set[tuple] = set()
            for i in range(len(ops) - 1, -1, -1):
                op = ops[i]
                if op.alias or op.random:
                    continue
                for k in op.made:
                    if k not in needed and all(j in cached or j in dead_ops
                                               for j in readers.get(k, ()) if j != i):
                        dead.add(k)
                if i not in cached and op.made and all(k in dead for k in op.made):
                    dead_ops.add(i)
            return dead_ops, dead

        def recompute_peak(dead_ops: set[int], dead: set[tuple]) -> int:
            """Bytes of the block's own tensors held at the fullest moment of its recompute
            (in backward): the cache, the tensors autograd saved as they come back, and
            each other output until its last reader in the recompute has run (torch's
            cache hands each entry over once, so a consumed entry is freed)."""
            last: dict[tuple, int] = {}
            for k, js in readers.items():
                for j in reversed(js):  # readers are in op order
                    if j not in cached and j not in dead_ops:
                        last[k] = j
                        break
            live: dict[tuple, int] = {}
            frees: dict[int, list[tuple]] = {}  # op index -> storages freed after it
            for i in cached:
                for k in ops[i].made:
                    if k not in dead and k not in live:
                        live[k] = self.produced.get(k, 0)
                        if k not in needed:
                            frees.setdefault(last.get(k, -1), []).append(k)
            total = peak = sum(live.values())
            for k in frees.pop(-1, ()):
                total -= live.pop(k)
            for i, op in enumerate(ops):
                if not (i in cached or op.alias):
                    made = {k: self.produced.get(k, 0) for k in op.made if k not in live}
                    peak = max(peak, total + sum(made.values()))
                    if i not in dead_ops:
                        for k, n in made.items():
                            live[k] = n
                            total += n
                            if k not in needed:
                                frees.setdefault(max(last.get(k, i), i), []).append(k)
                for k in frees.pop(i, ()):
                    total -= live.pop(k, 0)
            return peak

        dead_ops, dead = unread()
        while True:
            again = {i for i in cached if not ops[i].writes
                     and self.written.isdisjoint(ops[i].reads)
                     and any(k not in needed and k not in dead for k in ops[i].made)}
            if not again:
                break
            cached -= again
            dead_ops, dead = unread()
        # 4. a "save" decision now recomputed stays cached after all where that spares its
        # recompute and the recompute's fullest moment stays within none's
        saved = sum(n for k, n in self.produced.items() if k in self.packed)
        strict = recompute_peak(dead_ops, dead)
        # the recompute may hold a few transients beyond ``saved`` already (outputs
        # consumed at once, placeholders); the forward cache leaves at least that much
        # of ``saved`` free, so the earlier blocks' savings are not all used up by extras
        bound, room = max(saved, strict), saved - max(0, strict - saved)
        extras = sorted((i for i, op in enumerate(ops) if op.save and i not in cached
                         and i not in dead_ops and op.flops > 0
                         and self.written.isdisjoint(op.reads)),
                        key=lambda i: -ops[i].flops / max(1, sum(
                            self.produced.get(k, 0) for k in ops[i].made)))
        for i in extras:
            if i in dead_ops:
                continue  # made unread by an extra cached before it
            cached.add(i)
            trial_ops, trial_dead = unread()
            if (sum(self.kept(cached, trial_dead).values()) <= room
                    and recompute_peak(trial_ops, trial_dead) <= bound):
                dead_ops, dead = trial_ops, trial_dead
            else:
                cached.discard(i)
        return cached, dead_ops, dead

    def kept(self, cached: set[int], dead: set[tuple]) -> dict[tuple, int]:
        """Storage -> bytes of what the cache keeps, given :meth:`settle`'s answer."""
        return {k: self.produced[k] for i in cached for k in self.ops[i].made
                if k not in dead and k in self.produced}

    def finish(self, storage: dict) -> None:
        """After the block's forward, settle what the block keeps (:meth:`settle`) and
        rewrite torch's SAC cache of the block (``storage``, ``_CachingTorchDispatchMode``)
        to match: placeholders for dead ops, recompute entries for the rest."""
        ops = self.ops
        cached, dead_ops, dead = self.settle()
        kept_storages = set(self.kept(cached, dead))
        # every tensor autograd saved is cached anyway: checkpointing frees nothing here
        self.saves_nothing = all(k in kept_storages for k in self.produced if k in self.packed)
        self.rewrites_state = False
        for i, op in enumerate(ops):
            if i in dead_ops:
                storage[op.key][op.index] = _placeholder(op.meta)
                continue
            if i in cached:
                if any(k in dead for k in op.made):
                    storage[op.key][op.index] = _without(storage[op.key][op.index], op, dead)
                continue
            if op.save:
                storage[op.key][op.index] = _compat.SAC_RECOMPUTE
            # an op that runs again and writes a tensor the block did not make (a norm's
            # running statistics): the recompute must write into throw-away copies
            self.rewrites_state |= any(k not in self.produced for k in op.writes)

    def _decide(self, op, args, kwargs, out) -> CheckpointPolicy:
        schema = _compat.op_schema(op)
        written, read = [], []
        for i, arg in enumerate(schema.arguments):
            value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only
                               else None)
            keys = [k for k in map(self.key, _tensors(value)) if k is not None]
            (written if arg.alias_info is not None and arg.alias_info.is_write
             else read).extend(keys)
        self.written.update(written)
        self._last = (read, written)
        self._views = _views_per_return(schema, args, kwargs, out)
        aliasing = any(self._views)
        random = _is_random(op, args, kwargs)

        mutated = [self.saved[k] for k in written if k in self.saved]
        if any(mutated):  # changes a saved tensor: its result is the saved value
            for key in written:
                if key in self.read_by_recompute:
                    raise PolicyRefusal(
                        f"strategy selective: {_op_name(op)} changes in place a tensor that "
                        f"the recomputed op {self.read_by_recompute[key]} read before; the "
                        "recompute would feed it the changed values. Make the in-place op "
                        "out-of-place (e.g. inplace=False) or choose another policy")
            if random:
                raise PolicyRefusal(
                    f"strategy selective: {_op_name(op)} draws random numbers into a saved "
                    "tensor; it can be neither saved nor recomputed. Choose another policy")
            return _SAVE
        reads_core = any(k in self.core for k in read + written)
        replay_only = (aliasing and not written) or op.overloadpacket in _FACTORIES
        # an in-place op (it returns what it writes) on an input of the block: the replay
        # gets a copy of that input (remat.strategies.recompute), and autograd saves, and
        # the block's code reads on, what the op writes, not what the cache would hand back
        foreign = any(r.alias_info is not None and r.alias_info.is_write
                      for r in schema.returns) and any(k in self.inputs for k in written)
        if mutated or replay_only or random or foreign or not (read or written):
            # in-place on a recomputed tensor or on an input, views, factories, random ops
            decision = _RECOMPUTE
        elif (op.overloadpacket is torch.ops.aten.clone
              and _is_backup_of_saved(self, args, kwargs)):
            # The backup autograd takes before an in-place op whose backward needs the old
            # values (silu_, hardtanh_, ...): the saved original is about to change.
            decision = _SAVE
        else:
            decision = _SAVE if self.decide(op, reads_core) else _RECOMPUTE
        if decision is _RECOMPUTE and not replay_only:
            for key in read:
                if self.saved.get(key):
                    self.read_by_recompute.setdefault(key, _op_name(op))
        core = self.follow_core and decision is _RECOMPUTE and (
            reads_core or op.overloadpacket in _ATTENTION_CORE)
        for view, value in zip(self._views, _tensors_per_return(out, schema), strict=False):
            if view:
                continue  # a view or an in-place result: same storage, same standing
            for t in value:
                key = self.key(t, new=True)
                if key is None:
                    continue
                self.produced[key] = t.untyped_storage().nbytes()
                self.saved[key] = decision is _SAVE
                self.read_by_recompute.pop(key, None)
                (self.core.add if core else self.core.discard)(key)
        return decision


@contextlib.contextmanager
def _record_packs(policy: RegionPolicy) -> Iterator[None]:
    """Saved-tensor hooks pushed above the checkpoint's own: note which storages autograd
    saves (``policy.packed``), then hand each tensor to the hooks below (the checkpoint's),
    unchanged.

    Marked as a checkpoint-internal hook (torch's ``_checkpoint_internal``), so torch's
    search for the user's hooks (``save_on_cpu`` around the model) looks through it. The
    hook functions hold no reference back to anything that holds them: autograd keeps them
    with every saved tensor, and a reference cycle through them would keep the whole
    checkpoint (its inputs included) alive until the garbage collector runs.
    """
    below = _compat.top_saved_tensors_hooks()
    if below is None:
        raise RuntimeError("strategy selective: its block must run inside a checkpoint")
    pack_below, unpack_below = below
    packed, key = policy.packed, policy.key

    def pack(t):
        packed.add(key(t))
        return pack_below(t)

    with _compat.checkpoint_internal_hook(pack), \
            torch.autograd.graph.saved_tensors_hooks(pack, unpack_below):
        yield


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


@contextlib.contextmanager
def _autocast_cache_off() -> Iterator[None]:
    """Autocast as it is, with its weight-cast cache off (module docstring: autocast)."""
    with contextlib.ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICES:
            if (torch.amp.is_autocast_available(device_type)
                    and torch.is_autocast_enabled(device_type)):
                stack.enter_context(torch.autocast(
                    device_type, dtype=torch.get_autocast_dtype(device_type),
                    cache_enabled=False))
        yield


class _Contexts:
    """A (forward, recompute) context pair for one block, each enterable more than once
    (once per call of a segment's blocks), and :meth:`finish` once after the last call."""

    def __init__(self, policy: RegionPolicy, forward_mode, recompute_mode) -> None:
        self.policy = policy
        self.forward_mode = forward_mode
        self.recompute_mode = recompute_mode

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with _autocast_cache_off(), _record_packs(self.policy), self.forward_mode:
            yield

    def finish(self) -> None:
        """After the region's last forward call: settle the cache (:meth:`RegionPolicy.
        finish`). Not after each call: a later call of the segment reads earlier calls'
        outputs (and autograd saves them), which an earlier settle had dropped as unread.
        The region calls it once (:meth:`remat.strategies.recompute.Region.finish`)."""
        self.policy.finish(_compat.sac_cache(self.forward_mode))

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        with _autocast_cache_off(), self.recompute_mode:
            yield


class _Reenterable:
    """Wraps a generator context factory so that one object can be entered many times.

    As a recompute context it also answers ``rewrites_state`` (see
    :mod:`remat.strategies.recompute`): whether an op that runs again in the recompute
    writes a tensor the block did not make (a norm's running statistics); a block whose
    norms are all served from the cache needs no throw-away copies of their statistics.
    """

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager],
                 policy: RegionPolicy | None = None,
                 finish: Callable[[], None] | None = None) -> None:
        self.factory = factory
        self.policy = policy
        self._active: list = []
        #: as a forward context: settles the block after its region's last call
        self.finish = finish

    @property
    def rewrites_state(self) -> bool:
        return self.policy is None or self.policy.rewrites_state

    def note_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """As a forward context: :meth:`RegionPolicy.note_inputs` before a call."""
        if self.policy is not None:
            self.policy.note_inputs(tensors)

    @property
    def saves_nothing(self) -> bool:
        """As a forward context: after the block's forward, whether its checkpoint keeps
        every tensor autograd would have kept anyway (``attention`` on a block without an
        attention core), so the block may as well run without one."""
        return self.policy is not None and self.policy.saves_nothing

    def __enter__(self):
        ctx = self.factory()
        self._active.append(ctx)
        return ctx.__enter__()

    def __exit__(self, *exc):
        return self._active.pop().__exit__(*exc)


def _compiled_policy(save: frozenset, attention: bool, ctx, op, *args, **kwargs):
    """The policy under ``torch.compile``: the preset's op sets (no in-place or budget
    rules: the compiled graph is functional, and the partitioner decides the rest)."""
    if attention:
        return _RECOMPUTE if op.overloadpacket in _ATTENTION_CORE else _SAVE
    return _SAVE if (op in save or op.overloadpacket in save) else _RECOMPUTE


def _tensors_per_return(out, schema) -> list[list[torch.Tensor]]:
    if len(schema.returns) == 1:
        return [_tensors(out)]
    return [_tensors(o) for o in out] if isinstance(out, tuple | list) else []


def _views_per_return(schema, args: tuple, kwargs: dict, out) -> list[bool]:
    """For each return of the op: whether it lives in the storage of an argument (a view or
    an in-place result). The schema says so for most ops; ``unsafe_chunk``,
    ``unsafe_split`` and ``_unsafe_view`` return views their schema does not mark, which
    GRU cells write into in place."""
    inputs = {storage_key(t) for t in _tensors(list(args)) + _tensors(list(kwargs.values()))}
    inputs.discard(None)
    return [ret.alias_info is not None or any(storage_key(t) in inputs for t in value)
            for ret, value in zip(schema.returns, _tensors_per_return(out, schema),
                                  strict=False)]


class SelectiveCheckpoint(RecomputeStrategy):
    """Checkpoint each block alone, saving the outputs of the ops a policy picks.

    Args:
        policy: ``"matmul"`` (save matmuls, convolutions and SDPA; recompute the rest),
            ``"attention"`` (recompute the attention core only, Korthikanti et al. 2022,
            arXiv 2205.05198) or ``"ops"`` (save the ops in ``ops``). See the module
            docstring for the exact op sets and the rules that keep the function the same.
        ops: aten op names to save, e.g. ``["aten.mm", "aten.convolution"]``. Giving
            ``ops`` with the default policy selects ``policy="ops"``.

    Raises:
        ValueError: unknown policy (the message lists the valid ones), unknown or random
            op in ``ops``, ``ops`` with ``policy="attention"``, or ``policy="ops"`` without
            ``ops``.
        RuntimeError: the running torch has no ``op_output`` in the selective checkpoint
            policy context (the in-place and attention-core rules need it).
    """

    name = "selective"
    segment_mode = "selective"

    def __init__(self, policy: str = "matmul", ops: Sequence[str] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"strategy selective: unknown policy {policy!r}; valid policies: "
                             f"{', '.join(POLICIES)}")
        if ops is not None and policy == "matmul":
            policy = "ops"
        if policy == "ops" and ops is None:
            raise ValueError("strategy selective: policy='ops' needs ops, a list of aten op "
                             "names such as ['aten.mm', 'aten.convolution']")
        if ops is not None and policy != "ops":
            raise ValueError(f"strategy selective: ops is only used with policy='ops', not "
                             f"with policy={policy!r}")
        if "op_output" not in inspect.signature(SelectiveCheckpointContext).parameters:
            raise RuntimeError(f"strategy selective needs a torch whose selective checkpoint "
                               f"passes op_output to the policy; torch {torch.__version__} "
                               "does not")
        self._save = resolve_ops(ops) if ops is not None else (
            _MATMUL | _SDPA if policy == "matmul" else frozenset())
        self.policy = policy
        self.ops = list(ops) if ops is not None else None

    def segments_for(self, n: int) -> list[tuple[int, int]]:
        return every_k_segments(n, 1)

    def _saves(self, op, reads_core: bool) -> bool:
        if self.policy == "attention":
            core = op.overloadpacket in _ATTENTION_CORE or (
                reads_core and op.overloadpacket not in _PROJECTIONS)
            return not core
        return op in self._save or op.overloadpacket in self._save

    def saves_output(self, op) -> bool:
        """Whether this preset keeps the output of aten op ``op`` (an ``OpOverload``) rather
        than recomputing it (the attention preset: outside the attention core)."""
        return self._saves(op, False)

    def make_policy(self) -> RegionPolicy:
        """A fresh policy function for one checkpointed block (it keeps per-call state)."""
        return RegionPolicy(self._saves, follow_core=self.policy == "attention")

    def checkpoint_contexts(self) -> tuple:
        """(forward, recompute) contexts of one checkpointed block: torch's
        ``create_selective_checkpoint_contexts`` with this strategy's policy, the pack
        recorder that keeps the block at or below ``none``, and the autocast cache off.

        ``allow_cache_entry_mutation=True`` lets an in-place op change a saved tensor; the
        policy makes sure no recomputed op reads such a tensor before the change.
        """
        policy = self.make_policy()
        forward_mode, recompute_mode = create_selective_checkpoint_contexts(
            policy, allow_cache_entry_mutation=True)
        pair = _Contexts(policy, forward_mode, recompute_mode)
        return (_Reenterable(pair.forward, policy, pair.finish),
                _Reenterable(pair.recompute, policy))

    def compile_context_fn(self) -> Callable[[], tuple]:
        """Under ``torch.compile``: SAC with the preset's op sets, as a
        ``functools.partial`` (the form dynamo accepts as ``context_fn``)."""
        return functools.partial(
            create_selective_checkpoint_contexts,
            functools.partial(_compiled_policy, self._save, self.policy == "attention"))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_save")  # torch op objects do not pickle; rebuilt from the names
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._save = resolve_ops(self.ops) if self.ops is not None else (
            _MATMUL | _SDPA if self.policy == "matmul" else frozenset())
