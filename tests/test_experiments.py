"""Every benchmark experiment composes, builds its model, agrees with its datamodule on the
classes, and carries a well-formed ``reference:`` list (the results registry)."""

import math

import pytest
import torch
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from remat.config import config_dir
from remat.models.metrics import SegmentationMetrics
from tests.data.volumes import affine_for, draw_labels, paint_ct, save_nifti, write_msd_task
from tests.helpers import compose_train

EXPERIMENTS = sorted(p.stem for p in (config_dir()
                                      / "experiment").glob("*.yaml"))
# segmentation benchmarks of issue 6 (the GPT and ViT experiments belong to other suites)
BENCHMARKS = ["cvc_clinicdb_unet", "deepglobe_road_unet", "drive_unet", "dubai_aerial_unet",
              "inria_unet", "isbi2012_unet", "isic2018_unet", "kvasir_unet",
              "loveda_deeplabv3plus", "massachusetts_buildings_unet",
              "massachusetts_roads_unet"]
# published numbers the issue asks for, each checked against its source (see the yaml notes)
PUBLISHED = {("kvasir_unet", "val/dice"): 0.876, ("kvasir_unet", "val/iou"): 0.810,
             ("drive_unet", "val/dice"): 0.7867, ("loveda_deeplabv3plus", "val/miou"): 0.5099,
             ("msd_spleen_unet3d", "val/dice"): 0.961, ("btcv_swinunetr", "val/dice"): 0.82}
# 3D recipes: the folder each one reads, written by the test in its published layout
VOLUME_RECIPES = ["btcv_swinunetr", "msd_spleen_swinunetr", "msd_spleen_unet3d"]
ENTRY_KEYS = {"metric", "value", "model", "source", "note"}


def test_every_benchmark_has_an_experiment_file():
    assert set(BENCHMARKS) <= set(EXPERIMENTS)


def _metric_names(model) -> set[str]:
    """The ``val/`` keys the model's metric set logs, from one real update."""
    metrics = SegmentationMetrics(model.hparams.metrics, model.hparams.num_classes,
                                  model.hparams.ignore_index, model.hparams.class_names)
    metrics.update(torch.zeros(1, 4, 4, dtype=torch.long), torch.zeros(1, 4, 4, dtype=torch.long))
    return {f"val/{k}" for k in metrics.compute()} | {"val/loss"}


def _check_references(cfg, name: str, names: set[str]) -> None:
    """The ``reference:`` list is well formed, names metrics we log, and holds the published
    values of :data:`PUBLISHED`."""
    references = OmegaConf.to_container(cfg.reference, resolve=True)
    assert isinstance(references, list)
    for entry in references:
        assert {"metric", "value", "model", "source"} <= set(entry) <= ENTRY_KEYS, entry
        assert entry["metric"] in names, f"{entry['metric']} is not a metric we log: {names}"
        assert isinstance(entry["model"], str) and entry["model"]
        assert isinstance(entry["source"], str) and len(entry["source"]) > 10
        value = entry["value"]
        assert value is None or (isinstance(value, float) and 0.0 < value <= 1.0), (
            "reference values are fractions in (0, 1] like our metrics, or null if unverified")
        if value is None:
            assert "not verified" in entry.get("note", "")
    published = {m: v for (n, m), v in PUBLISHED.items() if n == name}
    ours = {e["metric"]: e["value"] for e in references}
    for metric, value in published.items():
        assert math.isclose(ours[metric], value), (name, metric)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_experiment_composes_and_pins_its_recipe(tmp_path, name):
    cfg = compose_train(tmp_path, [f"experiment={name}", f"data.root={tmp_path}"])
    assert cfg.task_name == name
    assert cfg.data.root == str(tmp_path)
    assert cfg.trainer.max_epochs >= 1 and cfg.data.batch_size >= 1
    data_cls = get_class(cfg.data._target_)
    model = instantiate(cfg.model)
    if name != "kvasir_unet":  # file-based datamodules of issue 6 declare their classes
        assert cfg.data.patch_size, "training resolution (data.patch_size) must be pinned"
        assert cfg.model.inference.patch_size, "whole-image inference must be pinned"
        assert model.hparams.num_classes == data_cls.num_classes
        if data_cls.num_classes > 1:
            assert list(model.hparams.class_names) == list(data_cls.class_names)
    names = _metric_names(model)
    assert cfg.monitor in names, f"monitor {cfg.monitor} is not logged; logged: {names}"
    _check_references(cfg, name, names)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_passes_the_top_level_checks(tmp_path, name):
    """Alone and with FSDP's trainer keys: the 3D recipes set ``trainer.precision: bf16-mixed``
    while the top-level key (the estimate's, the plan's and the report's) said 32-true."""
    from remat.config import check_top_level

    for trainer in ("default", "fsdp"):
        cfg = compose_train(tmp_path, [f"experiment={name}", f"trainer={trainer}"])
        check_top_level(cfg)
        assert str(cfg.trainer.precision) == str(cfg.precision)


@pytest.mark.parametrize("entry", ["plan", "estimate"])
def test_plan_and_estimate_take_a_recipe_as_train_does(tmp_path, entry):
    """``experiment=`` without ``+`` (Hydra refused it: "No match in the defaults list"),
    with the recipe's data, model and precision."""
    from tests.helpers import compose_config

    cfg = compose_config(entry, tmp_path, ["experiment=msd_spleen_unet3d"])
    assert cfg.precision == "bf16-mixed"
    assert cfg.model._target_ == compose_train(
        tmp_path, ["experiment=msd_spleen_unet3d"]).model._target_
    assert cfg.data.patch_size == [96, 96, 96]


def test_published_results_state_pretraining_and_hardware():
    for name in ("kvasir_unet", "loveda_deeplabv3plus", "drive_unet"):
        cfg = OmegaConf.load(config_dir() / "experiment"
                             / f"{name}.yaml")
        for entry in cfg.reference:
            note = entry.note.lower()
            assert "gpu" in note or "v100" in note
            assert "pretrained" in note or "scratch" in note


@pytest.mark.parametrize("name", VOLUME_RECIPES)
def test_volume_recipe_reads_its_layout_and_pins_96_cubed_patches(tmp_path, name):
    """Spleen recipes read an MSD task folder; BTCV reads RawData/Training/img/img0001.nii.gz
    and label/label0001.nii.gz as the Synapse archive ships them."""
    if name.startswith("btcv"):
        root = tmp_path / "RawData" / "Training"
        for i in (1, 2):
            labels = draw_labels((16,) * 3, seed=i, classes=3)
            save_nifti(paint_ct(labels, i), affine_for((1, 1, 1)),
                       root / "img" / f"img000{i}.nii.gz")
            save_nifti(labels, affine_for((1, 1, 1)), root / "label" / f"label000{i}.nii.gz")
    else:
        root = write_msd_task(tmp_path / "Task09_Spleen", count=2, shape=(16,) * 3)
    cfg = compose_train(tmp_path / "cfg", [f"experiment={name}", f"data.root={root}"])
    assert cfg.task_name == name and cfg.data.patch_size == [96, 96, 96]
    assert cfg.model.inference.patch_size == [96, 96, 96]
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    assert model.hparams.num_classes == datamodule.num_classes
    assert list(model.hparams.class_names) == list(datamodule.class_names)
    if name.startswith("btcv"):
        assert datamodule.num_classes == 14 and datamodule.class_names[1] == "spleen"
        assert [p.name for p in datamodule.list_pairs()] == ["0001", "0002"]
    else:
        assert datamodule.class_names == ("background", "spleen")
    assert datamodule.intensity == "ct"
    _check_references(cfg, name, _metric_names(model))
