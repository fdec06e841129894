"""Datamodules on tiny fakes in their published layouts: splits, shapes, class mapping, ignore
index, FOV, configs; and the bad-input errors (split file naming a missing image, empty split,
image/mask size mismatch, image without its mask, unset root) on every file-based datamodule."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from remat.config import config_dir
from remat.data import (
    CVCClinicDBDataModule,
    DeepGlobeRoadDataModule,
    DRIVEDataModule,
    DubaiAerialDataModule,
    InriaDataModule,
    ISBI2012DataModule,
    ISIC2018DataModule,
    LoveDADataModule,
    MassachusettsBuildingsDataModule,
    MassachusettsRoadsDataModule,
)
from remat.data.layout import natural_key
from remat.data.patch_seg import PatchSegDataModule
from remat.data.splits import split_ids
from tests.data import fakes

CONFIGS = config_dir() / "data"


def _labels(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array.astype(np.int64))


def _check_val(dm, labels: dict[str, np.ndarray], key: str = "val") -> None:
    """Every val (or test) item is the whole image with exactly the labels written."""
    dataset = dm.val_set if key == "val" else dm.test_set
    assert [dataset[i]["name"] for i in range(len(dataset))] == dm.splits[key]
    for sample in dataset:
        expected = _labels(labels[sample["name"]])
        assert sample["image"].shape == (3, *expected.shape)
        assert torch.equal(sample["mask"], expected), sample["name"]


# ---------------------------------------------------------------------------- medical


@pytest.mark.parametrize("suffix,sub", [(".tif", ""), (".png", "PNG")])
def test_cvc_clinicdb(tmp_path: Path, suffix: str, sub: str):
    """The original TIFF layout, and the Kaggle copy's ``PNG/`` folder found from its root."""
    labels = fakes.make_fake_cvc(tmp_path / "CVC-ClinicDB" / sub, n=6, suffix=suffix)
    dm = CVCClinicDBDataModule(tmp_path, val_size=2, patch_size=32)
    dm.setup()
    assert dm.dataset_root == tmp_path / "CVC-ClinicDB" / sub
    names = sorted(labels, key=natural_key)
    assert (dm.splits["train"], dm.splits["val"]) == split_ids(names, 2, 42)
    _check_val(dm, labels)
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (4, 3, 32, 32) and set(batch["mask"].unique().tolist()) <= {
        0, 1}


def test_isic2018_skips_text_files_and_pairs_segmentation_masks(tmp_path: Path):
    labels = fakes.make_fake_isic(tmp_path, n=5)
    dm = ISIC2018DataModule(tmp_path, val_size=2)
    dm.setup()
    assert sorted(dm.pairs) == sorted(labels) and len(dm.splits["val"]) == 2
    _check_val(dm, labels)  # JPEG images of different sizes, exact PNG masks
    (tmp_path / "ISIC2018_Task1_Training_GroundTruth" / "ISIC_0000007_segmentation.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"image\(s\) without a mask: "
                                                r"ISIC2018_Task1-2_Training_Input/ISIC_0000007.jpg"):
        ISIC2018DataModule(tmp_path, val_size=2).setup()


def test_drive_serves_fov_as_valid_and_labelled_test(tmp_path: Path):
    labels = fakes.make_fake_drive(tmp_path / "DRIVE")
    dm = DRIVEDataModule(tmp_path, val_size=2, patch_size=[32, 32], augment=False)
    dm.setup()
    assert dm.splits == {"train": [f"training/{n}" for n in range(21, 25)],
                         "val": ["training/25", "training/26"], "test": ["test/01", "test/02"]}
    fov = torch.from_numpy(fakes.fov_disc(30, 28) > 0)
    for key in ("val", "test"):
        _check_val(dm, labels, key)
    sample = dm.val_set[0]
    assert sample["valid"].dtype == torch.bool and torch.equal(sample["valid"], fov)
    patch = dm.train_set[0]  # 30x28 padded to 32x32: padding is outside the FOV
    assert patch["valid"].shape == (32, 32) and not patch["valid"][30:].any()
    assert torch.equal(patch["valid"][:30, :28], fov)
    batch = next(iter(dm.test_dataloader()))
    assert batch["valid"].shape == (1, 30, 28) and batch["name"] == ["test/01"]


def test_drive_without_test_labels_tests_on_val(tmp_path: Path):
    fakes.make_fake_drive(tmp_path, test_labels=False)
    dm = DRIVEDataModule(tmp_path, val_size=1)
    dm.setup()
    assert "test" not in dm.splits and dm.test_set is None
    assert [b["name"] for b in dm.test_dataloader()] == [["training/26"]]


def test_drive_missing_fov_mask_is_named(tmp_path: Path):
    fakes.make_fake_drive(tmp_path)
    (tmp_path / "training" / "mask" / "23_training_mask.gif").unlink()
    with pytest.raises(FileNotFoundError, match=r"image\(s\) without a FOV mask: "
                                                r"training/images/23_training.tif"):
        DRIVEDataModule(tmp_path).setup()


# ---------------------------------------------------------------------------- aerial


def test_inria_official_validation_is_tiles_1_to_5(tmp_path: Path):
    labels = fakes.make_fake_inria(tmp_path, cities=("austin", "tyrol-w"), tiles=7)
    dm = InriaDataModule(tmp_path, patch_size=16)
    dm.setup()
    assert dm.dataset_root == tmp_path / "AerialImageDataset"
    assert dm.splits["val"] == [f"austin{n}" for n in range(1, 6)] + [
        f"tyrol-w{n}" for n in range(1, 6)]
    assert dm.splits["train"] == ["austin6", "austin7", "tyrol-w6", "tyrol-w7"]
    _check_val(dm, labels)


def test_inria_samples_large_tile_patches_on_buildings(tmp_path: Path):
    """A 600 x 600 tile with one 6 x 6 building: biased crops find it, uniform ones rarely."""
    base = tmp_path / "AerialImageDataset" / "train"
    labels = np.zeros((600, 600), dtype=np.uint8)
    labels[400:406, 100:106] = 255
    for n in (1, 6):
        fakes.save(fakes.paint(labels // 255, n), base / "images" / f"vienna{n}.tif")
        fakes.save(labels, base / "gt" / f"vienna{n}.tif")
    torch.manual_seed(0)
    dm = InriaDataModule(tmp_path, patch_size=64, patches_per_image=20, foreground_prob=1.0)
    dm.setup()
    assert dm.splits == {"train": ["vienna6"], "val": ["vienna1"]}
    assert all(dm.train_set[i]["mask"].sum() > 0 for i in range(20))
    whole = dm.val_set[0]
    assert whole["mask"].shape == (600, 600) and whole["mask"].sum() == 36


def test_massachusetts_roads_official_folders_and_test_split(tmp_path: Path):
    labels = fakes.make_fake_massachusetts(tmp_path / "Massachusetts-Roads", counts=(3, 1, 2))
    dm = MassachusettsRoadsDataModule(tmp_path, patch_size=32)
    dm.setup()
    assert [len(dm.splits[k]) for k in ("train", "val", "test")] == [3, 1, 2]
    assert all(n.startswith("test/") for n in dm.splits["test"])
    _check_val(dm, labels)
    _check_val(dm, labels, "test")
    assert len(dm.test_dataloader()) == 2


def test_massachusetts_buildings_colour_labels(tmp_path: Path):
    labels = fakes.make_fake_massachusetts(tmp_path, counts=(2, 1, 0), mask_rgb=(255, 0, 0))
    dm = MassachusettsBuildingsDataModule(tmp_path)
    dm.setup()
    assert "test" not in dm.splits and dm.class_names == ("background", "building")
    _check_val(dm, labels)


def test_loveda_maps_no_data_to_ignore_and_shifts_classes(tmp_path: Path):
    stored = fakes.make_fake_loveda(tmp_path / "LoveDA", per_folder=2)
    lookup = np.array([255, 0, 1, 2, 3, 4, 5, 6])
    labels = {name: lookup[s] for name, s in stored.items()}
    dm = LoveDADataModule(tmp_path, patch_size=16)
    dm.setup()
    assert dm.splits["train"] == ["Train/Rural/2", "Train/Rural/3", "Train/Urban/0",
                                  "Train/Urban/1"]
    assert len(dm.splits["val"]) == 4 and (dm.num_classes, dm.ignore_index) == (7, 255)
    _check_val(dm, labels)
    assert (dm.val_set[0]["mask"][0] == 255).all()
    bad = dm.val_set.pairs[1].mask
    stored = np.asarray(Image.open(bad)).copy()
    stored[3, 4] = 9
    fakes.save(stored, bad)
    with pytest.raises(ValueError, match=r"holds value\(s\) \[9\] outside") as info:
        dm.val_set[1]
    assert str(bad) in str(info.value)
    rural = LoveDADataModule(tmp_path, scenes=["Rural"], verify=False)
    rural.setup()
    assert all("/Rural/" in n for split in rural.splits.values() for n in split)
    with pytest.raises(ValueError, match="data.scenes"):
        LoveDADataModule(tmp_path, scenes=["Suburban"])


def test_deepglobe_road_pairs_sat_and_mask(tmp_path: Path):
    labels = fakes.make_fake_deepglobe(tmp_path / "DeepGlobe-Road", n=6)
    dm = DeepGlobeRoadDataModule(tmp_path, val_size=2, patch_size=16)
    dm.setup()
    assert (dm.splits["train"], dm.splits["val"]) == split_ids(sorted(labels), 2, 42)
    stored = np.asarray(Image.open(dm.pairs[dm.splits["val"][0]].mask))
    assert stored.ndim == 3 and not set(np.unique(stored).tolist()) <= {0, 255}
    _check_val(dm, labels)  # values off 0/255 still threshold to the labels drawn


# ---------------------------------------------------------------------------- bad input, all sets

# Every file-based datamodule on a minimal fake in its layout: (class, writer, kwargs that give
# a one-image-or-more val split). The bad-input guarantees below run on each.
CASES = {
    "isbi2012": (ISBI2012DataModule, lambda r: fakes.make_fake_isbi(r, n=3, size=16),
                 {"val_sections": 1}),
    "dubai_aerial": (DubaiAerialDataModule,
                     lambda r: fakes.make_fake_dubai(r, tiles=(1, 2), parts=1), {"val_tiles": [2]}),
    "cvc_clinicdb": (CVCClinicDBDataModule, lambda r: fakes.make_fake_cvc(r, n=3),
                     {"val_size": 1}),
    "isic2018": (ISIC2018DataModule, lambda r: fakes.make_fake_isic(r, n=3), {"val_size": 1}),
    "drive": (DRIVEDataModule,
              lambda r: fakes.make_fake_drive(r, train_ids=(21, 22, 23), test_ids=(1,)),
              {"val_size": 1}),
    "inria": (InriaDataModule,
              lambda r: fakes.make_fake_inria(r, cities=("austin",), tiles=6, size=16), {}),
    "massachusetts_roads": (MassachusettsRoadsDataModule,
                            lambda r: fakes.make_fake_massachusetts(r, (2, 1, 1), size=16), {}),
    "massachusetts_buildings": (
        MassachusettsBuildingsDataModule,
        lambda r: fakes.make_fake_massachusetts(r, (2, 1, 0), mask_rgb=(255, 0, 0), size=16), {}),
    "loveda": (LoveDADataModule, lambda r: fakes.make_fake_loveda(r, per_folder=1, size=16), {}),
    "deepglobe_road": (DeepGlobeRoadDataModule, lambda r: fakes.make_fake_deepglobe(r, 3, 16),
                       {"val_size": 1}),
}


def _fake_dm(case: str, root: Path, write: bool = True, **overrides):
    """Write the case's fake under ``root`` (unless ``write`` is False) and return an
    un-set-up datamodule on it."""
    cls, writer, kwargs = CASES[case]
    if write:
        writer(root)
    return cls(root, patch_size=8, **{**kwargs, **overrides})


def test_cases_cover_every_file_datamodule():
    import remat.data as data

    paired = {getattr(data, n) for n in data.__all__ if n.endswith("DataModule")
              and issubclass(getattr(data, n), PatchSegDataModule)}
    # a user's own folder has no published layout: tests/data/test_folder.py
    assert paired - {data.FolderSegDataModule} == {cls for cls, _, _ in CASES.values()}


@pytest.mark.parametrize("val,error,match", [
    ("['no-such-image']", FileNotFoundError,
     r"\(val\) names 1 image\(s\) that are not in the dataset: no-such-image"),
    ("[]", ValueError, "the val split is empty"),
])
@pytest.mark.parametrize("case", CASES)
def test_split_file_naming_a_missing_image_or_an_empty_split_fails(
        tmp_path: Path, case: str, val: str, error: type, match: str):
    dm = _fake_dm(case, tmp_path / "data")
    dm.setup()
    split = tmp_path / "split.yaml"
    split.write_text(f"train: ['{dm.splits['train'][0]}']\nval: {val}\n")
    with pytest.raises(error, match=match) as info:
        _fake_dm(case, tmp_path / "data", write=False, split_file=split).setup()
    assert str(split) in str(info.value)


# Settings (or files removed) that leave the default val split empty, and the error expected.
EMPTY_VAL = {
    "isbi2012": ({"val_sections": 0}, None, ValueError, "data.val_sections must be between 1"),
    "dubai_aerial": ({"val_tiles": [9]}, None, ValueError,
                     r"the val split is empty: data.val_tiles=\[9\]"),
    "cvc_clinicdb": ({"val_size": 0}, None, ValueError, "data.val_size must be between 1"),
    "isic2018": ({"val_size": 3}, None, ValueError, "data.val_size must be between 1 and 2"),
    "drive": ({"val_size": 0}, None, ValueError, "data.val_size must be between 1"),
    "inria": ({"val_tiles": [99]}, None, ValueError,
              r"the val split is empty: data.val_tiles=\[99\]"),
    "massachusetts_roads": ({}, "tiff/val*/*", FileNotFoundError, "no images found in .*tiff/val"),
    "massachusetts_buildings": ({}, "tiff/val*/*", FileNotFoundError,
                                "no images found in .*tiff/val"),
    "loveda": ({}, "Val/Rural/*/*", FileNotFoundError, "no images found in LoveDA Val/Rural"),
    "deepglobe_road": ({"val_size": 0}, None, ValueError, "data.val_size must be between 1"),
}


@pytest.mark.parametrize("case", CASES)
def test_empty_default_val_split_fails(tmp_path: Path, case: str):
    overrides, remove, error, match = EMPTY_VAL[case]
    dm = _fake_dm(case, tmp_path, **overrides)
    for path in tmp_path.glob(remove or "no-such-file"):
        path.unlink()
    with pytest.raises(error, match=match):
        dm.setup()


@pytest.mark.parametrize("case", [*CASES, "drive-fov"])
def test_size_mismatch_names_the_file_and_both_sizes(tmp_path: Path, case: str):
    dm = _fake_dm(case.removesuffix("-fov"), tmp_path)
    dm.setup()
    pair = dm.val_set.pairs[0]
    shrink = pair.valid if case.endswith("-fov") else pair.mask
    with Image.open(shrink) as img:
        img.load()
        (width, height) = img.size
        img.crop((0, 0, width - 3, height - 2)).save(shrink)  # same format, mode and palette
    with pytest.raises(ValueError, match=f"size mismatch for {pair.name}") as info:
        dm.val_set[0]
    message = str(info.value)
    assert f"is {width}x{height} (WxH)" in message and f"{width - 3}x{height - 2}" in message
    assert str(shrink) in message and str(pair.image) in message


@pytest.mark.parametrize("case", CASES)
def test_image_without_its_mask_is_named(tmp_path: Path, case: str):
    dm = _fake_dm(case, tmp_path)
    dm.setup()
    pair = dm.val_set.pairs[0]
    pair.mask.unlink()
    relative = pair.image.relative_to(dm.dataset_root)
    with pytest.raises(FileNotFoundError,
                       match=rf"1 image\(s\) without a mask: {re.escape(str(relative))}\."):
        _fake_dm(case, tmp_path, write=False).setup()


@pytest.mark.parametrize("case", CASES)
def test_unset_or_empty_root_says_what_to_set(tmp_path: Path, case: str):
    cls = CASES[case][0]
    with pytest.raises(ValueError, match=f"data.root is not set for {re.escape(cls.title)}"):
        cls(None).setup()
    (tmp_path / "unrelated").mkdir()
    with pytest.raises(FileNotFoundError, match=rf"^data.root={re.escape(str(tmp_path))} "
                                                rf"\({re.escape(cls.title)}\) (lacks|does "
                                                r"not hold that layout)") as info:
        cls(tmp_path).setup()
    assert f"Expected layout: {cls.layout}" in str(info.value)
    assert f"Get it from {cls.url}" in str(info.value)
    absent = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match=rf"^data.root={re.escape(str(absent))} "
                                                rf"\({re.escape(cls.title)}\) does not "
                                                r"exist\. Expected layout: "):
        cls(absent).setup()


# ---------------------------------------------------------------------------- configs


@pytest.mark.parametrize("case", CASES)
def test_config_builds_the_datamodule(tmp_path: Path, case: str):
    """``configs/data/<case>.yaml`` builds the class, rooted at ``$data_dir/<its folder>``."""
    cls = CASES[case][0]
    cfg = OmegaConf.create({"paths": {"data_dir": str(tmp_path)},
                            "data": OmegaConf.load(CONFIGS / f"{case}.yaml")})
    dm = instantiate(cfg.data)
    assert type(dm) is cls and Path(dm.root) == tmp_path / cls.folder
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        dm.setup()  # nothing there: the message gives the layout and where to get it
    assert dm.url in str(info.value)
