"""ISBI 2012 EM segmentation challenge: neuronal membranes in ssTEM sections (binary).

Published by the challenge organisers (Arganda-Carreras et al., Front. Neuroanat. 9:142, 2015;
data: Cardona et al., PLoS Biol. 8(10):e1000502, 2010) as multi-page TIFF stacks; the copy
used here, and most U-Net tutorials, hold one PNG per section in the layout of
``zhixuhao/unet`` ``data/membrane/``: ``train/image/<n>.png`` and ``train/label/<n>.png``,
n = 0..29, 512 x 512, 8-bit grey. Labels are 0 on membrane and 255 on cell interior; membrane
is reported as the foreground (mask 1), as in the challenge. Test labels were never released,
so ``test/`` is not used; the val split is the last sections of the training stack.
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

ISBI_URL = ("http://brainiac2.mit.edu/isbi_challenge/ (PNG copy: github.com/zhixuhao/unet "
            "data/membrane)")
ISBI_LAYOUT = "train/image/<n>.png, train/label/<n>.png (8-bit grey, label 0 = membrane)"


class ISBI2012DataModule(PatchSegDataModule):
    """ISBI 2012 membranes: binary (``num_classes == 1``), membrane = class 1.

    Args:
        root: ``ISBI2012-EM-membrane`` folder (or its parent). Hydra: ``data.root``.
        val_sections: number of sections held out for val, taken from the end of the stack
            in section order (default 5: sections 25-29 of 0-29). Neighbouring sections look
            alike, so a contiguous block keeps val apart from train better than a shuffle.
        **kwargs: the options of :class:`remat.data.patch_seg.PatchSegDataModule`
            (patch size, sampler, loaders, ``split_file`` ...).

    Images are grey; by default they are served repeated to 3 channels (``image_mode=
    "grey_rgb"``), ``image_mode="grey"`` gives 1 channel. Batches: train ``{"image": float32
    [B, 3, p, p], "mask": int64 [B, p, p], "name"}``; val ``[1, 3, 512, 512]`` whole sections.

    Raises:
        ValueError: ``val_sections`` leaves train or val empty (in ``setup``).
    """

    title = "ISBI 2012 EM membranes"
    folder = "ISBI2012-EM-membrane"
    layout = ISBI_LAYOUT
    url = ISBI_URL
    required_dirs = ("train/image", "train/label")
    class_names = ("cell", "membrane")
    num_classes = 1
    default_image_mode = "grey_rgb"

    def __init__(self, root: str | Path | None, val_sections: int = 5, **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.val_sections = val_sections

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs ``train/image/<n>.png`` with ``train/label/<n>.png``; names are ``"<n>"``."""
        return match_pairs(list_files(root / "train" / "image", [".png"]),
                           list_files(root / "train" / "label", [".png"]),
                           f"ISBI 2012 at {root}", ISBI_LAYOUT, root=root)

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """The last ``val_sections`` names (in section order) are val, the rest train."""
        train, val = tail_split(names, self.val_sections, "val_sections")
        return {"train": train, "val": val}

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """Membrane (label < 128, stored 0) -> 1; cell interior (stored 255) -> 0."""
        return ThresholdMask(foreground="dark")
