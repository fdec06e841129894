"""``model=monai_swinunetr``: MONAI's 2D SwinUNETR as the segmentation ``net``, wrapped at
each stage's Swin blocks, trained on Kvasir-SEG."""

from __future__ import annotations

import pytest
import torch
from monai.networks.nets import SwinUNETR

from remat.models.monai_nets import SwinUNETR2D
from remat.train import train
from tests.helpers import TINY_TRAINER, compose_train

SMALL = {"feature_size": 12, "depths": (1, 1, 1, 1), "num_heads": (1, 1, 2, 2)}


def test_swinunetr_2d_is_monais_swinunetr_with_checked_sizes():
    torch.manual_seed(0)
    net = SwinUNETR2D(in_channels=3, num_classes=2, img_size=64, **SMALL)
    assert isinstance(net, SwinUNETR)
    assert net(torch.randn(1, 3, 64, 96)).shape == (1, 2, 64, 96)
    with pytest.raises(ValueError, match=r"input 64x80 px: each side must be a multiple of 32"
                                         r".*set data.image_size to e.g. 96"):
        net(torch.randn(1, 3, 64, 80))
    with pytest.raises(ValueError, match=r"input 32x32 px.*at least 64 with instance norm"):
        net(torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match="set data.image_size to e.g. 128"):
        SwinUNETR2D(img_size=100, **SMALL)
    batch_norm = SwinUNETR2D(img_size=32, norm_name="batch", **SMALL)  # 1 x 1 bottleneck ok
    assert batch_norm(torch.randn(2, 3, 32, 32)).shape == (2, 1, 32, 32)


def test_config_size_key_is_checked_when_the_model_is_built(tmp_path):
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    cfg = compose_train(tmp_path, ["model=monai_swinunetr", "data=kvasir_seg",
                                   "data.image_size=100"])
    with pytest.raises(InstantiationException, match="set data.image_size to e.g. 128"):
        instantiate(cfg.model)


def test_tiny_swinunetr_trains_on_kvasir(tmp_path, kvasir_root):
    cfg = compose_train(tmp_path, [
        "model=monai_swinunetr", "data=kvasir_seg", f"data.root={kvasir_root}",
        "data.image_size=64", "data.limit_train=8", "data.limit_val=4", "data.batch_size=4",
        "model.net.feature_size=12", "model.net.num_heads=[1,1,2,2]", "strategy=full",
        *TINY_TRAINER])
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["global_step"] == 2
    assert summary["image_size"] == 64
    assert torch.isfinite(torch.tensor(summary["metrics"]["train/loss"]))
    for key in ("val/dice", "val/iou", "val/dice_dataset"):
        assert 0.0 <= summary["metrics"][key] <= 1.0, key
    report = summary["strategy_report"]
    assert report["stages"] == [f"swinViT.layers{i}.0.blocks" for i in range(1, 5)]
    assert report["wrapped"] == [f"swinViT.layers{i}.0.blocks.{j}"
                                 for i in range(1, 5) for j in range(2)]
