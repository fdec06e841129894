"""LightningModule for semantic segmentation with any smp architecture and encoder."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import segmentation_models_pytorch as smp
import torch
from torch import nn
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryJaccardIndex, MulticlassJaccardIndex
from torchmetrics.segmentation import DiceScore, MeanIoU

from remat.models.base import StrategyModule
from remat.models.checks import require_keys, warn_if_schedule_ends_early
from remat.strategies import CheckpointStrategy


def build_smp_model(arch: str, encoder_name: str, encoder_weights: str | None,
                    in_channels: int, num_classes: int, **kwargs: Any) -> nn.Module:
    """Build an smp model; a wrong ``arch`` or ``encoder_name`` names the config key.

    Raises:
        ValueError: unknown ``model.arch`` or ``model.encoder_name`` (the message keeps smp's
            list of valid options).
    """
    try:
        return smp.create_model(arch, encoder_name=encoder_name, encoder_weights=encoder_weights,
                                in_channels=in_channels, classes=num_classes, **kwargs)
    except KeyError as err:
        raise ValueError(f"model.arch / model.encoder_name: {err.args[0]}") from err


class SegmentationModule(StrategyModule):
    """Binary or multiclass segmentation of ``{"image": [B,3,H,W], "mask": [B,H,W]}`` batches.

    The network is ``smp.create_model(arch, encoder_name, ...)`` (segmentation-models-pytorch);
    its output has ``num_classes`` channels (1 for binary). The activation checkpointing
    ``strategy`` is applied in place to ``stages`` (dotted paths with globs into the smp
    model, e.g. ``encoder.layer*``) when the module is built; the report is kept in
    ``strategy_report`` and logged.

    Loss (smp.losses): Dice + BCE-with-logits for binary, Dice + cross-entropy for multiclass.
    Metrics (torchmetrics), logged under ``val/``:
      - ``dice``, ``iou``: per-image scores averaged over images, as polyp papers report
        (Jha et al. 2021); foreground only for binary, mean over classes for multiclass.
      - ``dice_dataset``, ``iou_dataset``: pixels of the whole split pooled, then scored.

    Args:
        arch, encoder_name, encoder_weights, in_channels, num_classes: smp model arguments
            (``num_classes`` is smp's ``classes``); ``encoder_weights=None`` is random init.
        stages: stage paths the strategy wraps.
        strategy: a :class:`~remat.strategies.CheckpointStrategy` (default: ``none``).
        optimizer: partial optimizer, called with the parameters.
        scheduler: optional partial LR scheduler, called with the optimizer; stepped per epoch.
        arch_kwargs: extra smp model arguments (e.g. ``decoder_channels``).
        net: a ready network (``[B, in_channels, H, W]`` -> ``[B, num_classes, H, W]``) used
            instead of an smp model, e.g. a ViT segmenter; ``arch``/``encoder_*`` are then
            ignored.

    Raises:
        ValueError: ``num_classes < 1``; unknown arch/encoder.
        remat.strategies.StageError: a stage matches no module (close names are listed).
    """

    def __init__(self, arch: str = "Unet", encoder_name: str = "resnet34",
                 encoder_weights: str | None = None, in_channels: int = 3, num_classes: int = 1,
                 stages: Sequence[str] = (), strategy: CheckpointStrategy | None = None,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None,
                 arch_kwargs: dict[str, Any] | None = None, net: nn.Module | None = None) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"model.num_classes must be >= 1 (1 = binary), got {num_classes}")
        self.save_hyperparameters(ignore=["strategy", "optimizer", "scheduler", "net"])
        if net is None:
            net = build_smp_model(arch, encoder_name, encoder_weights, in_channels, num_classes,
                                  **dict(arch_kwargs or {}))
        self.wrap_net(net, stages, strategy)
        self.optimizer_factory = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        self.scheduler_factory = scheduler
        self.binary = num_classes == 1
        if self.binary:
            self.dice_loss = smp.losses.DiceLoss(mode="binary", from_logits=True)
            self.ce_loss = smp.losses.SoftBCEWithLogitsLoss()
        else:
            self.dice_loss = smp.losses.DiceLoss(mode="multiclass", from_logits=True)
            self.ce_loss = nn.CrossEntropyLoss()
        k = 2 if self.binary else num_classes
        fg = not self.binary  # include class 0 only when it is a real class
        self.val_metrics = MetricCollection({
            "dice": DiceScore(num_classes=k, include_background=fg, average="macro",
                              aggregation_level="samplewise", input_format="index"),
            "iou": MeanIoU(num_classes=k, include_background=fg, input_format="index"),
            "dice_dataset": DiceScore(num_classes=k, include_background=fg, average="macro",
                                      aggregation_level="global", input_format="index"),
            "iou_dataset": BinaryJaccardIndex() if self.binary
            else MulticlassJaccardIndex(num_classes=k, average="macro"),
        }, prefix="val/")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, in_channels, H, W]`` -> logits ``[B, num_classes, H, W]``."""
        return self.net(images)

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Dice + cross-entropy loss of a ``{"image", "mask"}`` batch (scalar)."""
        require_keys(batch, ("image", "mask"), "SegmentationModule")
        return self._loss(self(batch["image"]), batch["mask"])

    def example_batch(self, batch_size: int, size: int,
                      generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random images ``[batch_size, in_channels, size, size]`` and masks for benchmarks."""
        classes = 2 if self.binary else self.hparams.num_classes
        return {
            "image": torch.randn(batch_size, self.hparams.in_channels, size, size,
                                 generator=generator),
            "mask": torch.randint(0, classes, (batch_size, size, size), generator=generator),
        }

    def _loss(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.binary:
            target = mask.unsqueeze(1).float()
            return self.dice_loss(logits, target) + self.ce_loss(logits, target)
        return self.dice_loss(logits, mask) + self.ce_loss(logits, mask)

    def predict_labels(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C, H, W]`` -> class indices ``[B, H, W]`` (int64)."""
        if self.binary:
            return (logits[:, 0] > 0).long()
        return logits.argmax(dim=1)

    def on_train_start(self) -> None:
        warn_if_schedule_ends_early(self.trainer)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True,
                 batch_size=batch["image"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        require_keys(batch, ("image", "mask"), "SegmentationModule")
        logits = self(batch["image"])
        loss = self._loss(logits, batch["mask"])
        size = batch["image"].shape[0]
        self.log("val/loss", loss, on_epoch=True, prog_bar=True, batch_size=size)
        self.val_metrics.update(self.predict_labels(logits), batch["mask"])
        self.log_dict(self.val_metrics, on_epoch=True, prog_bar=False, batch_size=size)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
