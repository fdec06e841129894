"""Every private torch name remat uses, in one place.

remat's strategies and measurements reach into torch internals that have no public API yet
(the non-reentrant checkpoint's frames, selective checkpointing's cache, dynamo's backend
registry, ``MemTracker``'s bookkeeping, ...). No other module of remat may name a private
torch attribute or module (``tests/test_compat.py`` checks the source); they call the shims
here instead. Each shim says which torch releases it serves and which upstream change would
retire it.

The tested range is ``remat.TORCH_MIN`` up to the newest release CI installs (pyproject's
``torch`` requirement); ``import remat`` refuses an older torch (``remat.check_torch``)
before this module is imported, so the names below need no guard of their own.
Below 2.13, internals remat cannot do without are missing or different, so there is no
fallback for them: selective checkpointing's cache is a list per op that the policy is asked
about again in backward (2.12; from 2.13 ``_RECOMPUTE`` entries keyed by op and call index,
which the ``selective`` strategy rewrites after the forward), its policy gets no
``op_output`` (2.11), and ``MemTracker`` has no ``_fake_mode_on_entry`` (2.11, 2.12: the
CPU peak tracker fails on every operator).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

# torch 2.13-2.14: these live in private modules only. Retired when torch publishes them:
# - torch.utils._pytree: a public torch.utils.pytree with the same node registry;
# - torch.utils._python_dispatch, torch._subclasses, torch._guards: a public namespace for
#   TorchDispatchMode, FakeTensorMode and the active fake mode
#   (any_torch_dispatch_mode_on_stack is in 2.11-2.14 and absent in 2.9.1);
# - torch._ops: OpOverload(Packet) exposed by torch.ops, with a public ``schema`` (below);
# - torch.nn.modules.batchnorm._NormBase (the base of BatchNorm/InstanceNorm, modules with
#   running statistics): a public norm base class.
from torch._guards import active_fake_mode
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    is_fake,
    unset_fake_temporarily,
)
from torch.nn.modules.batchnorm import _NormBase as NormBase
from torch.utils import checkpoint as _checkpoint
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    any_torch_dispatch_mode_on_stack,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "FakeTensor", "FakeTensorMode", "NormBase", "OpOverload", "OpOverloadPacket",
    "TorchDispatchMode", "active_fake_mode", "any_torch_dispatch_mode_on_stack", "is_fake",
    "is_traceable_wrapper_subclass", "tree_flatten", "tree_map", "tree_unflatten",
    "unset_fake_temporarily",
]


# torch 2.13-2.14: an ATen overload's schema is private (``_schema``). Retired by a public
# ``OpOverload.schema``.
def op_schema(op: Any, missing_ok: bool = False) -> Any:
    """The ``torch._C.FunctionSchema`` of an ATen overload (its arguments, returns, alias
    information). With ``missing_ok`` an object without one (a higher-order op, a Python
    function) gives ``None`` instead of ``AttributeError``."""
    if missing_ok:
        return getattr(op, "_schema", None)
    return op._schema


# --- tensors and modules -------------------------------------------------------------------
# torch 2.13-2.14 (unchanged since 1.x): a tensor's version counter, view base and storage
# identity, and a module's own parameter/buffer/child tables, have no public accessors.
# Retired by public ``Tensor.version``/``Tensor.view_base`` and module tables that can be
# written in place (``named_buffers`` returns copies of the mapping, not the table).


def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter of ``t`` (bumped by every in-place write to its data)."""
    return t._version


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or ``None`` if ``t`` is not a view."""
    return t._base


def storage_id(t: torch.Tensor) -> int:
    """An identity of the storage ``t`` lives in (views share it); also for fake tensors,
    which have no data pointer.

    Raises:
        RuntimeError, NotImplementedError, TypeError: ``t`` has no untyped storage (sparse,
            some subclasses).
    """
    return t.untyped_storage()._cdata


def parameter_table(module: nn.Module) -> dict[str, Any]:
    """``module``'s own parameters, the live mapping (name -> parameter or ``None``)."""
    return module._parameters


def buffer_table(module: nn.Module) -> dict[str, Any]:
    """``module``'s own buffers, the live mapping (name -> tensor or ``None``): writing a
    key replaces the buffer without ``register_buffer``'s checks."""
    return module._buffers


def child_table(module: nn.Module) -> dict[str, Any]:
    """``module``'s direct children, the live mapping (name -> module or ``None``)."""
    return module._modules


def remove_forward_hook(module: nn.Module, hook: Callable) -> None:
    """Remove every registration of ``hook`` as a forward hook of ``module`` (the handle
    ``register_forward_hook`` returned is not needed)."""
    for key, registered in list(module._forward_hooks.items()):
        if registered is hook:
            del module._forward_hooks[key]
            module._forward_hooks_always_called.pop(key, None)
            module._forward_hooks_with_kwargs.pop(key, None)


def call_impl(module: nn.Module) -> Callable:
    """The bound ``Module._call_impl`` of ``module`` (what ``module(...)`` runs)."""
    return module._call_impl


def set_compiled_call_impl(module: nn.Module, compiled: Callable) -> None:
    """Make ``module(...)`` run ``compiled``, as ``nn.Module.compile`` does (in place:
    parameter names unchanged)."""
    module._compiled_call_impl = compiled


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state of ``module`` if it is itself an FSDP unit (``fully_shard``), else
    ``None``. torch 2.13-2.14: FSDP2 modules have only a private accessor; retired by a
    public ``FSDPModule`` state query."""
    get = getattr(module, "_get_fsdp_state", None)
    return get() if get is not None else None


# --- autograd engine -------------------------------------------------------------------


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (how
    ``torch.utils.checkpoint`` asks). torch 2.13-2.14; retired by a public query."""
    return torch._C._current_graph_task_id() != -1


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost ``(pack, unpack)`` saved-tensor hooks active now, or ``None``.
    torch 2.13-2.14; retired by a public ``torch.autograd.graph`` query."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


# torch 2.13 does not mark its checkpoint's pack hooks ``_checkpoint_internal`` (2.14 does);
# they are known there by where they are defined. Retired with torch 2.13 support.
_TORCH_CHECKPOINT_PACKS = ("_checkpoint_hook.__init__.<locals>.pack_hook",
                           "_recomputation_hook.__init__.<locals>.pack_hook")


def inside_checkpoint() -> bool:
    """Whether a torch checkpoint (forward or recompute, remat's regions included) is active
    around this call: the innermost saved-tensor hooks are a checkpoint's own (torch 2.14
    marks them ``_checkpoint_internal``; on 2.13 they are torch's checkpoint hook
    functions)."""
    hooks = top_saved_tensors_hooks()
    if hooks is None:
        return False
    pack = hooks[0]
    if getattr(pack, "_checkpoint_internal", False):
        return True
    return (getattr(pack, "__module__", None) == _checkpoint.__name__
            and getattr(pack, "__qualname__", None) in _TORCH_CHECKPOINT_PACKS)


# --- non-reentrant checkpoint frames (torch.utils.checkpoint) --------------------------
# torch 2.13-2.14: the machinery behind checkpoint(..., use_reentrant=False) -- a frame
# (recompute function, early stop, mismatch callback, determinism check) and the hook that
# installs it -- is private. remat drives one frame per segment from its own tape
# (remat.strategies.recompute). 2.11 and older keep the frame's inputs in ``input_saver``
# instead of ``get_inputs()``. Retired by a public "checkpoint region" API.

CheckpointFrame = _checkpoint._CheckpointFrame
checkpoint_hook = _checkpoint._checkpoint_hook
StopRecomputationError = _checkpoint._StopRecomputationError


def new_checkpoint_frame(recompute_fn: Callable[..., None],
                         unpack_error_cb: Callable[[BaseException], None]) -> Any:
    """A frame as ``checkpoint(..., use_reentrant=False)`` makes it: torch's early-stop
    setting (``set_checkpoint_early_stop``, default on) and default determinism check
    (shapes, dtypes, devices of the recomputed tensors)."""
    early = _checkpoint._enable_checkpoint_early_stop
    return CheckpointFrame(
        recompute_fn, early if early is not None else True, unpack_error_cb,
        _checkpoint._allowed_determinism_checks_to_fns[_checkpoint._DEFAULT_DETERMINISM_MODE])


# --- selective checkpointing's cache ---------------------------------------------------
# torch 2.13-2.14: ``_CachingTorchDispatchMode.storage`` is {key: {call index: entry}}, the
# key from ``_sac_storage_key(op, args)``, an entry either a tree of objects with
# ``get_val(allow_cache_entry_mutation)`` or ``_RECOMPUTE`` (run the op again in backward).
# 2.12 and older keep a list per op and ask the policy again in backward, which cannot
# express remat's after-the-fact decisions. Retired by a public SAC hook deciding per op
# after the forward.
SAC_RECOMPUTE = _checkpoint._RECOMPUTE
sac_storage_key = _checkpoint._sac_storage_key


def sac_cache(forward_mode: Any) -> dict:
    """The cache a selective checkpoint's forward context filled (layout above)."""
    return forward_mode.storage


# --- one checkpointed region of several calls under torch.compile ---------------------------
# torch 2.13-2.14: dynamo turns each checkpoint(...) call into a ``tag_activation_checkpoint``
# higher-order op; when AOTAutograd traces it, ``tag_activation_checkpoint_impl``
# (torch/_higher_order_ops/wrap.py) draws a new ``ac_graph_id`` per call and sets it on the
# forward context of the SAC pair (``_CachingTorchDispatchMode.ac_graph_id``), which tags
# every node of the call with it. The min-cut partitioner then saves every value passed
# from one checkpointed call to a later one (``cleanup_recompute_tags``,
# torch/_functorch/partitioners.py: "two consecutive checkpointed blocks ... stash the
# tensor at the boundary"): a segment of k blocks, checkpointed call by call, keeps all k
# inputs compiled where it keeps one eager. The forward context below keeps the id of the
# segment's first call for the later calls of the same segment, so the partitioner sees
# one region. Retired by a public way to checkpoint several calls as one region under
# dynamo.

_SEGMENT_IDS: dict[str, tuple[int, Any]] = {}


# --- what a random op's call keeps under torch.compile ------------------------------------
# torch 2.13-2.14: the SAC forward context runs the op (AOTAutograd decomposes it there:
# ``native_dropout`` becomes rand -> gt -> mul -> mul) and then tags *every* node the call
# made with the policy's answer. A random op must not be recomputed (inductor's backward
# draws other numbers), but MUST_SAVE on all of its nodes keeps the dropped-out tensor
# itself (float) where its bool mask would do, and for an attention call with dropout
# every intermediate of the decomposed kernel (the T x T scores). The context below keeps
# MUST_SAVE on the nodes that draw random numbers and those computed from them alone (the
# mask), and gives the call's other nodes the region's own policy for the op, so the
# partitioner saves the mask and recomputes the rest. Retired with functionalised RNG on
# CPU (``torch._functorch.config.functionalize_rng_ops``, CUDA only in 2.14).


def _draws_random(node: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def random_closure(nodes: Sequence[Any]) -> set:
    """Of ``nodes`` (fx nodes of one call, in graph order): those that draw random numbers
    and those computed from them alone (a dropout's mask: rand -> gt)."""
    closure: set = set()
    for node in nodes:
        inputs = node.all_input_nodes
        if _draws_random(node) or (inputs and all(i in closure for i in inputs)):
            closure.add(node)
    return closure


class _RegionCachingMode(_checkpoint._CachingTorchDispatchMode):
    """A SAC forward context whose ``ac_graph_id`` is its segment's, and whose random ops
    keep their masks only (see the two notes above)."""

    @property
    def ac_graph_id(self) -> Any:
        return self.__dict__.get("_segment_graph_id")

    @ac_graph_id.setter
    def ac_graph_id(self, value: Any) -> None:
        key, position = self.__dict__.get("_segment", (None, 0))
        if key is not None and value is not None:
            last = _SEGMENT_IDS.get(key)
            if last is not None and position > last[0]:
                value = last[1]  # a later call of the segment: the segment's region
            _SEGMENT_IDS[key] = (position, value)
        self.__dict__["_segment_graph_id"] = value

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = {} if kwargs is None else kwargs
        random_op, rest = self.__dict__.get("_random_op"), self.__dict__.get("_rest_policy")
        proxy = None
        if random_op is not None and random_op(func, args, kwargs):
            from torch.fx.experimental.proxy_tensor import get_proxy_mode

            proxy = get_proxy_mode()
        before = len(proxy.tracer.graph.nodes) if proxy is not None else 0
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if proxy is not None:
            nodes = list(proxy.tracer.graph.nodes)[before:]
            keep = random_closure(nodes)
            ctx = _checkpoint.SelectiveCheckpointContext(is_recompute=False, op_output=out)
            policy = rest(ctx, func, *args, **kwargs)
            if isinstance(policy, bool):
                policy = (_checkpoint.CheckpointPolicy.MUST_SAVE if policy
                          else _checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)
            for node in nodes:
                if (node not in keep and node.meta.get("recompute")
                        is _checkpoint.CheckpointPolicy.MUST_SAVE):
                    node.meta["recompute"] = policy
        return out


def region_context(forward_mode: Any, segment: str | None, position: int,
                   random_op: Callable[[Any, tuple, dict], bool] | None = None,
                   rest_policy: Callable[..., Any] | None = None) -> None:
    """Make ``forward_mode`` (a SAC forward context) one compiled region's: its nodes carry
    the region id of ``segment`` (the id of its first call at a lower ``position`` in the
    same trace; ``segment=None``: the call's own id); where ``random_op(func, args,
    kwargs)`` says a call draws random numbers (the mode's policy makes those MUST_SAVE),
    only the nodes that draw them and those computed from them alone stay MUST_SAVE, the
    call's other nodes get ``rest_policy``'s answer for the op (see above). A forward
    context of another kind is left as it is."""
    if type(forward_mode) is not _checkpoint._CachingTorchDispatchMode:
        return
    forward_mode.__class__ = _RegionCachingMode
    forward_mode.__dict__["_segment_graph_id"] = forward_mode.__dict__.pop("ac_graph_id", None)
    forward_mode.__dict__["_segment"] = (segment, position)
    if random_op is not None and rest_policy is not None:
        forward_mode.__dict__["_random_op"] = random_op
        forward_mode.__dict__["_rest_policy"] = rest_policy


class _ContextFnNotice(logging.Filter):
    """Drops torch's one-time notice that a ``context_fn`` reached a checkpoint under
    ``torch.compile`` ("make sure the checkpointed region does not contain in-place ops"):
    remat passes one for every segment (above), and a plain checkpoint goes through the
    same SAC path in torch (``_always_prefer_recompute``), so the notice would be printed
    for every compiled model with a recomputing strategy."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Detected that context_fn is passed" not in str(record.msg)


def quiet_context_fn_notice() -> None:
    """Install :class:`_ContextFnNotice` on torch's ``torch._higher_order_ops.wrap``
    logger (once)."""
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _ContextFnNotice) for f in logger.filters):
        logger.addFilter(_ContextFnNotice())


def prefer_recompute_contexts() -> tuple:
    """The SAC pair dynamo gives a plain ``checkpoint`` (every op ``PREFER_RECOMPUTE``)."""
    return _checkpoint.create_selective_checkpoint_contexts(_prefer_recompute)


def _prefer_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return _checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _current_user_hooks() -> Any:
    # torch 2.14: checkpoint looks through its own hooks to the user's (save_on_cpu around a
    # checkpointed model); 2.13 has no such search. Retired with the SAC/checkpoint API.
    find = getattr(_checkpoint, "_current_user_saved_tensors_hooks", None)
    return find() if find is not None else None


@contextlib.contextmanager
def checkpoint_internal_hook(pack: Callable) -> Iterator[None]:
    """Mark ``pack`` as a checkpoint-internal pack hook while the block runs, as torch marks
    its own, so that torch's search for the user's saved-tensor hooks looks through it."""
    pack._checkpoint_internal = True
    pack._user_hooks = _current_user_hooks()
    try:
        yield
    finally:
        del pack._user_hooks


# --- torch.compile: dynamo, functorch, inductor ----------------------------------------
# torch 2.13-2.14: backend lookup, the partitioner's settings (activation_memory_budget,
# joint_custom_pass) and inductor's mode table have no public API; imported on first use
# (dynamo is heavy). Retired by torch.compiler equivalents.


def lookup_backend(backend: str | Callable) -> Callable:
    """The compiler function of a registered ``torch.compile`` backend (or ``backend``
    itself if callable).

    Raises:
        Exception: torch's ``InvalidBackend`` for an unknown name.
    """
    import torch._dynamo

    return torch._dynamo.lookup_backend(backend)


def list_backends() -> list[str]:
    """Names of the registered ``torch.compile`` backends."""
    import torch._dynamo

    return torch._dynamo.list_backends()


def dynamo_break_counts() -> dict[str, int]:
    """Dynamo's graph-break messages so far in this process -> how often each was met
    (``torch._dynamo.utils.counters``, categories ``graph_break`` and ``unimplemented``;
    torch 2.13-2.14 file breaks under both). Empty where the counters are gone. Retired by
    a public graph-break API (``torch._dynamo.explain`` compiles a second time)."""
    import torch._dynamo.utils

    counters = getattr(torch._dynamo.utils, "counters", None) or {}
    out: dict[str, int] = {}
    for category in ("graph_break", "unimplemented"):
        for message, count in dict(counters.get(category, {})).items():
            out[message] = out.get(message, 0) + count
    return out


def inductor_backend(options: dict[str, Any]) -> Callable:
    """Inductor as a ``torch.compile`` backend with its config ``options`` patched for the
    forward and the backward compile (what ``torch.compile(backend="inductor",
    options=...)`` builds; ``compile_fx``'s ``config_patches``)."""
    from torch._inductor.compile_fx import compile_fx

    return functools.partial(compile_fx, config_patches=dict(options))


def custom_graph_pass_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomGraphPass`` (torch 2.13-2.14): the base of
    an inductor FX graph pass (``post_grad_custom_post_pass``) whose ``uuid()`` keeps
    inductor's FX graph cache usable. Retired by a public graph-pass API."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def inductor_config_names() -> set[str]:
    """The setting names of inductor's config module (``torch._inductor.config``)."""
    return set(inductor_config_values())


def inductor_config_values() -> dict[str, Any]:
    """Inductor's settings (``torch._inductor.config``) and their current values."""
    import torch._inductor.config

    return dict(torch._inductor.config.get_config_copy())


def functorch_config() -> Any:
    """The AOT autograd config module (``activation_memory_budget``, ``joint_custom_pass``,
    ``patch``)."""
    import torch._functorch.config

    return torch._functorch.config


def inductor_mode_options(mode: str | None = None, dynamic: bool | None = None) -> Any:
    """Without ``mode``: inductor's valid ``torch.compile(mode=...)`` names; with it: the
    config patches that mode means."""
    from torch._inductor import list_mode_options

    return list_mode_options() if mode is None else list_mode_options(mode, dynamic)


def comptime() -> Callable:
    """dynamo's ``comptime``: ``comptime(fn)`` runs ``fn(ctx)`` while dynamo traces the
    calling frame, without a graph break (eager: a no-op). Call the returned object from the
    traced code itself: dynamo recognises it there."""
    from torch._dynamo.comptime import comptime

    return comptime


def traced_local(ctx: Any, name: str) -> Any:
    """The real Python object of local ``name`` of the frame dynamo traces, or ``None``.

    Best effort: dynamo's VariableTracker accessor is private and explicitly unstable
    (torch 2.13-2.14). An API change loses the note, and a strategy's ``verify`` then calls
    a stage under ``torch.compile(model)`` bypassed: loud, not silent (tests/test_compat.py
    checks the accessor on the torch installed)."""
    try:
        tracker = ctx.get_local(name)._i_will_not_complain_if_bc_breaks_VariableTracker()
        return tracker.value
    except Exception:  # noqa: BLE001 - private dynamo API; never break a compile for a note
        return None


# --- memory tracking ---------------------------------------------------------------------
# torch 2.13-2.14: MemTracker (torch.distributed._tools) is private, and remat's peak-only
# tracker overrides its internals (_track, _update_peak_stats, _curr_mem_snap, _peak_mem,
# _WINFO, _fake_mode_on_entry, _mod_tracker). Retired by a public tensor-level memory
# tracker with a global-peak-only mode and no module hooks.


def preload_mem_tracker() -> None:
    """Import MemTracker's module (and what it imports) now, e.g. before forking."""
    from torch.distributed._tools import mem_tracker  # noqa: F401


def allocation_event_tag() -> Any:
    """The profiler event tag of allocator events (``experimental_event_tree`` nodes)."""
    from torch._C._profiler import _EventType

    return _EventType.Allocation


def fake_process_group_store() -> Any:
    """A store for ``init_process_group("fake", ...)``: collectives do nothing (torch's
    test utility, torch 2.13-2.14; retired by a public fake process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


class NoModuleHooks:
    """Stands in for ``MemTracker``'s ``ModTracker``: registers no module hooks and tells
    whether autograd's engine is running (:func:`in_backward`), which is all the storage
    accounting reads of it."""

    parents: set[str] = set()

    @property
    def is_bw(self) -> bool:
        return in_backward()

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> NoModuleHooks:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


@functools.cache
def global_peak_tracker_class() -> type:
    """A ``MemTracker`` that keeps only the whole-process peak, which is all
    ``remat.measure.PeakMemory`` reads (``get_tracker_snapshot("peak")``), and puts no hooks
    on modules.

    - After every operator the stock tracker walks every module it has seen to update that
      module's own peak: O(operators x modules), 20x the cost of the work itself on a
      ResNet-sized model on CPU. Here only the global peak is updated, exactly as the stock
      method updates it; the per-module peaks (``memory_tracking``) are not kept.
    - The stock tracker's module hooks (``ModTracker``: forward hooks and multi-grad hooks
      on every module's inputs and outputs) change what the measured step holds: they keep
      some tensors alive longer than a plain run does (U-Net-R18, 256 px, batch 2,
      ``every_k`` over the whole network: 246.5 MiB with them, 244.6 MiB without; ``none``
      and ``full`` unchanged), so the measure was of the tracked run, not of training. Here
      ``ModTracker`` is replaced by :class:`NoModuleHooks`; the storages are counted as the
      stock tracker counts them. Gradients are still filed under ``Gradient`` (the stock
      tracker's own per-parameter hooks, installed for every module given to
      ``track_external``). Without module hooks, tensors made during backward are all
      ``Temp``: activations that a recompute makes again count there, not as ``Activation``.
    - A view (or in-place result) of a tensor made before the tracker started and not
      given to ``track_external`` allocates nothing, but the stock tracker counted its
      storage as new from then on: a segmentation loss's ``mask.unsqueeze(1)`` added the
      int64 mask again (4 MiB at 512 px, batch 2), so traces were 4 MiB above the
      allocator. Such storages are now left out, as the tensors they view are.

    Its ``temporaries`` (``(func, args, kwargs) -> bytes`` or ``None``) adds each operator's
    kernel temporaries to ``kernel_peak``, the highest the held tensors plus one operator's
    temporaries reached, in bytes.
    """
    from copy import deepcopy

    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    class _NoHook:
        """A removable-handle stand-in for a hook never installed."""

        def remove(self) -> None:
            pass

    _NO_HOOK = _NoHook()

    class _GlobalPeakTracker(MemTracker):
        temporaries = None
        kernel_peak = 0

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = NoModuleHooks()
            # storages made before the tracker started and not given to track_external
            # (the batch): a view or in-place result of one allocates nothing
            self._outside = WeakIdKeyDictionary()

        def _track(self, reftype, t: torch.Tensor) -> None:
            storages = get_untyped_storages(t)
            if storages and all(st in self._outside for st in storages):
                return
            super()._track(reftype, t)

        def track_external(self, *external: Any) -> None:
            super().track_external(*external)
            for obj in external:
                if isinstance(obj, nn.Module):
                    # MemTracker hooks every parameter's gradient, and torch refuses a hook
                    # on a frozen one (a LoRA base, a frozen encoder): mark those as hooked
                    for param in obj.parameters():
                        if not param.requires_grad:
                            self._param_to_grad_hook_handles.setdefault(
                                param, (_NO_HOOK, _NO_HOOK))
                    self._track_module_params_and_buffers(obj, install_grad_hooks=True)

        def _update_peak_stats(self, peak_state) -> None:  # noqa: ARG002 (MemTracker's API)
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(dev_snap)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if active_fake_mode() is self._fake_mode_on_entry:
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t):
                        for st in get_untyped_storages(t):
                            if st not in self._WINFO:
                                self._outside[st] = True
            res = super().__torch_dispatch__(func, types, args, kwargs)
            if (self.temporaries and res is not NotImplemented
                    and active_fake_mode() is self._fake_mode_on_entry):
                extra = self.temporaries(func, args, kwargs or {})
                if extra:
                    held = sum(snap[_TOTAL_KEY] for dev, snap in self._curr_mem_snap.items()
                               if torch.device(dev).type != "meta")
                    self.kernel_peak = max(self.kernel_peak, held + extra)
            return res

    return _GlobalPeakTracker
