"""Evaluate a checkpoint: ``python -m remat.eval experiment=... ckpt_path=...``.

``evaluate(cfg)`` is a plain function (the tests call it with a composed config); ``main`` is
the thin Hydra wrapper. The experiment's datamodule gives whole images of the ``val`` or
``test`` split at full resolution; the model's own inference (sliding windows when
``model.inference`` is set) and metric set (``model.metrics``) score them.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from remat import run_shape
from remat.config import config_dir
from remat.models import SegmentationModule
from remat.models.checks import check_checkpoint_fits, read_checkpoint
from remat.models.metrics import SegmentationMetrics

log = logging.getLogger(__name__)

SPLITS = ("val", "test")


def load_checkpoint(model: torch.nn.Module, ckpt_path: str | Path) -> dict[str, Any]:
    """Load a Lightning checkpoint's ``state_dict`` into ``model`` (strict).

    Returns the checkpoint dict. State-dict keys do not depend on the checkpointing strategy,
    so a checkpoint trained under any strategy loads here.

    Raises:
        FileNotFoundError: ``ckpt_path`` does not exist.
        ValueError: the file is not a Lightning checkpoint, or its hyper-parameters or
            weights do not fit the configured model (the differing keys and shapes listed).
    """
    ckpt = read_checkpoint(ckpt_path)
    check_checkpoint_fits(model, ckpt, ckpt_path)
    model.load_state_dict(ckpt["state_dict"])
    return ckpt


def compare_with_references(metrics: dict[str, float],
                            references: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ``reference:`` entry with ``ours`` added: our value of the same metric.

    ``metric`` names like ``val/dice`` match our ``dice`` on whichever split was scored;
    ``ours`` is None when we do not compute that metric.
    """
    rows = []
    for ref in references:
        name = str(ref.get("metric", "")).split("/", 1)[-1]
        rows.append({**ref, "ours": metrics.get(name)})
    return rows


def _print_table(title: str, rows: list[dict[str, Any]], metrics: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("metric", "ours", "published", "model", "source"):
        table.add_column(column)
    listed = set()
    for row in rows:
        ours, value = row["ours"], row.get("value")
        table.add_row(str(row.get("metric")), "-" if ours is None else f"{ours:.4f}",
                      "not verified" if value is None else f"{value:.4f}",
                      str(row.get("model", "")), str(row.get("source", "")))
        listed.add(str(row.get("metric", "")).split("/", 1)[-1])
    for name, value in metrics.items():
        if name not in listed:
            table.add_row(name, f"{value:.4f}", "", "", "")
    Console().print(table)


def _finite(value: torch.Tensor | float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _group(pattern: re.Pattern[str], name: str) -> str:
    match = pattern.search(name)
    if match is None or not match.groups():
        raise ValueError(f"group_by={pattern.pattern!r} does not match image {name!r}: expected "
                         "a regex whose first group names the image's group, e.g. ^(\\D+)\\d+$")
    return match.group(1)


def _device(name: str) -> torch.device:
    return run_shape.resolve_device(name)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Score ``cfg.ckpt_path`` on ``cfg.split``; write ``per_image.csv`` and ``metrics.json``
    into ``cfg.paths.output_dir`` and return the ``metrics.json`` content.

    ``per_image.csv``: one row per image (``name``, ``height``, ``width`` in pixels, and each
    metric of the model's set computed on that image alone). ``metrics.json``: split-level
    metrics (fractions), the references with our value beside them, image count, wall time
    (s), device and torch version; with ``group_by`` (a regex whose first group names an
    image's group, e.g. the city of an Inria tile ``austin3``) also ``groups``: the metrics
    over the pixels of each group's images, as Inria reports IoU per city.

    Raises:
        ValueError: ``split`` not val/test, or ``test`` on a datamodule without a labelled
            test split (``test_set`` None after setup); a bad or unfitting checkpoint (see
            :func:`load_checkpoint`); a model that is not a segmentation model; an empty split;
            an image name that ``group_by`` does not match.
        FileNotFoundError: missing checkpoint, or the datamodule's own missing-data errors.
    """
    split = str(cfg.get("split"))
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {SPLITS}")
    ckpt_path = cfg.get("ckpt_path")
    if not ckpt_path:
        raise ValueError("ckpt_path is not set: pass ckpt_path=<run dir>/checkpoints/last.ckpt")
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = instantiate(cfg.model)
    if not isinstance(model, SegmentationModule):
        raise ValueError(f"remat.eval scores segmentation models; model._target_ built "
                         f"{type(model).__name__}")
    load_checkpoint(model, ckpt_path)
    device = _device(str(cfg.get("device", "auto")))
    model.to(device).eval()
    datamodule = instantiate(cfg.data)
    datamodule.setup("validate" if split == "val" else "test")
    if split == "test" and getattr(datamodule, "test_set", None) is None:
        raise ValueError(
            f"split=test: data._target_={cfg.data.get('_target_')} has no labelled test split "
            "here (its test loader would score the val images again); use split=val, or "
            "configure a labelled test split of the dataset (e.g. data.test_tiles)")
    loader = datamodule.val_dataloader() if split == "val" else datamodule.test_dataloader()
    metrics = model.metrics[split]
    metrics.reset()
    group_by = cfg.get("group_by")
    pattern = re.compile(str(group_by)) if group_by else None
    groups: dict[str, SegmentationMetrics] = {}
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    with torch.no_grad():
        for batch in loader:
            names = batch.get("name") or [f"{len(rows) + i:05d}"
                                          for i in range(batch["image"].shape[0])]
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in batch.items()}
            _, preds, target = model.evaluate_batch(batch, split)
            for i, name in enumerate(names):
                scores = metrics.score_one(preds[i:i + 1], target[i:i + 1])
                row = {"name": name, "height": int(target.shape[-2]),
                       "width": int(target.shape[-1])}
                if pattern is not None:
                    row["group"] = _group(pattern, name)
                    if row["group"] not in groups:
                        groups[row["group"]] = SegmentationMetrics(
                            metrics.kind, metrics.num_classes, metrics.ignore_index,
                            metrics.class_names).to(device)
                    groups[row["group"]].update(preds[i:i + 1], target[i:i + 1])
                rows.append({**row, **scores})
    if not rows:
        raise ValueError(f"the {split} split of data._target_={cfg.data.get('_target_')} "
                         "holds no images")
    overall = {k: float(v) for k, v in metrics.compute().items()}
    wall_s = time.perf_counter() - start
    with (out / "per_image.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    reference = cfg.get("reference")
    references = [] if reference is None else OmegaConf.to_container(reference, resolve=True)
    result = {
        "task_name": cfg.get("task_name"),
        "ckpt_path": str(ckpt_path),
        "split": split,
        "num_images": len(rows),
        "metrics": {f"{split}/{k}": _finite(v) for k, v in overall.items()},
        "reference": compare_with_references(overall, list(references)),
        "groups": {g: {f"{split}/{k}": _finite(v) for k, v in m.compute().items()}
                   for g, m in sorted(groups.items())},
        "wall_s": wall_s,
        "device": str(device),
        "torch_version": torch.__version__,
    }
    (out / "metrics.json").write_text(json.dumps(result, indent=2))
    _print_table(f"{cfg.get('task_name')}: {split} split, {len(rows)} images",
                 result["reference"], overall)
    for group, values in result["groups"].items():
        log.info("group %s: %s", group, ", ".join(
            f"{k}={v:.4f}" for k, v in values.items() if v is not None))
    log.info("per-image and overall metrics written to %s", out)
    return result


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="eval")
def main(cfg: DictConfig) -> None:
    """Hydra app around :func:`evaluate`."""
    evaluate(cfg)


if __name__ == "__main__":
    main()
