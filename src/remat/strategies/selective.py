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

Whatever the preset, a few rules keep the function the same:

- ops that draw random numbers (dropout, SDPA with ``dropout_p > 0``) are recomputed, so the
  recompute, which starts from the forward's RNG state, draws the same numbers in the same
  order (a saved random op would shift the stream for the random ops after it);
- views and tensor factories (``empty_like``, ``ones``, ...) are recomputed: they keep no
  information worth memory;
- an in-place op is saved when it changes a saved tensor (its result is then the saved
  value) and recomputed when it changes a recomputed one, so the recompute sees the same
  values as the forward. The whole-tensor ``clone`` autograd takes of a saved tensor before
  an in-place op whose backward needs the old values (``silu_``, ``hardtanh_``, as in
  EfficientNet and MobileNet blocks) is saved too. Any other recomputed op that read a
  saved tensor before an in-place op changed it cannot be replayed: the forward raises
  :class:`RuntimeError` naming both ops. (Changes made to a block's output after the block
  returns are outside the policy's view.)
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from remat.strategies.segmented import SegmentStrategy
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
        if not isinstance(op, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
            close = difflib.get_close_matches(parts[0], dir(torch.ops.aten), n=4, cutoff=0.7)
            hint = f"; close names: {', '.join('aten.' + c for c in close)}" if close else ""
            raise ValueError(f"strategy selective: unknown op '{name}' in ops (expected "
                             f"'aten.<name>' or 'aten.<name>.<overload>'){hint}")
        overloads = ([getattr(op, o) for o in op.overloads()]
                     if isinstance(op, torch._ops.OpOverloadPacket) else [op])
        if any(torch.Tag.nondeterministic_seeded in o.tags and "dropout_p" not in
               [a.name for a in o._schema.arguments] for o in overloads):
            raise ValueError(f"strategy selective: op '{name}' draws random numbers; it is "
                             "always recomputed (the recompute replays the forward's random "
                             "stream), so it cannot be listed in ops")
        resolved.add(op)
    return frozenset(resolved)


def _storage_key(t) -> tuple | None:
    """Identity of the memory a tensor lives in (views share it); ``None`` if unknown."""
    if not isinstance(t, torch.Tensor):
        return None
    if isinstance(t, FakeTensor):  # no data pointer (remat.estimate): the storage object's id
        return (t.device, "fake", t.untyped_storage()._cdata)
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # fake, meta, sparse, subclass
        return None
    return (t.device, ptr) if ptr else None


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
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return bool(value)
    return True


def _is_backup_of_saved(policy: _RegionPolicy, args, kwargs) -> bool:
    """Whether ``clone`` copies a whole saved tensor as it is (the backup autograd takes
    before an in-place op), not a part of it or into another layout (``.contiguous()``)."""
    t = args[0] if args else None
    if not isinstance(t, torch.Tensor) or not policy.saved.get(_storage_key(t)):
        return False
    return (kwargs.get("memory_format") in (None, torch.preserve_format)
            and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


class _RegionPolicy:
    """The policy function of one checkpointed block: per-op decisions of one forward.

    It tracks, per storage, whether the block saved or will recompute it, so that in-place
    ops and the ``attention`` core can be decided consistently (see the module docstring).
    """

    def __init__(self, decide: Callable[[object, bool], bool], follow_core: bool) -> None:
        self.decide = decide          # (op overload, reads the attention core) -> save?
        self.follow_core = follow_core
        self.saved: dict[tuple, bool] = {}     # storage -> saved (True) or recomputed
        self.core: set[tuple] = set()          # storages derived from the attention core
        self.read_by_recompute: dict[tuple, str] = {}
        self.decisions: list[CheckpointPolicy] = []
        self.replayed = 0

    def __call__(self, ctx: SelectiveCheckpointContext, op, *args, **kwargs):
        if ctx.is_recompute:  # torch versions that ask again in recompute: same answers
            self.replayed += 1
            return self.decisions[self.replayed - 1]
        decision = self._decide(op, args, kwargs, getattr(ctx, "op_output", None))
        self.decisions.append(decision)
        return decision

    def _decide(self, op, args, kwargs, out) -> CheckpointPolicy:
        schema = op._schema
        written, read = [], []
        for i, arg in enumerate(schema.arguments):
            value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only
                               else None)
            keys = [k for k in map(_storage_key, _tensors(value)) if k is not None]
            (written if arg.alias_info is not None and arg.alias_info.is_write
             else read).extend(keys)
        aliasing = any(r.alias_info is not None for r in schema.returns)
        random = _is_random(op, args, kwargs)

        mutated = [self.saved[k] for k in written if k in self.saved]
        if any(mutated):  # changes a saved tensor: its result is the saved value
            for key in written:
                if key in self.read_by_recompute:
                    raise RuntimeError(
                        f"strategy selective: {_op_name(op)} changes in place a tensor that "
                        f"the recomputed op {self.read_by_recompute[key]} read before; the "
                        "recompute would feed it the changed values. Make the in-place op "
                        "out-of-place (e.g. inplace=False) or choose another policy")
            if random:
                raise RuntimeError(
                    f"strategy selective: {_op_name(op)} draws random numbers into a saved "
                    "tensor; it can be neither saved nor recomputed. Choose another policy")
            return _SAVE
        reads_core = any(k in self.core for k in read + written)
        replay_only = (aliasing and not written) or op.overloadpacket in _FACTORIES
        if mutated or replay_only or random or not (read or written):
            # in-place on a recomputed tensor, views, factories, random ops: recompute
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
        for ret, value in zip(schema.returns, _tensors_per_return(out, schema), strict=False):
            if ret.alias_info is not None:
                continue  # a view or an in-place result: same storage, same standing
            for key in map(_storage_key, value):
                if key is None:
                    continue
                self.saved[key] = decision is _SAVE
                self.read_by_recompute.pop(key, None)
                (self.core.add if core else self.core.discard)(key)
        return decision


def _tensors_per_return(out, schema) -> list[list[torch.Tensor]]:
    if len(schema.returns) == 1:
        return [_tensors(out)]
    return [_tensors(o) for o in out] if isinstance(out, tuple | list) else []


class SelectiveCheckpoint(SegmentStrategy):
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

    def make_policy(self) -> _RegionPolicy:
        """A fresh policy function for one checkpointed block (it keeps per-call state)."""
        return _RegionPolicy(self._saves, follow_core=self.policy == "attention")

    def checkpoint_contexts(self) -> tuple:
        """(forward, recompute) contexts of one checkpoint call, from
        ``create_selective_checkpoint_contexts`` with this strategy's policy.

        ``allow_cache_entry_mutation=True`` lets an in-place op change a saved tensor; the
        policy makes sure no recomputed op reads such a tensor before the change.
        """
        return create_selective_checkpoint_contexts(self.make_policy(),
                                                    allow_cache_entry_mutation=True)
