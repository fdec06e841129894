"""Checks shared by the LightningModules: batch layout and resumed LR schedules."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn


def require_keys(batch: Mapping, keys: Iterable[str], module: str) -> None:
    """Raise a clear error when a batch lacks the keys a module reads.

    Raises:
        KeyError: e.g. a GPT model fed by an image datamodule; names both sides.
    """
    missing = [k for k in keys if not isinstance(batch, Mapping) or k not in batch]
    if missing:
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise KeyError(
            f"{module} needs batches with keys {sorted(keys)} but the datamodule gives {got}; "
            "pick a data config that matches the model (segmentation models: data=synthetic_seg "
            "or kvasir_seg)"
        )


def warn_if_schedule_ends_early(trainer: L.Trainer) -> None:
    """Warn when an epoch-based schedule restored from a checkpoint ends before the run does.

    Resuming with a larger ``trainer.max_epochs`` keeps the checkpoint's
    ``CosineAnnealingLR.T_max``: later epochs would train at ``eta_min`` (often 0).
    """
    for config in trainer.lr_scheduler_configs:
        t_max = getattr(config.scheduler, "T_max", None)
        if t_max is not None and trainer.max_epochs and config.interval == "epoch" \
                and t_max < trainer.max_epochs:
            rank_zero_warn(
                f"the LR schedule ends after T_max={t_max} epochs but trainer.max_epochs="
                f"{trainer.max_epochs}: epochs {t_max}..{trainer.max_epochs - 1} train at the "
                "minimum learning rate. This happens when a run is resumed (ckpt_path) with more "
                "epochs; resume with the same trainer.max_epochs, or fine-tune from the "
                "checkpoint's weights in a new run."
            )
