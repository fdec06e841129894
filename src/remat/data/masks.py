"""Mask decoders: turn a published mask file into class indices ``uint8 [H, W]``.

Each dataset stores its labels differently (grey 0/255 maps, colour-coded RGB PNGs, integer
label PNGs). The decoders here read one file and return class indices, with pixels that belong
to no class set to the datamodule's ``ignore_index`` (255 throughout remat). They are plain
module-level functions so that ``functools.partial`` of them pickles into DataLoader workers.

16-bit label files (16-bit PNGs, 16-bit grey TIFFs) are decoded where the encoding leaves no
doubt, and refused naming the file where it does:

* grey threshold masks: values spanning the 16-bit range are scaled to 8 bits
  (``round(v * 255 / 65535)``, so 0/65535 reads as 0/255); a 16-bit file whose values all fit
  in ``0..255`` could be an 8-bit mask stored in 16 bits or a nearly black 16-bit one, so it
  is refused;
* colour masks: every value must be an 8-bit value scaled to 16 bits (``v = 257 * c``);
* integer label maps: the values are labels, so 16-bit storage is fine while every value is
  in the lookup.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torchvision.io import ImageReadMode

from remat.data.io import DataFileError, file_format, read_label

IGNORE_INDEX = 255
RGB = tuple[int, int, int]


def _is_16bit(raw: torch.Tensor) -> bool:
    return raw.dtype == torch.int32  # read_label returns int32 only for 16-bit files


def to_8bit_intensity(raw: torch.Tensor, path: str | Path, expected: str) -> torch.Tensor:
    """uint8 grey levels of a label image from :func:`remat.data.io.read_label`.

    8-bit input is returned as it is; 16-bit input is scaled by ``255 / 65535`` (rounded).

    Raises:
        DataFileError: a 16-bit file whose non-zero values all lie in ``1..255`` (an 8-bit
            mask saved as 16 bits cannot be told from a nearly black 16-bit one); names the
            file and its largest value.
    """
    if not _is_16bit(raw):
        return raw
    top = int(raw.max())
    if 0 < top <= 255:
        raise DataFileError(
            path=path, problem=f"16-bit mask whose values all lie in 0..{top} (an 8-bit mask "
            "saved as 16 bits?)", expected=f"{expected}; 16-bit masks must span 0..65535 "
            "(e.g. 0/65535), or save the mask as 8-bit")
    return ((raw * 255 + 32767) // 65535).to(torch.uint8)


def threshold_mask(path: str | Path, foreground: str = "bright", threshold: int = 128,
                   channels: str = "grey") -> torch.Tensor:
    """Binary mask from a grey (or RGB) label image.

    Args:
        path: the mask file (PNG, JPEG, GIF, TIFF; 8-bit, or 16-bit spanning 0..65535).
        foreground: ``"bright"``: class 1 where the grey value is ``>= threshold`` (polyps,
            lesions, vessels, buildings, roads); ``"dark"``: class 1 where it is
            ``< threshold`` (ISBI 2012, where 0 is membrane and 255 is cell interior).
        threshold: 8-bit grey level splitting the two classes (128 tolerates JPEG noise; 1
            makes any non-zero value foreground, for 0/1 as well as 0/255 label maps).
        channels: ``"grey"``: threshold the luma of the file (``ImageReadMode.GRAY``);
            ``"max"``: threshold the brightest RGB channel, so labels drawn in one pure colour
            (e.g. red building maps) count as foreground.

    Returns:
        uint8 ``[H, W]`` with values 0 and 1.

    Raises:
        ValueError: ``foreground`` is neither ``"bright"`` nor ``"dark"``, or ``channels`` is
            neither ``"grey"`` nor ``"max"``.
        FileNotFoundError: the file is missing.
        DataFileError: the file is empty, cannot be decoded, or is an ambiguous 16-bit mask
            (see the module docstring); names the file.
    """
    if foreground not in ("bright", "dark"):
        raise ValueError(f"foreground must be 'bright' or 'dark', got {foreground!r}")
    if channels not in ("grey", "max"):
        raise ValueError(f"channels must be 'grey' or 'max', got {channels!r}")
    side = ">=" if foreground == "bright" else "<"
    expected = (f"a grey {file_format(path)} mask with the foreground {side} {threshold} "
                "(of 255)")
    mode = ImageReadMode.GRAY if channels == "grey" else ImageReadMode.RGB
    raw = read_label(path, mode, expected=expected)
    grey = to_8bit_intensity(raw, path, expected)
    grey = grey[0] if channels == "grey" else grey.amax(dim=0)
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
    (checked against Pillow's ``convert("RGB")`` on all 72 Dubai masks). A 16-bit RGB PNG is
    read when every value is an 8-bit value scaled to 16 bits (``257 * c``).

    Args:
        path: the mask file.
        palette: ``{(R, G, B): class index}``.
        ignore_colours: colours that are no class; their pixels become ``ignore_index``.
        ignore_index: value written for ``ignore_colours``.

    Returns:
        uint8 ``[H, W]`` class indices.

    Raises:
        DataFileError: (a ``ValueError``) the mask holds a colour that is neither in
            ``palette`` nor in ``ignore_colours`` (the message names the file and every such
            colour, RGB and hex, with its pixel count), is a 16-bit file with values that are
            no 8-bit colour, is empty or cannot be decoded.
        FileNotFoundError: the file is missing.
    """
    expected = "class colours " + ", ".join(f"{c}={i}" for c, i in palette.items()) + (
        f" or ignored colours {list(ignore_colours)}" if ignore_colours else "")
    rgb = read_label(path, ImageReadMode.RGB,
                     expected=f"an RGB {file_format(path)} mask with {expected}")
    if _is_16bit(rgb):
        if bool((rgb % 257).any()):
            raise DataFileError(path=path, problem="16-bit colour mask with values that are no "
                                "8-bit colour (a multiple of 257)",
                                expected=f"an 8-bit RGB mask with {expected}")
        rgb = rgb // 257
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
        raise DataFileError(path=path, problem=f"holds {len(found)} colour(s) not in the "
                            f"palette: {listed}{more}", expected=expected)
    return out


def index_mask(path: str | Path, lookup: Mapping[int, int]) -> torch.Tensor:
    """Class indices from an integer label image (8- or 16-bit), remapped through ``lookup``.

    Args:
        path: a single-channel label PNG (e.g. LoveDA ``masks_png/*.png``, values 0-7).
        lookup: ``{stored value: class index}``; map a value to :data:`IGNORE_INDEX` (255) to
            ignore its pixels (LoveDA's 0 = no-data).

    Returns:
        uint8 ``[H, W]`` class indices.

    Raises:
        DataFileError: (a ``ValueError``) the file holds a value missing from ``lookup`` or
            more than one channel, is empty or cannot be decoded; names the file and values.
        FileNotFoundError: the file is missing.
    """
    expected = f"a single-channel {file_format(path)} label image with values {sorted(lookup)}"
    raw = read_label(path, ImageReadMode.UNCHANGED, expected=expected)
    if raw.shape[0] != 1:
        raise DataFileError(path=path, problem=f"has {raw.shape[0]} channels",
                            expected=expected)
    raw = raw[0].long()
    table = torch.full((max(256, int(raw.max()) + 1),), -1, dtype=torch.int16)
    for value, index in lookup.items():
        table[value] = index
    out = table[raw]
    if bool((out < 0).any()):
        bad = sorted(int(v) for v in raw[out < 0].unique())
        raise DataFileError(path=path, problem=f"holds value(s) {bad[:10]} outside the lookup"
                            + (f" and {len(bad) - 10} more" if len(bad) > 10 else ""),
                            expected=expected)
    return out.to(torch.uint8)


# ----------------------------------------------------------------------------- decoders
# Picklable decoder objects. Besides decoding (``__call__``), each may answer
# ``encoding_problem(path)``: what in the raw file says the encoding is the wrong one
# (0/1 label maps under a 128 threshold, lossy JPEG masks read as "any non-zero"), which
# the data check (:mod:`remat.data.verify`) reports before training.


def _several_classes_problem(path: str | Path) -> str | None:
    """The problem of a binary encoding on a mask that holds several classes: a palette PNG
    (mode ``P``) using more than two indices, or a grey label map of more than two small
    values (0, 1, 2, ...). Either would be read as one foreground (or lose classes under a
    threshold) without an error."""
    import numpy as np
    from PIL import Image

    try:
        with Image.open(path) as image:
            mode = image.mode
            values = np.unique(np.asarray(image)) if mode in ("P", "L") else None
    except (OSError, ValueError):
        return None  # unreadable files are reported by the decoder itself
    if values is None or len(values) <= 2:
        return None
    shown = ", ".join(str(int(v)) for v in values[:8]) + (", ..." if len(values) > 8 else "")
    classes = int(values.max()) + 1
    if mode == "P":
        return (f"is a palette PNG using {len(values)} palette indices ({shown}): a mask with "
                f"several classes, which a binary encoding reads as one foreground; use "
                f"data.mask_encoding=palette data.num_classes={classes}")
    if int(values.max()) < 64:
        return (f"holds {len(values)} small values ({shown}): a label map with several "
                f"classes, which a binary encoding reads as one foreground; use "
                f"data.mask_encoding=index data.num_classes={classes}")
    return None


def _label_map_problem(path: str | Path, threshold: int, foreground: str) -> str | None:
    """The problem of a grey mask holding only 0 and 1 under a threshold above 1."""
    if threshold <= 1:
        return None
    raw = read_label(path, ImageReadMode.GRAY)
    if int(raw.max()) != 1:
        return None
    lost = "no foreground" if foreground == "bright" else "foreground everywhere"
    return (f"holds only the values 0 and 1 (a label map?), which a threshold of {threshold} "
            f"reads as {lost}; for 0/1 masks use data=folder with data.mask_encoding=index "
            "(or binary without data.threshold)")


class ThresholdMask:
    """Binary mask by a grey-level threshold (:func:`threshold_mask` with fixed settings).

    Args:
        foreground, threshold, channels: as :func:`threshold_mask`.

    Calling it with a path returns uint8 ``[H, W]`` with values 0 and 1.
    """

    def __init__(self, foreground: str = "bright", threshold: int = 128,
                 channels: str = "grey") -> None:
        self.foreground, self.threshold, self.channels = foreground, int(threshold), channels

    def __call__(self, path: str | Path) -> torch.Tensor:
        return threshold_mask(path, self.foreground, self.threshold, self.channels)

    def encoding_problem(self, path: str | Path) -> str | None:
        """A message when the file holds only 0/1 (a label map) and ``threshold > 1``, or
        several classes (a palette PNG, a label map of small values)."""
        return (_several_classes_problem(path)
                or _label_map_problem(path, self.threshold, self.foreground))

    def __repr__(self) -> str:
        return (f"ThresholdMask(foreground={self.foreground!r}, threshold={self.threshold}, "
                f"channels={self.channels!r})")


class NonZeroMask:
    """Binary mask: foreground wherever any channel of the stored value is non-zero (0/1,
    0/255, 0/65535 and one-colour label drawings alike; palette PNGs by their colours).

    Calling it with a path returns uint8 ``[H, W]`` with values 0 and 1.
    """

    def __call__(self, path: str | Path) -> torch.Tensor:
        raw = read_label(path, ImageReadMode.RGB,
                         expected=f"a {file_format(path)} mask (background 0)")
        return (raw.amax(dim=0) > 0).to(torch.uint8)

    def encoding_problem(self, path: str | Path) -> str | None:
        """A message for a mask with compression noise (values strictly between the
        darkest and brightest level in more than 0.1 % of its pixels, as JPEG leaves them),
        which "any non-zero" would read as foreground, or several classes (a palette PNG,
        a label map of small values); the threshold is suggested for lossy files only."""
        several = _several_classes_problem(path)
        if several is not None:
            return several
        raw = read_label(path, ImageReadMode.GRAY)
        top = int(raw.max())
        if top < 2:
            return None
        noisy = float(((raw > 0) & (raw < top)).float().mean())
        if noisy <= 1e-3:
            return None
        if file_format(path) in ("JPEG", "JPG"):
            return (f"{100 * noisy:.1f}% of its pixels lie between 0 and {top} (compression "
                    "noise of a JPEG mask), which mask_encoding=binary without a threshold "
                    "reads as foreground; set data.threshold=128 (or save masks as PNG)")
        return (f"{100 * noisy:.1f}% of its pixels lie between 0 and {top}, which "
                "mask_encoding=binary without a threshold reads as foreground: several "
                "classes (use data.mask_encoding=index, palette or colors) or soft edges "
                "(set data.threshold to the grey level that separates them)")

    def __repr__(self) -> str:
        return "NonZeroMask()"


class LabelMapMask:
    """Class indices stored as pixel values: a grey label map (``mask_encoding=index``) or
    the indices of a palette PNG (``mask_encoding=palette``).

    Args:
        num_classes: classes (1 = binary: values 0 and 1), so the stored values
            ``0..max(1, num_classes - 1)`` are classes.
        ignore_index: a stored value that is no class (kept as it is, so the loss and the
            metrics leave those pixels out).
        palette: read the file's palette indices and refuse a file that is no palette
            (mode ``P``) PNG.

    Calling it with a path returns uint8 ``[H, W]`` class indices (or ``ignore_index``).

    Raises (on call):
        DataFileError: a value that is neither a class nor ``ignore_index`` (every such
            value listed with its pixel count), a colour file under ``index`` whose channels
            differ, a non-palette file under ``palette``; names the file.
    """

    def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX,
                 palette: bool = False) -> None:
        self.classes = max(2, int(num_classes))
        self.ignore_index, self.palette = int(ignore_index), palette

    def _expected(self, path: str | Path) -> str:
        kind = "a palette (mode P) PNG" if self.palette else f"a single-channel {file_format(path)}"
        return (f"{kind} label map with values 0..{self.classes - 1} (classes) or "
                f"{self.ignore_index} (ignored)")

    def __call__(self, path: str | Path) -> torch.Tensor:
        expected = self._expected(path)
        if self.palette:
            from PIL import Image

            try:
                with Image.open(path) as img:
                    mode = img.mode
            except OSError as err:
                raise DataFileError(path=path, problem=f"cannot be decoded ({err})",
                                    expected=expected) from err
            if mode != "P":
                raise DataFileError(path=path, problem=f"is a mode {mode} image, not a palette "
                                    "PNG", expected=expected + "; for colour masks use "
                                    "data.mask_encoding=colors with data.colors, for grey "
                                    "label maps data.mask_encoding=index")
        raw = read_label(path, ImageReadMode.UNCHANGED, expected=expected)
        if raw.shape[0] > 1:
            colour = raw[:3]
            if bool((colour != colour[:1]).any()):
                raise DataFileError(path=path, problem=f"has {raw.shape[0]} channels that differ "
                                    "(a colour mask?)", expected=expected + "; for colour masks "
                                    "use data.mask_encoding=colors with data.colors")
            raw = raw[:1]
        raw = raw[0].long()
        bad = (raw >= self.classes) & (raw != self.ignore_index)
        if bool(bad.any()):
            values, counts = raw[bad].unique(return_counts=True)
            listed = ", ".join(f"{int(v)} ({int(n)} px)" for v, n in
                               zip(values[:10], counts[:10], strict=False))
            more = f" and {len(values) - 10} more" if len(values) > 10 else ""
            hint = ""
            if int(values.max()) == 255 and self.classes == 2:
                hint = "; 0/255 masks are mask_encoding=binary"
            elif self.classes < 256:
                hint = f"; more classes? raise data.num_classes (now {self.classes} values)"
            raise DataFileError(path=path, problem=f"holds value(s) outside the classes: "
                                f"{listed}{more}", expected=expected + hint)
        return raw.to(torch.uint8)

    def __repr__(self) -> str:
        return (f"LabelMapMask(num_classes={self.classes}, ignore_index={self.ignore_index}, "
                f"palette={self.palette})")


class ColourTableMask:
    """Class indices from exact RGB colours (:func:`colour_mask` with a fixed table).

    Args:
        colours: one ``(R, G, B)`` per class, in class order.
        ignore_colours: colours that are no class (their pixels become ``ignore_index``).
        ignore_index: value written for them.
    """

    def __init__(self, colours: Sequence[RGB], ignore_colours: Sequence[RGB] = (),
                 ignore_index: int = IGNORE_INDEX) -> None:
        self.palette = {tuple(int(c) for c in colour): index
                        for index, colour in enumerate(colours)}
        self.ignore_colours = [tuple(int(c) for c in colour) for colour in ignore_colours]
        self.ignore_index = int(ignore_index)

    def __call__(self, path: str | Path) -> torch.Tensor:
        return colour_mask(path, self.palette, self.ignore_colours, self.ignore_index)

    def __repr__(self) -> str:
        return f"ColourTableMask({len(self.palette)} colours)"


def parse_colour(value: object, key: str) -> RGB:
    """``"#RRGGBB"``, ``"RRGGBB"`` or ``[R, G, B]`` (0..255 each) -> ``(R, G, B)``.

    Raises:
        ValueError: anything else; names the config key ``key`` and the value.
    """
    if isinstance(value, str):
        text = value.strip().lstrip("#")
        if len(text) == 6:
            try:
                return (int(text[0:2], 16), int(text[2:4], 16), int(text[4:6], 16))
            except ValueError:
                pass
    elif isinstance(value, Sequence) and len(value) == 3 and all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in value):
        return (int(value[0]), int(value[1]), int(value[2]))
    raise ValueError(f"{key}: {value!r} is no colour; give '#RRGGBB' or [R, G, B] with values "
                     "0..255")
