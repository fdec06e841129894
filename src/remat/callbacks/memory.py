"""Lightning adapter over :class:`remat.measure.PeakMemory`."""

from __future__ import annotations

from typing import Any

import lightning as L

from remat.measure import PeakMemory
from remat.strategies import CompileBudget


class PeakMemoryMonitor(L.Callback):
    """Measures the peak memory of the first ``track_batches`` training batches.

    Each tracked batch (forward, backward and, when due, the optimizer step) runs inside
    its own :class:`~remat.measure.PeakMemory`; the maximum is kept. On CPU the tracker is
    exact but slows the tracked batches, so :class:`StepTimeMonitor` skips them.

    Logged: ``mem/peak_bytes`` (bytes) once tracking ends; read ``peak_bytes`` afterwards.
    Only the total is kept: Lightning runs forward and backward inside
    ``optimizer.step(closure)``, so MemTracker would file activations under optimizer
    state. On CPU with the ``compile`` strategy nothing is measured (MemTracker and
    torch.compile cannot run together): ``peak_bytes`` stays ``None`` and
    ``skipped_reason`` says why.
    """

    def __init__(self, track_batches: int = 2) -> None:
        if track_batches < 0:
            raise ValueError(f"PeakMemoryMonitor: track_batches must be >= 0, got {track_batches}")
        self.track_batches = track_batches
        self.peak_bytes: int | None = None
        self.tracked = 0
        self.skipped_reason: str | None = None
        self._current: PeakMemory | None = None

    def is_tracking(self) -> bool:
        """Whether the current (or next) training batch is one this monitor measures."""
        return self._current is not None or self.tracked < self.track_batches

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.tracked >= self.track_batches or self.skipped_reason:
            return
        if pl_module.device.type != "cuda" and isinstance(getattr(pl_module, "strategy", None),
                                                          CompileBudget):
            # torch.compile refuses to trace while MemTracker's dispatch mode is active
            self.skipped_reason = ("not measured: the CPU tracker (MemTracker) cannot run "
                                   "while torch.compile traces the compiled stages")
            self.tracked = self.track_batches
            return
        self._current = PeakMemory(pl_module.device, modules=[pl_module],
                                   optimizers=trainer.optimizers)
        self._current.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._current is None:
            return
        self._current.__exit__(None, None, None)
        peak, self._current = self._current, None
        self.tracked += 1
        if self.peak_bytes is None or peak.peak_bytes > self.peak_bytes:
            self.peak_bytes = peak.peak_bytes
        if self.tracked == self.track_batches:
            pl_module.log("mem/peak_bytes", float(self.peak_bytes), on_step=True,
                          on_epoch=False, batch_size=1)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        if self._current is not None:
            self._current.__exit__(type(exception), exception, None)
            self._current = None

    def state_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes,
                "tracked": self.tracked}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.peak_bytes = state_dict.get("peak_bytes")
        self.tracked = state_dict.get("tracked", 0)
