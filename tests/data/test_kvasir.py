"""KvasirSegDataModule on the real Kvasir-SEG copy and on tiny fake copies in its layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torchvision.io import ImageReadMode

from remat.config import config_dir
from remat.data import KvasirSegDataModule, KvasirSegDataset
from remat.data.io import DataFileError, read_image
from remat.data.kvasir import KVASIR_URL, split_ids
from remat.data.transforms import eval_transform, train_transform
from remat.data.verify import DataCheckError
from tests.data import fakes

CONFIG = config_dir() / "data" / "kvasir_seg.yaml"


# ---------------------------------------------------------------------------- fake copies


def _write_jpeg(path: Path, rgb: torch.Tensor) -> None:
    fakes.save(rgb.permute(1, 2, 0).numpy(), path, quality=95)


def _dataset(root: Path, transform) -> KvasirSegDataset:
    """All pairs of a fake copy, sorted by id, served with ``transform``."""
    dm = KvasirSegDataModule(root, val_size=1, verify=False)
    dm.setup()
    return KvasirSegDataset([dm.pairs[n] for n in sorted(dm.pairs)], transform)


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    root = tmp_path / "Kvasir-SEG"
    fakes.make_fake_kvasir(root)
    return root


# ---------------------------------------------------------------------------- real data


def test_real_split_is_880_120_deterministic_and_disjoint(kvasir_root: Path):
    dm = KvasirSegDataModule(kvasir_root, verify=False)
    dm.setup("fit")
    assert (len(dm.train_ids), len(dm.val_ids)) == (880, 120)
    assert not set(dm.train_ids) & set(dm.val_ids)
    all_ids = sorted(p.stem for p in (kvasir_root / "images").glob("*.jpg"))
    assert sorted(dm.train_ids + dm.val_ids) == all_ids
    assert (len(dm.train_set), len(dm.val_set)) == (880, 120)

    again = KvasirSegDataModule(str(kvasir_root), verify=False)
    again.setup("validate")
    assert (again.train_ids, again.val_ids) == (dm.train_ids, dm.val_ids)
    other = KvasirSegDataModule(kvasir_root, split_seed=0, verify=False)
    other.setup()
    assert set(other.val_ids) != set(dm.val_ids) and len(other.val_ids) == 120


def test_real_copy_passes_the_data_check(kvasir_root: Path, caplog):
    """data.verify=auto checks all 2000 files of the real copy (fit reads train and val)."""
    dm = KvasirSegDataModule(kvasir_root)
    with caplog.at_level("INFO", logger="remat.data.verify"):
        dm.setup("fit")
    assert dm.verify == "auto"
    assert "2000 files decoded" in caplog.text and "none bad" in caplog.text


def test_real_samples_load_as_binary_masks(kvasir_root: Path):
    dm = KvasirSegDataModule(kvasir_root, image_size=128, limit_val=3, verify=False)
    dm.setup()
    assert dm.num_classes == 1 and len(dm.val_set) == 3
    for index, stem in enumerate(dm.val_ids):
        sample = dm.val_set[index]
        assert sample["image"].shape == (3, 128, 128) and sample["image"].dtype == torch.float32
        assert sample["mask"].shape == (128, 128) and sample["mask"].dtype == torch.int64
        assert set(sample["mask"].unique().tolist()) == {0, 1}
        # ImageNet-normalised values of an ordinary photo.
        assert -2.2 < sample["image"].mean().item() < 2.7
        assert sample["image"].min() >= -2.2 and sample["image"].max() <= 2.7
        # The resized mask covers the same fraction as the full-size JPEG mask.
        raw = read_image(kvasir_root / "masks" / f"{stem}.jpg", ImageReadMode.GRAY)
        raw_fraction = (raw >= 128).float().mean().item()
        assert 0.005 < raw_fraction < 0.95
        assert abs(sample["mask"].float().mean().item() - raw_fraction) < 0.02


def test_real_train_batch_at_64_by_48px(kvasir_root: Path):
    dm = KvasirSegDataModule(kvasir_root, image_size=[64, 48], batch_size=4, limit_train=8)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert len(loader) == 2 and loader.drop_last
    batch = next(iter(loader))
    assert batch["image"].shape == (4, 3, 64, 48) and batch["image"].dtype == torch.float32
    assert batch["mask"].shape == (4, 64, 48) and batch["mask"].dtype == torch.int64
    assert set(batch["mask"].unique().tolist()) <= {0, 1}
    assert 0.0 < batch["mask"].float().mean().item() < 1.0


def test_real_config_points_at_data_dir(kvasir_root: Path):
    cfg = OmegaConf.create({
        "paths": {"data_dir": str(kvasir_root.parent)},
        "data": OmegaConf.load(CONFIG),
    })
    dm = instantiate(cfg.data, image_size=32, limit_train=2, limit_val=2)
    assert isinstance(dm, KvasirSegDataModule)
    assert Path(dm.root) == kvasir_root
    assert (dm.val_size, dm.split_seed, dm.num_classes, dm.in_channels) == (120, 42, 1, 3)
    assert (dm.verify, dm.image_mode, dm.image_size) == ("auto", "rgb", (32, 32))
    dm.setup("fit")  # 2 + 2 pairs checked, then loaded
    assert next(iter(dm.val_dataloader()))["image"].shape == (2, 3, 32, 32)


# ---------------------------------------------------------------------------- fake copies


def test_fake_copy_splits_and_limits(fake_root: Path):
    dm = KvasirSegDataModule(fake_root, image_size=32, batch_size=2, val_size=2, limit_train=3)
    dm.setup()
    assert len(dm.train_ids) == 3 and len(dm.val_ids) == 2
    order = sorted(f"fake{i:02d}" for i in range(6))
    expected_train, expected_val = split_ids(order[::-1], val_size=2, split_seed=42)
    assert dm.train_ids == expected_train[:3] and dm.val_ids == expected_val
    batch = next(iter(dm.val_dataloader()))
    assert batch["image"].shape == (2, 3, 32, 32) and batch["mask"].shape == (2, 32, 32)


def test_parent_of_the_dataset_folder_is_accepted(fake_root: Path):
    dm = KvasirSegDataModule(fake_root.parent, val_size=2)
    dm.setup()
    assert dm.dataset_root == fake_root


def test_masks_stay_aligned_with_images_under_augmentation(fake_root: Path):
    dataset = _dataset(fake_root, train_transform(32))
    torch.manual_seed(0)
    for index in range(len(dataset)):
        for _ in range(3):
            sample = dataset[index]
            mask = sample["mask"].bool()
            assert set(sample["mask"].unique().tolist()) <= {0, 1}
            if mask.any() and (~mask).any():  # the bright square is where the mask is
                grey = sample["image"].mean(0)
                assert grey[mask].mean() > grey[~mask].mean() + 1.0


def test_eval_transform_is_deterministic(fake_root: Path):
    ids = sorted(p.stem for p in (fake_root / "images").iterdir())
    dataset = _dataset(fake_root, eval_transform(24))
    a, b = dataset[1], dataset[1]
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])
    # 48x64 resized to 24x24: the square [6:24, 8:32] becomes rows 3:12, cols 3:12.
    assert a["mask"][3:12, 3:12].all() and a["mask"].sum().item() == 81
    assert a["name"] == ids[1]


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("root", [None, "", "  "])
def test_unset_root_says_how_to_set_it(root):
    dm = KvasirSegDataModule(root)
    with pytest.raises(ValueError, match="data.root") as info:
        dm.setup()
    assert "images/" in str(info.value) and KVASIR_URL in str(info.value)


def test_missing_root_names_it_and_the_layout(tmp_path: Path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        KvasirSegDataModule(missing).setup()
    message = str(info.value)
    assert str(missing) in message and "does not exist" in message
    assert "images/*.jpg, masks/*.jpg" in message and KVASIR_URL in message


@pytest.mark.parametrize("folder", ["images", "masks"])
def test_root_without_a_folder_names_the_layout(fake_root: Path, folder: str):
    for path in (fake_root / folder).iterdir():
        path.unlink()
    (fake_root / folder).rmdir()
    with pytest.raises(FileNotFoundError) as info:
        KvasirSegDataModule(fake_root, val_size=2).setup()
    message = str(info.value)
    assert str(fake_root) in message and "images/*.jpg, masks/*.jpg" in message
    assert KVASIR_URL in message


def test_empty_images_folder(tmp_path: Path):
    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    with pytest.raises(FileNotFoundError, match="no images found"):
        KvasirSegDataModule(tmp_path).setup()


def test_image_without_mask_is_named(fake_root: Path):
    (fake_root / "masks" / "fake03.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"1 image\(s\) without a mask: images/fake03.jpg"):
        KvasirSegDataModule(fake_root, val_size=2).setup()


def test_masks_without_images_are_named_up_to_five(fake_root: Path):
    for i in range(7):
        _write_jpeg(fake_root / "masks" / f"extra{i}.jpg", torch.zeros(3, 8, 8, dtype=torch.uint8))
    with pytest.raises(FileNotFoundError) as info:
        KvasirSegDataModule(fake_root, val_size=2).setup()
    message = str(info.value)
    assert "7 mask(s) without an image" in message
    assert "masks/extra0.jpg" in message and "masks/extra4.jpg" in message
    assert "masks/extra5.jpg" not in message and "and 2 more (7 in all)" in message


@pytest.mark.parametrize("folder", ["images", "masks"])
def test_corrupt_file_is_named_by_the_data_check_and_when_loaded(fake_root: Path, folder: str):
    bad = fake_root / folder / "fake02.jpg"
    bad.write_bytes(b"this is not a jpeg")
    with pytest.raises(DataCheckError, match=r"1 of 12 files cannot be used") as info:
        KvasirSegDataModule(fake_root, val_size=2).setup()  # both splits: 6 pairs
    assert f"{bad}: cannot be decoded" in str(info.value)
    expected = "an 8-bit RGB JPEG image" if folder == "images" else \
        "a grey JPEG mask with the foreground >= 128"
    assert f"; expected {expected}" in str(info.value)
    ids = sorted(p.stem for p in (fake_root / "images").iterdir())
    dataset = _dataset(fake_root, eval_transform(16))
    assert dataset[0]["mask"].shape == (16, 16)  # other samples still load
    with pytest.raises(DataFileError, match="fake02.jpg") as info:
        dataset[ids.index("fake02")]
    assert str(bad) in str(info.value)


def test_size_mismatch_names_file_and_both_sizes(fake_root: Path):
    mask = torch.from_numpy(fakes.square_mask(30, 20) * 255).expand(3, -1, -1).contiguous()
    _write_jpeg(fake_root / "masks" / "fake04.jpg", mask)
    dataset = _dataset(fake_root, eval_transform(16))
    with pytest.raises(DataFileError, match="fake04") as info:
        dataset[4]
    assert "64x48 (WxH)" in str(info.value) and "20x30" in str(info.value)


@pytest.mark.parametrize("val_size", [0, -1, 6, 7])
def test_val_size_must_leave_both_splits_non_empty(fake_root: Path, val_size: int):
    with pytest.raises(ValueError, match="val_size"):
        KvasirSegDataModule(fake_root, val_size=val_size).setup()


@pytest.mark.parametrize("limits", [{"limit_train": 0}, {"limit_val": -2}, {"limit_val": 1.5}])
def test_limits_must_be_positive_ints(fake_root: Path, limits: dict):
    with pytest.raises(ValueError, match="limit_"):
        KvasirSegDataModule(fake_root, **limits)


def test_split_ignores_input_order_and_checks_size():
    ids = [f"id{i}" for i in range(10)]
    train, val = split_ids(ids, val_size=3, split_seed=1)
    assert (train, val) == split_ids(list(reversed(ids)), val_size=3, split_seed=1)
    assert len(train) == 7 and len(val) == 3 and sorted(train + val) == ids
    with pytest.raises(ValueError, match="between 1 and 9"):
        split_ids(ids, val_size=10, split_seed=1)
