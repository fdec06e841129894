"""Sliding-window inference: exact when one window covers the image, full-resolution on
large tiles, independent of how windows are batched, blended where windows overlap."""

import pytest
import segmentation_models_pytorch as smp
import torch
from torch import nn

from remat.inference import SlidingWindow, blend_weights, sliding_window_inference, window_starts


def _unet() -> nn.Module:
    torch.manual_seed(0)
    net = smp.Unet("resnet18", encoder_weights=None, classes=2,
                   decoder_channels=(16, 16, 16, 16, 16))
    return net.eval()


def test_window_starts_cover_the_axis_and_end_at_its_edge():
    assert window_starts(100, 128, 0.5) == [0]
    assert window_starts(128, 128, 0.5) == [0]
    assert window_starts(300, 128, 0.5) == [0, 64, 128, 172]
    assert window_starts(5000, 1024, 0.25) == [0, 768, 1536, 2304, 3072, 3840, 3976]


def test_one_window_equals_plain_forward_pass():
    net = _unet()
    images = torch.randn(2, 3, 96, 128)
    with torch.no_grad():
        plain = net(images)
    for patch in (128, 256):  # window exactly the image, and larger than the image
        out = sliding_window_inference(net, images, SlidingWindow(patch_size=patch))
        assert out.shape == plain.shape
        assert torch.equal(out, plain)


def test_small_odd_sized_image_is_padded_and_cropped_back():
    net = _unet()
    images = torch.randn(1, 3, 50, 70)  # not a multiple of the encoder's 32x downsampling
    out = sliding_window_inference(net, images, SlidingWindow(patch_size=128))
    padded = nn.functional.pad(images, (0, 26, 0, 14), mode="reflect")
    with torch.no_grad():
        assert torch.equal(out, net(padded)[..., :50, :70])


def test_window_batching_does_not_change_results():
    net = _unet()
    images = torch.randn(1, 3, 160, 200)
    outs = [sliding_window_inference(net, images, SlidingWindow(64, overlap=0.5, batch_size=b))
            for b in (1, 3, 64)]
    assert outs[0].shape == (1, 2, 160, 200)
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=1e-5)


def test_overlaps_are_blended_weighted_averages():
    """With a per-pixel network, every window gives the same value at a pixel, so any convex
    blend must reproduce the whole-image output exactly (up to rounding)."""
    net = nn.Conv2d(3, 4, kernel_size=1).eval()
    images = torch.randn(2, 3, 90, 130)
    with torch.no_grad():
        plain = net(images)
    for blend in ("gaussian", "constant"):
        out = sliding_window_inference(net, images, SlidingWindow(32, overlap=0.5, blend=blend,
                                                                  size_divisor=1))
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)


def test_gaussian_blend_is_highest_at_the_centre():
    weights = blend_weights(64, 32, "gaussian")
    assert weights.shape == (64, 32)
    assert weights.min() >= 1e-3
    assert weights[31:33, 15:17].min() > 0.98 and weights[0, 0] < 0.01


def test_large_tile_is_scored_whole_at_full_resolution():
    """A 5000 x 5000 tile (Inria size) with 1024-pixel windows: every pixel is covered and
    lands in its place. A per-pixel network gives the same value in every window, so the
    stitched result must equal the network run on the whole tile at once."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Conv2d(4, 2, 1)).eval()
    tile = torch.randn(1, 3, 5000, 5000)
    out = sliding_window_inference(net, tile, SlidingWindow(1024, overlap=0.25, batch_size=8))
    assert out.shape == (1, 2, 5000, 5000)
    with torch.no_grad():
        whole = net(tile)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)


def test_bad_settings_name_the_config_key():
    with pytest.raises(ValueError, match="model.inference.overlap"):
        SlidingWindow(64, overlap=1.0)
    with pytest.raises(ValueError, match="model.inference.blend"):
        SlidingWindow(64, blend="linear")
    with pytest.raises(ValueError, match=r"images \[B, C, H, W\]"):
        sliding_window_inference(nn.Identity(), torch.zeros(3, 8, 8), SlidingWindow(8))


def test_height_width_windows_from_a_config_list():
    """``model.inference.patch_size=[h, w]`` (a ListConfig from Hydra): non-square windows,
    each placed where it belongs; a window the size of the image is one forward pass."""
    from omegaconf import OmegaConf

    net = nn.Conv2d(3, 2, kernel_size=1).eval()
    images = torch.randn(1, 3, 96, 160)
    with torch.no_grad():
        plain = net(images)
    window = SlidingWindow(patch_size=OmegaConf.create([32, 64]), overlap=0.5, size_divisor=1)
    assert window.patch == (32, 64)
    torch.testing.assert_close(sliding_window_inference(net, images, window), plain,
                               rtol=1e-5, atol=1e-6)
    exact = sliding_window_inference(net, images, SlidingWindow(patch_size=[96, 160]))
    assert torch.equal(exact, plain)


@pytest.mark.parametrize("size", [0, [32], [32, 0], "64", 2.5, True])
def test_bad_window_sizes_name_the_key(size):
    with pytest.raises(ValueError, match=r"model.inference.patch_size must be a positive int "
                                         r"or \[height, width\]"):
        SlidingWindow(patch_size=size)
