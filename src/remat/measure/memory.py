"""Peak memory of a block of work: exact on CPU (MemTracker), allocator peak on CUDA."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

# MemTracker's category names (torch/distributed/_tools/mem_tracker.py, ``_MemRefType``)
# -> the names remat reports them under.
CATEGORIES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}


class _NoModuleHooks:
    """Stands in for ``MemTracker``'s ``ModTracker``: registers no module hooks and tells
    whether autograd's engine is running (``torch._C._current_graph_task_id``, as
    ``torch.utils.checkpoint`` asks), which is all the storage accounting reads of it."""

    parents: set[str] = set()

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModuleHooks:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


@functools.cache
def _global_peak_tracker_class() -> type:
    """A ``MemTracker`` that keeps only the whole-process peak, which is all PeakMemory reads
    (``get_tracker_snapshot("peak")``), and puts no hooks on modules.

    - After every operator the stock tracker walks every module it has seen to update that
      module's own peak: O(operators x modules), 20x the cost of the work itself on a
      ResNet-sized model on CPU. Here only the global peak is updated, exactly as the stock
      method updates it; the per-module peaks (``memory_tracking``) are not kept.
    - The stock tracker's module hooks (``ModTracker``: forward hooks and multi-grad hooks
      on every module's inputs and outputs) change what the measured step holds: they keep
      some tensors alive longer than a plain run does (U-Net-R18, 256 px, batch 2,
      ``every_k`` over the whole network: 246.5 MiB with them, 244.6 MiB without; ``none``
      and ``full`` unchanged), so the measure was of the tracked run, not of training. Here
      ``ModTracker`` is replaced by :class:`_NoModuleHooks`; the storages are counted as the
      stock tracker counts them. Gradients are still filed under ``Gradient`` (the stock
      tracker's own per-parameter hooks, installed for every module given to
      ``track_external``). Without module hooks, tensors made during backward are all
      ``Temp``: activations that a recompute makes again count there, not as ``Activation``.
    - A view (or in-place result) of a tensor made before the tracker started and not
      given to ``track_external`` allocates nothing, but the stock tracker counted its
      storage as new from then on: a segmentation loss's ``mask.unsqueeze(1)`` added the
      int64 mask again (4 MiB at 512 px, batch 2), so traces were 4 MiB above the
      allocator. Such storages are now left out, as the tensors they view are.
    """
    from copy import deepcopy

    from torch._guards import active_fake_mode
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary

    class _NoHook:
        """A removable-handle stand-in for a hook never installed."""

        def remove(self) -> None:
            pass

    _NO_HOOK = _NoHook()

    class _GlobalPeakTracker(MemTracker):
        # kernel temporaries (remat.measure.kernels.KernelTemporaries) and the highest the
        # held tensors plus one operator's temporaries reached
        temporaries = None
        kernel_peak = 0

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = _NoModuleHooks()
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


class PeakMemory:
    """Context manager that measures the peak memory of the work inside it, in bytes.

    On CUDA it uses ``torch.cuda.reset_peak_memory_stats`` and
    ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (allocator level, every
    tensor on the device; reserved adds the caching allocator's unused blocks). On CPU, and
    for fake tensors (``FakeTensorMode``, see :mod:`remat.estimate`), it uses
    ``torch.distributed._tools.mem_tracker.MemTracker``, which counts tensor storages exactly
    and splits the peak into parameters, buffers, gradients, optimizer state, activations
    and temporaries (measure one training step per tracker).

    The split is only right when the optimizer step runs *after* backward, outside
    ``optimizer.step``: MemTracker files every tensor created while an optimizer step is
    running as optimizer state, so with a closure (``optimizer.step(closure)``, as Lightning
    runs forward and backward) activations land there too. Pass ``split=False`` for such
    work; only the total is then reported.

    Args:
        device: where the work runs.
        modules: models whose parameters and buffers MemTracker should attribute (CPU only).
        optimizers: optimizers whose state MemTracker should attribute (CPU only).
        split: whether the per-category split is meaningful (see above).
        tracker: ``"auto"`` (MemTracker on CPU, allocator on CUDA) or ``"memtracker"``
            (MemTracker on any device; needed for fake tensors, which the allocator never sees).
        temporaries: MemTracker only: measured kernel temporaries
            (:class:`remat.measure.kernels.KernelTemporaries`); after each operator its
            temporaries are added to the bytes then held, giving ``allocator_peak_bytes``.

    Tensors on the ``meta`` device hold no memory and are left out (a fake trace of a GPU
    step made on a CPU puts what the step would offload to host memory there; see
    :class:`remat.strategies.offload.HostOffload`).

    After the block: ``peak_bytes`` (int), ``allocator_peak_bytes`` (``peak_bytes`` or, with
    ``temporaries``, the higher peak with them), ``reserved_bytes`` (CUDA allocator only, else
    ``None``), ``breakdown`` (MemTracker name -> bytes at the peak, ``{"Total": ...}`` on
    CUDA) and :attr:`categories`.

    Raises:
        ValueError: unknown ``tracker``.
    """

    def __init__(self, device: torch.device | str, modules: Iterable[nn.Module] = (),
                 optimizers: Iterable[torch.optim.Optimizer] = (), split: bool = True,
                 tracker: str = "auto", temporaries: Any = None) -> None:
        if tracker not in ("auto", "memtracker"):
            raise ValueError(f"PeakMemory: tracker must be 'auto' or 'memtracker', got "
                             f"{tracker!r}")
        self.device = torch.device(device)
        self.modules = list(modules)
        self.optimizers = list(optimizers)
        self.split = split
        self.use_allocator = tracker == "auto" and self.device.type == "cuda"
        self.temporaries = temporaries
        self.peak_bytes: int | None = None
        self.allocator_peak_bytes: int | None = None
        self.reserved_bytes: int | None = None
        self.breakdown: dict[str, int] = {}
        self._stack = ExitStack()
        self._tracker = None

    def __enter__(self) -> PeakMemory:
        if self.use_allocator:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._tracker = _global_peak_tracker_class()()
            self._tracker.temporaries = self.temporaries
            self._tracker.track_external(*self.modules, *self.optimizers)
            self._stack.enter_context(self._tracker)
        return self

    def __exit__(self, *exc) -> None:
        if self.use_allocator:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))
            self.breakdown = {"Total": self.peak_bytes}
            self.allocator_peak_bytes = self.peak_bytes
            return
        self._stack.close()
        snapshot = self._tracker.get_tracker_snapshot("peak")
        totals: dict[str, int] = {}
        for dev, per_device in snapshot.items():
            if torch.device(dev).type == "meta":
                continue  # holds no memory (a fake trace's stand-in for host memory)
            for key, value in per_device.items():
                name = str(getattr(key, "value", key))  # plain str: checkpoints load weights_only
                totals[name] = totals.get(name, 0) + int(value)
        self.breakdown = totals
        self.peak_bytes = totals.get("Total", 0)
        self.allocator_peak_bytes = max(self.peak_bytes, int(self._tracker.kernel_peak))
        self._tracker = None

    @property
    def categories(self) -> dict[str, int]:
        """Bytes at the peak per category (``parameters``, ``buffers``, ``gradients``,
        ``optimizer_state``, ``activations``, ``temporaries``, ``other``) plus ``total``;
        only ``total`` when the split is not available (CUDA allocator, or ``split=False``)."""
        if self.peak_bytes is None:
            return {}
        if self.use_allocator or not self.split:
            return {"total": self.peak_bytes}
        out = {CATEGORIES.get(k, k.lower()): v for k, v in self.breakdown.items()
               if k != "Total"}
        out["total"] = self.peak_bytes
        return out


def allocation_levels(prof: Any, device_type: str) -> tuple[list[int], list[int]]:
    """The allocator's running total through a finished
    ``torch.profiler.profile(profile_memory=True)`` session on devices of ``device_type``:
    ``(times_ns, levels)``, one entry per allocation or free, in time order, each level
    in bytes above the session's start.

    Read from the profiler's allocation events (``experimental_event_tree()``: each has its
    block's address and signed size). A free counts only when its block was allocated in
    the session: the profiler also reports frees of blocks allocated during an *earlier*
    profiling session of the process (a model's gradients from the last measured step,
    freed by ``zero_grad``), which would put the total that much too low (a 2-block GPT's
    step: 869,704 B instead of 987,976 B on every measurement after the first).
    """
    from torch._C._profiler import _EventType

    events = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == device_type:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.allocation_id, fields.ptr,
                           fields.alloc_size))
    live: dict[int, int] = {}
    running = 0
    times, levels = [], []
    for t, _, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            running += size
        elif ptr in live:
            running -= live.pop(ptr)
        else:
            continue
        times.append(t)
        levels.append(running)
    return times, levels


def format_bytes(num_bytes: int | None) -> str:
    """Human-readable binary size: ``1536`` -> ``'1.5 KiB'``; ``None`` -> ``'n/a'``."""
    if num_bytes is None:
        return "n/a"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def device_name(device: torch.device | str) -> str:
    """Name of the device for result records (GPU model, or the CPU's architecture)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
