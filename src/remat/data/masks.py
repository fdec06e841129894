"""Mask decoders: turn a published mask file into class indices ``uint8 [H, W]``.

Each dataset stores its labels differently (grey 0/255 maps, colour-coded RGB PNGs, integer
label PNGs). The decoders here read one file and return class indices, with pixels that belong
to no class set to the datamodule's ``ignore_index`` (255 throughout remat). They are plain
module-level functions so that ``functools.partial`` of them pickles into DataLoader workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torchvision.io import ImageReadMode

from remat.data.io import read_image

IGNORE_INDEX = 255
RGB = tuple[int, int, int]


def threshold_mask(path: str | Path, foreground: str = "bright", threshold: int = 128,
                   channels: str = "grey") -> torch.Tensor:
    """Binary mask from a grey (or RGB) label image.

    Args:
        path: the mask file (PNG, JPEG, GIF, TIFF).
        foreground: ``"bright"``: class 1 where the grey value is ``>= threshold`` (polyps,
            lesions, vessels, buildings, roads); ``"dark"``: class 1 where it is
            ``< threshold`` (ISBI 2012, where 0 is membrane and 255 is cell interior).
        threshold: grey level splitting the two classes (128 tolerates JPEG noise; 1 makes
            any non-zero value foreground, for 0/1 as well as 0/255 label maps).
        channels: ``"grey"``: threshold the luma of the file (``ImageReadMode.GRAY``);
            ``"max"``: threshold the brightest RGB channel, so labels drawn in one pure colour
            (e.g. red building maps) count as foreground.

    Returns:
        uint8 ``[H, W]`` with values 0 and 1.

    Raises:
        ValueError: ``foreground`` is neither ``"bright"`` nor ``"dark"``, or ``channels`` is
            neither ``"grey"`` nor ``"max"``.
        FileNotFoundError, RuntimeError: from :func:`remat.data.io.read_image`.
    """
    if foreground not in ("bright", "dark"):
        raise ValueError(f"foreground must be 'bright' or 'dark', got {foreground!r}")
    if channels == "grey":
        grey = read_image(path, ImageReadMode.GRAY)[0]
    elif channels == "max":
        grey = read_image(path, ImageReadMode.RGB).amax(dim=0)
    else:
        raise ValueError(f"channels must be 'grey' or 'max', got {channels!r}")
    fg = grey >= threshold if foreground == "bright" else grey < threshold
    return fg.to(torch.uint8)


def _rgb_key(rgb: torch.Tensor) -> torch.Tensor:
    """uint8 ``[3, H, W]`` -> int32 ``[H, W]`` holding ``R << 16 | G << 8 | B``."""
    rgb = rgb.to(torch.int32)
    return (rgb[0] << 16) | (rgb[1] << 8) | rgb[2]


def _pack(colour: RGB) -> int:
    return (int(colour[0]) << 16) | (int(colour[1]) << 8) | int(colour[2])


def _hex(colour: RGB) -> str:
    return "#{:02X}{:02X}{:02X}".format(*colour)


def colour_mask(path: str | Path, palette: Mapping[RGB, int],
                ignore_colours: Sequence[RGB] = (), ignore_index: int = IGNORE_INDEX
                ) -> torch.Tensor:
    """Class indices from a colour-coded mask (one exact RGB colour per class).

    Palette PNGs (mode ``P``) are expanded to RGB by the decoder, so they read like RGB PNGs
    (checked against Pillow's ``convert("RGB")`` on all 72 Dubai masks).

    Args:
        path: the mask file.
        palette: ``{(R, G, B): class index}``.
        ignore_colours: colours that are no class; their pixels become ``ignore_index``.
        ignore_index: value written for ``ignore_colours``.

    Returns:
        uint8 ``[H, W]`` class indices.

    Raises:
        ValueError: the mask holds a colour that is neither in ``palette`` nor in
            ``ignore_colours``; the message names the file and every such colour (RGB and hex)
            with its pixel count.
    """
    rgb = read_image(path, ImageReadMode.RGB)
    key = _rgb_key(rgb)
    # One sorted lookup of the packed colour instead of a comparison per colour.
    table = {_pack(colour): index for colour, index in palette.items()}
    for colour in ignore_colours:
        table.setdefault(_pack(colour), ignore_index)
    keys = torch.tensor(sorted(table), dtype=torch.int32)
    values = torch.tensor([table[k] for k in sorted(table)], dtype=torch.uint8)
    slot = torch.searchsorted(keys, key).clamp_(max=len(keys) - 1)
    known = keys[slot] == key
    out = values[slot]
    if not bool(known.all()):
        values, counts = key[~known].unique(return_counts=True)
        order = counts.argsort(descending=True)
        found = [((int(v) >> 16) & 255, (int(v) >> 8) & 255, int(v) & 255) for v in values[order]]
        listed = ", ".join(f"{c} {_hex(c)} ({int(n)} px)"
                           for c, n in zip(found[:8], counts[order][:8], strict=False))
        more = f" and {len(found) - 8} more" if len(found) > 8 else ""
        expected = ", ".join(f"{c}={i}" for c, i in palette.items())
        raise ValueError(
            f"mask {path} holds {len(found)} colour(s) not in the palette: {listed}{more}. "
            f"Expected class colours {expected}"
            + (f" or ignored colours {list(ignore_colours)}" if ignore_colours else "")
        )
    return out


def index_mask(path: str | Path, lookup: Mapping[int, int]) -> torch.Tensor:
    """Class indices from an integer label image, remapped through ``lookup``.

    Args:
        path: a single-channel label PNG (e.g. LoveDA ``masks_png/*.png``, values 0-7).
        lookup: ``{stored value: class index}``; map a value to :data:`IGNORE_INDEX` (255) to
            ignore its pixels (LoveDA's 0 = no-data).

    Returns:
        uint8 ``[H, W]`` class indices.

    Raises:
        ValueError: the file holds a value missing from ``lookup``; names the file and values.
    """
    raw = read_image(path, ImageReadMode.UNCHANGED)
    if raw.shape[0] != 1:
        raise ValueError(f"label image {path} has {raw.shape[0]} channels; expected a "
                         "single-channel PNG of class values")
    table = torch.full((256,), -1, dtype=torch.int16)
    for value, index in lookup.items():
        table[value] = index
    out = table[raw[0].long()]
    if bool((out < 0).any()):
        bad = sorted(int(v) for v in raw[0][out < 0].unique())
        raise ValueError(f"label image {path} holds value(s) {bad} outside the expected "
                         f"{sorted(lookup)}")
    return out.to(torch.uint8)
