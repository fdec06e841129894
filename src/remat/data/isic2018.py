"""ISIC 2018 Task 1: dermoscopic lesion boundary segmentation (binary).

Published by the International Skin Imaging Collaboration (Codella et al., arXiv 1902.03368,
2019; Tschandl et al., Sci. Data 5:180161, 2018; https://challenge.isic-archive.com/data/#2018)
as ``ISIC2018_Task1-2_Training_Input/ISIC_<7 digits>.jpg`` (2594 RGB JPEGs of varying size,
many of several megapixels) and
``ISIC2018_Task1_Training_GroundTruth/ISIC_<id>_segmentation.png`` (8-bit grey, lesion 255,
background 0). The input folder also holds ``ATTRIBUTION.txt`` and
``LICENSE.txt``, which are skipped. The official validation and test ground truth came later
as separate archives; here val is a seeded random part of the training set unless
``data.split_file`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from remat.data.layout import list_files, match_pairs
from remat.data.masks import ThresholdMask
from remat.data.pairs import ImageMaskPair
from remat.data.patch_seg import SeededSplitDataModule

ISIC_URL = "https://challenge.isic-archive.com/data/#2018"
ISIC_INPUT = "ISIC2018_Task1-2_Training_Input"
ISIC_GT = "ISIC2018_Task1_Training_GroundTruth"
ISIC_LAYOUT = f"{ISIC_INPUT}/ISIC_<id>.jpg and {ISIC_GT}/ISIC_<id>_segmentation.png"


class ISIC2018DataModule(SeededSplitDataModule):
    """ISIC 2018 Task 1 lesions: binary (``num_classes == 1``), lesion = class 1.

    Args:
        root: the folder holding ``ISIC2018_Task1-2_Training_Input/`` and
            ``ISIC2018_Task1_Training_GroundTruth/`` (or its parent, named ``ISIC2018``).
        val_size: val images (default 259, about 10 % of 2594), drawn as in
            :class:`remat.data.patch_seg.SeededSplitDataModule`.
        split_seed: seed of that draw.
        **kwargs: the options of :class:`remat.data.patch_seg.PatchSegDataModule`.

    Sample names are the ISIC ids (``ISIC_0000000``). Val images are served whole at their
    native size (often several megapixels): score them with sliding-window inference.
    """

    title = "ISIC 2018 Task 1"
    folder = "ISIC2018"
    layout = ISIC_LAYOUT
    url = ISIC_URL
    required_dirs = (ISIC_INPUT, ISIC_GT)
    class_names = ("background", "lesion")
    num_classes = 1
    default_val_size = 259

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs ``<input>/ISIC_<id>.jpg`` with ``<gt>/ISIC_<id>_segmentation.png``."""
        images = {n: p for n, p in list_files(root / ISIC_INPUT, [".jpg"]).items()
                  if n.startswith("ISIC_")}
        return match_pairs(images, list_files(root / ISIC_GT, ["_segmentation.png"]),
                           f"ISIC 2018 at {root}", ISIC_LAYOUT, root=root)

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """Lesion (grey >= 128) -> 1, else 0."""
        return ThresholdMask()
