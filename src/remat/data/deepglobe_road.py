"""DeepGlobe Road Extraction: 1024 x 1024 satellite tiles (0.5 m/px) with binary road masks.

Published for the DeepGlobe 2018 challenge (Demir et al., "DeepGlobe 2018: A Challenge to
Parse the Earth through Satellite Images", CVPR Workshops 2018;
https://competitions.codalab.org/competitions/18467) as ``train/<id>_sat.jpg`` (RGB) and
``train/<id>_mask.png`` (white road on black, stored with 3 equal channels). The challenge's
data description warns that mask values "may not be pure 0 and 255" and asks to binarise at
128, which :func:`remat.data.masks.threshold_mask` does. The ``valid/`` (1243) and ``test/``
(1101) folders hold images only, so val is a seeded random part of ``train/`` (6226
labelled tiles) unless ``data.split_file`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from remat.data.layout import list_files, match_pairs
from remat.data.masks import ThresholdMask
from remat.data.pairs import ImageMaskPair
from remat.data.patch_seg import SeededSplitDataModule

DEEPGLOBE_URL = "https://competitions.codalab.org/competitions/18467"
DEEPGLOBE_LAYOUT = "train/<id>_sat.jpg and train/<id>_mask.png (road 255)"


class DeepGlobeRoadDataModule(SeededSplitDataModule):
    """DeepGlobe roads: binary (``num_classes == 1``), road = class 1.

    Args:
        root: the folder holding ``train/`` (or its parent, named ``DeepGlobe-Road``).
        val_size: val tiles (default 623, about 10 % of 6226), drawn as in
            :class:`remat.data.patch_seg.SeededSplitDataModule`.
        split_seed: seed of that draw.
        **kwargs: the options of :class:`remat.data.patch_seg.PatchSegDataModule`
            (roads are thin and sparse: a ``foreground_prob`` of about 0.5 helps).

    Masks are thresholded at 128 (grey, as the challenge asks). Names are the numeric ids.
    """

    title = "DeepGlobe Road Extraction"
    folder = "DeepGlobe-Road"
    layout = DEEPGLOBE_LAYOUT
    url = DEEPGLOBE_URL
    required_dirs = ("train",)
    class_names = ("background", "road")
    num_classes = 1
    default_val_size = 623

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs ``train/<id>_sat.jpg`` with ``train/<id>_mask.png``."""
        folder = root / "train"
        return match_pairs(list_files(folder, ["_sat.jpg"]), list_files(folder, ["_mask.png"]),
                           f"DeepGlobe Road at {root}", DEEPGLOBE_LAYOUT, root=root)

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """Road (grey >= 128) -> 1, else 0."""
        return ThresholdMask()
