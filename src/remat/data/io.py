"""Getting data in: decoding image files with errors that name the file, and building loaders."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_image, read_file

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec and warns on every call;
# the decoders still work, so keep the per-sample warning out of training logs.
_CODEC_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"


def read_image(path: str | Path, mode: ImageReadMode = ImageReadMode.RGB) -> torch.Tensor:
    """Decode an image file (JPEG, PNG, ...) into a uint8 tensor ``[C, H, W]``.

    ``C`` is 3 for ``ImageReadMode.RGB`` and 1 for ``ImageReadMode.GRAY``.

    Raises:
        FileNotFoundError: the file does not exist.
        RuntimeError: the bytes cannot be decoded; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
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
