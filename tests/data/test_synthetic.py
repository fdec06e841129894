"""SyntheticSegDataset / SyntheticSegDataModule: determinism, content statistics, loaders."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from remat.config import config_dir
from remat.data import SyntheticSegDataModule, SyntheticSegDataset
from remat.data.synthetic import render_sample
from remat.data.transforms import IMAGENET_MEAN, IMAGENET_STD

CONFIG = config_dir() / "data" / "synthetic_seg.yaml"


def _best_threshold_dice(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Best Dice of ``values > t`` or ``values <= t`` over 99 quantile thresholds t."""
    values, target = values.flatten(), mask.bool().flatten()
    thresholds = torch.quantile(values, torch.linspace(0.01, 0.99, 99))
    above = values[None, :] > thresholds[:, None]
    best = 0.0
    for pred in (above, ~above):
        inter = (pred & target).sum(1).float()
        dice = 2 * inter / (pred.sum(1) + target.sum()).float()
        best = max(best, dice.max().item())
    return best


def _box(x: torch.Tensor, k: int) -> torch.Tensor:
    return F.avg_pool2d(x[None], k, 1, k // 2, count_include_pad=False)[0]


def test_sample_shapes_dtypes_and_values():
    ds = SyntheticSegDataset(num_samples=3, image_size=64, seed=0)
    assert len(ds) == 3
    sample = ds[0]
    assert set(sample) == {"image", "mask"}
    assert sample["image"].shape == (3, 64, 64) and sample["image"].dtype == torch.float32
    assert sample["mask"].shape == (64, 64) and sample["mask"].dtype == torch.int64
    assert set(sample["mask"].unique().tolist()) == {0, 1}
    # ImageNet-normalised: undoing the normalisation gives the rendered [0, 1] image.
    image, _ = render_sample(0, 0, 64)
    mean = torch.tensor(IMAGENET_MEAN)[:, None, None]
    std = torch.tensor(IMAGENET_STD)[:, None, None]
    torch.testing.assert_close(sample["image"] * std + mean, image, atol=1e-5, rtol=0)
    assert image.min() >= 0 and image.max() <= 1
    with pytest.raises(IndexError):
        ds[3]


def test_same_seed_and_index_give_identical_samples():
    a = SyntheticSegDataset(4, 96, seed=7)[2]
    b = SyntheticSegDataset(10, 96, seed=7)[2]
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])


def test_index_seed_and_split_change_the_sample():
    ref = SyntheticSegDataset(4, 64, seed=0)[0]
    others = [
        SyntheticSegDataset(4, 64, seed=0)[1],
        SyntheticSegDataset(4, 64, seed=1)[0],
        SyntheticSegDataset(4, 64, seed=0, split="val")[0],
    ]
    for other in others:
        assert not torch.equal(ref["mask"], other["mask"])
        assert (ref["image"] - other["image"]).abs().mean() > 0.1


def test_generation_leaves_global_rng_alone():
    state = torch.get_rng_state()
    SyntheticSegDataset(2, 64, seed=0)[1]
    assert torch.equal(state, torch.get_rng_state())


def test_foreground_fraction_is_sane():
    masks = [render_sample(0, i, 96)[1] for i in range(32)]
    fractions = torch.stack([m.float().mean() for m in masks])
    assert 0.05 <= fractions.mean().item() <= 0.6
    assert fractions.min().item() > 0.005 and fractions.max().item() < 0.9  # both classes always


def test_mask_not_recoverable_by_intensity_threshold():
    """Even the best per-image, per-channel threshold (an oracle) is far from the mask."""
    dices = []
    for i in range(24):
        image, mask = render_sample(0, i, 96)
        dices.append(max(_best_threshold_dice(image[c], mask) for c in range(3)))
    dices = torch.tensor(dices)
    assert dices.mean().item() < 0.7, dices
    assert dices.max().item() < 0.85, dices


def test_mask_recoverable_from_local_texture_energy():
    """The signal is there: local band-pass energy (stripes) finds the objects."""
    dices = []
    for i in range(24):
        image, mask = render_sample(0, i, 96)
        grey = image.mean(0, keepdim=True)
        energy = _box((grey - _box(grey, 13)) ** 2, 9)[0]
        dices.append(_best_threshold_dice(energy, mask))
    dices = torch.tensor(dices)
    assert dices.mean().item() > 0.9, dices
    assert dices.min().item() > 0.8, dices


def test_datamodule_batches_and_loader_rules():
    dm = SyntheticSegDataModule(image_size=64, batch_size=4, num_train=10, num_val=6)
    assert dm.num_classes == 1
    dm.setup("fit")
    train = dm.train_dataloader()
    assert train.drop_last and len(train) == 2  # 10 samples, batch 4, last partial dropped
    assert not train.pin_memory and not train.persistent_workers
    batch = next(iter(train))
    assert batch["image"].shape == (4, 3, 64, 64) and batch["image"].dtype == torch.float32
    assert batch["mask"].shape == (4, 64, 64) and batch["mask"].dtype == torch.int64

    val = dm.val_dataloader()
    assert not val.drop_last and [len(b["mask"]) for b in val] == [4, 2]
    first = next(iter(dm.test_dataloader()))
    expected = torch.stack([dm.val_set[i]["mask"] for i in range(4)])
    assert torch.equal(first["mask"], expected)  # val keeps order


@pytest.mark.parametrize("setting, message", [
    ({"batch_size": -1}, r"data.batch_size must be a positive int, got -1"),
    ({"batch_size": 2.5}, r"data.batch_size must be a positive int, got 2.5"),
    ({"batch_size": True}, r"data.batch_size must be a positive int, got True"),
    ({"num_workers": -2}, r"data.num_workers must be an int >= 0, got -2"),
    ({"num_train": 0}, r"data.num_train must be a positive int, got 0"),
    ({"num_val": 0}, r"data.num_val must be a positive int, got 0"),
])
def test_loader_settings_are_checked_when_the_datamodule_is_built(setting, message):
    """A bad batch size was DataLoader's traceback at the first batch; now one line naming
    the key, before the run starts."""
    with pytest.raises(ValueError, match=message):
        SyntheticSegDataModule(image_size=64, **{"batch_size": 4, **setting})


def test_small_train_set_keeps_its_partial_batch():
    dm = SyntheticSegDataModule(image_size=32, batch_size=4, num_train=3, num_val=2)
    dm.setup()
    train = dm.train_dataloader()
    assert not train.drop_last
    assert [b["mask"].shape[0] for b in train] == [3]


def test_train_shuffle_is_seeded():
    def epoch_orders(seed: int) -> list[list[int]]:
        dm = SyntheticSegDataModule(image_size=32, batch_size=2, num_train=8, seed=seed)
        dm.setup()
        loader = dm.train_dataloader()
        # (index, seed) pairs: the seed of each sample's draws (remat.data.seeding)
        return [[i for i, _ in loader.batch_sampler.sampler] for _ in range(2)]

    orders = epoch_orders(3)
    assert orders == epoch_orders(3)
    assert orders[0] != orders[1]  # a new order each epoch
    assert sorted(orders[0]) == list(range(8))


def test_workers_persist_when_used():
    dm = SyntheticSegDataModule(image_size=32, num_workers=1, num_train=8, num_val=4)
    dm.setup()
    assert dm.train_dataloader().persistent_workers
    assert dm.val_dataloader().persistent_workers


def test_hydra_config_instantiates_the_datamodule():
    cfg = OmegaConf.load(CONFIG)
    dm = instantiate(cfg, image_size=32, num_train=4, num_val=2)
    assert isinstance(dm, SyntheticSegDataModule)
    assert (dm.batch_size, dm.seed, dm.num_classes) == (4, 0, 1)
