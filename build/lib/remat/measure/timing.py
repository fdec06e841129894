"""Step timing that waits for the device, with warm-up steps excluded."""

from __future__ import annotations

import statistics
import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (no-op on CPU), so a wall clock reads real time."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Records step durations in milliseconds, skipping the first ``warmup`` steps.

    Call :meth:`start` and :meth:`stop` around each step; :attr:`median_ms` is the median of
    the recorded steps (``None`` if none was recorded).
    """

    def __init__(self, device: torch.device | str = "cpu", warmup: int = 2) -> None:
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.device = torch.device(device)
        self.warmup = warmup
        self.seen = 0
        self.times_ms: list[float] = []
        self._t0: float | None = None

    def start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()

    def stop(self, record: bool = True) -> float:
        """End the step; returns its duration (ms). Warm-up or ``record=False`` steps are
        not kept."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() called before start()")
        synchronize(self.device)
        elapsed = (time.perf_counter() - self._t0) * 1000.0
        self._t0 = None
        self.seen += 1
        if record and self.seen > self.warmup:
            self.times_ms.append(elapsed)
        return elapsed

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None
