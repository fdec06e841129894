"""ViTSegmenter: shapes, the patch grid, 1024 x 1024 inputs, bad sizes, the Hydra configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from remat.models import SegmentationModule, ViTSegmenter
from remat.strategies import build_strategy
from tests.helpers import compose_train


def _tiny(**kw) -> ViTSegmenter:
    torch.manual_seed(0)
    args = dict(img_size=64, embed_dim=32, depth=2, num_heads=2, decoder_channels=(16, 8, 8, 8))
    return ViTSegmenter(**{**args, **kw})


def test_logits_have_the_input_size_and_one_token_per_patch():
    model = _tiny(num_classes=3).eval()
    seen = {}
    model.encoder.blocks.register_forward_hook(lambda m, a, out: seen.update(tokens=out.shape))
    assert model(torch.randn(2, 3, 64, 96)).shape == (2, 3, 64, 96)
    assert seen["tokens"] == (2, (64 // 16) * (96 // 16), 32)  # no class token
    assert model.encoder.num_prefix_tokens == 0
    # patch 8 with 4 decoder stages upsamples 16x, then resizes down to the input size
    assert _tiny(patch_size=8).eval()(torch.randn(1, 3, 32, 32)).shape == (1, 1, 32, 32)


def test_the_decoder_sees_each_patch_at_its_place():
    model = _tiny().eval()
    x = torch.zeros(1, 3, 64, 64)
    y = x.clone()
    y[..., :16, :16] = 5.0  # change only the top-left patch
    with torch.no_grad():
        grid_x = model.encoder.forward_features(x).transpose(1, 2).reshape(1, 32, 4, 4)
        grid_y = model.encoder.forward_features(y).transpose(1, 2).reshape(1, 32, 4, 4)
    diff = (grid_x - grid_y).abs().sum(1)[0]
    assert diff[0, 0] == diff.max() and diff[0, 0] > 0  # the changed patch moves most


def test_1024_px_input_runs_4096_tokens_through_checkpointed_blocks():
    model = _tiny(img_size=1024, embed_dim=16, num_heads=1, decoder_channels=(8, 4, 4, 2))
    report = build_strategy("full").apply(model, ["encoder.blocks"])
    assert report.wrapped == ["encoder.blocks.0", "encoder.blocks.1"]
    seen = {}
    model.encoder.blocks[0].register_forward_hook(lambda m, a, out: seen.update(n=out.shape[1]))
    x = torch.randn(1, 3, 1024, 1024)
    out = model(x)
    assert out.shape == (1, 1, 1024, 1024) and seen["n"] == 4096
    out.mean().backward()
    assert model.encoder.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def test_input_not_divisible_by_the_patch_names_size_patch_and_key():
    model = _tiny()
    with pytest.raises(ValueError, match=r"input 72x64 px is not divisible by the patch size 16 "
                                         r"\(model.net.patch_size\); set data.image_size"):
        model(torch.randn(1, 3, 72, 64))
    with pytest.raises(ValueError, match=r"model.net.img_size=1000 is not divisible by "
                                         r"model.net.patch_size=16"):
        ViTSegmenter(img_size=1000)
    with pytest.raises(ValueError, match=r"model.net.embed_dim=30 must be divisible"):
        ViTSegmenter(img_size=64, embed_dim=30, num_heads=4)


def test_vit_seg_configs_build_a_segmentation_module_whose_blocks_take_a_strategy(tmp_path):
    cfg = compose_train(tmp_path, ["model=vit_seg_small", "data.image_size=96",
                                   "model.net.depth=3", "strategy=sqrtn"])
    assert cfg.model.net.img_size == 96 and cfg.model.net.embed_dim == 384
    model = instantiate(cfg.model, strategy=instantiate(cfg.strategy))
    assert isinstance(model, SegmentationModule) and isinstance(model.net, ViTSegmenter)
    assert model.strategy_report.segments == {"encoder.blocks": [(0, 2), (2, 3)]}
    bad = compose_train(tmp_path, ["model=vit_seg_tiny", "data.image_size=100"])
    with pytest.raises(Exception, match="model.net.img_size=100 is not divisible"):
        instantiate(bad.model)


def test_vit_seg_highres_experiment_pins_1024_px(tmp_path: Path):
    cfg = compose_train(tmp_path, ["experiment=vit_seg_highres"])
    assert cfg.data.image_size == 1024 and cfg.model.net.img_size == 1024
    assert cfg.model.net.patch_size == 16 and list(cfg.model.stages) == ["encoder.blocks"]
    assert cfg.data._target_.endswith("KvasirSegDataModule")
