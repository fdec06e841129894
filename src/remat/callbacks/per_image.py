"""Per-image scores of a validation or test run (``per_image.csv``), for ``remat.eval``."""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from remat.models.metrics import SegmentationMetrics


def _group(pattern: re.Pattern[str], name: str) -> str:
    match = pattern.search(name)
    if match is None or not match.groups():
        raise ValueError(f"group_by={pattern.pattern!r} does not match image {name!r}: expected "
                         "a regex whose first group names the image's group, e.g. ^(\\D+)\\d+$")
    return match.group(1)


class PerImageMetrics(L.Callback):
    """Score every image of a validation or test run on its own; write ``per_image.csv``.

    For each image of the split: ``name``, ``depth`` (volumes only), ``height``, ``width``
    (pixels or voxels), ``group`` (with ``group_by``) and every metric of the module's set
    (``model.metrics``) computed on that
    image alone (:meth:`remat.models.metrics.SegmentationMetrics.score_one`). With
    ``group_by`` (a regex whose first group names an image's group, e.g. the city of an Inria
    tile ``austin3``), :attr:`groups` also pools the metrics over each group's pixels.

    Predictions come from the step's outputs when it returns ``{"preds": [B, H, W],
    "target": [B, H, W]}``; otherwise from the module's ``evaluate_batch`` (see
    :class:`remat.models.SegmentationModule`), recorded while the callback is attached.
    Sanity-check batches are skipped; each validation epoch starts a new table, and the file
    is written at the end of each run.

    Args:
        path: the CSV file to write.
        group_by: the regex, or None.

    Raises:
        ValueError: ``group_by`` does not match an image name; a module that gives no
            predictions (neither outputs nor ``evaluate_batch``).
    """

    def __init__(self, path: str | Path, group_by: str | None = None) -> None:
        self.path = Path(path)
        self.pattern = re.compile(group_by) if group_by else None
        self.rows: list[dict[str, Any]] = []
        self.groups: dict[str, SegmentationMetrics] = {}
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        evaluate_batch = getattr(pl_module, "evaluate_batch", None)
        if evaluate_batch is None:
            return

        def recording(batch: dict[str, Any], stage: str = "val") -> Any:
            result = evaluate_batch(batch, stage)
            self._last = (result[1], result[2])
            return result

        pl_module.evaluate_batch = recording

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.__dict__.pop("evaluate_batch", None)  # back to the class's method

    def _reset(self) -> None:
        self.rows, self.groups = [], {}

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()

    def _predictions(self, pl_module: L.LightningModule, outputs: Any
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(outputs, Mapping) and "preds" in outputs and "target" in outputs:
            return outputs["preds"], outputs["target"]
        if self._last is None:
            raise ValueError(f"{type(pl_module).__name__} gives PerImageMetrics no predictions: "
                             "its step returns no {'preds', 'target'} and it has no "
                             "evaluate_batch")
        last, self._last = self._last, None
        return last

    def _score(self, stage: str, trainer: L.Trainer, pl_module: L.LightningModule,
               outputs: Any, batch: dict[str, Any]) -> None:
        if trainer.sanity_checking:
            self._last = None
            return
        preds, target = self._predictions(pl_module, outputs)
        metrics: SegmentationMetrics = pl_module.metrics[stage]
        names = batch.get("name") or [f"{len(self.rows) + i:05d}" for i in range(len(preds))]
        for i, name in enumerate(names):
            one_pred, one_target = preds[i:i + 1], target[i:i + 1]
            row: dict[str, Any] = {"name": name}
            if getattr(pl_module, "spatial_dims", 2) == 3:  # volumes: [B, D, H, W] targets
                row["depth"] = int(target.shape[-3])
            row.update(height=int(target.shape[-2]), width=int(target.shape[-1]))
            if self.pattern is not None:
                group = row["group"] = _group(self.pattern, name)
                if group not in self.groups:
                    self.groups[group] = SegmentationMetrics(
                        metrics.kind, metrics.num_classes, metrics.ignore_index,
                        metrics.class_names).to(one_pred.device)
                self.groups[group].update(one_pred, one_target)
            self.rows.append({**row, **metrics.score_one(one_pred, one_target)})

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._score("val", trainer, pl_module, outputs, batch)

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                          outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._score("test", trainer, pl_module, outputs, batch)

    def write(self) -> None:
        """Write the rows scored so far (nothing when there are none)."""
        if not self.rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(self.rows[0]))
            writer.writeheader()
            writer.writerows(self.rows)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.write()

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write()
