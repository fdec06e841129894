"""ResumeState's sampler for DDP/FSDP train loaders: each rank's share is the one Lightning's
own distributed sampler gives, and a resume skips exactly the indices that rank trained.
(The 2-process run: tests/test_ddp_resume.py, tests/test_fsdp_resume.py.)"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from remat.callbacks.resume import _ShardedResumableSampler, _with_sampler
from remat.data.text import WindowSampler


@pytest.mark.parametrize("drop_last", [False, True])
def test_dataset_shares_are_torch_s_distributed_sampler_s(drop_last):
    data = list(range(11))  # 11 over 2 ranks: padded to 12, or cut to 10
    for rank in (0, 1):
        ours = _ShardedResumableSampler(RandomSampler(data), None, data, by_dataset=True,
                                        num_replicas=2, rank=rank, seed=5, drop_last=drop_last)
        torch_s = DistributedSampler(data, num_replicas=2, rank=rank, seed=5,
                                     drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            torch_s.set_epoch(epoch)
            assert list(ours) == list(torch_s)
        assert len(ours) == len(torch_s) == (5 if drop_last else 6)
    shares = []
    for rank in (0, 1):
        sampler = _ShardedResumableSampler(None, None, data, by_dataset=True, num_replicas=2,
                                           rank=rank, seed=5)
        shares += list(sampler)
    assert sorted(set(shares)) == data  # every index once, one repeated as padding
    assert len(shares) == 12


def test_window_shares_are_lightning_s_wrapper_s_and_draw_new_windows_each_epoch():
    def windows() -> WindowSampler:
        return WindowSampler(RandomSampler(range(1000), num_samples=9,
                                           generator=torch.Generator().manual_seed(3)))

    for rank in (0, 1):
        inner = windows()
        ours = _ShardedResumableSampler(inner, inner.generator, None, by_dataset=False,
                                        num_replicas=2, rank=rank, seed=7)
        lightning_s = DistributedSamplerWrapper(windows(), num_replicas=2, rank=rank, seed=7)
        passes = []
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            lightning_s.set_epoch(epoch)
            passes.append(list(ours))
            assert passes[-1] == list(lightning_s)
        assert len(passes[0]) == len(ours) == 5
        assert passes[0] != passes[1]


@pytest.mark.parametrize("by_dataset", [True, False])
def test_a_resume_skips_this_rank_s_trained_indices_of_the_same_pass(by_dataset):
    def sampler() -> _ShardedResumableSampler:
        inner = RandomSampler(range(50), num_samples=20,
                              generator=torch.Generator().manual_seed(1))
        return _ShardedResumableSampler(inner, inner.generator, list(range(50)) if by_dataset
                                        else None, by_dataset=by_dataset, num_replicas=2,
                                        rank=1, seed=0)

    straight = sampler()
    straight.set_epoch(0)
    list(straight)  # epoch 0
    straight.set_epoch(1)
    epoch_1 = list(straight)
    start = straight.epoch_start  # the generator when epoch 1's pass began

    resumed = sampler()  # a new process: generator as seeded, epoch 1 set by Lightning
    resumed.set_epoch(1)
    resumed.resume = (start, 4)
    assert list(resumed) == epoch_1[4:]
    straight.set_epoch(2)
    resumed.set_epoch(2)
    assert list(resumed) == list(straight)  # the next pass is whole, and the same


def test_the_loader_made_again_keeps_every_setting():
    gen = torch.Generator().manual_seed(0)

    def collate(batch):
        return batch

    loader = DataLoader(list(range(9)), batch_size=2, shuffle=True, drop_last=True,
                        collate_fn=collate, generator=gen, worker_init_fn=collate)
    sampler = _ShardedResumableSampler(loader.sampler, gen, loader.dataset, by_dataset=True,
                                       num_replicas=2, rank=0)
    again = _with_sampler(loader, sampler)
    assert again.sampler is sampler and again.batch_sampler.sampler is sampler
    assert again.batch_size == 2 and again.drop_last and again.worker_init_fn is collate
    assert again.collate_fn is collate and again.generator is gen
    assert len(again) == 2  # 5 of 9 (padded to 10) on this rank, whole batches of 2
    assert list(again) == [[i, j] for i, j in zip(*[iter(list(sampler))] * 2, strict=False)]

    class Loader(DataLoader):
        pass

    assert _with_sampler(Loader(list(range(4))), sampler) is None
