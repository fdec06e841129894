"""Kvasir-SEG: 1000 colonoscopy frames with binary polyp masks.

Published by Simula (https://datasets.simula.no/kvasir-seg/) as ``images/<id>.jpg`` and
``masks/<id>.jpg`` (Jha et al., "Kvasir-SEG: A Segmented Polyp Dataset", MMM 2020; research
and education use only); masks are RGB JPEGs with polyp near 255 and background near 0. There is
no official split; following Jha et al. 2021 (arXiv 2011.07631) we use a random 880/120
train/val split, made deterministic by sorting the ids and shuffling with a fixed seed.
Unlike the large-image sets, Kvasir frames are resized to ``data.image_size`` for training and
evaluation alike (as the benchmark's baselines do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors

from remat.data.base import FileSegDataModule
from remat.data.layout import list_files, match_pairs
from remat.data.masks import ThresholdMask
from remat.data.pairs import ImageMaskPair, MaskDecoder, load_pair
from remat.data.sizes import as_pair
from remat.data.splits import split_ids
from remat.data.transforms import eval_transform, to_sample, train_transform

KVASIR_URL = "https://datasets.simula.no/kvasir-seg/"
KVASIR_LAYOUT = "images/*.jpg, masks/*.jpg (one mask per image, same file name)"
_SUFFIXES = (".jpg", ".jpeg")
# polyp where the mask JPEG, read as one grey channel, is >= 128
kvasir_mask = ThresholdMask(foreground="bright", threshold=128, channels="grey")


class KvasirSegDataset(Dataset):
    """Image/mask pairs decoded per sample and transformed together (resized).

    Args:
        pairs: the pairs to serve, in order (names are the file stems).
        transform: joint v2 transform ``(Image uint8 [C,H,W], Mask uint8 [1,H,W]) ->
            (Image float32 [C,h,w], Mask [1,h,w])``, e.g. from :mod:`remat.data.transforms`.
        decode_mask: ``path -> uint8 [H, W]`` class indices (default: polyp where the mask,
            read as grey, is >= 128).
        image_mode: ``"rgb"`` (3 channels), ``"grey"`` (1) or ``"grey_rgb"`` (grey repeated
            to 3).

    Items are ``{"image": float32 [C, h, w], "mask": int64 [h, w], "name": str}``.

    Raises (on ``__getitem__``):
        remat.data.io.DataFileError: (a ``ValueError``) an empty or undecodable file, or image
            and mask sizes that differ; names the file (and both sizes).
    """

    def __init__(self, pairs: Sequence[ImageMaskPair], transform: Callable,
                 decode_mask: MaskDecoder = kvasir_mask, image_mode: str = "rgb") -> None:
        self.pairs = list(pairs)
        self.transform = transform
        self.decode_mask = decode_mask
        self.image_mode = image_mode

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        pair = self.pairs[index]
        image, mask, _ = load_pair(pair, self.image_mode, self.decode_mask)
        if self.image_mode == "grey_rgb":
            image = image.expand(3, -1, -1)
        image, mask = self.transform(tv_tensors.Image(image), tv_tensors.Mask(mask[None]))
        return {**to_sample(image, mask), "name": pair.name}


class KvasirSegDataModule(FileSegDataModule):
    """Kvasir-SEG polyp segmentation (binary, ``num_classes == 1``).

    Args:
        root: Kvasir-SEG folder (``images/*.jpg``, ``masks/*.jpg``) or a folder holding
            ``Kvasir-SEG/`` (e.g. ``$REMAT_DATA_DIR``). Hydra: ``data.root``.
        image_size: size ``S`` or ``[H, W]`` (pixels) of the crops/resizes fed to the model,
            in training and evaluation.
        batch_size: batch size of every loader (frames are resized, so val batches stack).
        num_workers, pin_memory: DataLoader settings.
        val_size: number of val pairs (120 gives the 880/120 split of Jha et al. 2021).
        split_seed: seed of the split shuffle; also seeds the train loader's shuffle.
        augment: random resized crop (scale 0.5-1), flips and colour jitter on train; if
            False, train uses the val transform (resize to ``image_size``).
        image_mode, split_file, limit_train, limit_val, verify: see
            :class:`remat.data.base.FileSegDataModule`.

    Batches are ``{"image": float32 [B, 3, H, W] (ImageNet-normalised), "mask": int64
    [B, H, W], "name": list[str]}`` with mask values 0 (background) and 1 (polyp);
    ``class_names`` names them and ``ignore_index`` is 255 like every remat datamodule's (no
    Kvasir pixel has it). ``train_ids``/``val_ids`` are the split's file stems.

    Raises:
        ValueError: a bad ``image_size``, limit or option (at construction); an unset
            ``root`` or a ``val_size`` leaving a split empty (in ``setup``).
        FileNotFoundError: (in ``setup``) a missing folder, no JPEGs, or unpaired files.
        remat.data.verify.DataCheckError: (in ``setup``) bad files, when checked.
    """

    title = "Kvasir-SEG"
    folder = "Kvasir-SEG"
    layout = KVASIR_LAYOUT
    url = KVASIR_URL
    required_dirs = ("images", "masks")
    class_names = ("background", "polyp")
    num_classes = 1
    resizes_for_eval = True

    def __init__(self, root: str | Path | None, image_size: int | Sequence[int] = 256,
                 batch_size: int = 4, num_workers: int = 0, val_size: int = 120,
                 split_seed: int = 42, augment: bool = True, limit_train: int | None = None,
                 limit_val: int | None = None, pin_memory: bool = False,
                 image_mode: str | None = None, split_file: str | Path | None = None,
                 verify: bool | str = "auto") -> None:
        super().__init__(root, batch_size=batch_size, eval_batch_size=batch_size,
                         num_workers=num_workers, pin_memory=pin_memory, seed=split_seed,
                         image_mode=image_mode, split_file=split_file, limit_train=limit_train,
                         limit_val=limit_val, verify=verify)
        self.image_size = as_pair(image_size, "data.image_size")
        self.val_size = val_size
        self.split_seed = split_seed
        self.augment = augment

    @property
    def train_ids(self) -> list[str]:
        """File stems of the train split (after ``limit_train``); empty before ``setup``."""
        return list(self.splits.get("train", []))

    @property
    def val_ids(self) -> list[str]:
        """File stems of the val split (after ``limit_val``); empty before ``setup``."""
        return list(self.splits.get("val", []))

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs ``images/<id>.jpg`` with ``masks/<id>.jpg``; names are the ids."""
        return match_pairs(list_files(root / "images", _SUFFIXES),
                           list_files(root / "masks", _SUFFIXES),
                           f"Kvasir-SEG at {root}", KVASIR_LAYOUT, root=root)

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """Sorted ids shuffled with ``random.Random(split_seed)``; the last ``val_size`` val."""
        train, val = split_ids(names, self.val_size, self.split_seed)
        return {"train": train, "val": val}

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """Polyp (grey >= 128) -> 1, else 0."""
        return kvasir_mask

    def predict_dataset(self, paths: Sequence[Path], names: Sequence[str]) -> Dataset:
        """Images resized to ``image_size`` as evaluation images are (predictions go back to
        each image's native size); see :meth:`FileSegDataModule.predict_dataset`."""
        from remat.data.folder import EightBitImages, Normalize, PredictImages

        return PredictImages(paths, names, EightBitImages(self.image_mode),
                             Normalize("imagenet"), resize=self.image_size)

    def build_dataset(self, pairs: list[ImageMaskPair], train: bool) -> KvasirSegDataset:
        """Augmented resized crops (``train`` and ``augment``), else plain resizes."""
        grey = self.image_mode == "grey"
        make = train_transform if train and self.augment else eval_transform
        return KvasirSegDataset(pairs, make(self.image_size, grey=grey), self.mask_decoder(),
                                self.image_mode)
