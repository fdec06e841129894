"""``remat.eval``: a checkpoint scored on the val split, per-image CSV and overall JSON,
our numbers beside the experiment's references, clear errors for bad checkpoints."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from remat.eval import evaluate
from remat.train import train
from tests.helpers import TINY, compose_app, compose_train

REPO = Path(__file__).resolve().parents[1]
# the synthetic set of tests.helpers.TINY, evaluated on its 4 val images
DATA = ["data.image_size=64", "data.num_train=8", "data.num_val=4", "data.batch_size=1"]


def compose_eval(output_dir: Path, overrides: list[str]) -> DictConfig:
    """Compose ``configs/eval.yaml`` as ``python -m remat.eval`` does."""
    return compose_app("eval", output_dir, overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """One tiny training run on synthetic data: its last checkpoint and summary."""
    out = tmp_path_factory.mktemp("train")
    summary = train(compose_train(out, TINY))
    return out / "checkpoints" / "last.ckpt", summary


def test_eval_writes_per_image_and_overall_metrics(tmp_path, trained):
    ckpt, summary = trained
    reference = ("reference=[{metric: val/dice, value: 0.9, model: U-Net, source: paper},"
                 "{metric: val/hd95, value: 3.0, model: U-Net, source: paper}]")
    result = evaluate(compose_eval(tmp_path, [*DATA, f"ckpt_path={ckpt}", reference]))
    rows = list(csv.DictReader((tmp_path / "per_image.csv").open()))
    assert len(rows) == 4 and result["num_images"] == 4
    assert {"name", "height", "width", "dice", "iou"} <= set(rows[0])
    assert all(row["height"] == "64" and row["width"] == "64" for row in rows)
    # val/dice is the mean of the per-image Dice values
    dice = result["metrics"]["val/dice"]
    assert dice == pytest.approx(sum(float(r["dice"]) for r in rows) / 4, abs=1e-6)
    # the same weights scored the same images at the end of training
    assert dice == pytest.approx(summary["metrics"]["val/dice"], abs=1e-5)
    assert json.loads((tmp_path / "metrics.json").read_text()) == result
    ours = {r["metric"]: r["ours"] for r in result["reference"]}
    assert ours == {"val/dice": pytest.approx(dice), "val/hd95": None}


def test_eval_without_references_lists_our_metrics(tmp_path, trained):
    ckpt, _ = trained
    result = evaluate(compose_eval(tmp_path, [*DATA, f"ckpt_path={ckpt}"]))  # reference: []
    assert result["reference"] == []
    assert set(result["metrics"]) == {"val/dice", "val/iou", "val/dice_dataset",
                                      "val/iou_dataset"}


def test_group_by_pools_metrics_per_group(tmp_path, trained):
    ckpt, _ = trained
    # the synthetic images are named 00000..00003: one group holding all four
    result = evaluate(compose_eval(tmp_path, [*DATA, f"ckpt_path={ckpt}",
                                              "group_by='^(\\d{4})\\d$'"]))
    assert list(result["groups"]) == ["0000"]
    for key, value in result["metrics"].items():
        assert result["groups"]["0000"][key] == pytest.approx(value, abs=1e-6)
    rows = list(csv.DictReader((tmp_path / "per_image.csv").open()))
    assert [row["group"] for row in rows] == ["0000"] * 4
    with pytest.raises(ValueError, match="group_by='\\^city' does not match image '00000'"):
        evaluate(compose_eval(tmp_path, [*DATA, f"ckpt_path={ckpt}", "group_by='^city'"]))


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="ckpt_path=.*nothing.ckpt: no such file"):
        evaluate(compose_eval(tmp_path, [*DATA, f"ckpt_path={tmp_path / 'nothing.ckpt'}"]))


def test_checkpoint_of_another_model_is_refused(tmp_path, trained):
    ckpt, _ = trained
    with pytest.raises(ValueError, match="model.encoder_name: checkpoint 'resnet18', config "
                                         "'resnet34'"):
        evaluate(compose_eval(tmp_path, [*DATA, "model=unet_resnet34", f"ckpt_path={ckpt}"]))
    state = torch.load(ckpt, weights_only=False)
    state["state_dict"].pop(next(iter(state["state_dict"])))
    state["state_dict"]["extra.weight"] = torch.zeros(1)
    broken = tmp_path / "broken.ckpt"
    torch.save(state, broken)
    with pytest.raises(ValueError, match="does not fit the configured model: 1 missing keys"):
        evaluate(compose_eval(tmp_path, [*DATA, f"ckpt_path={broken}"]))
    foreign = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(1)}, foreign)
    with pytest.raises(ValueError, match="is not a Lightning checkpoint"):
        evaluate(compose_eval(tmp_path, [*DATA, f"ckpt_path={foreign}"]))


def test_eval_command_line_prints_reference_table(tmp_path, trained):
    ckpt, _ = trained
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "remat.eval", *DATA, f"ckpt_path={ckpt}", "split=val",
         f"hydra.run.dir={tmp_path}", "reference=[{metric: val/dice, value: 0.876, "
         "model: U-Net ResNet-34, source: Jha et al. 2021}]"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "metrics.json").read_text())
    assert result["split"] == "val" and "val/dice" in result["metrics"]
    assert "0.8760" in proc.stdout and "Jha et al. 2021" in proc.stdout
    assert f"{result['metrics']['val/dice']:.4f}" in proc.stdout


def test_eval_refuses_a_test_split_the_dataset_does_not_have(tmp_path, trained, isbi_root):
    ckpt, _ = trained
    with pytest.raises(ValueError, match=r"split=test: data._target_=remat.data.SyntheticSeg"
                                         r"DataModule has no labelled test split"):
        evaluate(compose_eval(tmp_path, [*DATA, f"ckpt_path={ckpt}", "split=test"]))
    assert not (tmp_path / "metrics.json").exists()
    isbi = compose_eval(tmp_path, ["data=isbi2012", f"data.root={isbi_root}",
                                   f"ckpt_path={ckpt}", "split=test"])
    with pytest.raises(ValueError, match=r"split=test: data._target_=remat.data.ISBI2012"):
        evaluate(isbi)


def test_inria_experiment_scores_fake_tiles_per_city(tmp_path):
    """experiment=inria_unet end to end on a fake Inria tree in the published layout:
    whole tiles by sliding windows, IoU per city (group_by), our value beside the reference."""
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
    assert result["num_images"] == 10  # tiles 1-5 of each city
    assert sorted(result["groups"]) == ["austin", "tyrol-w"]
    rows = list(csv.DictReader((tmp_path / "out" / "per_image.csv").open()))
    assert {(r["height"], r["width"]) for r in rows} == {("96", "96")}
    assert {r["name"] for r in rows} == {f"{c}{n}" for c in ("austin", "tyrol-w")
                                         for n in range(1, 6)}
    assert [r["metric"] for r in result["reference"]] == ["val/iou", "val/acc"]
    assert result["reference"][0]["value"] is None  # unverified, kept null
    assert result["reference"][0]["ours"] == pytest.approx(result["metrics"]["val/iou"])
