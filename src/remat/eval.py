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

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from remat.callbacks import PerImageMetrics
from remat.config import config_dir
from remat.errors import mark_in_loop, run_entry
from remat.evaluation import (
    SPLITS,
    compare_with_references,
    eval_config,
    eval_shape,
    finite_or_none,
    print_reference_table,
    resolution_of,
    size_settings,
    warn_on_size_mismatch,
)
from remat.models import SegmentationModule
from remat.models.checks import (
    check_checkpoint_fits,
    check_model_fits_data,
    is_sharded_checkpoint,
    read_checkpoint,
    restore_datamodule_state,
    sharded_weights,
)
from remat.run_config import run_config_path, run_group_args

log = logging.getLogger(__name__)


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
    restore_datamodule_state(datamodule, ckpt)
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
    overall = {k[len(prefix):]: finite_or_none(v) for k, v in logged[0].items()
               if k.startswith(prefix)}
    reference = cfg.get("reference")
    references = [] if reference is None else OmegaConf.to_container(reference, resolve=True)
    other = run is not None and _other_data(cfg.data, run.get("data"))
    if references and other:  # a benchmark's published scores are for its own data
        log.info("published scores of %s not shown: scored on other data (%s) than the run "
                 "trained on", cfg.get("task_name"), other)
        references = []
    result = {
        "task_name": cfg.get("task_name"),
        "ckpt_path": str(ckpt_path),
        "run_config": str(run_path) if run_path else None,
        "split": split,
        "num_images": len(writer.rows),
        "metrics": {prefix + k: v for k, v in overall.items()},
        "reference": compare_with_references(overall, list(references)),
        "groups": {g: {prefix + k: finite_or_none(v) for k, v in m.compute().items()}
                   for g, m in sorted(writer.groups.items())},
        "sizes": shape["sizes"],
        "resolution": resolution_of(datamodule),
        "precision": shape["precision"],
        "wall_s": wall_s,
        "device": str(trainer.strategy.root_device),
        "torch_version": torch.__version__,
    }
    (out / "metrics.json").write_text(json.dumps(result, indent=2))
    print_reference_table(f"{cfg.get('task_name')}: {split} split, {len(writer.rows)} images, "
                          f"scored at {result['resolution']}", result["reference"], overall)
    for group, values in result["groups"].items():
        log.info("group %s: %s", group, ", ".join(
            f"{k}={v:.4f}" for k, v in values.items() if v is not None))
    log.info("per-image and overall metrics written to %s", out)
    return result


def _other_data(data: DictConfig, trained: Any) -> str | None:
    """What differs between the data scored (``data``) and the run's (``trained``): its
    ``_target_`` or ``root``, as ``key=value``; None when neither does."""
    if not isinstance(trained, DictConfig):
        return None
    for key in ("_target_", "root"):
        if str(data.get(key)) != str(trained.get(key)):
            return f"data.{key}={data.get(key)}"
    return None


def _app(cfg: DictConfig) -> None:
    run_entry(evaluate, cfg)


_hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir()),
                         config_name="eval")(_app)


def main() -> None:
    """``python -m remat.eval`` / ``remat-eval``: :func:`evaluate` with the run's own data
    and model composed first (:func:`remat.run_config.run_group_args`); a user error ends
    with ``error: <message>`` and exit code 1 (:func:`remat.errors.run_entry`)."""
    sys.argv[1:] = run_entry(run_group_args, sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
