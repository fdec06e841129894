"""What ``python -m remat.eval`` needs besides Lightning's loop: the evaluation's config and
shape (the run's :data:`RUN_KEYS` under the command line, size settings checked against the
run's), and the report (our metrics beside the published ``reference:`` values). The
per-image scores come from :class:`remat.callbacks.PerImageMetrics`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from remat import run_shape
from remat.data.sizes import same_size
from remat.run_config import apply_run_config

SPLITS = ("val", "test", "all")
# Top-level keys an evaluation takes from the run's config.yaml.
RUN_KEYS = ("data", "model", "precision", "seed", "task_name", "reference", "group_by",
            "monitor", "monitor_mode")
# Size settings compared between the run and its evaluation (pixels; a side or [h, w]).
SIZE_KEYS = ("data.image_size", "data.patch_size", "model.inference.patch_size")


# ----------------------------------------------------------------------------- config


def eval_config(cfg: DictConfig, run: DictConfig | None, run_path: Path | None = None
                ) -> DictConfig:
    """The config to evaluate with: the :data:`RUN_KEYS` of the run's ``config.yaml`` under
    the command line's overrides (:func:`remat.run_config.apply_run_config`)."""
    return apply_run_config(cfg, run, run_path, RUN_KEYS)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def size_settings(cfg: DictConfig) -> dict[str, Any]:
    """``{key: value or None}`` of the :data:`SIZE_KEYS` of a config (a side or ``[h, w]``,
    pixels)."""
    return {key: _plain(OmegaConf.select(cfg, key, default=None)) for key in SIZE_KEYS}


def eval_shape(cfg: DictConfig) -> dict[str, Any]:
    """Size settings (pixels), precision and devices of an evaluation (precision checked by
    :func:`remat.run_shape.check_precision`, as for training).

    Returns ``{"sizes": {key: value or None for SIZE_KEYS}, "precision": str,
    "accelerator": str, "devices": int | list | str}``.

    Raises:
        ValueError: ``trainer.devices`` other than one device (per-image rows and pooled
            metrics need every image exactly once; a DistributedSampler pads splits).
    """
    devices = _plain(cfg.trainer.get("devices", 1))
    if not (devices == 1 or (isinstance(devices, list) and len(devices) == 1)):
        raise ValueError(f"remat.eval scores on one device; got trainer.devices={devices} "
                         "(use trainer.devices=1, or trainer.devices=[<index>] for one GPU)")
    return {
        "sizes": size_settings(cfg),
        "precision": run_shape.check_precision(cfg.get("precision"),
                                               cfg.trainer.get("accelerator", "auto")),
        "accelerator": str(cfg.trainer.get("accelerator", "auto")),
        "devices": devices,
    }


def warn_on_size_mismatch(ours: Mapping[str, Any], trained: Mapping[str, Any],
                          run_path: Path) -> list[str]:
    """Warn (``UserWarning``) for every size setting that differs from the run's; returns the
    messages. ``128`` and ``[128, 128]`` count as the same size."""
    messages = [f"{key}={ours.get(key)} but the run trained with {key}={trained.get(key)} "
                f"({run_path}); scores at another size than the run's differ from its own"
                for key in SIZE_KEYS if not same_size(ours.get(key), trained.get(key))]
    for message in messages:
        warnings.warn(message, UserWarning, stacklevel=2)
    return messages


# ----------------------------------------------------------------------------- report


def compare_with_references(metrics: dict[str, float | None],
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


def print_reference_table(title: str, rows: list[dict[str, Any]], metrics: dict[str, float | None]
                          ) -> None:
    """Print (rich) a table of ``rows`` (:func:`compare_with_references`: metric, ours,
    published, model, source) under ``title``, then every metric of ``metrics`` (fractions)
    no reference lists."""
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
            table.add_row(name, "-" if value is None else f"{value:.4f}", "", "", "")
    Console().print(table)


def finite_or_none(value: Any) -> float | None:
    """``float(value)``, or None when it is NaN or infinite (JSON has neither)."""
    value = float(value)
    return value if math.isfinite(value) else None


def resolution_of(datamodule: Any) -> str:
    """``"native resolution"`` where the evaluation images are served whole at their own
    size, ``"<h>x<w> px (resized)"`` for datamodules that resize (as Kvasir-SEG's), and
    ``"resampled to <x>x<y>x<z> mm voxels (data.pixdim)"`` for volumes resampled to a voxel
    size (``data.pixdim``), where Dice is scored on that grid."""
    pixdim = getattr(datamodule, "pixdim", None)
    if pixdim is not None:
        return f"resampled to {'x'.join(f'{v:g}' for v in pixdim)} mm voxels (data.pixdim)"
    size = getattr(datamodule, "image_size", None)
    if getattr(datamodule, "resizes_for_eval", False) and size is not None:
        height, width = size if isinstance(size, tuple | list) else (size, size)
        return f"{height}x{width} px (resized)"
    return "native resolution"
