"""The part every remat datamodule shares: a train and a val dataset, and their loaders."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader, Dataset

from remat.data.io import make_loader


class SplitDataModule(L.LightningDataModule):
    """Train/val datamodule base: subclasses build ``train_set`` and ``val_set`` in
    ``setup``; the loaders come from :func:`remat.data.io.make_loader` (train shuffled with a
    generator seeded by ``loader_seed``). The test loader is the val loader.

    Raises:
        RuntimeError: a loader asked for before ``setup``.
    """

    def __init__(self, batch_size: int, num_workers: int, pin_memory: bool,
                 loader_seed: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.loader_seed = loader_seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        return make_loader(dataset, self.batch_size, self.num_workers, train=train,
                           seed=self.loader_seed, pin_memory=self.pin_memory)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
