"""Joint image/mask transforms shared by the datamodules.

Images enter as ``tv_tensors.Image`` uint8 ``[3, H, W]`` and masks as ``tv_tensors.Mask``
uint8 ``[1, H, W]`` holding class indices. ``torchvision.transforms.v2`` applies the same
geometry to both, resamples masks with nearest neighbour and applies photometric transforms
(colour jitter, dtype scaling, normalisation) to the image only.
"""

from __future__ import annotations

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


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


def _to_float_normalized() -> list[v2.Transform]:
    return [
        v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        v2.Normalize(mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD)),
    ]


def train_transform(image_size: int) -> v2.Compose:
    """Training augmentation: random resized crop, flips, colour jitter, normalisation.

    Returns a callable ``(Image uint8 [3,H,W], Mask [1,H,W]) -> (Image float32 [3,S,S],
    Mask [1,S,S])`` with ``S = image_size``; the mask keeps its dtype and values.
    """
    return v2.Compose([
        v2.RandomResizedCrop(image_size, scale=(0.5, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomVerticalFlip(),
        v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2, hue=0.02),
        *_to_float_normalized(),
    ])


def eval_transform(image_size: int) -> v2.Compose:
    """Evaluation transform: resize to ``(image_size, image_size)`` and normalise.

    Same input/output types as :func:`train_transform`; deterministic.
    """
    return v2.Compose([
        v2.Resize((image_size, image_size), antialias=True),
        *_to_float_normalized(),
    ])


def to_sample(image: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Turn transformed tensors into a sample dict.

    Args:
        image: float32 ``[3, H, W]``.
        mask: integer ``[1, H, W]`` or ``[H, W]`` of class indices.

    Returns:
        ``{"image": float32 [3, H, W], "mask": int64 [H, W]}`` as plain tensors.
    """
    if mask.ndim == 3:
        mask = mask[0]
    return {
        "image": image.as_subclass(torch.Tensor).float(),
        "mask": mask.as_subclass(torch.Tensor).long(),
    }
