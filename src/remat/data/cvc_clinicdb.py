"""CVC-ClinicDB: 612 colonoscopy frames (384 x 288) with binary polyp masks.

Published by Bernal et al., "WM-DOVA maps for accurate polyp highlighting in colonoscopy",
Computerized Medical Imaging and Graphics 43:99-111, 2015
(https://polyp.grand-challenge.org/CVCClinicDB/), as ``Original/<n>.tif`` (RGB) and
``Ground Truth/<n>.tif`` (polyp 255, background 0), n = 1..612; the widely used Kaggle copy
(``balraj98/cvcclinicdb``) ships the same frames as ``PNG/{Original,Ground Truth}/<n>.png``
beside ``TIF/...``. Either suffix is accepted, and ``data.root`` may point at the folder that
holds ``PNG/`` or ``TIF/``. There is no official split; the frames come from 31 sequences of
23 patients, so a random split puts frames of one polyp on both sides (as most published
splits do); give ``data.split_file`` for a sequence-wise one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from remat.data.layout import list_files, match_pairs
from remat.data.masks import ThresholdMask
from remat.data.pairs import ImageMaskPair
from remat.data.patch_seg import SeededSplitDataModule

CVC_URL = "https://polyp.grand-challenge.org/CVCClinicDB/"
CVC_LAYOUT = "Original/<n>.tif|png and 'Ground Truth'/<n>.tif|png (polyp 255)"


class CVCClinicDBDataModule(SeededSplitDataModule):
    """CVC-ClinicDB polyps: binary (``num_classes == 1``), polyp = class 1.

    Args:
        root: ``CVC-ClinicDB`` folder (holding ``Original/`` and ``Ground Truth/``, directly
            or under ``PNG/`` or ``TIF/``) or its parent. Hydra: ``data.root``.
        val_size: val frames (default 61, about 10 % of 612), drawn as in
            :class:`remat.data.patch_seg.SeededSplitDataModule`.
        split_seed: seed of that draw.
        **kwargs: the options of :class:`remat.data.patch_seg.PatchSegDataModule`.

    Masks are thresholded at 128 on their brightest channel (grey or RGB TIFFs alike).
    Batches: train ``[B, 3, p, p]`` patches; val whole ``[1, 3, 288, 384]`` frames.
    """

    title = "CVC-ClinicDB"
    folder = "CVC-ClinicDB"
    layout = CVC_LAYOUT
    url = CVC_URL
    required_dirs = ("Original", "Ground Truth")
    root_subfolders = ("PNG", "TIF")
    class_names = ("background", "polyp")
    num_classes = 1
    default_val_size = 61

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs ``Original/<n>`` with ``Ground Truth/<n>`` (``.tif``, ``.tiff`` or ``.png``)."""
        suffixes = [".tif", ".tiff", ".png"]
        return match_pairs(list_files(root / "Original", suffixes),
                           list_files(root / "Ground Truth", suffixes),
                           f"CVC-ClinicDB at {root}", CVC_LAYOUT, root=root)

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """Polyp (>= 128 on the brightest channel) -> 1, else 0."""
        return ThresholdMask(channels="max")
