"""``remat.eval``: a checkpoint scored through Lightning's validate/test loop with its run's own
config, per-image CSV and overall JSON, our numbers beside the references, clear errors."""

import csv
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import DictConfig

from remat.callbacks import PerImageMetrics
from remat.eval import evaluate
from remat.models import SegmentationModule
from remat.train import train
from tests.helpers import TINY, TINY_TRAINER, compose_app, compose_train

REPO = Path(__file__).resolve().parents[1]
QUIET = ["trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]


def compose_eval(output_dir: Path, overrides: list[str]) -> DictConfig:
    """Compose ``configs/eval.yaml`` as ``python -m remat.eval`` does."""
    return compose_app("eval", output_dir, [*QUIET, *overrides])


def _rows(out: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((out / "per_image.csv").open()))


def _size_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "but the run trained with" in str(w.message)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Iterator[tuple[Path, dict]]:
    """One tiny training run on synthetic data at 128 px (eval.yaml's default data is 256
    px): its last checkpoint and summary."""
    out = tmp_path_factory.mktemp("train")
    summary = train(compose_train(out, [*TINY, "data.image_size=128"]))
    yield out / "checkpoints" / "last.ckpt", summary
    shutil.rmtree(out, ignore_errors=True)  # its checkpoints: about 300 MB


def test_eval_of_a_128px_run_scores_at_128px_without_overrides(tmp_path, trained):
    ckpt, summary = trained
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}"]))
    assert _size_warnings(caught) == []
    assert result["run_config"] == str(ckpt.parent.parent / "config.yaml")
    assert result["sizes"]["data.image_size"] == 128
    rows = _rows(tmp_path)
    assert len(rows) == 4 and {(r["height"], r["width"]) for r in rows} == {("128", "128")}
    # the same weights on the same images and size: the run's own last validation
    for key in ("val/dice", "val/iou", "val/dice_dataset", "val/iou_dataset", "val/loss"):
        assert result["metrics"][key] == pytest.approx(summary["metrics"][key], abs=1e-6)
    assert (tmp_path / "config.yaml").is_file()


def test_a_size_override_goes_on_top_and_warns(tmp_path, trained):
    ckpt, summary = trained
    with pytest.warns(UserWarning, match=r"data.image_size=64 but the run trained with "
                                         r"data.image_size=128 \(.*config.yaml\)"):
        result = evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}", "data.image_size=64"]))
    assert {(r["height"], r["width"]) for r in _rows(tmp_path)} == {("64", "64")}
    assert result["sizes"]["data.image_size"] == 64
    assert result["metrics"]["val/dice"] != pytest.approx(summary["metrics"]["val/dice"],
                                                          abs=1e-6)
    # [h, w] works as a size everywhere; 128 and [128, 128] are the same size (no warning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluate(compose_eval(tmp_path / "hw", [f"ckpt_path={ckpt}", "data.image_size=[128,128]"]))
    assert _size_warnings(caught) == []
    with pytest.warns(UserWarning, match=r"data.image_size=\[96, 128\]"):
        evaluate(compose_eval(tmp_path / "r", [f"ckpt_path={ckpt}", "data.image_size=[96,128]"]))
    assert {(r["height"], r["width"]) for r in _rows(tmp_path / "r")} == {("96", "128")}


def test_an_experiment_other_than_the_runs_warns_and_the_run_config_wins(tmp_path, trained):
    ckpt, summary = trained
    with pytest.warns(UserWarning, match=r"experiment=isbi2012_unet \(task isbi2012_unet\) is "
                                         r"not what the checkpoint's run trained \(task train"):
        result = evaluate(compose_eval(tmp_path, ["experiment=isbi2012_unet", f"ckpt_path={ckpt}"]))
    assert result["task_name"] == "train" and result["num_images"] == 4  # the synthetic run
    assert result["metrics"]["val/dice"] == pytest.approx(summary["metrics"]["val/dice"],
                                                          abs=1e-6)


def test_without_the_run_config_the_command_line_decides(tmp_path, trained):
    ckpt, _ = trained
    result = evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}", "run_config=null",
                                              "data.num_val=2"]))
    assert result["run_config"] is None
    assert {(r["height"], r["width"]) for r in _rows(tmp_path)} == {("256", "256")}
    with pytest.raises(FileNotFoundError, match="run_config=.*nope.yaml: no such file"):
        evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}", f"run_config={tmp_path}/nope.yaml"]))


def test_eval_writes_per_image_and_overall_metrics(tmp_path, trained):
    ckpt, _ = trained
    reference = ("reference=[{metric: val/dice, value: 0.9, model: U-Net, source: paper},"
                 "{metric: val/hd95, value: 3.0, model: U-Net, source: paper}]")
    result = evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}", reference]))
    rows = _rows(tmp_path)
    assert len(rows) == 4 and result["num_images"] == 4
    assert {"name", "height", "width", "dice", "iou"} <= set(rows[0])
    assert [r["name"] for r in rows] == [f"{i:05d}" for i in range(4)]
    # val/dice is the mean of the per-image Dice values
    dice = result["metrics"]["val/dice"]
    assert dice == pytest.approx(sum(float(r["dice"]) for r in rows) / 4, abs=1e-6)
    assert json.loads((tmp_path / "metrics.json").read_text()) == result
    ours = {r["metric"]: r["ours"] for r in result["reference"]}
    assert ours == {"val/dice": pytest.approx(dice), "val/hd95": None}
    assert result["device"] == "cpu" and result["precision"] == "32-true"


def test_eval_without_references_lists_our_metrics(tmp_path, trained):
    ckpt, _ = trained
    result = evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}"]))  # reference: []
    assert result["reference"] == []
    assert set(result["metrics"]) == {"val/loss", "val/dice", "val/iou", "val/dice_dataset",
                                      "val/iou_dataset"}


def test_group_by_pools_metrics_per_group(tmp_path, trained):
    ckpt, _ = trained
    # the synthetic images are named 00000..00003: one group holding all four
    result = evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}", "group_by='^(\\d{4})\\d$'"]))
    assert list(result["groups"]) == ["0000"]
    for key, value in result["metrics"].items():
        if key != "val/loss":
            assert result["groups"]["0000"][key] == pytest.approx(value, abs=1e-6)
    assert [row["group"] for row in _rows(tmp_path)] == ["0000"] * 4
    with pytest.raises(ValueError, match="group_by='\\^city' does not match image '00000'"):
        evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}", "group_by='^city'"]))


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="ckpt_path=.*nothing.ckpt: no such file"):
        evaluate(compose_eval(tmp_path, [f"ckpt_path={tmp_path / 'nothing.ckpt'}"]))
    from remat.models.checks import read_checkpoint

    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "last.ckpt").write_text("174812789\n")  # not torch.save's
    with pytest.raises(FileNotFoundError, match=r"ckpts is a folder, not a checkpoint file.*"
                                                r"it holds last.ckpt"):
        read_checkpoint(tmp_path / "ckpts")
    with pytest.raises(ValueError, match=r"last.ckpt is not a checkpoint: torch.save writes a "
                                         r"zip archive and this file is none"):
        read_checkpoint(tmp_path / "ckpts" / "last.ckpt")


def test_checkpoint_of_another_model_is_refused(tmp_path, trained):
    ckpt, _ = trained
    with pytest.raises(ValueError, match="model.encoder_name: checkpoint 'resnet18', config "
                                         "'resnet34'"):
        evaluate(compose_eval(tmp_path, ["model=unet_resnet34", f"ckpt_path={ckpt}"]))
    state = torch.load(ckpt, weights_only=True)
    state["state_dict"].pop(next(iter(state["state_dict"])))
    state["state_dict"]["extra.weight"] = torch.zeros(1)
    broken = tmp_path / "broken.ckpt"
    torch.save(state, broken)
    with pytest.raises(ValueError, match="does not fit the configured model: 1 missing keys"):
        evaluate(compose_eval(tmp_path, [f"ckpt_path={broken}"]))
    foreign = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(1)}, foreign)
    with pytest.raises(ValueError, match="is not a Lightning checkpoint"):
        evaluate(compose_eval(tmp_path, [f"ckpt_path={foreign}"]))


class Opaque:
    """A class a checkpoint should never make remat import and run."""


def test_checkpoints_are_read_weights_only(tmp_path, trained):
    ckpt, _ = trained
    state = torch.load(ckpt, weights_only=True)  # what train.py writes loads weights-only
    state["hyper_parameters"]["extra"] = Opaque()
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save(state, unsafe)
    with pytest.raises(ValueError, match=r"unsafe.ckpt holds objects that torch.load\("
                                         r"weights_only=True\) refuses to unpickle") as info:
        evaluate(compose_eval(tmp_path, [f"ckpt_path={unsafe}"]))
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)
    assert "Opaque" in str(info.value)


def test_eval_refuses_more_than_one_device(tmp_path, trained):
    ckpt, _ = trained
    with pytest.raises(ValueError, match=r"scores on one device; got trainer.devices=2"):
        evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}", "trainer.devices=2"]))


@pytest.mark.slow  # a remat.eval start, 9 s; the table in process: the tests above
def test_eval_command_line_prints_reference_table(tmp_path, trained):
    ckpt, _ = trained
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "remat.eval", f"ckpt_path={ckpt}", "split=val",
         f"hydra.run.dir={tmp_path}", "reference=[{metric: val/dice, value: 0.876, "
         "model: U-Net ResNet-34, source: Jha et al. 2021}]"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "metrics.json").read_text())
    assert result["split"] == "val" and "val/dice" in result["metrics"]
    assert "0.8760" in proc.stdout and "Jha et al. 2021" in proc.stdout
    assert f"{result['metrics']['val/dice']:.4f}" in proc.stdout
    assert {r["height"] for r in _rows(tmp_path)} == {"128"}  # the run's size


def test_eval_refuses_a_test_split_the_dataset_does_not_have(tmp_path, trained, isbi_root):
    ckpt, _ = trained
    with pytest.raises(ValueError, match=r"split=test: data._target_=remat.data.SyntheticSeg"
                                         r"DataModule has no labelled test split"):
        evaluate(compose_eval(tmp_path, [f"ckpt_path={ckpt}", "split=test"]))
    assert not (tmp_path / "metrics.json").exists()
    # data=<name> replaces the run's data node (here: the real ISBI 2012 copy)
    isbi = compose_eval(tmp_path, ["data=isbi2012", f"data.root={isbi_root}",
                                   f"ckpt_path={ckpt}", "split=test"])
    with pytest.raises(ValueError, match=r"split=test: data._target_=remat.data.ISBI2012"):
        evaluate(isbi)


def test_another_dataset_scores_with_the_runs_model(tmp_path, trained, isbi_root):
    """data=<name> scores the run's model on another dataset (its size keys differ: warned);
    published scores, which are for the run's own data, are left out of the report."""
    ckpt, _ = trained
    cfg = compose_eval(tmp_path, ["data=isbi2012", f"data.root={isbi_root}", "data.limit_val=1",
                                  f"ckpt_path={ckpt}", "reference=[{metric: val/dice, "
                                  "value: 0.9, model: U-Net, source: paper}]"])
    with pytest.warns(UserWarning, match=r"data.patch_size=256 but the run trained with "
                                         r"data.patch_size=None"):
        result = evaluate(cfg)
    assert [(r["name"], r["height"], r["width"]) for r in _rows(tmp_path)] == [
        ("25", "512", "512")]  # the first val section, whole
    assert result["task_name"] == "train"  # the run's
    assert cfg.model.encoder_name == "resnet18"
    assert result["reference"] == []


def test_drive_test_split_scores_the_labelled_test_folder(tmp_path):
    """split=test runs Trainer.test on DRIVE's labelled test/ (fake tree, published layout),
    scoring inside the field of view only."""
    from hydra.utils import instantiate

    from tests.data import fakes

    fakes.make_fake_drive(tmp_path / "data" / "DRIVE", size=(40, 44))
    cfg = compose_eval(tmp_path / "out", [
        "experiment=drive_unet", f"data.root={tmp_path / 'data'}", "model.inference.patch_size=32",
        "split=test", f"ckpt_path={tmp_path / 'init.ckpt'}"])
    model = instantiate(cfg.model)
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)},
               tmp_path / "init.ckpt")
    result = evaluate(cfg)
    rows = _rows(tmp_path / "out")
    assert [r["name"] for r in rows] == ["test/01", "test/02"]
    assert {(r["height"], r["width"]) for r in rows} == {("40", "44")}
    assert set(result["metrics"]) == {"test/loss", "test/dice", "test/iou", "test/acc"}
    assert result["split"] == "test" and result["task_name"] == "drive_unet"


def test_tiny_real_kvasir_run_is_scored_at_its_own_size(tmp_path, kvasir_root):
    """The issue's case: a Kvasir-SEG run trained at 128 px, evaluated with the experiment
    (whose default is 256 px) and no size override, scores at 128 px, as its validation did."""
    data = [f"data.root={kvasir_root}", "data.limit_train=8", "data.limit_val=4",
            "data.batch_size=4"]
    summary = train(compose_train(tmp_path / "run", [
        "experiment=kvasir_unet", "model=unet_resnet18", "data.image_size=128", *data,
        *TINY_TRAINER]))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    result = evaluate(compose_eval(tmp_path / "eval", ["experiment=kvasir_unet",
                                                       f"ckpt_path={ckpt}"]))
    assert {(r["height"], r["width"]) for r in _rows(tmp_path / "eval")} == {("128", "128")}
    assert result["metrics"]["val/dice"] == pytest.approx(summary["metrics"]["val/dice"],
                                                          abs=1e-6)
    assert result["task_name"] == "kvasir_unet"
    assert [r["metric"] for r in result["reference"]] == ["val/dice", "val/iou"]


def test_inria_experiment_scores_fake_tiles_per_city(tmp_path):
    """experiment=inria_unet end to end on a fake Inria tree in the published layout, for a
    checkpoint without its run folder: whole tiles by sliding windows through the module's
    validation step, IoU per city (group_by), our value beside the reference."""
    from hydra.utils import instantiate

    from tests.data import fakes

    fakes.make_fake_inria(tmp_path / "data", cities=("austin", "tyrol-w"), tiles=6, size=96)
    overrides = ["experiment=inria_unet", f"data.root={tmp_path / 'data'}",
                 "model=unet_resnet18", "model.inference.patch_size=64"]
    cfg = compose_eval(tmp_path / "out", [*overrides, f"ckpt_path={tmp_path / 'init.ckpt'}"])
    model = instantiate(cfg.model)  # untrained weights saved as a Lightning checkpoint
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)},
               tmp_path / "init.ckpt")
    result = evaluate(cfg)
    assert result["run_config"] is None and result["num_images"] == 10  # tiles 1-5 per city
    assert sorted(result["groups"]) == ["austin", "tyrol-w"]
    rows = _rows(tmp_path / "out")
    assert {(r["height"], r["width"]) for r in rows} == {("96", "96")}
    assert {r["name"] for r in rows} == {f"{c}{n}" for c in ("austin", "tyrol-w")
                                         for n in range(1, 6)}
    assert [r["metric"] for r in result["reference"]] == ["val/iou", "val/acc"]
    assert result["reference"][0]["value"] is None  # unverified, kept null
    assert result["reference"][0]["ours"] == pytest.approx(result["metrics"]["val/iou"])


class _ReturningModule(SegmentationModule):
    """A module whose validation step returns its predictions (no evaluate_batch record)."""

    def validation_step(self, batch, batch_idx):
        loss, preds, target = SegmentationModule.evaluate_batch(self, batch, "val")
        self.log("val/loss", loss, batch_size=len(preds))
        return {"preds": preds, "target": target}


def test_per_image_callback_reads_step_outputs_and_skips_sanity_checks(tmp_path):
    from remat.data import SyntheticSegDataModule

    model = _ReturningModule(arch="Unet", encoder_name="resnet18", num_classes=1,
                             arch_kwargs={"decoder_channels": [16, 16, 16, 16, 16]})
    writer = PerImageMetrics(tmp_path / "per_image.csv")
    dm = SyntheticSegDataModule(image_size=32, batch_size=2, num_train=2, num_val=3)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, callbacks=[writer],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=1)
    trainer.fit(model, datamodule=dm)
    rows = _rows(tmp_path)
    assert [r["name"] for r in rows] == ["00000", "00001", "00002"]  # not the sanity batch too
    assert "evaluate_batch" not in model.__dict__  # the recorder is gone after the run
    dice = trainer.callback_metrics["val/dice"].item()
    assert dice == pytest.approx(sum(float(r["dice"]) for r in rows) / 3, abs=1e-6)


def test_the_resolution_said_is_the_grid_scored_on():
    """Volumes resampled to data.pixdim are scored on that grid, not at native resolution."""
    from types import SimpleNamespace

    from remat.evaluation import resolution_of

    assert resolution_of(SimpleNamespace(pixdim=[1.5, 1.5, 2.0])) == (
        "resampled to 1.5x1.5x2 mm voxels (data.pixdim)")
    assert resolution_of(SimpleNamespace(pixdim=None)) == "native resolution"
    assert resolution_of(SimpleNamespace(image_size=256, resizes_for_eval=True)) == (
        "256x256 px (resized)")


def test_a_missing_last_ckpt_names_the_checkpoints_beside_it(tmp_path):
    """A run killed while writing its first last.ckpt left the epoch's checkpoint (and a
    temporary file): the error named only the missing file."""
    from remat.models.checks import read_checkpoint

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "epoch_000.ckpt").write_bytes(b"")
    (folder / ".last.ckpt.11671.tmp").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"last.ckpt: no such file .*; "
                                                r".*checkpoints holds epoch_000.ckpt$"):
        read_checkpoint(folder / "last.ckpt")
