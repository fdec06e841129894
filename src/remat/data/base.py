"""The part every remat datamodule shares: a train and a val dataset, and their loaders."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader, Dataset

from remat.data.io import make_loader


def check_limits(**limits: int | None) -> None:
    """Check ``limit_train``-style settings: each None or a positive int.

    Raises:
        ValueError: a value is a bool, a non-integer or < 1; names ``data.<key>``.
    """
    for name, value in limits.items():
        if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
            raise ValueError(f"data.{name} must be a positive int or None, got {value!r}")


class SplitDataModule(L.LightningDataModule):
    """Train/val(/test) datamodule base: subclasses build ``train_set`` and ``val_set`` (and
    optionally ``test_set``) in ``setup``; the loaders come from
    :func:`remat.data.io.make_loader` (train shuffled with a generator seeded by
    ``loader_seed``). Evaluation loaders use ``eval_batch_size`` (default: ``batch_size``; 1
    for datasets whose images differ in size). The test loader serves ``test_set``, or the
    val set when there is no labelled test split.

    Raises:
        RuntimeError: a loader asked for before ``setup``.
    """

    def __init__(self, batch_size: int, num_workers: int, pin_memory: bool,
                 loader_seed: int, eval_batch_size: int | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.loader_seed = loader_seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        size = self.batch_size if train else self.eval_batch_size
        return make_loader(dataset, size, self.num_workers, train=train,
                           seed=self.loader_seed, pin_memory=self.pin_memory)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        if self.test_set is not None:
            return self._loader(self.test_set, train=False)
        return self.val_dataloader()
