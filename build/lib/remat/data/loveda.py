"""LoveDA: land-cover domain adaptation set, 1024 x 1024 Urban and Rural scenes, 7 classes.

Published by Wang et al., "LoveDA: A Remote Sensing Land-Cover Dataset for Domain Adaptive
Semantic Segmentation", NeurIPS Datasets and Benchmarks 2021 (https://github.com/Junjue-Wang/
LoveDA, data on Zenodo) as ``{Train,Val}/{Urban,Rural}/images_png/<n>.png`` (RGB) and
``.../masks_png/<n>.png`` (8-bit labels: 0 no-data, 1 background, 2 building, 3 road,
4 water, 5 barren, 6 forest, 7 agriculture); ``Test/`` has images only. No-data becomes the
ignore index and classes 1..7 become 0..6 (as mmsegmentation's ``reduce_zero_label``).
Train is ``Train/``, val is ``Val/`` (the benchmark's validation set).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from remat.data.layout import list_files, match_pairs
from remat.data.masks import IGNORE_INDEX, index_mask
from remat.data.pairs import ImageMaskPair
from remat.data.patch_seg import PatchSegDataModule

LOVEDA_URL = "https://github.com/Junjue-Wang/LoveDA"
LOVEDA_LAYOUT = "{Train,Val}/{Urban,Rural}/images_png/<n>.png and .../masks_png/<n>.png"
LOVEDA_CLASSES = ("background", "building", "road", "water", "barren", "forest", "agriculture")
LOVEDA_LOOKUP = {0: IGNORE_INDEX, **{v: v - 1 for v in range(1, 8)}}
SCENES = ("Urban", "Rural")


class LoveDADataModule(PatchSegDataModule):
    """LoveDA: 7 classes (``num_classes == 7``), no-data ignored (255).

    Args:
        root: ``LoveDA`` folder (holding ``Train/`` and ``Val/``) or its parent.
        scenes: which domains to read, any of ``Urban``, ``Rural`` (default both; the
            domain-adaptation settings train on one and test on the other via split files).
        **kwargs: the options of :class:`remat.data.patch_seg.PatchSegDataModule`.

    Names are ``"<Train|Val>/<Urban|Rural>/<n>"``. Val serves whole ``[1, 3, 1024, 1024]``
    images.

    Raises:
        ValueError: an unknown scene (at construction); a label value above 7 (when loaded).
    """

    title = "LoveDA"
    folder = "LoveDA"
    layout = LOVEDA_LAYOUT
    url = LOVEDA_URL
    required_dirs = ("Train", "Val")
    class_names = LOVEDA_CLASSES
    num_classes = len(LOVEDA_CLASSES)

    def __init__(self, root: str | Path | None, scenes: Sequence[str] = SCENES,
                 **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.scenes = [str(s) for s in scenes]
        unknown = sorted(set(self.scenes) - set(SCENES))
        if unknown or not self.scenes:
            raise ValueError(f"data.scenes must be a non-empty subset of {list(SCENES)}, got "
                             f"{list(scenes)}")

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs of every ``<split>/<scene>`` folder."""
        pairs: list[ImageMaskPair] = []
        for split in ("Train", "Val"):
            for scene in self.scenes:
                folder = root / split / scene
                if not (folder / "images_png").is_dir() or not (folder / "masks_png").is_dir():
                    raise FileNotFoundError(f"{folder} lacks images_png/ or masks_png/; expected "
                                            f"{LOVEDA_LAYOUT}")
                pairs += match_pairs(list_files(folder / "images_png", [".png"]),
                                     list_files(folder / "masks_png", [".png"]),
                                     f"LoveDA {split}/{scene} at {root}", LOVEDA_LAYOUT,
                                     prefix=f"{split}/{scene}/", root=root)
        return pairs

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """``Train/`` to train, ``Val/`` to val."""
        return {"train": [n for n in names if n.startswith("Train/")],
                "val": [n for n in names if n.startswith("Val/")]}

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """0 -> 255 (no-data), 1..7 -> 0..6; other values are an error."""
        return partial(index_mask, lookup=LOVEDA_LOOKUP)
