"""Models shared by the strategy tests."""

import pytest
import segmentation_models_pytorch as smp
import torch


@pytest.fixture(scope="module")
def unet():
    """A small smp U-Net with a ResNet-18 encoder (BatchNorm, in-place ReLU), random init;
    tests deep-copy it before wrapping."""
    torch.manual_seed(0)
    return smp.Unet("resnet18", encoder_weights=None, classes=1,
                    decoder_channels=(32, 16, 16, 8, 8))
