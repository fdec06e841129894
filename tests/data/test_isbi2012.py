"""ISBI2012DataModule on the real ISBI 2012 copy and on a tiny fake copy in its layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torchvision.io import ImageReadMode

from remat.config import config_dir
from remat.data import ISBI2012DataModule
from remat.data.io import read_image
from remat.data.transforms import GREY_MEAN, GREY_STD, IMAGENET_MEAN, IMAGENET_STD
from tests.data.fakes import make_fake_isbi

CONFIG = config_dir() / "data" / "isbi2012.yaml"


# ---------------------------------------------------------------------------- real data


def test_real_split_is_last_five_sections(isbi_root: Path):
    dm = ISBI2012DataModule(isbi_root)
    dm.setup("fit")
    assert dm.splits["train"] == [str(i) for i in range(25)]
    assert dm.splits["val"] == ["25", "26", "27", "28", "29"]
    assert (len(dm.train_set), len(dm.val_set)) == (25, 5)
    assert dm.test_set is None and len(dm.test_dataloader()) == 5  # test runs on val
    assert (dm.num_classes, dm.class_names, dm.ignore_index) == (1, ("cell", "membrane"), 255)


def test_real_val_is_whole_sections_with_membrane_as_foreground(isbi_root: Path):
    dm = ISBI2012DataModule(isbi_root, limit_val=2)
    dm.setup("validate")
    loader = dm.val_dataloader()
    assert loader.batch_size == 1
    for batch in loader:
        name = batch["name"][0]
        assert batch["image"].shape == (1, 3, 512, 512) and batch["image"].dtype == torch.float32
        assert batch["mask"].shape == (1, 512, 512) and batch["mask"].dtype == torch.int64
        label = read_image(isbi_root / "train" / "label" / f"{name}.png", ImageReadMode.GRAY)[0]
        assert set(label.unique().tolist()) == {0, 255}
        assert torch.equal(batch["mask"][0], (label == 0).long())  # membrane (0) -> 1
        assert 0.1 < batch["mask"].float().mean().item() < 0.4  # ~22 % membrane
        # The grey section repeated to 3 channels, each normalised with ImageNet statistics.
        raw = read_image(isbi_root / "train" / "image" / f"{name}.png", ImageReadMode.GRAY)[0]
        for channel, (mean, std) in enumerate(zip(IMAGENET_MEAN, IMAGENET_STD, strict=True)):
            expected = (raw.float() / 255 - mean) / std
            assert torch.allclose(batch["image"][0, channel], expected, atol=1e-5)


def test_real_train_patches(isbi_root: Path):
    torch.manual_seed(0)
    dm = ISBI2012DataModule(isbi_root, patch_size=128, patches_per_image=2, batch_size=4,
                            limit_train=4, image_mode="grey")
    dm.setup("fit")
    assert len(dm.train_set) == 8 and dm.in_channels == 1
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (4, 1, 128, 128) and batch["mask"].shape == (4, 128, 128)
    assert set(batch["mask"].unique().tolist()) == {0, 1}
    assert set(batch["name"]) <= {"0", "1", "2", "3"}
    # One grey channel is normalised with the mean ImageNet statistics.
    assert batch["image"].min().item() >= -GREY_MEAN / GREY_STD - 1e-4


def test_real_config_points_at_data_dir(isbi_root: Path):
    cfg = OmegaConf.create({"paths": {"data_dir": str(isbi_root.parent)},
                            "data": OmegaConf.load(CONFIG)})
    dm = instantiate(cfg.data)
    assert isinstance(dm, ISBI2012DataModule) and Path(dm.root) == isbi_root
    dm.setup()
    assert dm.splits["val"] == ["25", "26", "27", "28", "29"] and len(dm.train_set) == 100
    assert dm.patch_size == (256, 256) and dm.image_mode == "grey_rgb"


# ---------------------------------------------------------------------------- fake copy


def test_fake_copy_and_val_sections(tmp_path: Path):
    root = tmp_path / "ISBI2012-EM-membrane"
    membranes = make_fake_isbi(root, n=12, size=40)
    dm = ISBI2012DataModule(tmp_path, val_sections=3, patch_size=64, augment=False)
    dm.setup()
    assert dm.dataset_root == root
    assert dm.splits["val"] == ["9", "10", "11"]  # section order, not string order
    sample = dm.val_set[1]
    assert sample["name"] == "10" and torch.equal(sample["mask"],
                                                  torch.from_numpy(membranes[10]).long())
    patch = dm.train_set[0]  # 40 px sections padded to 64: mask 255, image 0 on the pad
    assert patch["mask"].shape == (64, 64) and (patch["mask"][40:] == 255).all()
    assert set(patch["mask"][:40, :40].unique().tolist()) <= {0, 1}


@pytest.mark.parametrize("val_sections", [0, 12])
def test_val_sections_must_leave_both_splits(tmp_path: Path, val_sections: int):
    make_fake_isbi(tmp_path, n=12, size=16)
    with pytest.raises(ValueError, match="data.val_sections must be between 1 and 11"):
        ISBI2012DataModule(tmp_path, val_sections=val_sections).setup()


def test_missing_root_names_layout(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        ISBI2012DataModule(tmp_path / "nowhere").setup()
    assert "train/image/<n>.png" in str(info.value)
    with pytest.raises(ValueError, match="data.root is not set"):
        ISBI2012DataModule(None).setup()
