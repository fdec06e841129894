"""Getting data in: decoding image files with errors that name the file, and building loaders.

Every file that cannot be used raises :class:`DataFileError` saying which file, what is wrong
and what was expected, so a data check (:mod:`remat.data.verify`) can list every bad file of a
dataset at once and a training step that meets one names it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_image, read_file

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec and warns on every call;
# the decoders still work, so keep the per-sample warning out of training logs.
_CODEC_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"
# torchvision has no TIFF decoder (DRIVE, CVC-ClinicDB, Inria and the Massachusetts sets ship
# TIFFs), and its GIF decoder ignores the read mode (a GRAY read of a grey GIF returns 3
# channels, torchvision 0.29); both go through Pillow.
_PIL_SUFFIXES = {".tif", ".tiff", ".gif"}
_PIL_MODES = {ImageReadMode.RGB: "RGB", ImageReadMode.GRAY: "L"}
_PIL_16BIT_MODES = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
_FORMATS = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".tif": "TIFF", ".tiff": "TIFF",
            ".gif": "GIF", ".bmp": "BMP", ".webp": "WebP"}


class DataFileError(ValueError):
    """A data file that cannot be used.

    Build it with ``DataFileError(path=..., problem=..., expected=...)``; the message is
    ``"<path>: <problem>; expected <expected>"`` and the three parts stay available as
    attributes. A plain ``DataFileError(message)`` also works (DataLoader workers re-raise
    exceptions that way).

    Attributes:
        path: the file (``Path``), or None.
        problem: what is wrong with it (``"empty file (0 bytes)"``).
        expected: what a usable file holds (``"an 8-bit PNG image"``), or None.
    """

    def __init__(self, message: str = "", *, path: str | Path | None = None,
                 problem: str | None = None, expected: str | None = None) -> None:
        if path is not None:
            message = f"{path}: {problem}" + (f"; expected {expected}" if expected else "")
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.problem = problem if problem is not None else message
        self.expected = expected


def file_format(path: str | Path) -> str:
    """``"JPEG"``, ``"PNG"``, ``"TIFF"`` ... from the file's suffix (the suffix itself when it
    is none of those)."""
    suffix = Path(path).suffix.lower()
    return _FORMATS.get(suffix, suffix.lstrip(".").upper() or "image")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _read_with_pillow(path: Path, mode: ImageReadMode, expected: str) -> torch.Tensor:
    try:
        with Image.open(path) as img:
            if img.mode in _PIL_16BIT_MODES:  # 16-bit grey: keep the values, never clip
                array = np.asarray(img).astype(np.int64)
                if array.min() < 0 or array.max() > 65535:
                    raise DataFileError(path=path, problem=f"{img.mode} pixels outside 0..65535",
                                        expected=expected)
                tensor = torch.from_numpy(array.astype(np.int32))[None].to(torch.uint16)
                return tensor.expand(3, -1, -1).contiguous() if mode == ImageReadMode.RGB \
                    else tensor
            if mode in _PIL_MODES:
                img = img.convert(_PIL_MODES[mode])
            elif img.mode == "1":  # 1-bit TIFFs (some binary label maps): 0/255 like PNGs
                img = img.convert("L")
            array = np.asarray(img)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        if isinstance(err, DataFileError):
            raise
        raise DataFileError(path=path, problem=f"cannot be decoded ({_first_line(err)})",
                            expected=expected) from err
    if array.dtype != np.uint8:
        raise DataFileError(path=path, problem=f"holds {array.dtype} pixels", expected=expected)
    tensor = torch.from_numpy(array.copy())
    return tensor[None] if tensor.ndim == 2 else tensor.permute(2, 0, 1).contiguous()


def _decode(path: str | Path, mode: ImageReadMode, expected: str) -> torch.Tensor:
    """uint8 or uint16 ``[C, H, W]`` as stored (channels converted to ``mode``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    if path.stat().st_size == 0:
        raise DataFileError(path=path, problem="empty file (0 bytes)", expected=expected)
    if path.suffix.lower() in _PIL_SUFFIXES:
        return _read_with_pillow(path, mode, expected)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _CODEC_DEPRECATION, DeprecationWarning)
        try:
            return decode_image(read_file(str(path)), mode=mode)
        except (RuntimeError, ValueError) as err:
            raise DataFileError(path=path, problem=f"cannot be decoded ({_first_line(err)})",
                                expected=expected) from err


def read_image(path: str | Path, mode: ImageReadMode = ImageReadMode.RGB,
               expected: str | None = None) -> torch.Tensor:
    """Decode an 8-bit image file (JPEG, PNG, GIF, TIFF) into a uint8 tensor ``[C, H, W]``.

    ``C`` is 3 for ``ImageReadMode.RGB`` and 1 for ``ImageReadMode.GRAY`` (as stored for
    ``UNCHANGED``). Palette PNGs are expanded to their colours (for RGB and GRAY). TIFFs and
    GIFs are decoded with Pillow (torchvision lacks TIFF and ignores the mode for GIF).

    Args:
        path: the file.
        mode: channels to return.
        expected: what the file should hold, for messages (default ``"an 8-bit <FORMAT>
            image"``).

    Raises:
        FileNotFoundError: the file does not exist.
        DataFileError: (a ``ValueError``) the file is empty, cannot be decoded, or holds
            16-bit (or other non-8-bit) pixels; the message names the file.
    """
    expected = expected or f"an 8-bit {file_format(path)} image"
    image = _decode(path, mode, expected)
    if image.dtype != torch.uint8:
        bits = 16 if image.dtype == torch.uint16 else image.dtype
        raise DataFileError(path=path, problem=f"holds {bits}-bit pixels", expected=expected)
    return image


def read_label(path: str | Path, mode: ImageReadMode = ImageReadMode.GRAY,
               expected: str | None = None) -> torch.Tensor:
    """Decode a label image as stored: uint8 ``[C, H, W]``, or int32 values ``0..65535`` for
    16-bit files (16-bit PNGs and grey TIFFs), which the mask decoders of
    :mod:`remat.data.masks` accept where their encoding allows.

    Raises:
        FileNotFoundError, DataFileError: as :func:`read_image` (16-bit files excepted).
    """
    expected = expected or f"an 8-bit or 16-bit {file_format(path)} label image"
    label = _decode(path, mode, expected)
    return label.to(torch.int32) if label.dtype == torch.uint16 else label


def make_loader(
    dataset: Dataset,
    batch_size: int,
    num_workers: int,
    *,
    train: bool,
    seed: int,
    pin_memory: bool = False,
) -> DataLoader:
    """Build the project's standard ``DataLoader``.

    Train loaders shuffle with a ``torch.Generator`` seeded by ``seed`` (reproducible order,
    and reproducible worker seeds) and drop the last partial batch only when the dataset is
    larger than ``batch_size``; eval loaders keep order and every sample. Workers persist
    between epochs when ``num_workers > 0``.
    """
    drop_last = train and len(dataset) > batch_size
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train,
        drop_last=drop_last,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed) if train else None,
    )
