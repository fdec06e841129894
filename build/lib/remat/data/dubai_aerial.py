"""Dubai aerial imagery (Humans in the Loop / MBRSC): 6-class land cover from colour masks.

Published CC0 by Humans in the Loop (Kaggle ``humansintheloop/semantic-segmentation-of-aerial-
imagery``; https://humansintheloop.org/resources/datasets/semantic-segmentation-dataset-2/) as
``Tile <t>/images/image_part_00<k>.jpg`` and ``Tile <t>/masks/image_part_00<k>.png``, t = 1..8,
k = 1..9; sizes vary by tile from 509 x 544 to 2149 x 1479 (W x H). Masks hold one RGB colour
per class (Tiles 2 and 4 as palette PNGs); class ids follow the publisher's listing order
(table in the data copy's SOURCE.md). Nine masks also hold pure black pixels (#000000, 0.56 %
of all mask pixels, mostly ``Tile 8/masks/image_part_003.png``), which are no class: they
become the ignore index. There is no official split; we hold out whole tiles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from remat.data.layout import list_files, match_pairs, natural_key
from remat.data.masks import IGNORE_INDEX, colour_mask
from remat.data.pairs import ImageMaskPair
from remat.data.patch_seg import PatchSegDataModule

DUBAI_URL = "https://www.kaggle.com/datasets/humansintheloop/semantic-segmentation-of-aerial-imagery"
DUBAI_LAYOUT = ("'Tile <t>/images/image_part_<k>.jpg' and 'Tile <t>/masks/image_part_<k>.png' "
                "(RGB colour per class)")
# Publisher's class table (name, colour), in listing order = class index.
DUBAI_CLASSES: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("building", (60, 16, 152)),     # #3C1098
    ("land", (132, 41, 246)),        # #8429F6, unpaved area
    ("road", (110, 193, 228)),       # #6EC1E4
    ("vegetation", (254, 221, 58)),  # #FEDD3A
    ("water", (226, 169, 41)),       # #E2A929
    ("unlabeled", (155, 155, 155)),  # #9B9B9B
)
DUBAI_PALETTE = {colour: index for index, (_, colour) in enumerate(DUBAI_CLASSES)}
DUBAI_IGNORED_COLOURS = ((0, 0, 0),)
KAGGLE_TOP_FOLDER = "Semantic segmentation dataset"  # the release zip's top-level folder


class DubaiAerialDataModule(PatchSegDataModule):
    """Dubai aerial land cover: 6 classes (``num_classes == 6``), black pixels ignored (255).

    Args:
        root: ``Dubai-aerial-semantic-segmentation`` folder (holding ``Tile 1/`` ...
            ``Tile 8/``) or its parent. Hydra: ``data.root``.
        val_tiles: tile numbers held out for val (default ``[3]``: 9 images of 682 x 658 px
            holding all six classes and some black pixels); every other tile is train.
        test_tiles: tile numbers of a test split (default none: test runs on val).
        **kwargs: the options of :class:`remat.data.patch_seg.PatchSegDataModule`.

    Sample names are ``"Tile <t>/image_part_<k>"``. Batches: train ``{"image": float32
    [B, 3, p, p], "mask": int64 [B, p, p] in 0..5 or 255, "name"}`` (images smaller than the
    patch are padded, mask 255); val: one whole image ``[1, 3, H, W]``.

    ``root`` may also be the folder holding the release's own top folder ``Semantic
    segmentation dataset/``.

    Raises (in ``setup``): ValueError when a split has no image (a tile number that does
    not exist; names ``data.val_tiles`` or ``data.test_tiles``); FileNotFoundError for a
    missing ``Tile */images`` or ``masks`` folder or unpaired files. A mask colour outside
    the class table raises ValueError naming the file and colour when the sample loads.
    """

    title = "Dubai aerial semantic segmentation"
    folder = "Dubai-aerial-semantic-segmentation"
    layout = DUBAI_LAYOUT
    url = DUBAI_URL
    required_dirs = ()
    root_subfolders = (KAGGLE_TOP_FOLDER,)
    class_names = tuple(name for name, _ in DUBAI_CLASSES)
    num_classes = len(DUBAI_CLASSES)

    def __init__(self, root: str | Path | None, val_tiles: Sequence[int] = (3,),
                 test_tiles: Sequence[int] = (), **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.val_tiles = [int(t) for t in val_tiles]
        self.test_tiles = [int(t) for t in test_tiles]

    @staticmethod
    def _tiles(root: Path) -> list[Path]:
        return sorted((p for p in root.glob("Tile *") if p.is_dir()),
                      key=lambda p: natural_key(p.name))

    def is_dataset_root(self, candidate: Path) -> bool:
        """Whether ``candidate`` holds ``Tile <t>/`` folders."""
        return bool(self._tiles(candidate))

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs of every ``Tile <t>``; names are ``"Tile <t>/image_part_<k>"``."""
        pairs: list[ImageMaskPair] = []
        for tile in self._tiles(root):
            images, masks = tile / "images", tile / "masks"
            for folder in (images, masks):
                if not folder.is_dir():
                    raise FileNotFoundError(f"{folder} is missing; every tile needs images/ and "
                                            f"masks/ ({DUBAI_LAYOUT})")
            pairs += match_pairs(list_files(images, [".jpg", ".jpeg"]),
                                 list_files(masks, [".png"]), f"Dubai {tile}", DUBAI_LAYOUT,
                                 prefix=f"{tile.name}/", root=root)
        return pairs

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """Whole tiles: ``val_tiles`` to val, ``test_tiles`` to test, the rest to train."""
        def tile_of(name: str) -> int:
            return int(name.split("/")[0].split()[-1])

        split: dict[str, list[str]] = {
            "train": [n for n in names if tile_of(n) not in self.val_tiles + self.test_tiles],
            "val": [n for n in names if tile_of(n) in self.val_tiles],
        }
        if self.test_tiles:
            split["test"] = [n for n in names if tile_of(n) in self.test_tiles]
        for key, tiles in (("val", self.val_tiles), ("test", self.test_tiles)):
            if key in split and not split[key]:
                raise ValueError(f"the {key} split is empty: data.{key}_tiles={tiles} names no "
                                 "tile of the dataset")
        return split

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """Exact class colours -> 0..5; black -> 255; any other colour is an error."""
        return partial(colour_mask, palette=DUBAI_PALETTE, ignore_colours=DUBAI_IGNORED_COLOURS,
                       ignore_index=IGNORE_INDEX)
