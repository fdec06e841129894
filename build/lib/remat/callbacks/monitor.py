"""Fail early when the metric that picks the best checkpoint is never logged."""

from __future__ import annotations

import lightning as L


class MonitorCheck(L.Callback):
    """Raise after the first validation (the sanity check included) when a checkpoint
    callback's ``monitor`` key was not logged, instead of Lightning's error after an epoch.

    Only ``val/`` keys are checked (``train/`` keys appear after the first epoch).

    Raises:
        ValueError: names ``monitor`` and lists the logged ``val/`` keys.
    """

    def __init__(self) -> None:
        self.done = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.done:
            return
        self.done = True
        logged = set(trainer.callback_metrics)
        for cb in trainer.checkpoint_callbacks:
            key = getattr(cb, "monitor", None)
            if key and key.startswith("val/") and key not in logged:
                available = sorted(k for k in logged if k.startswith("val/"))
                raise ValueError(
                    f"monitor={key} is not among the metrics this model logs in validation; "
                    f"available val/ keys: {', '.join(available) or 'none'} (set monitor= and "
                    "monitor_mode= to one of them, e.g. monitor=val/loss monitor_mode=min)")
