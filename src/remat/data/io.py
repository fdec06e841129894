"""Getting data in: decoding image files with errors that name the file, and building loaders."""

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


def _read_with_pillow(path: Path, mode: ImageReadMode) -> torch.Tensor:
    try:
        with Image.open(path) as img:
            if mode in _PIL_MODES:
                img = img.convert(_PIL_MODES[mode])
            elif img.mode == "1":  # 1-bit TIFFs (some binary label maps): 0/255 like PNGs
                img = img.convert("L")
            array = np.asarray(img)
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise RuntimeError(f"cannot decode image file {path}: {err}") from err
    if array.dtype != np.uint8:
        raise RuntimeError(f"image file {path} holds {array.dtype} pixels; expected 8-bit")
    tensor = torch.from_numpy(array.copy())
    return tensor[None] if tensor.ndim == 2 else tensor.permute(2, 0, 1).contiguous()


def read_image(path: str | Path, mode: ImageReadMode = ImageReadMode.RGB) -> torch.Tensor:
    """Decode an image file (JPEG, PNG, GIF, TIFF) into a uint8 tensor ``[C, H, W]``.

    ``C`` is 3 for ``ImageReadMode.RGB`` and 1 for ``ImageReadMode.GRAY`` (as stored for
    ``UNCHANGED``). Palette PNGs are expanded to their colours (for RGB and GRAY). TIFFs and
    GIFs are decoded with Pillow (torchvision lacks TIFF and ignores the mode for GIF) and
    must hold 8-bit pixels.

    Raises:
        FileNotFoundError: the file does not exist.
        RuntimeError: the bytes cannot be decoded; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    if path.suffix.lower() in _PIL_SUFFIXES:
        return _read_with_pillow(path, mode)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _CODEC_DEPRECATION, DeprecationWarning)
        try:
            return decode_image(read_file(str(path)), mode=mode)
        except (RuntimeError, ValueError) as err:
            raise RuntimeError(f"cannot decode image file {path}: {err}") from err


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
