"""``model.in_channels`` against what each datamodule serves: a clear error naming both keys
before training, never a raw convolution error mid-step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from remat.data import ISBI2012DataModule, KvasirSegDataModule, SyntheticSegDataModule
from remat.models.checks import check_model_fits_data
from remat.train import train
from tests.data.fakes import make_fake_kvasir
from tests.helpers import TINY_TRAINER, compose_train


def _model(in_channels: int):
    from remat.models import SegmentationModule

    return SegmentationModule(arch="Unet", encoder_name="resnet18", in_channels=in_channels,
                              arch_kwargs={"decoder_channels": [16, 16, 16, 16, 16]})


@pytest.mark.parametrize("make,served,hint", [
    (lambda root: SyntheticSegDataModule(), 3, r"\(it has no data.image_mode\); set "
                                               r"model.in_channels=3"),
    (lambda root: KvasirSegDataModule(root), 3, r"\(data.image_mode=rgb\); set "
                                                r"model.in_channels=3 or data.image_mode=grey"),
    (lambda root: ISBI2012DataModule(root, image_mode="grey"), 1,
     r"\(data.image_mode=grey\); set model.in_channels=1 or data.image_mode=rgb"),
])
def test_wrong_in_channels_names_both_keys(tmp_path: Path, make, served: int, hint: str):
    wanted = 1 if served == 3 else 3
    with pytest.raises(ValueError, match=rf"model.in_channels={wanted} but data "
                                         rf"\(\w+\) serves {served} image channels {hint}"):
        check_model_fits_data(_model(wanted), make(tmp_path))
    check_model_fits_data(_model(served), make(tmp_path))  # the fitting pair passes


def test_four_channel_model_on_rgb_data_says_no_image_mode_fits(tmp_path: Path):
    with pytest.raises(ValueError, match=r"data.image_mode serves 1 or 3 channels, not 4"):
        check_model_fits_data(_model(4), KvasirSegDataModule(tmp_path))


def test_grey_model_on_kvasir_fails_before_training(tmp_path: Path):
    """Kvasir-SEG gave a raw convolution error here before it exposed in_channels."""
    make_fake_kvasir(tmp_path / "Kvasir-SEG", n=4, height=32, width=32)
    cfg = compose_train(tmp_path / "run", [*TINY_TRAINER, "data=kvasir_seg",
                                           f"data.root={tmp_path}", "data.val_size=2",
                                           "data.image_size=32", "model.in_channels=1"])
    with pytest.raises(ValueError, match=r"model.in_channels=1 but data=kvasir_seg serves 3 "
                                         r"image channels \(data.image_mode=rgb\)"):
        train(cfg)
    # and the grey mode it suggests trains
    cfg = compose_train(tmp_path / "grey", [*TINY_TRAINER, "data=kvasir_seg",
                                            f"data.root={tmp_path}", "data.val_size=2",
                                            "data.image_size=32", "data.batch_size=2",
                                            "model.in_channels=1", "data.image_mode=grey"])
    assert instantiate(cfg.data).in_channels == 1
    assert train(cfg)["status"] == "completed"



def test_3d_network_on_images_names_both_keys_before_any_work(tmp_path: Path):
    """model=monai_unet3d data=synthetic_seg planned, built and then died mid-step with
    torch's conv3d channel error; now one error before the data or the model is built."""
    from remat.build import build_from_config
    from remat.run_shape import check_spatial_dims

    cfg = compose_train(tmp_path / "run", [*TINY_TRAINER, "model=monai_unet3d",
                                           "data=synthetic_seg", "data.image_size=32"])
    with pytest.raises(ValueError, match=r"^model=monai_unet3d is a 3D network \(model\."
                                         r"spatial_dims=3\) but data=synthetic_seg serves 2D "
                                         r"images \(data.image_size=32\); a 3D network needs "
                                         r"volumes \[d, h, w\]: use data=msd or data=volumes "
                                         r"\(with data.root\), or a 2D model"):
        check_spatial_dims(cfg.model, cfg.data, "monai_unet3d", "synthetic_seg")
    dims_error = r"^model=monai_unet3d is a 3D network .* but data=synthetic_seg serves 2D"
    with pytest.raises(ValueError, match=dims_error):
        train(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the run began
    with pytest.raises(ValueError, match=dims_error):  # remat.plan, estimate, strategy=budget
        build_from_config(cfg)


def test_a_volume_patch_given_as_one_side_is_named_with_the_triple(tmp_path: Path):
    """data=msd data.patch_size=32 (a cube's side, as MONAI's roi_size takes it) told the
    user to 'use data=msd', the data they had chosen; it names the triple to write now."""
    from remat.run_shape import check_spatial_dims

    cfg = compose_train(tmp_path / "run", [*TINY_TRAINER, "model=monai_dynunet3d", "data=msd",
                                           "data.root=x", "data.patch_size=32"])
    with pytest.raises(ValueError, match=re.escape(
            "model=monai_dynunet3d is a 3D network (model.spatial_dims=3) but "
            "data.patch_size=32 is one side (2D patches); volumes (data=msd, data=volumes) "
            "take data.patch_size=[d, h, w] voxels, e.g. 'data.patch_size=[32,32,32]'")):
        check_spatial_dims(cfg.model, cfg.data, "monai_dynunet3d", "msd")


def test_2d_network_on_volumes_fails_before_reading_them(tmp_path: Path):
    """unet_resnet18 on data=msd died with 'Expected 3D (unbatched) or 4D (batched) input to
    conv2d'; the check reads no file (this data.root does not even exist)."""
    cfg = compose_train(tmp_path / "run", [*TINY_TRAINER, "model=unet_resnet18", "data=msd",
                                           f"data.root={tmp_path / 'absent'}"])
    with pytest.raises(ValueError, match=r"^model=unet_resnet18 is a 2D network "
                                         r"\(model.spatial_dims=2\) but data=msd "
                                         r"serves 3D volumes \(data.patch_size=\[96, 96, 96\]\); "
                                         r"use a 3D model for volumes \(e.g. "
                                         r"model=monai_unet3d, or model.spatial_dims=3 with a "
                                         r"3D model.net\), or 2D image data"):
        train(cfg)


def test_matching_dims_and_sequence_models_pass_the_check(tmp_path: Path):
    from remat.run_shape import check_spatial_dims

    for overrides in (["model=monai_unet3d", "data=msd", "data.root=x"],
                      ["model=unet_resnet18", "data=synthetic_seg"],
                      ["model=gpt_tiny", "data=tinyshakespeare"]):
        cfg = compose_train(tmp_path / "run", [*TINY_TRAINER, *overrides])
        check_spatial_dims(cfg.model, cfg.data)  # no error


def test_patch_sides_a_strided_network_cannot_halve_are_named():
    """data=msd model=monai_dynunet3d data.patch_size=[24,24,24] died in the sanity
    validation with torch's 'Sizes of tensors must match' from MONAI's skip concatenation;
    the patch is refused first, naming the network's total stride and sides that fit."""
    from monai.networks.nets import DynUNet, UNet

    from remat.models.checks import check_patch_fits_strides

    dyn = DynUNet(3, 1, 2, kernel_size=[3] * 5, strides=[1, 2, 2, 2, 2],
                  upsample_kernel_size=[2] * 4, filters=[4, 8, 16, 32, 64])
    with pytest.raises(ValueError, match=re.escape(
            "data.patch_size=[24, 24, 40]: DynUNet downsamples each side by [16, 16, 16] "
            "(model.net.strides), so every side must be a multiple of it; e.g. "
            "data.patch_size=[32, 32, 48]")):
        check_patch_fits_strides(dyn, [24, 24, 40])
    check_patch_fits_strides(dyn, [32, 48, 64])  # fits
    anisotropic = DynUNet(3, 1, 2, kernel_size=[3] * 3, strides=[[1, 1, 1], [1, 2, 2], [2, 2, 2]],
                          upsample_kernel_size=[[1, 2, 2], [2, 2, 2]])
    check_patch_fits_strides(anisotropic, [2, 4, 4])
    with pytest.raises(ValueError, match=r"by \[2, 4, 4\]"):
        check_patch_fits_strides(anisotropic, [2, 4, 6])
    unet = UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2))
    with pytest.raises(ValueError, match=r"UNet downsamples each side by \[4, 4, 4\]"):
        check_patch_fits_strides(unet, [30, 32, 32])
    check_patch_fits_strides(torch.nn.Conv3d(1, 1, 3), [30, 30, 30])  # no strides: no rule
