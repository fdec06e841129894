"""Segmentation metrics as each benchmark defines them, chosen by name (``model.metrics``).

All sets take predicted class indices and targets ``[B, H, W]`` (int64; volumes
``[B, D, H, W]``); target pixels equal
to ``ignore_index`` (LoveDA no-data, Dubai unlabelled black, DRIVE outside the field of
view) count for nothing. Scores are fractions in ``[0, 1]``. The scores come from
torchmetrics; this module only picks and names them per benchmark:

``per_image`` (Kvasir-SEG, CVC-ClinicDB, ISIC 2018; Jha et al. 2021, arXiv 2011.07631):
    ``dice``, ``iou``: Dice ``2|P∩T| / (|P|+|T|)`` and IoU ``|P∩T| / |P∪T|`` of each image,
    averaged over images (binary: the foreground class; multiclass: mean over classes);
    ``dice_dataset``, ``iou_dataset``: the same with the pixels of the whole split pooled.
``binary_pooled`` (ISBI 2012 membrane, DRIVE vessels, Inria, Massachusetts, DeepGlobe):
    ``dice`` (= F1), ``iou`` of the foreground class and pixel accuracy ``acc``, each from
    TP/FP/FN/TN counted over all pixels of the split (Inria's "IoU" and "accuracy", Maggiori
    et al. 2017; mmsegmentation's DRIVE Dice).
``multiclass`` (LoveDA, Dubai aerial):
    ``miou``: IoU per class from a confusion matrix over the split, averaged over the classes
    present in prediction or target (torchmetrics ``MulticlassJaccardIndex``, ``macro``);
    ``iou_<class name>``: each class's IoU (NaN when the class is absent from both);
    ``acc``: pixel accuracy over non-ignored pixels.
``volume`` (3D organ and tumour segmentation: the Medical Segmentation Decathlon, MONAI's
spleen and BTCV recipes):
    ``dice_<class name>``: Dice of each foreground class per volume, averaged over the
    volumes where the class is in the prediction or the target (torchmetrics
    ``DiceScore``, ``samplewise``, as MONAI's ``DiceMetric`` with ``ignore_empty``);
    ``dice``: the mean of those per-class values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryF1Score,
    BinaryJaccardIndex,
    MulticlassAccuracy,
    MulticlassJaccardIndex,
)
from torchmetrics.segmentation import DiceScore, MeanIoU

METRIC_SETS = ("per_image", "binary_pooled", "multiclass", "volume")


def resolve_metric_set(kind: str, num_classes: int) -> str:
    """``model.metrics``, with ``auto`` resolved: ``per_image`` for a binary model
    (``num_classes == 1``), ``multiclass`` otherwise; other names as given."""
    if kind == "auto":
        return "per_image" if num_classes == 1 else "multiclass"
    return kind


class SegmentationMetrics(nn.Module):
    """One benchmark's metric set over predictions and targets ``[B, H, W]`` (int64).

    Args:
        kind: one of :data:`METRIC_SETS` (definitions in the module docstring), or
            ``"auto"`` (:func:`resolve_metric_set`).
        num_classes: model output channels, 1 = binary (class indices 0/1).
        ignore_index: target value that is excluded from every score.
        class_names: names for ``iou_<name>`` (``multiclass``); default ``class<i>``.

    Raises:
        ValueError: unknown ``kind``; ``binary_pooled`` with ``num_classes != 1``;
            ``multiclass`` with ``num_classes < 2``; ``class_names`` of the wrong length.
    """

    def __init__(self, kind: str = "per_image", num_classes: int = 1, ignore_index: int = 255,
                 class_names: Sequence[str] | None = None) -> None:
        super().__init__()
        kind = resolve_metric_set(kind, num_classes)
        if kind not in METRIC_SETS:
            raise ValueError(f"model.metrics must be auto or one of {METRIC_SETS}, got "
                             f"{kind!r}")
        if kind == "binary_pooled" and num_classes != 1:
            raise ValueError(f"model.metrics=binary_pooled needs model.num_classes=1 (binary), "
                             f"got {num_classes}")
        if kind == "multiclass" and num_classes < 2:
            raise ValueError(f"model.metrics=multiclass needs model.num_classes >= 2, got "
                             f"{num_classes}")
        count = max(2, num_classes) if kind == "volume" else num_classes
        names = list(class_names) if class_names else (
            ["background", "foreground"] if kind == "volume" and num_classes == 1
            else [f"class{i}" for i in range(count)])
        if kind in ("multiclass", "volume") and len(names) != count:
            raise ValueError(f"model.class_names has {len(names)} names for "
                             f"model.num_classes={num_classes} ({count} classes, background "
                             f"first): {names}")
        self.kind, self.num_classes, self.ignore_index = kind, num_classes, ignore_index
        self.class_names = names
        self.binary = num_classes == 1
        self.collection = MetricCollection(self._build())
        # pooled IoU of the per_image set takes class indices (ignore_index honoured there)
        self.pooled = MetricCollection({"iou_dataset": (
            BinaryJaccardIndex(ignore_index=ignore_index) if self.binary
            else MulticlassJaccardIndex(num_classes, average="macro", ignore_index=ignore_index))
        }) if kind == "per_image" else None

    def _build(self) -> dict[str, Metric]:
        ignore = self.ignore_index
        if self.kind == "per_image":
            k = 2 if self.binary else self.num_classes
            bg = not self.binary  # class 0 is a real class only in multiclass sets
            return {
                "dice": DiceScore(num_classes=k, include_background=bg, average="macro",
                                  aggregation_level="samplewise", input_format="one-hot"),
                "iou": MeanIoU(num_classes=k, include_background=bg, input_format="one-hot"),
                "dice_dataset": DiceScore(num_classes=k, include_background=bg, average="macro",
                                          aggregation_level="global", input_format="one-hot"),
            }
        if self.kind == "volume":
            return {"dice_class": DiceScore(num_classes=max(2, self.num_classes),
                                            include_background=False, average="none",
                                            aggregation_level="samplewise",
                                            input_format="one-hot")}
        if self.kind == "binary_pooled":
            return {"dice": BinaryF1Score(ignore_index=ignore),
                    "iou": BinaryJaccardIndex(ignore_index=ignore),
                    "acc": BinaryAccuracy(ignore_index=ignore)}
        return {
            "miou": MulticlassJaccardIndex(self.num_classes, average="macro",
                                           ignore_index=ignore),
            "iou_class": MulticlassJaccardIndex(self.num_classes, average="none",
                                                ignore_index=ignore,
                                                zero_division=float("nan")),
            "acc": MulticlassAccuracy(self.num_classes, average="micro", ignore_index=ignore),
        }

    def _one_hot(self, labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        k = 2 if self.binary else self.num_classes
        hot = torch.nn.functional.one_hot(labels.clamp(0, k - 1), k).movedim(-1, 1)
        return hot * keep.unsqueeze(1)  # ignored pixels belong to no class

    @torch.no_grad()
    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Add a batch: ``preds``, ``target`` ``[B, H, W]`` (volumes ``[B, D, H, W]``)
        int64 class indices.

        Raises:
            ValueError: shapes differ.
        """
        if preds.shape != target.shape:
            raise ValueError(f"predictions {tuple(preds.shape)} and masks "
                             f"{tuple(target.shape)} differ in shape")
        if self.kind == "volume":
            keep = target != self.ignore_index
            self.collection.update(self._one_hot(preds, keep), self._one_hot(target, keep))
        elif self.kind == "per_image":
            keep = target != self.ignore_index
            self.collection.update(self._one_hot(preds, keep), self._one_hot(target, keep))
            assert self.pooled is not None
            self.pooled.update(preds.clamp(0, 1) if self.binary else preds, target)
        else:
            if self.kind == "binary_pooled":
                preds = preds.clamp(0, 1)
            self.collection.update(preds, target)

    def compute(self) -> dict[str, torch.Tensor]:
        """Scalar scores by name (``iou_class`` expanded into ``iou_<class name>``)."""
        out: dict[str, torch.Tensor] = {}
        values = dict(self.collection.compute())
        if self.pooled is not None:
            values.update(self.pooled.compute())
        for name, value in values.items():
            if name == "iou_class":
                out.update({f"iou_{c}": v for c, v in zip(self.class_names, value, strict=True)})
            elif name == "dice_class":
                value = value.float().reshape(-1)
                out.update({f"dice_{c}": v for c, v in
                            zip(self.class_names[1:], value, strict=True)})
                out["dice"] = value.nanmean()
            else:
                out[name] = value.float().mean() if value.ndim else value.float()
        return out

    def names(self) -> list[str]:
        """The score names :meth:`compute` returns (``iou_<class name>`` per class;
        ``volume``: ``dice_<class name>`` per foreground class and ``dice``)."""
        out = [n for n in self.collection.keys() if n not in ("iou_class", "dice_class")]
        if self.pooled is not None:
            out += list(self.pooled.keys())
        if "iou_class" in self.collection.keys():
            out += [f"iou_{c}" for c in self.class_names]
        if "dice_class" in self.collection.keys():
            out += [f"dice_{c}" for c in self.class_names[1:]] + ["dice"]
        return out

    def reset(self) -> None:
        """Forget every batch added so far."""
        self.collection.reset()
        if self.pooled is not None:
            self.pooled.reset()

    def score_one(self, preds: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        """Scores of one image alone (``[1, H, W]`` each), leaving the running state alone."""
        single = SegmentationMetrics(self.kind, self.num_classes, self.ignore_index,
                                     self.class_names).to(preds.device)
        single.update(preds, target)
        return {k: float(v) for k, v in single.compute().items()}
