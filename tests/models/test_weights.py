"""``model.pretrained=<file>`` of the segmentation models: a local weights file loaded into
the encoder (smp's own names, a whole model's, timm's for a ``tu-`` encoder), offline."""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import save_file

from remat.models import SegmentationModule, build_smp_model

KW = {"decoder_channels": [16, 16, 8, 8, 8]}


def _module(encoder: str, pretrained) -> SegmentationModule:
    return SegmentationModule(encoder_name=encoder, arch_kwargs=KW, pretrained=str(pretrained),
                              stages=[])


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_resnet_encoder_weights_from_a_file(tmp_path, suffix):
    torch.manual_seed(3)
    source = build_smp_model("Unet", "resnet18", None, 3, 1, **KW).encoder
    state = {k: v.clone() for k, v in source.state_dict().items()}
    # what torchvision/timm files have beyond the encoder: the classifier
    state |= {"fc.weight": torch.zeros(10, 512), "fc.bias": torch.zeros(10)}
    path = tmp_path / f"resnet18{suffix}"
    save_file(state, path) if suffix == ".safetensors" else torch.save({"state_dict": state}, path)
    module = _module("resnet18", path)
    for name, tensor in source.state_dict().items():
        assert torch.equal(module.net.encoder.state_dict()[name], tensor), name


def test_timm_weights_into_a_tu_encoder(tmp_path):
    torch.manual_seed(4)
    timm_model = timm.create_model("convnext_atto", pretrained=False)
    save_file(timm_model.state_dict(), tmp_path / "convnext_atto.safetensors")
    module = _module("tu-convnext_atto", tmp_path / "convnext_atto.safetensors")
    loaded = module.net.encoder.model.state_dict()
    theirs = timm_model.state_dict()
    # timm's feature wrapper renames the first level: stages.3 -> stages_3, stem.0 -> stem_0
    assert torch.equal(loaded["stages_3.blocks.1.conv_dw.weight"],
                       theirs["stages.3.blocks.1.conv_dw.weight"])
    assert torch.equal(loaded["stem_0.weight"], theirs["stem.0.weight"])
    assert len(loaded) == 124 and all(v.abs().sum() > 0 for k, v in loaded.items()
                                      if k.endswith("conv_dw.weight"))


def test_weights_errors_name_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^model.pretrained=.*nowhere.pth: no such file"):
        _module("resnet18", tmp_path / "nowhere.pth")
    (tmp_path / "w.txt").write_text("x")
    with pytest.raises(ValueError, match=r"^model.pretrained=.*w.txt: not a weights file"):
        _module("resnet18", tmp_path / "w.txt")
    save_file({"other.weight": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match=r"^model.pretrained=.*other.safetensors: \d+ of the "
                                         r"\d+ tensors of ResNetEncoder are not in the file"):
        _module("resnet18", tmp_path / "other.safetensors")
    wrong = {k: torch.zeros(1) for k in build_smp_model("Unet", "resnet18", None, 3, 1,
                                                         **KW).encoder.state_dict()}
    save_file(wrong, tmp_path / "wrong.safetensors")
    with pytest.raises(ValueError, match=r"other shapes than ResNetEncoder's"):
        _module("resnet18", tmp_path / "wrong.safetensors")
