"""Peak memory of a block of work: exact on CPU (MemTracker), allocator peak on CUDA."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from remat import _compat

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
            self._tracker = _compat.global_peak_tracker_class()()
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


def allocation_levels(prof: Any, device_type: str, held: dict[int, int] | None = None
                      ) -> tuple[list[int], list[int]]:
    """The allocator's running total through a finished
    ``torch.profiler.profile(profile_memory=True)`` session on devices of ``device_type``:
    ``(times_ns, levels)``, one entry per allocation or free, in time order, each level
    in bytes above the session's start (below it, negative, once blocks in ``held`` are
    freed).

    ``held``: address -> bytes of blocks alive when the session started whose frees count
    (the previous step's gradients, freed by ``zero_grad`` inside the step).

    Read from the profiler's allocation events (``experimental_event_tree()``: each has its
    block's address and signed size). A free counts only when its block was allocated in
    the session: the profiler also reports frees of blocks allocated during an *earlier*
    profiling session of the process (a model's gradients from the last measured step,
    freed by ``zero_grad``), which would put the total that much too low (a 2-block GPT's
    step: 869,704 B instead of 987,976 B on every measurement after the first).
    """
    allocation = _compat.allocation_event_tag()
    events = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if node.tag == allocation and node.extra_fields.device.type == device_type:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.allocation_id, fields.ptr,
                           fields.alloc_size))
    live: dict[int, int] = {}
    before = dict(held or {})
    running = 0
    times, levels = [], []
    for t, _, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            running += size
        elif ptr in live:
            running -= live.pop(ptr)
        elif ptr in before:
            running -= before.pop(ptr)
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
