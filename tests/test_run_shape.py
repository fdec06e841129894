"""The one size-key / precision / device rule (remat.run_shape) and the summaries of runs
that fail early."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from remat import run_shape
from remat.callbacks.summary import error_text
from remat.train import train
from tests.helpers import TINY_TRAINER, compose_train


@pytest.mark.parametrize("data,model,expected", [
    ({"image_size": 256, "batch_size": 4}, {"arch": "Unet"}, ("data.image_size", 256)),
    ({"patch_size": [512, 256], "batch_size": 2}, {"arch": "Unet"},
     ("data.patch_size", (512, 256))),
    ({"patch_size": [128, 128], "batch_size": 2}, {"arch": "Unet"}, ("data.patch_size", 128)),
    ({"block_size": 64, "batch_size": 8}, {"block_size": 128}, ("data.block_size", 64)),
    ({"batch_size": 8}, {"block_size": 128}, ("model.block_size", 128)),
])
def test_size_key_rule(data, model, expected):
    shape = run_shape.shape_of(OmegaConf.create(data), OmegaConf.create(model), strict=True)
    assert (shape.size_key, shape.size) == expected
    assert shape.batch_size == data["batch_size"]
    assert shape.kind == ("sequence" if "block_size" in model else "image")


def test_bad_sizes_name_the_key():
    with pytest.raises(ValueError, match=r"data.image_size must be an integer >= 1 or \[h, w\]"):
        run_shape.normalize_size([64, 0], "data.image_size")
    with pytest.raises(ValueError, match=r"data.block_size must be an integer >= 1, got \[8, 8\]"):
        run_shape.normalize_size([8, 8], "data.block_size")
    with pytest.raises(ValueError, match="no input size"):
        run_shape.shape_of(OmegaConf.create({"batch_size": 2}), None, strict=True)


def test_precision_and_device():
    assert run_shape.check_precision("32") == "32-true"
    with pytest.raises(ValueError, match="precision='fp8' is not supported"):
        run_shape.check_precision("fp8")
    with pytest.raises(ValueError, match="16-mixed needs a CUDA device"):
        run_shape.check_precision("16-mixed", "cpu")
    assert run_shape.resolve_device("cpu") == torch.device("cpu")
    assert run_shape.resolve_device("auto").type == ("cuda" if torch.cuda.is_available()
                                                     else "cpu")
    with pytest.raises(ValueError, match="not a torch device"):
        run_shape.resolve_device("tpu9")


def test_interpolation_error_text_names_the_key_without_parsing_the_message():
    cfg = OmegaConf.create({"data": {"batch_size": "${remat.batch_for:8,3}"}})
    with pytest.raises(Exception) as err:
        _ = cfg.data.batch_size
    assert error_text(err.value).startswith(
        "data.batch_size: ValueError: effective_batch_size=8 is not divisible")


def test_an_image_size_pair_that_fails_still_writes_the_summary(tmp_path):
    # a grey model on RGB data: the run fails before training, with the [h, w] size in
    # its summary
    cfg = compose_train(tmp_path, [*TINY_TRAINER, "data.image_size=[64,48]", "data.num_train=4",
                                   "data.num_val=2", "data.batch_size=2", "model.in_channels=1"])
    with pytest.raises(ValueError, match="model.in_channels=1"):
        train(cfg)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"]
    assert summary["size"] == [64, 48] and summary["size_key"] == "data.image_size"


def test_an_image_size_pair_trains(tmp_path):
    cfg = compose_train(tmp_path, [*TINY_TRAINER, "data.image_size=[64,32]", "data.num_train=4",
                                   "data.num_val=2", "data.batch_size=2"])
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["size"] == [64, 32]
