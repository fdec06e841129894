"""Inria Aerial Image Labeling: building footprints on 5000 x 5000 orthophotos (binary).

Published by Maggiori et al., "Can semantic labeling methods generalize to any city? The
Inria Aerial Image Labeling Benchmark", IGARSS 2017 (https://project.inria.fr/aerialimagelabeling/)
as ``AerialImageDataset/train/images/<city><n>.tif`` (RGB GeoTIFF, 0.3 m/px) and
``AerialImageDataset/train/gt/<city><n>.tif`` (one band, building 255, else 0), 36 tiles for
each of austin, chicago, kitsap, tyrol-w and vienna; ``test/images/`` (other cities) has no
ground truth. The validation set the benchmark's authors recommend is tiles 1-5 of every
training city (project page). torchgeo's ``InriaAerialImageLabeling`` reads the same layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from remat.data.layout import list_files, match_pairs
from remat.data.masks import ThresholdMask
from remat.data.pairs import ImageMaskPair
from remat.data.patch_seg import PatchSegDataModule

INRIA_URL = "https://project.inria.fr/aerialimagelabeling/"
INRIA_LAYOUT = ("AerialImageDataset/train/images/<city><n>.tif and "
                "AerialImageDataset/train/gt/<city><n>.tif")


def split_city_tile(name: str) -> tuple[str, int]:
    """``"tyrol-w12"`` -> ``("tyrol-w", 12)``.

    Raises:
        ValueError: the name does not end in a tile number.
    """
    city = name.rstrip("0123456789")
    if city == name:
        raise ValueError(f"Inria file name {name!r} does not end in a tile number "
                         "(expected <city><n>.tif)")
    return city, int(name[len(city):])


class InriaDataModule(PatchSegDataModule):
    """Inria buildings: binary (``num_classes == 1``), building = class 1.

    Args:
        root: the folder holding ``AerialImageDataset/`` (or ``AerialImageDataset`` itself).
        val_tiles: tile numbers held out of every city for val (default 1-5, the official
            validation set: 25 tiles); the other 155 train.
        **kwargs: the options of :class:`remat.data.patch_seg.PatchSegDataModule`.

    Any non-zero ``gt`` value is a building (the files hold 0/255; 0/1 copies also work).
    Val serves whole 5000 x 5000 tiles (``[1, 3, 5000, 5000]``, 300 MB as float32): score
    them with sliding-window inference. Names are ``<city><n>``.
    """

    title = "Inria Aerial Image Labeling"
    folder = "AerialImageDataset"
    layout = INRIA_LAYOUT
    url = INRIA_URL
    required_dirs = ("train/images", "train/gt")
    class_names = ("background", "building")
    num_classes = 1

    def __init__(self, root: str | Path | None, val_tiles: Sequence[int] = (1, 2, 3, 4, 5),
                 **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.val_tiles = [int(t) for t in val_tiles]

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs ``train/images/<city><n>.tif`` with ``train/gt/<city><n>.tif``."""
        images = list_files(root / "train" / "images", [".tif"])
        for name in images:
            split_city_tile(name)
        return match_pairs(images, list_files(root / "train" / "gt", [".tif"]),
                           f"Inria at {root}", INRIA_LAYOUT, root=root)

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """Tiles ``val_tiles`` of every city to val, the rest to train.

        Raises:
            ValueError: no tile has a number in ``val_tiles`` (names ``data.val_tiles``).
        """
        is_val = {n: split_city_tile(n)[1] in self.val_tiles for n in names}
        if not any(is_val.values()):
            raise ValueError(f"the val split is empty: data.val_tiles={self.val_tiles} names no "
                             "tile number of the dataset")
        return {"train": [n for n in names if not is_val[n]],
                "val": [n for n in names if is_val[n]]}

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """Building (any non-zero value) -> 1, else 0."""
        return ThresholdMask(threshold=1)
