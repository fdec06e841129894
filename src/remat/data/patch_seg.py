"""Datasets trained on random patches and scored on whole images (ISBI 2012, Dubai, DRIVE,
Inria, Massachusetts, LoveDA, CVC-ClinicDB, ISIC 2018, DeepGlobe).

* training items: a random ``patch_size`` crop (:class:`remat.data.patches.PatchSampler`),
  flips and mild brightness/contrast jitter (``torchvision.transforms.v2``), normalised;
* evaluation items: the whole image at full resolution, normalised, never resized
  (batch size 1: sizes differ; score it with sliding-window inference).

Items are ``{"image": float32 [C, h, w], "mask": int64 [h, w], "name": str}`` plus
``"valid": bool [h, w]`` when the dataset has a region-of-interest mask (DRIVE field of view).
Mask pixels that belong to no class hold ``ignore_index`` (255).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from remat.data.base import FileSegDataModule
from remat.data.masks import IGNORE_INDEX
from remat.data.pairs import IMAGE_MODES, ImageMaskPair, ImageReader, MaskDecoder, load_pair
from remat.data.patches import PatchSampler, crop_pad
from remat.data.sizes import as_pair
from remat.data.splits import split_ids
from remat.data.transforms import to_float_normalized


class PatchSegDataset(Dataset):
    """Image/mask pairs served as random training patches or whole evaluation images.

    Args:
        pairs: the files to serve.
        decode_mask: ``path -> uint8 [H, W]`` class indices (see :mod:`remat.data.masks`).
        train: True: random patches (``sampler``), flips, jitter; False: whole images.
        sampler: where to crop training patches; required when ``train``.
        patches_per_image: training items per image per epoch.
        image_mode: ``"rgb"`` (3 channels), ``"grey"`` (1 channel) or ``"grey_rgb"`` (grey
            repeated to 3 channels, so ImageNet-style 3-channel encoders take it).
        augment: flips and brightness/contrast jitter on training patches.
        ignore_index: mask value of padding and of pixels that are no class.
        cache: keep decoded files in memory (per worker process).

    Items: ``{"image": float32 [C, h, w] (normalised: ImageNet mean/std, or their channel mean
    0.449/0.226 for one grey channel), "mask": int64 [h, w], "name": str}`` and ``"valid":
    bool [h, w]`` if the pairs have FOV masks. ``h, w`` is the patch size (padded with image 0,
    mask ``ignore_index``, valid False when the image is smaller) or the full image size.

    Raises (on ``__getitem__``):
        remat.data.io.DataFileError: (a ``ValueError``) a file is empty or cannot be decoded,
            a mask value is outside the encoding, or image, mask (and FOV mask) sizes differ;
            names the file (see :func:`remat.data.pairs.load_pair`).
    """

    def __init__(self, pairs: Sequence[ImageMaskPair], decode_mask: MaskDecoder,
                 train: bool, sampler: PatchSampler | None = None, patches_per_image: int = 1,
                 image_mode: str = "rgb", augment: bool = True, ignore_index: int = IGNORE_INDEX,
                 cache: bool = False, image_reader: ImageReader | None = None) -> None:
        if image_reader is None and image_mode not in IMAGE_MODES:
            raise ValueError(f"image_mode must be one of {IMAGE_MODES}, got {image_mode!r}")
        if train and sampler is None:
            raise ValueError("a training PatchSegDataset needs a PatchSampler")
        if patches_per_image < 1:
            raise ValueError(f"data.patches_per_image must be >= 1, got {patches_per_image}")
        self.pairs = list(pairs)
        self.decode_mask = decode_mask
        self.train = train
        self.sampler = sampler
        self.patches_per_image = patches_per_image if train else 1
        self.image_mode = image_mode
        self.ignore_index = ignore_index
        self.cache = cache
        self.image_reader = image_reader
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        steps: list[v2.Transform] = []
        if train and augment:
            steps += [v2.RandomHorizontalFlip(), v2.RandomVerticalFlip(),
                      v2.ColorJitter(brightness=0.2, contrast=0.2)]
        steps += to_float_normalized(grey=image_mode == "grey")
        self.transform = v2.Compose(steps)

    def __len__(self) -> int:
        return len(self.pairs) * self.patches_per_image

    def load(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Decode pair ``index``: image uint8 ``[C, H, W]`` (``C`` = 1 for grey modes), mask
        uint8 ``[H, W]``, FOV bool ``[H, W]`` or None, after checking that their sizes agree."""
        if index in self._cache:
            return self._cache[index]
        loaded = load_pair(self.pairs[index], self.image_mode, self.decode_mask,
                           self.image_reader)
        if self.cache:
            self._cache[index] = loaded
        return loaded

    def transform_for(self, image: torch.Tensor) -> v2.Transform:
        """The joint transform of a sample whose decoded image is ``image`` (subclasses pick
        one by dtype and channels); by default the one built at construction."""
        return self.transform

    def finish(self, image: torch.Tensor) -> torch.Tensor:
        """The transformed float image ``[C, h, w]`` as served (default: as it is)."""
        return image

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        pair_index = index // self.patches_per_image
        image, mask, valid = self.load(pair_index)
        if self.image_mode == "grey_rgb" and image.shape[0] == 1:
            image = image.expand(3, -1, -1)
        if self.train:
            assert self.sampler is not None
            box = self.sampler(mask)
            size = self.sampler.patch
            image = crop_pad(image, box, size, 0)
            mask = crop_pad(mask, box, size, self.ignore_index)
            valid = None if valid is None else crop_pad(valid, box, size, False)
        parts = {"image": tv_tensors.Image(image), "mask": tv_tensors.Mask(mask)}
        if valid is not None:
            parts["valid"] = tv_tensors.Mask(valid)
        parts = self.transform_for(image)(parts)
        sample: dict[str, Any] = {
            "image": self.finish(parts["image"].as_subclass(torch.Tensor)),
            "mask": parts["mask"].as_subclass(torch.Tensor).long(),
            "name": self.pairs[pair_index].name,
        }
        if valid is not None:
            sample["valid"] = parts["valid"].as_subclass(torch.Tensor).bool()
        return sample


class PatchSegDataModule(FileSegDataModule):
    """A :class:`remat.data.base.FileSegDataModule` that trains on random patches and
    evaluates whole images (batch size 1): the base of every large-image dataset.

    Args:
        root: see :class:`remat.data.base.FileSegDataModule`.
        patch_size: training patch side (or ``[height, width]``) in pixels.
        patches_per_image: training patches drawn from each image per epoch.
        foreground_prob: probability that a training patch is centred on a foreground pixel.
        foreground_classes: classes that count as foreground; None: class 1 for binary
            tasks, every class for multi-class ones.
        augment: flips and brightness/contrast jitter on training patches.
        cache: keep decoded images in memory.
        **kwargs: the other options of :class:`remat.data.base.FileSegDataModule`
            (``batch_size``, ``num_workers``, ``pin_memory``, ``seed``, ``image_mode``,
            ``split_file``, ``limit_train``, ``limit_val``, ``verify``).

    Raises:
        ValueError: a bad ``patch_size``, ``patches_per_image``, ``foreground_prob``,
            ``foreground_classes`` (a class outside ``num_classes``) or any option of the
            base; naming the ``data.`` key.
    """

    def __init__(self, root: str | Path | None, patch_size: int | Sequence[int] = 256,
                 patches_per_image: int = 1, foreground_prob: float = 0.0,
                 foreground_classes: Sequence[int] | None = None, augment: bool = True,
                 cache: bool = False, **kwargs: Any) -> None:
        super().__init__(root, eval_batch_size=1, **kwargs)
        self.patch_size = as_pair(patch_size, "data.patch_size")
        if foreground_classes is None:
            foreground_classes = (1,) if self.num_classes == 1 else range(self.num_classes)
        classes = 2 if self.num_classes == 1 else self.num_classes  # binary: 0 and 1
        outside = [c for c in foreground_classes if not 0 <= int(c) < classes]
        if outside:  # a patch centred on a class no mask holds: never drawn, silently
            raise ValueError(f"data.foreground_classes={list(foreground_classes)}: "
                             f"{outside} not a class; the classes are 0..{classes - 1} "
                             f"(data.num_classes={self.num_classes})")
        self.sampler = PatchSampler(self.patch_size, foreground_prob, foreground_classes)
        if patches_per_image < 1:
            raise ValueError(f"data.patches_per_image must be >= 1, got {patches_per_image}")
        self.patches_per_image = patches_per_image
        self.augment = augment
        self.cache = cache

    def build_dataset(self, pairs: list[ImageMaskPair], train: bool) -> PatchSegDataset:
        """Random patches (``train``) or whole images of ``pairs``."""
        return PatchSegDataset(
            pairs, self.mask_decoder(), train=train, sampler=self.sampler,
            patches_per_image=self.patches_per_image, image_mode=self.image_mode,
            augment=self.augment, ignore_index=self.ignore_index, cache=self.cache)


class SeededSplitDataModule(PatchSegDataModule):
    """A :class:`PatchSegDataModule` whose default split is
    :func:`remat.data.splits.split_ids`: for datasets with no official split (CVC-ClinicDB,
    ISIC 2018 Task 1 training set, DeepGlobe Road).

    Args:
        root: see :class:`remat.data.base.FileSegDataModule`.
        val_size: val images; None: the class's :attr:`default_val_size` (about 10 % of the
            published set). The sorted names are shuffled with ``random.Random(split_seed)``
            and the last ``val_size`` are val.
        split_seed: seed of that shuffle.
        **kwargs: the other options of :class:`PatchSegDataModule`.

    Raises (in ``setup``): ValueError when ``val_size`` leaves train or val empty.
    """

    default_val_size: ClassVar[int] = 1

    def __init__(self, root: str | Path | None, val_size: int | None = None,
                 split_seed: int = 42, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.val_size = self.default_val_size if val_size is None else val_size
        self.split_seed = split_seed

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """Seeded random split (see the class docstring)."""
        train, val = split_ids(names, self.val_size, self.split_seed)
        return {"train": train, "val": val}
