"""Peak memory of a block of work: exact on CPU (MemTracker), allocator peak on CUDA."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack

import torch
from torch import nn


class PeakMemory:
    """Context manager that measures the peak memory of the work inside it, in bytes.

    On CUDA it uses ``torch.cuda.reset_peak_memory_stats`` and
    ``torch.cuda.max_memory_allocated`` (allocator level, includes every tensor on the
    device). On CPU it uses ``torch.distributed._tools.mem_tracker.MemTracker``, which counts
    tensor storages exactly and splits the peak into parameters, buffers, gradients,
    activations, temporaries and optimizer state (measure one training step per tracker).

    Args:
        device: where the work runs.
        modules: models whose parameters and buffers MemTracker should attribute (CPU only).
        optimizers: optimizers whose state MemTracker should attribute (CPU only).

    After the block: ``peak_bytes`` (int) and ``breakdown`` (category name -> bytes at the
    peak; on CUDA only ``{"Total": ...}``).
    """

    def __init__(self, device: torch.device | str, modules: Iterable[nn.Module] = (),
                 optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        self.device = torch.device(device)
        self.modules = list(modules)
        self.optimizers = list(optimizers)
        self.peak_bytes: int | None = None
        self.breakdown: dict[str, int] = {}
        self._stack = ExitStack()
        self._tracker = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            self._tracker = MemTracker()
            self._tracker.track_external(*self.modules, *self.optimizers)
            self._stack.enter_context(self._tracker)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.breakdown = {"Total": self.peak_bytes}
            return
        self._stack.close()
        snapshot = self._tracker.get_tracker_snapshot("peak")
        totals: dict[str, int] = {}
        for per_device in snapshot.values():
            for key, value in per_device.items():
                name = str(getattr(key, "value", key))  # plain str: checkpoints load weights_only
                totals[name] = totals.get(name, 0) + int(value)
        self.breakdown = totals
        self.peak_bytes = totals.get("Total", 0)
        self._tracker = None


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
