"""A seed for every training sample, drawn in the main process with the epoch's order.

A training set's random draws (torchvision's random crops and flips, colour jitter, a
patch's position, MONAI's random crop) come from the global RNG of whichever process loads
the sample. Loaded in the main process (``num_workers=0``) they follow the order of the
batches; loaded by DataLoader workers they follow each worker's own RNG, seeded once when
the workers start and carried on from epoch to epoch (persistent workers), so a resumed run,
whose workers start afresh at the checkpoint, drew other crops than the uninterrupted run
(a U-Net on a folder of images, 2 workers, resumed at step 25: loss 0.38287 against 0.38112,
every later step off).

:class:`SeededShuffle` draws, with each epoch's permutation and from the same generator, one
seed per position; :class:`SeededSamples` loads a sample with torch's CPU, numpy's and
Python's global RNG seeded from it and puts them back after. A sample's augmentation then
depends only on the loader's seed, the run's seed, its epoch and its position: the same
with or without workers, with any number of them, and after a resume that skips the
positions already trained (:class:`remat.callbacks.ResumeState`).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

#: seeds are drawn below this bound (numpy's ``seed`` takes 32 bits: it gets the low ones)
_SEED_BOUND = 2**62
#: an odd multiplier spreading the run's seed over the bits of a sample's seed
_MIX = 0x9E3779B97F4A7C15


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Torch's CPU generator, numpy's and Python's global RNG seeded with ``seed`` inside
    the block and put back after (CUDA generators untouched: a sample loads on the CPU)."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def run_seed() -> int:
    """The run's seed as Lightning's ``seed_everything`` left it (``PL_GLOBAL_SEED``, which
    its launchers pass to every rank), or 0 where none was set."""
    try:
        return int(os.environ.get("PL_GLOBAL_SEED", 0))
    except ValueError:
        return 0


class SeededShuffle(Sampler):
    """Each pass: a permutation of ``range(n)`` (the order ``RandomSampler`` with the same
    generator gives) and then one seed per position, both drawn from ``generator``, each
    seed mixed with ``salt``; yields ``(index, seed)`` for :class:`SeededSamples`.

    Args:
        n: the dataset's length.
        generator: the loader's generator (its state at a pass's start fixes the pass).
        salt: mixed into every sample's seed: the run's seed (:func:`run_seed`), so that a
            ``seed=`` sweep draws other augmentation, as it did when the draws came from
            the global RNG, while the order stays the loader seed's.
    """

    def __init__(self, n: int, generator: torch.Generator, salt: int = 0) -> None:
        self.n = int(n)
        self.generator = generator
        self.salt = (int(salt) * _MIX) % _SEED_BOUND

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        seeds = torch.randint(0, _SEED_BOUND, (self.n,), generator=self.generator).tolist()
        return iter(zip(order, (s ^ self.salt for s in seeds), strict=True))

    def __len__(self) -> int:
        return self.n


class SeededSamples(Dataset):
    """``dataset`` whose item ``(index, seed)`` is ``dataset[index]`` loaded under
    :func:`seeded` (``seed``); a plain index (a sampler of Lightning's or the user's) loads
    as it is. Other attributes are the dataset's own (``pairs``, ``patches_per_image``).

    Args:
        dataset: a map-style dataset.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, tuple):
            index, seed = key
            with seeded(int(seed)):
                return self.dataset[index]
        return self.dataset[key]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "dataset":  # unpickling in a worker: not yet set
            raise AttributeError(name)
        return getattr(self.dataset, name)
