"""Evaluate a checkpoint: ``python -m remat.eval ckpt_path=<run dir>/checkpoints/last.ckpt``.

``evaluate(cfg)`` is a plain function (the tests call it with a composed config); ``main`` is
the thin Hydra wrapper.

What is scored, and how:

* **The run's own config.** A checkpoint written by ``python train.py`` sits in
  ``<run dir>/checkpoints/``; the run's resolved ``config.yaml`` beside that folder is the
  base of the evaluation (``run_config=auto``): its ``data``, ``model``, ``precision``,
  ``task_name``, ``reference`` and ``group_by``, so a model trained at 128 px is scored at
  128 px. Key overrides on the command line (``data.image_size=256``,
  ``model.inference.patch_size=1024``, ``data.root=...``) go on top; ``data=<name>`` or
  ``model=<name>`` replace the run's node (e.g. to score a Kvasir-SEG model on CVC-ClinicDB);
  ``experiment=<name>`` is only used for checkpoints without a run folder
  (``run_config=null`` forces that). A size setting that differs from the run's warns.
* **Lightning's loop.** ``Trainer.validate`` (``split=val``) or ``Trainer.test``
  (``split=test``) runs the LightningModule's own validation/test step (whole images;
  sliding-window inference when ``model.inference`` is set) and its metric set
  (``model.metrics``), with the progress bar, ``precision`` and ``trainer.accelerator`` /
  ``trainer.devices`` of a Lightning run. :class:`PerImageMetrics`, a callback, writes
  ``per_image.csv``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from remat import run_shape
from remat.config import config_dir
from remat.data.sizes import same_size
from remat.errors import mark_in_loop, run_entry
from remat.models import SegmentationModule
from remat.models.checks import (
    check_checkpoint_fits,
    check_model_fits_data,
    is_sharded_checkpoint,
    read_checkpoint,
    sharded_weights,
)
from remat.models.metrics import SegmentationMetrics
from remat.run_config import apply_run_config, run_config_path, run_group_args

log = logging.getLogger(__name__)

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


# ----------------------------------------------------------------------------- callback


def _group(pattern: re.Pattern[str], name: str) -> str:
    match = pattern.search(name)
    if match is None or not match.groups():
        raise ValueError(f"group_by={pattern.pattern!r} does not match image {name!r}: expected "
                         "a regex whose first group names the image's group, e.g. ^(\\D+)\\d+$")
    return match.group(1)


class PerImageMetrics(L.Callback):
    """Score every image of a validation or test run on its own; write ``per_image.csv``.

    For each image of the split: ``name``, ``height``, ``width`` (pixels), ``group`` (with
    ``group_by``) and every metric of the module's set (``model.metrics``) computed on that
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
            row: dict[str, Any] = {"name": name, "height": int(target.shape[-2]),
                                   "width": int(target.shape[-1])}
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


def _print_table(title: str, rows: list[dict[str, Any]], metrics: dict[str, float | None]
                 ) -> None:
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


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


# ----------------------------------------------------------------------------- entry point


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Score ``cfg.ckpt_path`` on ``cfg.split``; write ``config.yaml`` (what was scored),
    ``per_image.csv`` and ``metrics.json`` into ``cfg.paths.output_dir`` and return the
    ``metrics.json`` content.

    ``per_image.csv``: one row per image (see :class:`PerImageMetrics`). ``metrics.json``:
    split-level metrics (fractions, and the loss) as Lightning's loop logged them, the
    references with our value beside them, image count, ``groups`` (with ``group_by``: the
    metrics over the pixels of each group's images, as Inria reports IoU per city), the run
    config used (``run_config``, None without one), the run shape (``sizes`` in pixels,
    ``precision``), wall time of the loop (s), device and torch version.

    Raises:
        ValueError: ``split`` not val/test, or ``test`` on a datamodule without a labelled
            test split (``test_set`` None after setup); a bad or unfitting checkpoint (see
            :func:`remat.models.checks.read_checkpoint`, which reads it with
            ``weights_only=True``); a model that is not a segmentation model or does not fit
            the data; more than one device; an empty split; an image name that ``group_by``
            does not match; bad files (the data check, ``data.verify``).
        FileNotFoundError: missing checkpoint or ``run_config``, or the datamodule's own
            missing-data errors.
    """
    split = str(cfg.get("split"))
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {SPLITS}")
    ckpt_path = cfg.get("ckpt_path")
    if not ckpt_path:
        raise ValueError("ckpt_path is not set: pass ckpt_path=<run dir>/checkpoints/last.ckpt")
    ckpt = read_checkpoint(ckpt_path)
    run_path = run_config_path(cfg)
    run = OmegaConf.load(run_path) if run_path is not None else None
    cfg = eval_config(cfg, run, run_path)
    shape = eval_shape(cfg)
    if run is not None:
        warn_on_size_mismatch(shape["sizes"], size_settings(run), run_path)
    else:
        log.warning("no run config for ckpt_path=%s (no config.yaml beside its checkpoints/ "
                    "folder, or run_config=null): scoring with the command line's config; "
                    "its sizes cannot be checked against the run's", ckpt_path)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved.pop("hydra", None)
    OmegaConf.save(OmegaConf.create(saved), out / "config.yaml")

    model = instantiate(cfg.model)
    if not isinstance(model, SegmentationModule):
        raise ValueError(f"remat.eval scores segmentation models; model._target_ built "
                         f"{type(model).__name__}")
    check_checkpoint_fits(model, ckpt, ckpt_path)
    if is_sharded_checkpoint(ckpt_path):  # trainer=fsdp: gather the shards on this process
        ckpt["state_dict"] = sharded_weights(ckpt_path)
    model.load_state_dict(ckpt["state_dict"])  # read once, weights_only, fit checked above
    datamodule = instantiate(cfg.data)
    check_model_fits_data(model, datamodule)
    if split == "all":
        if not hasattr(datamodule, "eval_all"):
            raise ValueError(f"split=all scores every labelled image of a file dataset; "
                             f"data._target_={cfg.data.get('_target_')} has no files")
        datamodule.eval_all = True
    datamodule.setup("test" if split == "test" else "validate")
    if split == "test" and getattr(datamodule, "test_set", None) is None:
        raise ValueError(
            f"split=test: data._target_={cfg.data.get('_target_')} has no labelled test split "
            "here (its test loader would score the val images again); use split=val, or "
            "configure a labelled test split of the dataset (e.g. data.test_tiles)")

    writer = PerImageMetrics(out / "per_image.csv", cfg.get("group_by"))
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=[writer], logger=False,
                                     enable_checkpointing=False)
    loop = trainer.test if split == "test" else trainer.validate
    start = time.perf_counter()
    with mark_in_loop():
        logged = loop(model, datamodule=datamodule, verbose=False)
    wall_s = time.perf_counter() - start
    if not writer.rows:
        raise ValueError(f"the {split} split of data._target_={cfg.data.get('_target_')} "
                         "holds no images")
    prefix = "test/" if split == "test" else "val/"
    overall = {k[len(prefix):]: _finite(v) for k, v in logged[0].items() if k.startswith(prefix)}
    reference = cfg.get("reference")
    references = [] if reference is None else OmegaConf.to_container(reference, resolve=True)
    result = {
        "task_name": cfg.get("task_name"),
        "ckpt_path": str(ckpt_path),
        "run_config": str(run_path) if run_path else None,
        "split": split,
        "num_images": len(writer.rows),
        "metrics": {prefix + k: v for k, v in overall.items()},
        "reference": compare_with_references(overall, list(references)),
        "groups": {g: {prefix + k: _finite(v) for k, v in m.compute().items()}
                   for g, m in sorted(writer.groups.items())},
        "sizes": shape["sizes"],
        "resolution": resolution_of(datamodule),
        "precision": shape["precision"],
        "wall_s": wall_s,
        "device": str(trainer.strategy.root_device),
        "torch_version": torch.__version__,
    }
    (out / "metrics.json").write_text(json.dumps(result, indent=2))
    _print_table(f"{cfg.get('task_name')}: {split} split, {len(writer.rows)} images, scored "
                 f"at {result['resolution']}", result["reference"], overall)
    for group, values in result["groups"].items():
        log.info("group %s: %s", group, ", ".join(
            f"{k}={v:.4f}" for k, v in values.items() if v is not None))
    log.info("per-image and overall metrics written to %s", out)
    return result


def resolution_of(datamodule: Any) -> str:
    """``"native resolution"`` where the evaluation images are served whole at their own
    size, else ``"<h>x<w> px (resized)"`` (datamodules that resize, as Kvasir-SEG's)."""
    size = getattr(datamodule, "image_size", None)
    if getattr(datamodule, "resizes_for_eval", False) and size is not None:
        height, width = size if isinstance(size, tuple | list) else (size, size)
        return f"{height}x{width} px (resized)"
    return "native resolution"


def _app(cfg: DictConfig) -> None:
    run_entry(evaluate, cfg)


_hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir()),
                         config_name="eval")(_app)


def main() -> None:
    """``python -m remat.eval`` / ``remat-eval``: :func:`evaluate` with the run's own data
    and model composed first (:func:`remat.run_config.run_group_args`); a user error ends
    with ``error: <message>`` and exit code 1 (:func:`remat.errors.run_entry`)."""
    sys.argv[1:] = run_group_args(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
