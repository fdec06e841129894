"""DubaiAerialDataModule on the real copy (every mask) and on a fake copy in its layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from remat.config import config_dir
from remat.data import DubaiAerialDataModule
from remat.data.dubai_aerial import DUBAI_CLASSES
from tests.data.fakes import make_fake_dubai

CONFIG = config_dir() / "data" / "dubai_aerial.yaml"


# ---------------------------------------------------------------------------- real data


def test_real_every_mask_decodes_and_black_is_ignored(dubai_root: Path):
    """All 72 masks hold only the six class colours and black; black pixels count as
    SOURCE.md of the copy reports (545,723 in Tile 8 part 003, nine masks in all)."""
    dm = DubaiAerialDataModule(dubai_root)
    dm.setup()
    decode = dm.mask_decoder()
    assert len(dm.pairs) == 72
    with_black = {}
    for name, pair in dm.pairs.items():
        mask = decode(pair.mask)
        assert set(mask.unique().tolist()) <= {0, 1, 2, 3, 4, 5, 255}
        ignored = int((mask == 255).sum())
        if ignored:
            with_black[name] = ignored
    assert len(with_black) == 9 and with_black["Tile 8/image_part_003"] == 545_723
    assert with_black["Tile 3/image_part_007"] == 4


def test_real_palette_mask_matches_pillow(dubai_root: Path):
    path = dubai_root / "Tile 2" / "masks" / "image_part_001.png"
    assert Image.open(path).mode == "P"
    rgb = np.asarray(Image.open(path).convert("RGB"))
    dm = DubaiAerialDataModule(dubai_root)
    mask = dm.mask_decoder()(path).numpy()
    for index, (_, colour) in enumerate(DUBAI_CLASSES):
        assert np.array_equal(mask == index, (rgb == colour).all(axis=2))


def test_real_split_by_tile_and_full_resolution_val(dubai_root: Path):
    dm = DubaiAerialDataModule(dubai_root, limit_val=1)
    dm.setup()
    assert len(dm.splits["train"]) == 63 and all(not n.startswith("Tile 3/")
                                                 for n in dm.splits["train"])
    assert dm.splits["val"] == ["Tile 3/image_part_001"]
    assert (dm.num_classes, dm.ignore_index, len(dm.class_names)) == (6, 255, 6)
    batch = next(iter(dm.val_dataloader()))
    assert batch["image"].shape == (1, 3, 658, 682) and batch["mask"].shape == (1, 658, 682)
    assert batch["name"] == ["Tile 3/image_part_001"]
    assert set(batch["mask"].unique().tolist()) == {0, 1, 2, 3, 4, 5}


def test_real_small_tile_is_padded_with_ignore(dubai_root: Path, tmp_path: Path):
    split = tmp_path / "split.yaml"
    split.write_text("train: ['Tile 2/image_part_001']\nval: ['Tile 3/image_part_002']\n")
    torch.manual_seed(0)
    dm = DubaiAerialDataModule(dubai_root, split_file=split, patch_size=[560, 520],
                               augment=False)
    dm.setup()
    sample = dm.train_set[0]  # the image is 509 x 544 (W x H)
    assert sample["image"].shape == (3, 560, 520) and sample["mask"].shape == (560, 520)
    assert (sample["mask"][544:] == 255).all() and (sample["mask"][:, 509:] == 255).all()
    assert (sample["mask"][:544, :509] != 255).all()


def test_real_config_points_at_data_dir(dubai_root: Path):
    cfg = OmegaConf.create({"paths": {"data_dir": str(dubai_root.parent)},
                            "data": OmegaConf.load(CONFIG)})
    dm = instantiate(cfg.data)
    assert isinstance(dm, DubaiAerialDataModule) and Path(dm.root) == dubai_root
    assert dm.val_tiles == [3] and dm.patch_size == (256, 256)


# ---------------------------------------------------------------------------- fake copy


def test_fake_copy_decodes_rgb_and_palette_masks(tmp_path: Path):
    labels = make_fake_dubai(tmp_path, tiles=(1, 2, 3), parts=2)
    dm = DubaiAerialDataModule(tmp_path, val_tiles=[2], test_tiles=[3])
    dm.setup()
    assert dm.splits == {"train": ["Tile 1/image_part_001", "Tile 1/image_part_002"],
                         "val": ["Tile 2/image_part_001", "Tile 2/image_part_002"],
                         "test": ["Tile 3/image_part_001", "Tile 3/image_part_002"]}
    for dataset in (dm.val_set, dm.test_set):  # Tile 2 palette PNGs, Tile 3 RGB PNGs
        for sample in dataset:
            expected = torch.from_numpy(labels[sample["name"]]).long()
            assert torch.equal(sample["mask"], expected)
    assert (dm.val_set[0]["mask"][0, :3] == 255).all()  # the black pixels
    assert len(dm.test_dataloader()) == 2 and dm.test_dataloader().dataset is dm.test_set


def test_empty_split_from_tiles(tmp_path: Path):
    make_fake_dubai(tmp_path, tiles=(1, 2), parts=1)
    with pytest.raises(ValueError, match="the val split is empty"):
        DubaiAerialDataModule(tmp_path, val_tiles=[7]).setup()
    with pytest.raises(ValueError, match="the train split is empty"):
        DubaiAerialDataModule(tmp_path, val_tiles=[1, 2]).setup()


def test_release_top_folder_is_accepted(tmp_path: Path):
    make_fake_dubai(tmp_path / "Semantic segmentation dataset", tiles=(1, 3), parts=1)
    dm = DubaiAerialDataModule(tmp_path)
    dm.setup()
    assert dm.dataset_root == tmp_path / "Semantic segmentation dataset"
    assert dm.splits == {"train": ["Tile 1/image_part_001"], "val": ["Tile 3/image_part_001"]}


def test_root_without_tiles(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not hold that layout"):
        DubaiAerialDataModule(tmp_path).setup()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DubaiAerialDataModule(tmp_path / "nope").setup()
