"""Predict masks: ``python -m remat.predict ckpt_path=<run>/checkpoints/last.ckpt
input=<folder|file> output=<folder>`` (or ``remat-predict``).

``predict(cfg)`` is a plain function (the tests call it with a composed config); ``main``
is the thin Hydra wrapper. The run's own ``config.yaml`` gives the data (how images are read
and normalised), the model and the precision (:func:`remat.run_config.apply_run_config`);
Lightning's ``Trainer.predict`` runs the model's ``predict_step`` (whole images at their own
size) and :class:`remat.prediction.MaskWriter` writes the masks.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from remat.config import config_dir
from remat.data.folder import IMAGE_SUFFIXES
from remat.errors import mark_in_loop, run_entry
from remat.models import SegmentationModule
from remat.models.checks import (
    check_checkpoint_fits,
    is_sharded_checkpoint,
    read_checkpoint,
    restore_datamodule_state,
    sharded_weights,
)
from remat.prediction import (
    MaskWriter,
    VolumeMaskWriter,
    check_inputs,
    check_output,
    list_inputs,
    mask_format,
    refuse_output_inside,
    stale_files,
)
from remat.run_config import apply_run_config, run_config_path, run_group_args

log = logging.getLogger(__name__)

# Top-level keys a prediction takes from the run's config.yaml.
RUN_KEYS = ("data", "model", "precision", "seed", "task_name")


def predict(cfg: DictConfig) -> dict[str, Any]:
    """Write the masks of ``cfg.input`` predicted by ``cfg.ckpt_path`` into ``cfg.output``;
    return ``{"output", "count", "format", "rows"}`` (``rows``: ``predictions.csv``).

    Raises:
        ValueError: no ``ckpt_path``; a bad or unfitting checkpoint; a model that is not a
            segmentation model; a bad ``format``.
        FileNotFoundError: a missing checkpoint, ``run_config`` or ``input``, or an input
            folder without images.
        FileExistsError: ``output`` already holds files and ``overwrite`` is false.
        remat.data.verify.DataCheckError: inputs that cannot be read (all named; checked
            before any mask is written).
    """
    ckpt_path = cfg.get("ckpt_path")
    if not ckpt_path:
        raise ValueError("ckpt_path is not set: pass ckpt_path=<run dir>/checkpoints/last.ckpt")
    ckpt = read_checkpoint(ckpt_path)
    run_path = run_config_path(cfg)
    run = OmegaConf.load(run_path) if run_path is not None else None
    cfg = apply_run_config(cfg, run, run_path, RUN_KEYS)
    output = Path(str(cfg.output)).expanduser()
    refuse_output_inside(cfg.input, output)  # before "holds files": overwrite would not do
    held = check_output(output, bool(cfg.get("overwrite", False)))
    model = instantiate(cfg.model)
    if not isinstance(model, SegmentationModule):
        raise ValueError(f"remat.predict writes segmentation masks; model._target_ built "
                         f"{type(model).__name__}")
    check_checkpoint_fits(model, ckpt, ckpt_path)
    if is_sharded_checkpoint(ckpt_path):
        ckpt["state_dict"] = sharded_weights(ckpt_path)
    model.load_state_dict(ckpt["state_dict"])
    datamodule = instantiate(cfg.data)
    if not hasattr(datamodule, "predict_dataset"):
        raise ValueError(f"data._target_={cfg.data.get('_target_')} reads no image files, so it "
                         "cannot say how new images are read; predict with a checkpoint of a "
                         "file dataset (data=folder, kvasir_seg, ...) or give data=<one>")
    restore_datamodule_state(datamodule, ckpt)
    volumes = hasattr(datamodule, "restore_labels")  # data=msd/volumes: NIfTI (.npy) out
    suffixes = getattr(datamodule, "input_suffixes", IMAGE_SUFFIXES)
    paths, names = list_inputs(cfg.input, str(cfg.get("images", "**/*")), suffixes)
    kind, colours = ("nifti", None) if volumes else mask_format(
        datamodule, int(model.hparams.num_classes), str(cfg.get("format", "auto")))
    dataset = datamodule.predict_dataset(paths, names)
    check_inputs(dataset, cfg.input)
    loader = DataLoader(dataset, batch_size=1,
                        num_workers=int(cfg.data.get("num_workers", 0) or 0))
    output.mkdir(parents=True, exist_ok=True)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml", resolve=True)
    writer: MaskWriter | VolumeMaskWriter = (
        VolumeMaskWriter(output, datamodule, int(model.hparams.num_classes) == 1) if volumes
        else MaskWriter(output, kind, colours, bool(cfg.get("probabilities", False))))
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=[writer], logger=False,
                                     enable_checkpointing=False)
    with mark_in_loop():
        trainer.predict(model, dataloaders=loader, return_predictions=False)
    if volumes:  # NIfTI for NIfTI inputs, .npy for .npy inputs
        kind = "/".join(sorted({"npy" if str(r["mask"]).endswith(".npy") else "nifti"
                                for r in writer.rows})) or kind
    log.info("%d %s masks written to %s (list: %s)", len(writer.rows), kind, output,
             output / "predictions.csv")
    stale = stale_files(held, writer.rows)
    if stale:
        log.warning("overwrite=true: %d file(s) of an earlier run remain in %s, not listed in "
                    "predictions.csv (e.g. %s); remove them, or predict into an empty folder",
                    len(stale), output, stale[0])
    return {"output": str(output), "count": len(writer.rows), "format": kind,
            "rows": writer.rows}


def _app(cfg: DictConfig) -> None:
    result = run_entry(predict, cfg)
    print(f"{result['count']} masks ({result['format']}) written to {result['output']}")


_hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir()),
                         config_name="predict")(_app)


def main() -> None:
    """``python -m remat.predict`` / ``remat-predict``: :func:`predict` with the run's own
    data and model composed first (:func:`remat.run_config.run_group_args`); a user error
    ends with ``error: <message>`` and exit code 1 (:func:`remat.errors.run_entry`)."""
    sys.argv[1:] = run_entry(run_group_args, sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
