"""``offload``: keep the saved activations of the stages in host memory instead of the device.

Saved tensors go through a pair of saved-tensor hooks (PyTorch documentation, "Autograd
mechanics", hooks for saved tensors, https://docs.pytorch.org/docs/stable/notes/autograd.html;
the same mechanism as ``torch.autograd.graph.save_on_cpu``): the pack hook copies an
activation into host memory in the forward, the unpack hook copies it back in backward.
Weights are never moved: a saved tensor that is a parameter, a view of one, a leaf that
requires grad, an autocast copy of one, or a buffer of the stage stays where it is (moving it
would cost a host copy of the weights every step and free nothing, since the module keeps
them anyway). Two modes:

``segments=None``
    Each stage runs under the hooks: every activation it saves goes to host memory and
    nothing is recomputed. Any module is a stage; for an ``nn.ModuleList``/``ModuleDict``
    stage each member is wrapped.
``segments="full" | "sqrtn" | "every_k"``
    The stages are checkpointed as that strategy does; only the tensors a checkpointed
    segment keeps (its inputs) are moved, the inside is recomputed as usual.

On a machine without CUDA the tensors already live in host memory: nothing is copied and the
wrapped model computes the same function as without the strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from remat import _compat
from remat.strategies import wrapping
from remat.strategies.base import StrategyReport
from remat.strategies.recompute import ChainPlan
from remat.strategies.segmented import RecomputeStrategy, chain_members
from remat.strategies.segments import every_k_segments, sqrt_segments

SEGMENTS = ("full", "sqrtn", "every_k")


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return _compat.storage_id(t)
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, some subclasses
        return None


def is_weight(t: torch.Tensor, buffers: frozenset[int] = frozenset()) -> bool:
    """Whether a saved tensor is (or shares storage with) a weight rather than an activation:
    a parameter, a leaf that requires grad, an autocast copy of such a leaf (its ``grad_fn``
    is ``ToCopyBackward0`` fed straight by an ``AccumulateGrad``), a view of any of these,
    or one of ``buffers`` (storage ids)."""
    base = _compat.view_base(t)
    base = base if base is not None else t  # a view: judge what it views
    if isinstance(base, nn.Parameter):
        return True
    if base.grad_fn is None and base.requires_grad:
        return True
    grad_fn = base.grad_fn
    if grad_fn is not None and type(grad_fn).__name__ == "ToCopyBackward0":
        nxt = grad_fn.next_functions
        if nxt and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad":
            return True
    return bool(buffers) and _storage_id(t) in buffers


class HostOffload:
    """Pack/unpack hooks that move activations to host memory and leave weights alone.

    Args:
        pin_memory: copy into page-locked host memory (asynchronous copies on CUDA).
        buffers: storage ids of buffers that must stay (see :func:`is_weight`).
        copy_host_tensors: also copy tensors that already live in host memory (tests use it
            to see on CPU what a CUDA run would move).
        host: ``"cpu"`` (host memory), or ``"meta"`` in a fake trace
            (``FakeTensorMode``) of a GPU step made on a CPU: the moved tensors then leave
            the traced device as they would leave the GPU, and hold nothing (the planner's
            ``offload`` mode; :class:`~remat.measure.PeakMemory` leaves ``meta`` out).

    Raises:
        ValueError: ``host`` is neither ``cpu`` nor ``meta``; :meth:`pack` with ``host="meta"``
            of a real tensor (its values would be lost).
    """

    def __init__(self, pin_memory: bool, buffers: frozenset[int] = frozenset(),
                 copy_host_tensors: bool = False, host: str = "cpu") -> None:
        if host not in ("cpu", "meta"):
            raise ValueError(f"HostOffload: host must be 'cpu' or 'meta', got {host!r}")
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.buffers = buffers
        self.copy_host_tensors = copy_host_tensors
        self.host = host

    def moves(self, t: torch.Tensor) -> bool:
        """Whether :meth:`pack` copies ``t`` to host memory."""
        if t.device.type == "cpu" and not self.copy_host_tensors and self.host == "cpu":
            return False
        return not is_weight(t, self.buffers)

    def pack(self, t: torch.Tensor) -> torch.Tensor | tuple[torch.device, torch.Tensor]:
        """``t`` itself where it stays (a weight, or already in host memory: the caller
        then holds the very tensor, and sees in-place writes to it), else ``(device,
        host copy)``."""
        if not self.moves(t):
            return t
        if self.host == "meta":
            if not _compat.is_fake(t):
                raise ValueError("HostOffload(host='meta') is for fake traces only; a real "
                                 "tensor's values would be lost")
            return t.device, t.to("meta")
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout,
                           pin_memory=self.pin_memory and t.device.type == "cuda")
        host.copy_(t)
        return t.device, host

    def unpack(self, packed: torch.Tensor | tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, t = packed
        return t.to(device, non_blocking=self.pin_memory)


class OffloadCheckpoint(RecomputeStrategy):
    """Move the saved activations of the stages to host memory.

    Args:
        pin_memory: copy into page-locked host memory, so the copies run asynchronously on
            CUDA. Ignored when CUDA is not available.
        segments: ``None`` to offload every activation each stage saves (no recompute); or
            ``"full"``, ``"sqrtn"``, ``"every_k"`` to checkpoint the stages as that
            strategy does and offload only what the segments keep (their inputs).
        k: blocks per segment for ``segments="every_k"``.

    Raises:
        ValueError: unknown ``segments`` (the message lists the valid ones), ``k < 1``, or a
            ``pin_memory`` that is not a bool.
    """

    name = "offload"
    segment_mode = "offload"

    def __init__(self, pin_memory: bool = True, segments: str | None = None,
                 k: int = 2) -> None:
        if not isinstance(pin_memory, bool):
            raise ValueError(f"strategy offload: pin_memory must be true or false, "
                             f"got {pin_memory!r}")
        if segments is not None and segments not in SEGMENTS:
            raise ValueError(f"strategy offload: unknown segments {segments!r}; valid: "
                             f"null (offload everything the stage saves), "
                             f"{', '.join(SEGMENTS)}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"strategy.k must be an int >= 1, got {k!r} (offload: blocks "
                             "per segment)")
        self.pin_memory = pin_memory
        self.segments = segments
        self.k = k
        self._copy_host_tensors = False  # tests: copy on CPU as a CUDA run would
        self._host = "cpu"  # "meta": a fake trace of a GPU step (HostOffload)

    @property
    def recomputes(self) -> bool:  # type: ignore[override]
        """With ``segments`` the stages are recomputed; without, nothing is."""
        return self.segments is not None

    def offload(self, buffers: frozenset[int] = frozenset()) -> HostOffload:
        """The hooks this strategy moves tensors with."""
        return HostOffload(self.pin_memory, buffers, self._copy_host_tensors,
                           getattr(self, "_host", "cpu"))

    def segments_for(self, n: int) -> list[tuple[int, int]]:
        if self.segments == "every_k":
            return every_k_segments(n, self.k)
        if self.segments == "sqrtn":
            return sqrt_segments(n)
        return every_k_segments(n, 1)

    def boundary_hooks(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        hooks = self.offload()
        return hooks.pack, hooks.unpack

    def wrap_stage(self, path: str, module: nn.Module, report: StrategyReport) -> None:
        if self.segments is not None:
            super().wrap_stage(path, module, report)
            return
        targets = (chain_members(module) if isinstance(module, nn.ModuleList | nn.ModuleDict)
                   else [("", module)])
        # the members of a list are one stage for the bypass check (a parent may skip some)
        group = ChainPlan(path, [(0, len(targets))]) if targets[0][0] else None
        for name, target, indices in wrapping.distinct_members(targets):
            wrapping.install(target, wrapping.Wrap(self, f"{path}.{name}" if name else path,
                                                   self.run_offloaded, chain=group,
                                                   index=indices[0]))
        # Nothing is recomputed in this mode, so no module is reported as wrapped.

    def run_offloaded(self, module: nn.Module, wrap: wrapping.Wrap,
                      forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runner of ``segments=None``: the call under the offload hooks."""
        if not torch.compiler.is_compiling():
            wrap.calls += 1
        buffers = frozenset(filter(None, map(_storage_id, module.buffers())))
        hooks = self.offload(buffers)
        with saved_tensors_hooks(hooks.pack, hooks.unpack):
            return forward(*args, **kwargs)
