"""Lightning adapter over :class:`remat.measure.PeakMemory`."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from remat.measure import PeakMemory


class PeakMemoryMonitor(L.Callback):
    """Measures the peak memory of the first ``track_batches`` training batches, and of each
    epoch where that is cheap.

    Each tracked batch (forward, backward and, when due, the optimizer step) runs inside
    its own :class:`~remat.measure.PeakMemory`; the maximum is kept. On CPU the tracker is
    exact but slows the tracked batches, so :class:`StepTimeMonitor` skips them.

    Logged (bytes): ``mem/step_peak_bytes`` per tracked batch, ``mem/peak_bytes`` (their
    maximum) once tracking ends, ``mem/epoch_peak_bytes`` per epoch. The epoch peak is the
    allocator's peak over the whole epoch on CUDA; on CPU only the tracked batches are
    measured, so it is their maximum within that epoch (absent for epochs without one).
    Only totals are kept: Lightning runs forward and backward inside
    ``optimizer.step(closure)``, so MemTracker would file activations under optimizer state
    (the per-category split is given by :mod:`remat.estimate` and
    :func:`remat.measure.step_peak_memory`, which step the optimizer after backward). On CPU
    with the ``compile`` strategy nothing is measured (MemTracker and torch.compile cannot
    run together): ``peak_bytes`` stays ``None`` and ``skipped_reason`` says why.

    Raises:
        ValueError: ``track_batches < 0``.
    """

    def __init__(self, track_batches: int = 2) -> None:
        if track_batches < 0:
            raise ValueError(f"PeakMemoryMonitor: track_batches must be >= 0, got {track_batches}")
        self.track_batches = track_batches
        self.peak_bytes: int | None = None
        self.reserved_bytes: int | None = None
        self.step_peaks: list[int] = []
        self.epoch_peaks: list[int | None] = []
        self.tracked = 0
        self.skipped_reason: str | None = None
        self._current: PeakMemory | None = None
        self._epoch_peak: int | None = None

    def is_tracking(self) -> bool:
        """Whether the current (or next) training batch is one this monitor measures."""
        return self._current is not None or self.tracked < self.track_batches

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_peak = None
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.tracked >= self.track_batches or self.skipped_reason:
            return
        strategy = getattr(pl_module, "strategy", None)
        if pl_module.device.type != "cuda" and not getattr(strategy, "measurable_on_cpu", True):
            # e.g. torch.compile refuses to trace while MemTracker's dispatch mode is active
            self.skipped_reason = ("not measured: the CPU tracker (MemTracker) cannot run "
                                   "while torch.compile traces the compiled stages")
            self.tracked = self.track_batches
            return
        self._current = PeakMemory(pl_module.device, modules=[pl_module],
                                   optimizers=trainer.optimizers, split=False)
        self._current.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":  # peak since the last reset (epoch or step)
            allocated = int(torch.cuda.max_memory_allocated(pl_module.device))
            self._epoch_peak = max(self._epoch_peak or 0, allocated)
        if self._current is None:
            return
        self._current.__exit__(None, None, None)
        peak, self._current = self._current, None
        self.tracked += 1
        self.step_peaks.append(int(peak.peak_bytes))
        self._epoch_peak = max(self._epoch_peak or 0, int(peak.peak_bytes))
        if peak.reserved_bytes is not None:
            self.reserved_bytes = max(self.reserved_bytes or 0, peak.reserved_bytes)
        if self.peak_bytes is None or peak.peak_bytes > self.peak_bytes:
            self.peak_bytes = peak.peak_bytes
        pl_module.log("mem/step_peak_bytes", float(peak.peak_bytes), on_step=True,
                      on_epoch=False, batch_size=1)
        if self.tracked == self.track_batches:
            pl_module.log("mem/peak_bytes", float(self.peak_bytes), on_step=True,
                          on_epoch=False, batch_size=1)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_peaks.append(self._epoch_peak)
        if self._epoch_peak is not None:
            pl_module.log("mem/epoch_peak_bytes", float(self._epoch_peak), on_step=False,
                          on_epoch=True, batch_size=1)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        if self._current is not None:
            self._current.__exit__(type(exception), exception, None)
            self._current = None

    def state_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "tracked": self.tracked,
                "reserved_bytes": self.reserved_bytes, "step_peaks": list(self.step_peaks),
                "epoch_peaks": list(self.epoch_peaks)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.peak_bytes = state_dict.get("peak_bytes")
        self.tracked = state_dict.get("tracked", 0)
        self.reserved_bytes = state_dict.get("reserved_bytes")
        self.step_peaks = list(state_dict.get("step_peaks", []))
        self.epoch_peaks = list(state_dict.get("epoch_peaks", []))
