"""Every training sample's random draws start from a seed of its own, drawn with the epoch's
order (remat.data.seeding): the same augmentation with or without DataLoader workers, and
after a resume inside an epoch whose workers start afresh."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

from remat.callbacks.resume import _ResumableSampler, _ShardedResumableSampler
from remat.data.io import make_loader
from remat.data.seeding import SeededSamples, SeededShuffle


class Augmented(Dataset):
    """Draws from torch's, numpy's and Python's global RNG, as augmentations do."""

    pairs = ["kept as the dataset's own"]

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        draws = [torch.rand(()).item(), float(np.random.rand()), random.random()]
        return torch.tensor(index), torch.tensor(draws, dtype=torch.float64)


def batches(loader, epochs: int = 2) -> list[list[tuple[list[int], torch.Tensor]]]:
    return [[(index.tolist(), draws) for index, draws in loader] for _ in range(epochs)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(ea) == len(eb) and all(x[0] == y[0] and torch.equal(x[1], y[1])
                                   for x, y in zip(ea, eb, strict=True))
        for ea, eb in zip(a, b, strict=True))


def test_the_draws_are_the_same_with_any_number_of_workers():
    plain = batches(make_loader(Augmented(), 4, 0, train=True, seed=5))
    assert same(plain, batches(make_loader(Augmented(), 4, 2, train=True, seed=5)))
    assert same(plain, batches(make_loader(Augmented(), 4, 1, train=True, seed=5)))
    # new draws each epoch and each sample, another seed another run
    first, second = plain
    assert not torch.equal(first[0][1], second[0][1])
    assert len({tuple(d.tolist()) for _, draws in first for d in draws}) == 8
    assert not same(plain, batches(make_loader(Augmented(), 4, 0, train=True, seed=6)))
    # every index once an epoch (drop_last: 2 batches of 4 out of 10)
    assert len({i for idx, _ in first for i in idx}) == 8


def test_loading_leaves_the_global_rng_alone():
    """Dropout draws from the global RNG in the main process: loading samples there
    (num_workers=0) must not move it, or the losses would depend on the workers."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    batches(make_loader(Augmented(), 4, 0, train=True, seed=5))
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]


def test_a_resume_inside_an_epoch_with_workers_draws_what_the_uninterrupted_run_drew():
    """A run killed after batch 1 of epoch 1 and resumed in a new process: its workers start
    afresh (they carried their RNG on from epoch 0 before: other crops), the resume skips
    the batch trained (ResumeState's sampler)."""
    straight = make_loader(Augmented(), 2, 2, train=True, seed=5)
    wrapped = straight.batch_sampler.sampler = _ResumableSampler(
        straight.batch_sampler.sampler, straight.batch_sampler.sampler.generator)
    epoch_0, epoch_1 = batches(straight)
    start = wrapped.epoch_start  # what the checkpoint keeps of epoch 1

    resumed = make_loader(Augmented(), 2, 2, train=True, seed=5)
    inner = resumed.batch_sampler.sampler
    resumed.batch_sampler.sampler = _ResumableSampler(inner, inner.generator)
    resumed.batch_sampler.sampler.resume = (start, 2 * 1)  # one batch of 2 trained
    assert same([epoch_1[1:]], batches(resumed, epochs=1))


def test_sharded_shares_carry_the_seeds():
    """Under DDP the resumable sampler shards the (index, seed) pairs: each rank's samples
    draw what they draw in one process, the whole epoch covered once."""
    data = SeededSamples(Augmented())

    def shard(rank: int) -> list:
        inner = SeededShuffle(len(data), torch.Generator().manual_seed(5))
        sampler = _ShardedResumableSampler(inner, inner.generator, data, by_dataset=False,
                                           num_replicas=2, rank=rank, seed=0)
        sampler.set_epoch(0)
        return list(sampler)

    one = dict(SeededShuffle(len(data), torch.Generator().manual_seed(5)))
    shares = shard(0) + shard(1)
    assert sorted(i for i, _ in shares) == list(range(10))
    assert all(one[i] == seed for i, seed in shares)
    index, seed = shares[0]
    assert torch.equal(data[(index, seed)][1], data[(index, seed)][1])  # a seed, its draws
    assert data.pairs == Augmented.pairs and len(data) == 10


def test_the_runs_seed_changes_the_draws_not_the_order(monkeypatch):
    """A seed=... sweep drew other augmentation when the draws came from the global RNG;
    with the loader drawing them, they take the run's seed in (Lightning's PL_GLOBAL_SEED)."""
    runs = {}
    for seed in ("42", "7"):
        monkeypatch.setenv("PL_GLOBAL_SEED", seed)
        runs[seed] = batches(make_loader(Augmented(), 4, 0, train=True, seed=5))
    assert [i for i, _ in runs["42"][0]] == [i for i, _ in runs["7"][0]]  # data.seed's order
    assert not torch.equal(runs["42"][0][0][1], runs["7"][0][0][1])
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    assert same(runs["42"], batches(make_loader(Augmented(), 4, 2, train=True, seed=5)))
