"""One labelled image on disk: its files, decoded together, with their sizes checked.

:func:`load_pair` is what a dataset calls per sample (it stops at the first bad file);
:func:`check_pair` decodes the same files the same way but collects every problem, for the
data check that runs before training (:mod:`remat.data.verify`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torchvision.io import ImageReadMode

from remat.data.io import DataFileError, file_format, read_image

IMAGE_MODES = ("rgb", "grey", "grey_rgb")
MaskDecoder = Callable[[Path], torch.Tensor]
#: ``path -> [C, H, W]`` image reader replacing the 8-bit one (e.g. a user's 16-bit TIFFs)
ImageReader = Callable[[Path], torch.Tensor]


@dataclass(frozen=True)
class ImageMaskPair:
    """One labelled image: its name (unique in the dataset) and file paths.

    ``valid`` is an optional region-of-interest mask file (non-zero = inside).
    """

    name: str
    image: Path
    mask: Path
    valid: Path | None = None

    @property
    def files(self) -> list[Path]:
        """The pair's files: image, mask and (if any) region-of-interest mask."""
        return [self.image, self.mask] + ([self.valid] if self.valid is not None else [])


# what a pair's file is, by its field, for messages
_FILE_KINDS = {"image": "image", "mask": "mask", "valid": "region-of-interest mask"}


def missing_file(pair: ImageMaskPair, key: str) -> DataFileError:
    """The problem of the pair's file ``key`` (``image``, ``mask``, ``valid``) that does
    not exist: ``"<path>: mask file not found; expected the mask of <name>"``."""
    kind = _FILE_KINDS[key]
    return DataFileError(path=getattr(pair, key), problem=f"{kind} file not found",
                         expected=f"the {kind} of {pair.name}")


def _read_mode(image_mode: str) -> ImageReadMode:
    if image_mode not in IMAGE_MODES:
        raise ValueError(f"data.image_mode must be one of {IMAGE_MODES}, got {image_mode!r}")
    return ImageReadMode.RGB if image_mode == "rgb" else ImageReadMode.GRAY


def _image_expected(pair: ImageMaskPair, image_mode: str) -> str:
    kind = "RGB" if image_mode == "rgb" else "grey or RGB"
    return f"an 8-bit {kind} {file_format(pair.image)} image"


def _size_error(pair: ImageMaskPair, path: Path, got: tuple[int, ...],
                image: tuple[int, ...]) -> DataFileError:
    return DataFileError(
        path=path, problem=f"size mismatch for {pair.name}: its image {pair.image} is "
        f"{image[1]}x{image[0]} (WxH) but this file is {got[1]}x{got[0]}",
        expected="the same size as its image")


def _decode(pair: ImageMaskPair, image_mode: str, decode_mask: MaskDecoder,
            problems: list[DataFileError] | None, image_reader: ImageReader | None = None
            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Decode the pair's files; with ``problems`` given, collect errors instead of raising."""
    if image_reader is None:
        mode = _read_mode(image_mode)

        def image_reader(path: Path) -> torch.Tensor:
            return read_image(path, mode, _image_expected(pair, image_mode))

    steps: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("image", lambda: image_reader(pair.image)),
        ("mask", lambda: decode_mask(pair.mask)),
    ]
    if pair.valid is not None:
        valid_path = pair.valid
        steps.append(("valid", lambda: read_image(
            valid_path, ImageReadMode.GRAY, f"an 8-bit grey {file_format(valid_path)} "
            "region-of-interest mask (non-zero = inside)")[0] > 0))
    out: dict[str, torch.Tensor | None] = {}
    for key, read in steps:
        try:
            out[key] = read()
        except (DataFileError, FileNotFoundError) as err:
            if problems is None:
                raise
            problems.append(err if isinstance(err, DataFileError) else missing_file(pair, key))
            out[key] = None
    image = out["image"]
    if image is not None:
        size = tuple(image.shape[-2:])
        for key, path in (("mask", pair.mask), ("valid", pair.valid)):
            tensor = out.get(key)
            if tensor is not None and tuple(tensor.shape[-2:]) != size:
                err = _size_error(pair, path, tuple(tensor.shape[-2:]), size)
                if problems is None:
                    raise err
                problems.append(err)
    return image, out["mask"], out.get("valid")


def load_pair(pair: ImageMaskPair, image_mode: str, decode_mask: MaskDecoder,
              image_reader: ImageReader | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode a pair: image uint8 ``[C, H, W]`` (``C`` = 3 for ``"rgb"``, 1 for the grey
    modes; ``image_reader``'s result when given), mask uint8 ``[H, W]`` class indices (from
    ``decode_mask``), region-of-interest bool ``[H, W]`` or None.

    Raises:
        ValueError: unknown ``image_mode``.
        DataFileError: (a ``ValueError``) the first bad file: empty, not decodable, 16-bit
            image, mask values outside the encoding, or a size differing from the image's.
        FileNotFoundError: a file is missing.
    """
    image, mask, valid = _decode(pair, image_mode, decode_mask, None, image_reader)
    assert image is not None and mask is not None
    return image, mask, valid


def check_pair(pair: ImageMaskPair, image_mode: str, decode_mask: MaskDecoder,
               image_reader: ImageReader | None = None) -> list[DataFileError]:
    """Every problem of a pair's files (empty list: the pair loads), decoding each file once
    as :func:`load_pair` does."""
    return inspect_pair(pair, image_mode, decode_mask, image_reader)[0]


def inspect_pair(pair: ImageMaskPair, image_mode: str, decode_mask: MaskDecoder,
                 image_reader: ImageReader | None = None,
                 image_kind: Callable[[torch.Tensor], str] | None = None
                 ) -> tuple[list[DataFileError], torch.Tensor | None, str | None]:
    """:func:`check_pair` plus the mask's label counts and the image's kind.

    Returns:
        ``(problems, counts, kind)``: every problem of the pair's files, including what the
        mask decoder's ``encoding_problem(path)`` (if it has one) finds in the raw file;
        int64 ``[256]`` pixel counts per decoded mask value inside the region of interest
        (None when the mask could not be decoded); ``image_kind`` of the decoded image
        (None without one, or when the image could not be decoded).
    """
    problems: list[DataFileError] = []
    image, mask, valid = _decode(pair, image_mode, decode_mask, problems, image_reader)
    kind = image_kind(image) if image_kind is not None and image is not None else None
    counts = None
    if mask is not None:
        values = mask if valid is None or valid.shape != mask.shape else mask[valid]
        counts = torch.bincount(values.reshape(-1).long(), minlength=256)
        check = getattr(decode_mask, "encoding_problem", None)
        note = check(pair.mask) if check is not None else None
        if note:
            problems.append(DataFileError(path=pair.mask, problem=note))
    return problems, counts, kind
