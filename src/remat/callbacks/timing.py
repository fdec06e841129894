"""Lightning adapter over :class:`remat.measure.StepTimer`."""

from __future__ import annotations

import statistics
from typing import Any

import lightning as L
import torch

from remat.callbacks.memory import PeakMemoryMonitor
from remat.measure import StepTimer


class StepTimeMonitor(L.Callback):
    """Times every training batch (device-synchronised), skipping warm-up batches and the
    batches :class:`PeakMemoryMonitor` is tracking (its CPU tracker slows them).

    Logged per timed batch: ``time/step_ms`` (ms), ``time/samples_per_s`` and
    ``time/pixels_per_s`` (image batches) or ``time/tokens_per_s`` (token batches); the
    same counts Lightning's ``ThroughputMonitor`` would log, from this synchronised timer
    (ThroughputMonitor times with its own clock and needs a ``batch_size_fn``).
    ``median_ms`` is the median over the timed batches, ``None`` if the run was too short
    to time any; :meth:`throughput` turns it into per-second rates of the counted batches.
    """

    def __init__(self, warmup_batches: int = 2) -> None:
        self.warmup_batches = warmup_batches
        self.timer: StepTimer | None = None
        self._record = True
        self._counts: dict[str, list[int]] = {}

    @property
    def median_ms(self) -> float | None:
        return self.timer.median_ms if self.timer else None

    def throughput(self) -> dict[str, float | None]:
        """``samples_per_s`` and ``pixels_per_s`` or ``tokens_per_s``: the median count of a
        timed batch per median step time (``samples_per_s`` None when nothing was timed)."""
        median = self.median_ms
        if not median or not self._counts:
            return {"samples_per_s": None}
        return {f"{name}_per_s": statistics.median(counts) * 1000.0 / median
                for name, counts in self._counts.items()}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.timer = StepTimer(pl_module.device, warmup=self.warmup_batches)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._record = not any(isinstance(cb, PeakMemoryMonitor) and cb.is_tracking()
                               for cb in trainer.callbacks)
        self.timer.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        timed = len(self.timer.times_ms)
        elapsed = self.timer.stop(record=self._record)
        if len(self.timer.times_ms) > timed:  # kept: not warm-up, not memory-tracked
            pl_module.log("time/step_ms", elapsed, on_step=True, on_epoch=False, batch_size=1)
            for name, count in _batch_counts(batch).items():
                self._counts.setdefault(name, []).append(count)
                pl_module.log(f"time/{name}_per_s", count * 1000.0 / elapsed, on_step=True,
                              on_epoch=False, batch_size=1)


def _batch_counts(batch: Any) -> dict[str, int]:
    """Samples in a batch and, for ``{"image": [B, C, H, W]}`` batches, pixels (B*H*W), for
    volumes ``[B, C, D, H, W]`` voxels (B*D*H*W), or,
    for ``{"tokens": [B, T+1]}`` batches, predicted tokens (B*T)."""
    if not isinstance(batch, dict):
        return {}
    if isinstance(batch.get("image"), torch.Tensor) and batch["image"].ndim == 4:
        b, _, h, w = batch["image"].shape
        return {"samples": b, "pixels": b * h * w}
    if isinstance(batch.get("image"), torch.Tensor) and batch["image"].ndim == 5:
        b, _, d, h, w = batch["image"].shape
        return {"samples": b, "voxels": b * d * h * w}
    if isinstance(batch.get("tokens"), torch.Tensor) and batch["tokens"].ndim == 2:
        b, t = batch["tokens"].shape
        return {"samples": b, "tokens": b * (t - 1)}
    return {}
