"""Massachusetts Roads and Buildings (Mnih 2013): 1500 x 1500 aerial tiles, binary labels.

Published by V. Mnih, "Machine Learning for Aerial Image Labeling", PhD thesis, University of
Toronto, 2013, Ch. 6 (https://www.cs.toronto.edu/~vmnih/data/), with official train/val/test
splits (roads 1108/14/49, buildings 137/4/10). The layout read here is the widely used Kaggle
copy (``balraj98/massachusetts-roads-dataset`` and ``balraj98/massachusetts-buildings-dataset``):
``tiff/{train,val,test}/<id>.tiff`` (RGB, 1 m/px) and ``tiff/{train,val,test}_labels/<id>.tif``
(label 255 on road / building). Labels are thresholded at 128 on their brightest channel, so
grey maps and maps drawn in one pure colour both decode. White (255, 255, 255) image regions
are missing imagery in the source; they are kept as ordinary pixels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from remat.data.layout import list_files, match_pairs
from remat.data.masks import ThresholdMask
from remat.data.pairs import ImageMaskPair
from remat.data.patch_seg import PatchSegDataModule

MASSACHUSETTS_URL = "https://www.cs.toronto.edu/~vmnih/data/"
MASSACHUSETTS_LAYOUT = "tiff/{train,val,test}/<id>.tiff and tiff/{train,val,test}_labels/<id>.tif"
SPLITS = ("train", "val", "test")


class _MassachusettsDataModule(PatchSegDataModule):
    """Shared reader of the two Massachusetts sets (official split by folder)."""

    layout = MASSACHUSETTS_LAYOUT
    url = MASSACHUSETTS_URL
    required_dirs = ("tiff/train", "tiff/train_labels", "tiff/val", "tiff/val_labels")
    num_classes = 1

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs ``tiff/<split>/<id>.tiff`` with ``tiff/<split>_labels/<id>.tif`` per split
        (a missing ``test`` split is skipped); names are ``"<split>/<id>"``."""
        pairs: list[ImageMaskPair] = []
        for split in SPLITS:
            images = root / "tiff" / split
            if split == "test" and not images.is_dir():
                continue
            pairs += match_pairs(list_files(images, [".tiff", ".tif"]),
                                 list_files(root / "tiff" / f"{split}_labels", [".tif", ".tiff"]),
                                 f"{self.title} tiff/{split} at {root}", MASSACHUSETTS_LAYOUT,
                                 prefix=f"{split}/", root=root)
        return pairs

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """The official split: each name goes to the folder it came from."""
        split = {key: [n for n in names if n.startswith(f"{key}/")] for key in SPLITS}
        if not split["test"]:
            del split["test"]
        return split

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """Foreground (>= 128 on the brightest channel) -> 1, else 0."""
        return ThresholdMask(channels="max")


class MassachusettsRoadsDataModule(_MassachusettsDataModule):
    """Massachusetts Roads: binary (``num_classes == 1``), road = class 1; official
    1108/14/49 split; the labelled test split is served by ``test_dataloader``.

    Args: see :class:`remat.data.patch_seg.PatchSegDataModule` (``root``: the folder holding
    ``tiff/``, or its parent ``Massachusetts-Roads/``). Roads are thin and sparse, so a
    ``foreground_prob`` of about 0.5 helps. Val/test serve whole ``[1, 3, 1500, 1500]`` tiles.
    """

    title = "Massachusetts Roads"
    folder = "Massachusetts-Roads"
    class_names = ("background", "road")


class MassachusettsBuildingsDataModule(_MassachusettsDataModule):
    """Massachusetts Buildings: binary (``num_classes == 1``), building = class 1; official
    137/4/10 split; the labelled test split is served by ``test_dataloader``.

    Args: see :class:`remat.data.patch_seg.PatchSegDataModule` (``root``: the folder holding
    ``tiff/``, or its parent ``Massachusetts-Buildings/``).
    """

    title = "Massachusetts Buildings"
    folder = "Massachusetts-Buildings"
    class_names = ("background", "building")
