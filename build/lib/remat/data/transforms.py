"""Joint image/mask transforms and the normalisation every datamodule shares.

Images enter as ``tv_tensors.Image`` uint8 ``[C, H, W]`` (C = 3, or 1 for grey images) and
masks as ``tv_tensors.Mask`` uint8 ``[1, H, W]`` holding class indices.
``torchvision.transforms.v2`` applies the same geometry to both, resamples masks with nearest
neighbour and applies photometric transforms (colour jitter, dtype scaling, normalisation) to
the image only. Sizes are one side or ``(height, width)`` in pixels
(:func:`remat.data.sizes.as_pair`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

from remat.data.sizes import as_pair

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
# Grey images fed as one channel are normalised with the mean of ImageNet's channel statistics.
GREY_MEAN = sum(IMAGENET_MEAN) / 3
GREY_STD = sum(IMAGENET_STD) / 3


def normalize(image: torch.Tensor) -> torch.Tensor:
    """Normalise a float image in ``[0, 1]`` with the ImageNet mean and std.

    Args:
        image: float tensor ``[3, H, W]`` (or ``[B, 3, H, W]``) with values in ``[0, 1]``.

    Returns:
        A new float tensor of the same shape and dtype.
    """
    mean = torch.tensor(IMAGENET_MEAN, dtype=image.dtype, device=image.device)[:, None, None]
    std = torch.tensor(IMAGENET_STD, dtype=image.dtype, device=image.device)[:, None, None]
    return (image - mean) / std


def to_float_normalized(grey: bool = False) -> list[v2.Transform]:
    """uint8 image -> float32 in ``[0, 1]`` -> normalised with the ImageNet mean/std (one grey
    channel: their averages 0.449/0.226); masks pass through unchanged."""
    return [
        v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        v2.Normalize(mean=[GREY_MEAN] if grey else list(IMAGENET_MEAN),
                     std=[GREY_STD] if grey else list(IMAGENET_STD)),
    ]


def train_transform(image_size: int | Sequence[int], grey: bool = False) -> v2.Compose:
    """Training augmentation: random resized crop, flips, colour jitter, normalisation.

    Args:
        image_size: output side ``S`` or ``(H, W)`` in pixels.
        grey: images have one channel (no saturation/hue jitter; grey normalisation).

    Returns a callable ``(Image uint8 [C,H0,W0], Mask [1,H0,W0]) -> (Image float32 [C,H,W],
    Mask [1,H,W])``; the mask keeps its dtype and values.

    Raises:
        ValueError: a bad ``image_size`` (names ``data.image_size``).
    """
    size = as_pair(image_size, "data.image_size")
    jitter = v2.ColorJitter(brightness=0.2, contrast=0.2) if grey else \
        v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2, hue=0.02)
    return v2.Compose([
        v2.RandomResizedCrop(size, scale=(0.5, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomVerticalFlip(),
        jitter,
        *to_float_normalized(grey),
    ])


def eval_transform(image_size: int | Sequence[int], grey: bool = False) -> v2.Compose:
    """Evaluation transform: resize to ``image_size`` (``S x S`` or ``(H, W)``) and normalise.

    Same input/output types as :func:`train_transform`; deterministic.
    """
    return v2.Compose([
        v2.Resize(as_pair(image_size, "data.image_size"), antialias=True),
        *to_float_normalized(grey),
    ])


def to_sample(image: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Turn transformed tensors into a sample dict.

    Args:
        image: float32 ``[C, H, W]``.
        mask: integer ``[1, H, W]`` or ``[H, W]`` of class indices.

    Returns:
        ``{"image": float32 [C, H, W], "mask": int64 [H, W]}`` as plain tensors.
    """
    if mask.ndim == 3:
        mask = mask[0]
    return {
        "image": image.as_subclass(torch.Tensor).float(),
        "mask": mask.as_subclass(torch.Tensor).long(),
    }
