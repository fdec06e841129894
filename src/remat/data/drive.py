"""DRIVE: retinal vessel segmentation in 40 fundus photographs (565 x 584), with FOV masks.

Published by Staal et al., "Ridge-based vessel segmentation in color images of the retina",
IEEE TMI 23(4):501-509, 2004 (https://drive.grand-challenge.org/) as
``training/images/<n>_training.tif`` (RGB), ``training/1st_manual/<n>_manual1.gif`` (vessels
255, background 0) and ``training/mask/<n>_training_mask.gif`` (field of view 255), n = 21..40;
``test/`` holds ``<n>_test.tif`` and ``<n>_test_mask.gif`` for n = 01..20 and, in the original
release, ``test/1st_manual/<n>_manual1.gif``. Vessel metrics are computed inside the field of
view (FOV) only; items carry it as ``"valid"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from remat.data.layout import list_files, match_pairs
from remat.data.masks import ThresholdMask
from remat.data.pairs import ImageMaskPair
from remat.data.patch_seg import PatchSegDataModule
from remat.data.splits import tail_split

DRIVE_URL = "https://drive.grand-challenge.org/"
DRIVE_LAYOUT = ("training/images/<n>_training.tif, training/1st_manual/<n>_manual1.gif, "
                "training/mask/<n>_training_mask.gif")


class DRIVEDataModule(PatchSegDataModule):
    """DRIVE vessels: binary (``num_classes == 1``), vessel = class 1, plus ``"valid"`` (FOV).

    Args:
        root: ``DRIVE`` folder (holding ``training/``) or its parent. Hydra: ``data.root``.
        val_size: the last ``val_size`` training images (ids 21..40 in order) are val
            (default 4: 37-40), the rest train.
        use_test: also serve ``test/`` as the labelled test split when
            ``test/1st_manual/`` exists (the original release); otherwise test runs on val.
        **kwargs: the options of :class:`remat.data.patch_seg.PatchSegDataModule`
            (vessels are thin: ``foreground_prob`` helps).

    Items hold ``"valid": bool [h, w]``, True inside the FOV (patches: False on padding).
    The mask keeps its labels outside the FOV (0 there); loss and metrics should use
    ``valid``. Names are ``"training/<n>"`` and ``"test/<n>"``.
    """

    title = "DRIVE"
    folder = "DRIVE"
    layout = DRIVE_LAYOUT
    url = DRIVE_URL
    required_dirs = ("training/images", "training/1st_manual", "training/mask")
    class_names = ("background", "vessel")
    num_classes = 1

    def __init__(self, root: str | Path | None, val_size: int = 4, use_test: bool = True,
                 **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.val_size = val_size
        self.use_test = use_test

    @staticmethod
    def _split_pairs(root: Path, split: str) -> list[ImageMaskPair]:
        return match_pairs(
            list_files(root / split / "images", [f"_{split}.tif"]),
            list_files(root / split / "1st_manual", ["_manual1.gif"]),
            f"DRIVE {split}/ at {root}", DRIVE_LAYOUT,
            valid=list_files(root / split / "mask", [f"_{split}_mask.gif"]),
            prefix=f"{split}/", root=root)

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Training pairs, plus test pairs when ``test/1st_manual/`` exists."""
        pairs = self._split_pairs(root, "training")
        if self.use_test and (root / "test" / "1st_manual").is_dir():
            pairs += self._split_pairs(root, "test")
        return pairs

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """Last ``val_size`` training ids to val; ``test/`` (if labelled) to test."""
        training = [n for n in names if n.startswith("training/")]
        train, val = tail_split(training, self.val_size, "val_size")
        split = {"train": train, "val": val}
        test = [n for n in names if n.startswith("test/")]
        if test:
            split["test"] = test
        return split

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """Vessel (grey >= 128) -> 1, else 0."""
        return ThresholdMask()
