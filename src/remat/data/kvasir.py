"""Kvasir-SEG: 1000 colonoscopy frames with binary polyp masks.

Published by Simula (https://datasets.simula.no/kvasir-seg/) as ``images/<id>.jpg`` and
``masks/<id>.jpg`` (Jha et al., "Kvasir-SEG: A Segmented Polyp Dataset", MMM 2020; research
and education use only); masks are RGB JPEGs with polyp near 255 and background near 0. There is
no official split; following Jha et al. 2021 (arXiv 2011.07631) we use a random 880/120
train/val split, made deterministic by sorting the ids and shuffling with a fixed seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.io import ImageReadMode

from remat.data.base import SplitDataModule, check_limits
from remat.data.io import read_image
from remat.data.paired import find_dataset_root, list_files, match_pairs, split_ids
from remat.data.transforms import eval_transform, to_sample, train_transform

KVASIR_URL = "https://datasets.simula.no/kvasir-seg/"
KVASIR_LAYOUT = "images/*.jpg, masks/*.jpg (one mask per image, same file name)"
_SUFFIXES = (".jpg", ".jpeg")


def find_kvasir_pairs(root: str | Path | None) -> tuple[Path, list[str]]:
    """Locate the dataset and list its image/mask ids.

    Args:
        root: the Kvasir-SEG folder (holding ``images/`` and ``masks/``), or a folder that
            holds ``Kvasir-SEG/`` such as ``$REMAT_DATA_DIR``.

    Returns:
        The dataset folder and the sorted list of ids that have both an image and a mask.

    Raises:
        ValueError: ``root`` is None or empty.
        FileNotFoundError: the folder, ``images/`` or ``masks/`` is missing, there are no
            JPEGs, or some image lacks its mask (or the reverse); the message names the files
            (see :func:`remat.data.paired.find_dataset_root` and
            :func:`remat.data.paired.match_pairs`).
    """
    required = ("images", "masks")
    found = find_dataset_root(
        root, title="Kvasir-SEG", folder="Kvasir-SEG", layout=KVASIR_LAYOUT, url=KVASIR_URL,
        is_root=lambda c: all((c / d).is_dir() for d in required), required=required)
    pairs = match_pairs(list_files(found / "images", _SUFFIXES),
                        list_files(found / "masks", _SUFFIXES),
                        f"Kvasir-SEG at {found}", KVASIR_LAYOUT, root=found)
    return found, [pair.name for pair in pairs]


class KvasirSegDataset(Dataset):
    """Image/mask pairs of Kvasir-SEG, decoded per sample.

    Args:
        root: dataset folder holding ``images/`` and ``masks/``.
        ids: file stems to serve, in order.
        transform: joint v2 transform ``(Image uint8 [3,H,W], Mask uint8 [1,H,W]) ->
            (Image float32 [3,S,S], Mask [1,S,S])``, e.g. from :mod:`remat.data.transforms`.

    Items are ``{"image": float32 [3, S, S], "mask": int64 [S, S], "name": str}`` (the file
    stem), mask 1 where the mask JPEG (as one channel) is >= 128, else 0.

    Raises (on ``__getitem__``):
        RuntimeError: an image or mask cannot be decoded; names the file.
        ValueError: image and mask sizes differ; names both files and sizes.
    """

    def __init__(self, root: str | Path, ids: Sequence[str], transform: Callable) -> None:
        self.root = Path(root)
        self.ids = list(ids)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.ids)

    def _path(self, folder: str, stem: str) -> Path:
        for suffix in (".jpg", ".jpeg", ".JPG", ".JPEG"):
            path = self.root / folder / f"{stem}{suffix}"
            if path.is_file():
                return path
        raise FileNotFoundError(f"no {folder}/{stem}.jpg under {self.root}")

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        stem = self.ids[index]
        image_path, mask_path = self._path("images", stem), self._path("masks", stem)
        image = read_image(image_path, ImageReadMode.RGB)
        mask = read_image(mask_path, ImageReadMode.GRAY)
        if image.shape[-2:] != mask.shape[-2:]:
            (ih, iw), (mh, mw) = image.shape[-2:], mask.shape[-2:]
            raise ValueError(
                f"size mismatch for {stem}: image {image_path} is {iw}x{ih} (WxH) but mask "
                f"{mask_path} is {mw}x{mh}"
            )
        mask = (mask >= 128).to(torch.uint8)
        image, mask = self.transform(tv_tensors.Image(image), tv_tensors.Mask(mask))
        return {**to_sample(image, mask), "name": stem}


class KvasirSegDataModule(SplitDataModule):
    """Kvasir-SEG polyp segmentation (binary, ``num_classes == 1``).

    Args:
        root: Kvasir-SEG folder (``images/*.jpg``, ``masks/*.jpg``) or a folder holding
            ``Kvasir-SEG/`` (e.g. ``$REMAT_DATA_DIR``). Hydra: ``data.root``.
        image_size: side ``S`` of the square crops/resizes fed to the model.
        batch_size, num_workers, pin_memory: DataLoader settings.
        val_size: number of val pairs (120 gives the 880/120 split of Jha et al. 2021).
        split_seed: seed of the split shuffle; also seeds the train loader's shuffle.
        augment: random resized crop (scale 0.5-1), flips and colour jitter on train; if
            False, train uses the val transform (resize to ``S x S``).
        limit_train, limit_val: keep only the first n of each split (tiny runs), or None.

    Batches are ``{"image": float32 [B, 3, S, S] (ImageNet-normalised), "mask": int64
    [B, S, S]}`` with mask values 0 (background) and 1 (polyp); ``class_names`` names them
    and ``ignore_index`` is 255 like every remat datamodule's (no Kvasir pixel has it).

    Raises (in ``setup``): ValueError for an unset ``root``, a bad ``val_size`` or limit;
    FileNotFoundError for a missing folder or unpaired files (see :func:`find_kvasir_pairs`).
    Decoding errors and size mismatches surface when the sample is loaded.
    """

    def __init__(
        self,
        root: str | Path | None,
        image_size: int = 256,
        batch_size: int = 4,
        num_workers: int = 0,
        val_size: int = 120,
        split_seed: int = 42,
        augment: bool = True,
        limit_train: int | None = None,
        limit_val: int | None = None,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size, num_workers, pin_memory, loader_seed=split_seed)
        check_limits(limit_train=limit_train, limit_val=limit_val)
        self.root = root
        self.image_size = image_size
        self.val_size = val_size
        self.split_seed = split_seed
        self.augment = augment
        self.limit_train = limit_train
        self.limit_val = limit_val
        self.num_classes = 1
        self.class_names = ("background", "polyp")
        self.ignore_index = 255  # never present: every Kvasir pixel is labelled
        self.dataset_root: Path | None = None
        self.train_ids: list[str] = []
        self.val_ids: list[str] = []

    def setup(self, stage: str | None = None) -> None:
        """Check the layout, split the ids and build both datasets (no decoding here)."""
        if self.train_set is not None:
            return
        self.dataset_root, ids = find_kvasir_pairs(self.root)
        train_ids, val_ids = split_ids(ids, self.val_size, self.split_seed)
        self.train_ids = train_ids[: self.limit_train]
        self.val_ids = val_ids[: self.limit_val]
        train_tf = train_transform if self.augment else eval_transform
        self.train_set = KvasirSegDataset(
            self.dataset_root, self.train_ids, train_tf(self.image_size)
        )
        self.val_set = KvasirSegDataset(
            self.dataset_root, self.val_ids, eval_transform(self.image_size)
        )
