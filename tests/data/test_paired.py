"""The shared file-dataset machinery: patch sampler, mask decoders, split files, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.io import ImageReadMode

from remat.data import DubaiAerialDataModule, ISBI2012DataModule
from remat.data.io import DataFileError, read_image
from remat.data.layout import list_files, natural_key
from remat.data.masks import colour_mask, index_mask, threshold_mask
from remat.data.patches import Box, PatchSampler, crop_pad
from remat.data.sizes import as_pair
from remat.data.verify import DataCheckError
from tests.data.fakes import make_fake_dubai, make_fake_isbi, save

# ---------------------------------------------------------------------------- patch sampler


def test_uniform_patches_stay_inside_and_reach_every_corner():
    sampler = PatchSampler(8, foreground_prob=0.0)
    mask = torch.zeros(20, 30, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(0)
    boxes = [sampler(mask, generator) for _ in range(400)]
    assert all(0 <= b.top <= 12 and 0 <= b.left <= 22 and (b.height, b.width) == (8, 8)
               for b in boxes)
    assert {b.top for b in boxes} == set(range(13)) and {b.left for b in boxes} == set(range(23))


def test_foreground_sampler_centres_patches_on_rare_foreground():
    mask = torch.zeros(200, 200, dtype=torch.uint8)
    mask[150:153, 20:23] = 1  # 9 of 40,000 pixels
    generator = torch.Generator().manual_seed(0)
    biased = PatchSampler(32, foreground_prob=1.0)
    for _ in range(50):
        box = biased(mask, generator)
        crop = crop_pad(mask, box, (32, 32), 255)
        assert crop.sum() > 0 and crop[14:19, 14:19].any()  # foreground near the centre
    uniform = PatchSampler(32, foreground_prob=0.0)
    hits = sum(bool(crop_pad(mask, uniform(mask, generator), (32, 32), 255).any())
               for _ in range(200))
    assert hits < 20  # ~(32+2)^2/169^2 = 4 % of uniform patches see it
    half = PatchSampler(32, foreground_prob=0.5)
    hits = sum(bool(crop_pad(mask, half(mask, generator), (32, 32), 255).any())
               for _ in range(400))
    assert 160 < hits < 250


def test_foreground_sampler_falls_back_to_uniform_without_foreground():
    sampler = PatchSampler(4, foreground_prob=1.0, foreground_classes=[2, 3])
    mask = torch.ones(10, 10, dtype=torch.uint8)
    tops = {sampler(mask, torch.Generator().manual_seed(s)).top for s in range(60)}
    assert len(tops) > 3
    mask[7, 7] = 3
    box = sampler(mask)
    assert (box.top, box.left) == (5, 5)  # centred on (7, 7): 7 - 4 // 2


def test_small_images_are_padded_with_fill():
    image = torch.arange(12, dtype=torch.uint8).reshape(1, 3, 4)
    box = PatchSampler((5, 6))(image[0])
    assert box == Box(0, 0, 3, 4)
    out = crop_pad(image, box, (5, 6), 255)
    assert out.shape == (1, 5, 6) and torch.equal(out[:, :3, :4], image)
    assert (out[:, 3:] == 255).all() and (out[:, :, 4:] == 255).all()


@pytest.mark.parametrize("size", [0, -3, (4,), (4, 0), 2.5, True])
def test_patch_size_must_be_positive(size):
    with pytest.raises(ValueError, match="patch_size"):
        as_pair(size)


@pytest.mark.parametrize("prob", [-0.1, 1.5])
def test_foreground_prob_range(prob):
    with pytest.raises(ValueError, match=r"data.foreground_prob must be in \[0, 1\]"):
        PatchSampler(8, foreground_prob=prob)


def test_sampled_patch_keeps_image_and_mask_aligned(tmp_path: Path):
    """Training patches with flips: the bright membrane pixels are where the mask is 1."""
    make_fake_isbi(tmp_path, n=3, size=48)
    dm = ISBI2012DataModule(tmp_path, val_sections=1, patch_size=24, patches_per_image=10,
                            foreground_prob=0.5)
    dm.setup()
    torch.manual_seed(3)
    for index in range(len(dm.train_set)):
        sample = dm.train_set[index]
        fg = sample["mask"] == 1
        if fg.any() and (~fg).any():
            grey = sample["image"].mean(0)
            assert grey[fg].mean() > grey[~fg].mean() + 0.3


# ---------------------------------------------------------------------------- decoders


def test_threshold_mask_bright_dark_and_max_channel(tmp_path: Path):
    grey = np.array([[0, 127], [128, 255]], dtype=np.uint8)
    path = save(grey, tmp_path / "m.png")
    assert threshold_mask(path).tolist() == [[0, 0], [1, 1]]
    assert threshold_mask(path, foreground="dark").tolist() == [[1, 1], [0, 0]]
    red = np.zeros((2, 2, 3), dtype=np.uint8)
    red[0, 0] = (255, 0, 0)  # a pure red label pixel is dark in grey (76) but bright in red
    path = save(red, tmp_path / "red.tif")
    assert threshold_mask(path).tolist() == [[0, 0], [0, 0]]
    assert threshold_mask(path, channels="max").tolist() == [[1, 0], [0, 0]]
    with pytest.raises(ValueError, match="foreground must be"):
        threshold_mask(path, foreground="white")


def test_colour_not_in_palette_names_colour_and_file(tmp_path: Path):
    rgb = np.zeros((4, 5, 3), dtype=np.uint8)
    rgb[...] = (60, 16, 152)
    rgb[1, 1:4] = (255, 0, 255)
    rgb[3, 4] = (1, 2, 3)
    path = save(rgb, tmp_path / "mask.png")
    with pytest.raises(ValueError) as info:
        colour_mask(path, {(60, 16, 152): 0})
    message = str(info.value)
    assert str(path) in message and "2 colour(s) not in the palette" in message
    assert "(255, 0, 255) #FF00FF (3 px)" in message and "(1, 2, 3) #010203 (1 px)" in message
    mask = colour_mask(path, {(60, 16, 152): 0, (255, 0, 255): 4}, ignore_colours=[(1, 2, 3)])
    assert mask[1].tolist() == [0, 4, 4, 4, 0] and mask[3, 4] == 255


def test_index_mask_remaps_and_rejects_unknown_values(tmp_path: Path):
    raw = np.array([[0, 1, 7], [2, 3, 4]], dtype=np.uint8)
    path = save(raw, tmp_path / "label.png")
    lookup = {0: 255, **{v: v - 1 for v in range(1, 8)}}
    assert index_mask(path, lookup).tolist() == [[255, 0, 6], [1, 2, 3]]
    save(np.array([[1, 9]], dtype=np.uint8), path)
    with pytest.raises(ValueError, match=r"holds value\(s\) \[9\]") as info:
        index_mask(path, lookup)
    assert str(path) in str(info.value)


def test_read_image_decodes_tif_and_gif_and_names_corrupt_files(tmp_path: Path):
    rgb = np.random.default_rng(0).integers(0, 255, (6, 7, 3), dtype=np.uint8)
    assert torch.equal(read_image(save(rgb, tmp_path / "a.tif")),
                       torch.from_numpy(rgb).permute(2, 0, 1))
    grey = np.array([[0, 255, 0]], dtype=np.uint8)
    gif = read_image(save(grey, tmp_path / "b.gif"), ImageReadMode.GRAY)
    assert gif.shape == (1, 1, 3) and gif[0, 0].tolist() == [0, 255, 0]
    bad = tmp_path / "c.tif"
    bad.write_bytes(b"not a tiff")
    with pytest.raises(DataFileError, match=r"c.tif: cannot be decoded \(cannot identify "
                                             r"image file .*\); expected an 8-bit TIFF image"):
        read_image(bad)


def test_names_sort_naturally_and_endings_strip():
    assert sorted(["10", "9", "1"], key=natural_key) == ["1", "9", "10"]
    assert sorted(["tyrol-w10", "austin2", "tyrol-w9"], key=natural_key) == [
        "austin2", "tyrol-w9", "tyrol-w10"]


def test_list_files_strips_endings(tmp_path: Path):
    for name in ("21_training.tif", "22_training.TIF", "notes.txt", ".hidden_training.tif"):
        (tmp_path / name).write_bytes(b"")
    assert sorted(list_files(tmp_path, ["_training.tif"])) == ["21", "22"]


# ---------------------------------------------------------------------------- bad input


def test_bad_palette_colour_in_a_dataset_names_the_file(tmp_path: Path):
    make_fake_dubai(tmp_path, tiles=(1, 2), parts=1, black=0)
    path = tmp_path / "Tile 2" / "masks" / "image_part_001.png"
    rgb = np.zeros((40, 48, 3), dtype=np.uint8) + np.array([132, 41, 246], dtype=np.uint8)
    rgb[5, 5] = (80, 227, 194)  # #50E3C2, a colour of the release's stale classes.json
    save(rgb, path)
    colour = r"\(80, 227, 194\) #50E3C2 \(1 px\)"
    with pytest.raises(DataCheckError, match=colour) as info:  # the data check lists it ...
        DubaiAerialDataModule(tmp_path, val_tiles=[2]).setup()
    assert f"{path}: holds 1 colour(s) not in the palette" in str(info.value)
    dm = DubaiAerialDataModule(tmp_path, val_tiles=[2], verify=False)
    dm.setup()
    with pytest.raises(DataFileError, match=colour) as info:  # ... else the batch that meets it
        dm.val_set[0]
    assert str(path) in str(info.value)


def test_split_file_selects_and_names_missing_images(tmp_path: Path):
    make_fake_isbi(tmp_path, n=6, size=16)
    split = tmp_path / "split.yaml"
    split.write_text("train: ['0', '1', '2']\nval: ['5']\ntest: ['4']\n")
    dm = ISBI2012DataModule(tmp_path, split_file=split)
    dm.setup()
    assert dm.splits == {"train": ["0", "1", "2"], "val": ["5"], "test": ["4"]}
    assert [b["name"] for b in dm.test_dataloader()] == [["4"]]

    split.write_text("train: ['0', '1', '17']\nval: ['5', 'x']\n")
    with pytest.raises(FileNotFoundError, match=r"\(train\) names 1 image\(s\) that are not in "
                                                r"the dataset: 17") as info:
        ISBI2012DataModule(tmp_path, split_file=split).setup()
    assert str(split) in str(info.value)


@pytest.mark.parametrize("text,error,match", [
    ("train: ['0']\nval: []\n", ValueError, "the val split is empty"),
    ("train: []\nval: ['1']\n", ValueError, "the train split is empty"),
    ("train: ['0']\nval: ['1']\ntest: []\n", ValueError, "the test split is empty"),
    ("train: ['0']\nval: ['0']\n", ValueError, "0 is in both the train and the val split"),
    ("train: ['0']\nvalid: ['1']\n", ValueError, "must have keys among train, val and test"),
    ("- 0\n- 1\n", ValueError, "must map train/val"),
])
def test_bad_split_files(tmp_path: Path, text: str, error: type, match: str):
    make_fake_isbi(tmp_path, n=3, size=16)
    split = tmp_path / "split.yaml"
    split.write_text(text)
    with pytest.raises(error, match=match) as info:
        ISBI2012DataModule(tmp_path, split_file=split).setup()
    assert str(split) in str(info.value)


def test_an_eval_only_split_file_validates_and_refuses_to_fit(tmp_path: Path):
    """A split file with only val (or only test) scores that split; fit names what it lacks."""
    make_fake_isbi(tmp_path, n=3, size=16)
    split = tmp_path / "split.yaml"
    split.write_text("val: ['2']\n")
    dm = ISBI2012DataModule(tmp_path, split_file=split, patch_size=8)
    dm.setup("validate")
    assert [b["name"] for b in dm.val_dataloader()] == [["2"]] and dm.train_set is None
    with pytest.raises(ValueError, match=r"no train split \(split file .*split.yaml\) but fit "
                                         "needs it"):
        dm.setup("fit")
    split.write_text("test: ['1']\n")
    dm = ISBI2012DataModule(tmp_path, split_file=split, patch_size=8)
    dm.setup("test")
    assert [b["name"] for b in dm.test_dataloader()] == [["1"]]
    with pytest.raises(ValueError, match="no val split"):
        dm.setup("validate")


def test_missing_split_file(tmp_path: Path):
    make_fake_isbi(tmp_path, n=3, size=16)
    with pytest.raises(FileNotFoundError, match="data.split_file .*nope.yaml does not exist"):
        ISBI2012DataModule(tmp_path, split_file=tmp_path / "nope.yaml").setup()


@pytest.mark.parametrize("kwargs,match", [
    ({"limit_train": 0}, "data.limit_train"), ({"limit_val": 1.5}, "data.limit_val"),
    ({"patches_per_image": 0}, "data.patches_per_image"), ({"image_mode": "cmyk"},
                                                           "data.image_mode"),
    ({"patch_size": [0, 8]}, "data.patch_size"),
])
def test_bad_options_name_the_config_key(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        ISBI2012DataModule("/nowhere", **kwargs)


def test_every_datamodule_exposes_the_contract_attributes(tmp_path: Path):
    """num_classes (1 = binary), one class name per mask value, ignore index 255."""
    import remat.data as data

    names = [n for n in data.__all__ if n.endswith("DataModule") and "Text" not in n]
    assert len(names) == 15  # the 2D datamodules, data=msd and data=volumes
    for name in names:
        cls = getattr(data, name)
        if name == "MSDDataModule":  # its classes come from the task's dataset.json
            (tmp_path / "msd").mkdir(exist_ok=True)
            (tmp_path / "msd" / "dataset.json").write_text(json.dumps(
                {"labels": {"0": "background", "1": "spleen"}, "modality": {"0": "CT"},
                 "training": [{"image": "./imagesTr/a.nii.gz",
                               "label": "./labelsTr/a.nii.gz"}]}))
            dm = cls(tmp_path / "msd")
        else:
            dm = cls() if name == "SyntheticSegDataModule" else cls(tmp_path)
        expected = 2 if dm.num_classes == 1 else dm.num_classes
        assert len(dm.class_names) == expected and dm.ignore_index == 255, name
