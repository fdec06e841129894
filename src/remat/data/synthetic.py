"""Procedural binary segmentation set: striped objects among smooth look-alike distractors.

Every sample is drawn on the fly from a ``torch.Generator`` seeded by ``(seed, split, index)``;
nothing touches the global RNG, so the set is reproducible without files. The mask can only be
found from texture: objects carry oriented stripes (period 4-12 px), while the background and
the distractor shapes carry a smooth low-frequency texture, and distractors are tinted like the
objects. Colour jitter and Gaussian noise are added on top, so no per-pixel intensity threshold
recovers the mask, but a small CNN does.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from remat.data.base import SplitDataModule, check_count
from remat.data.sizes import as_pair
from remat.data.transforms import normalize

_STRIPE_PERIOD_PX = (4.0, 12.0)
_SMOOTH_PERIOD_PX = (24.0, 96.0)


def _sample_seed(seed: int, split: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{split}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: a valid manual_seed value


class _Draws:
    """Uniform numbers from one generator, drawn in a block to keep per-call overhead low."""

    def __init__(self, generator: torch.Generator, block: int = 160) -> None:
        self._generator = generator
        self._block = block
        self._values: list[float] = []

    def __call__(self, low: float, high: float) -> float:
        if not self._values:
            fresh = torch.rand(self._block, generator=self._generator, dtype=torch.float64)
            self._values = fresh.tolist()[::-1]
        return low + (high - low) * self._values.pop()


def _blob(xx: torch.Tensor, yy: torch.Tensor, draw: _Draws, height: int, width: int
          ) -> torch.Tensor:
    """Bool ``[H, W]``: a rotated ellipse with a wavy rim, placed relative to the width and
    height and sized relative to ``sqrt(H * W)`` (the side of a square image)."""
    scale = math.sqrt(height * width)
    cx, cy = draw(0.1, 0.9) * width, draw(0.1, 0.9) * height
    a, b = draw(0.07, 0.2) * scale, draw(0.07, 0.2) * scale
    phi = draw(0.0, math.pi)
    lobes, wobble, phase = int(draw(2.0, 6.0)), draw(0.0, 0.2), draw(0.0, 2 * math.pi)
    dx, dy = xx - cx, yy - cy
    u = (dx * math.cos(phi) + dy * math.sin(phi)) / a
    v = (dy * math.cos(phi) - dx * math.sin(phi)) / b
    rim = 1.0 + wobble * torch.sin(lobes * torch.atan2(v, u) + phase)
    return u * u + v * v <= rim * rim


def _stripes(xx: torch.Tensor, yy: torch.Tensor, draw: _Draws) -> torch.Tensor:
    """Float ``[H, W]`` in ``[-1, 1]``: oriented sinusoidal stripes, period 4-12 px."""
    theta = draw(0.0, math.pi)
    period = draw(*_STRIPE_PERIOD_PX)
    phase = draw(0.0, 2 * math.pi)
    along = xx * math.cos(theta) + yy * math.sin(theta)
    return torch.sin(along * (2 * math.pi / period) + phase)


def _smooth(xx: torch.Tensor, yy: torch.Tensor, draw: _Draws, waves: int = 3) -> torch.Tensor:
    """Float ``[H, W]`` in ``[-1, 1]``: mean of a few long-period plane waves (24-96 px)."""
    field = torch.zeros_like(xx)
    for _ in range(waves):
        theta = draw(0.0, 2 * math.pi)
        period = draw(*_SMOOTH_PERIOD_PX)
        along = xx * math.cos(theta) + yy * math.sin(theta)
        field += torch.sin(along * (2 * math.pi / period) + draw(0.0, 2 * math.pi))
    return field / waves


def render_sample(
    seed: int, index: int, image_size: int | Sequence[int], split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one scene; a pure function of ``(seed, split, index, image_size)``.

    Args:
        image_size: side ``S`` or ``(H, W)`` in pixels (a square ``(S, S)`` draws exactly
            the image of ``S``).

    Returns:
        ``image`` float32 ``[3, H, W]`` in ``[0, 1]`` (not normalised) and ``mask`` int64
        ``[H, W]`` with 1 on the striped objects and 0 elsewhere.
    """
    height, width = as_pair(image_size, "data.image_size")
    generator = torch.Generator().manual_seed(_sample_seed(seed, split, index))
    draw = _Draws(generator)
    yy, xx = torch.meshgrid(torch.arange(height, dtype=torch.float32),
                            torch.arange(width, dtype=torch.float32), indexing="ij")

    base = torch.tensor([draw(0.3, 0.7) for _ in range(3)])
    bg_colour = base + torch.tensor([draw(-0.12, 0.12) for _ in range(3)])
    fg_colour = base + torch.tensor([draw(-0.08, 0.08) for _ in range(3)])

    # Background: smooth texture around the background colour.
    bg_amp = draw(0.08, 0.2)
    image = bg_colour[:, None, None] + bg_amp * _smooth(xx, yy, draw)

    # Distractors: background-kind (smooth) texture, tinted like the objects.
    for _ in range(int(draw(1.0, 4.0))):
        region = _blob(xx, yy, draw, height, width)
        colour = fg_colour + torch.tensor([draw(-0.04, 0.04) for _ in range(3)])
        texture = colour[:, None, None] + draw(0.08, 0.2) * _smooth(xx, yy, draw)
        image = torch.where(region, texture, image)

    # Objects: one striped texture shared by all objects of the scene.
    mask = torch.zeros(height, width, dtype=torch.bool)
    for _ in range(int(draw(1.0, 4.0))):
        mask |= _blob(xx, yy, draw, height, width)
    stripe_amp = draw(0.15, 0.3)
    texture = fg_colour[:, None, None] + stripe_amp * _stripes(xx, yy, draw)
    image = torch.where(mask, texture, image)

    # Global colour jitter (contrast, brightness, per-channel gain), then sensor noise.
    contrast, brightness = draw(0.8, 1.2), draw(-0.08, 0.08)
    gain = torch.tensor([draw(0.9, 1.1) for _ in range(3)])[:, None, None]
    image = ((image - 0.5) * contrast + 0.5 + brightness) * gain
    noise_std = draw(0.02, 0.07)
    image = image + noise_std * torch.randn(image.shape, generator=generator)
    return image.clamp_(0.0, 1.0), mask.long()


class SyntheticSegDataset(Dataset):
    """Procedural binary segmentation samples, generated on the fly.

    Args:
        num_samples: number of samples.
        image_size: side ``S`` of square images, or ``(H, W)``, in pixels (each >= 16).
        seed: base seed; sample ``i`` is a pure function of ``(seed, split, i, image_size)``.
        split: stream name mixed into the seed; ``"train"`` and ``"val"`` never share samples.

    Items are ``{"image": float32 [3, H, W] (ImageNet-normalised), "mask": int64 [H, W]}``,
    mask values 0 (background) and 1 (object).

    Raises:
        ValueError: ``num_samples < 1``, or a side under 16 px or a bad size (names
            ``data.image_size``).
    """

    def __init__(self, num_samples: int, image_size: int | Sequence[int], seed: int,
                 split: str = "train"):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        size = as_pair(image_size, "data.image_size")
        if min(size) < 16:
            raise ValueError(f"data.image_size must be >= 16 px per side, got {image_size}")
        self.num_samples = num_samples
        self.image_size = size
        self.seed = seed
        self.split = split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        image, mask = render_sample(self.seed, index, self.image_size, self.split)
        return {"image": normalize(image), "mask": mask}


class SyntheticSegDataModule(SplitDataModule):
    """Lightning datamodule over :class:`SyntheticSegDataset` (train and val streams).

    Batches are ``{"image": float32 [B, 3, H, W], "mask": int64 [B, H, W]}`` with
    ``(H, W)`` from ``image_size`` (a side or ``[H, W]``, pixels); binary task, so
    ``num_classes == 1`` (``class_names`` background/object; ``ignore_index`` 255 never
    occurs); ``in_channels`` is 3. The train loader shuffles with a generator seeded by ``seed`` and
    drops the last partial batch only when the train set is larger than ``batch_size``.
    """

    in_channels = 3

    def __init__(
        self,
        image_size: int | Sequence[int] = 256,
        batch_size: int = 4,
        num_workers: int = 0,
        num_train: int = 64,
        num_val: int = 16,
        seed: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size, num_workers, pin_memory, loader_seed=seed)
        self.image_size = as_pair(image_size, "data.image_size")
        check_count("num_train", num_train)
        check_count("num_val", num_val)
        self.num_train = num_train
        self.num_val = num_val
        self.seed = seed
        self.num_classes = 1
        self.class_names = ("background", "object")
        self.ignore_index = 255  # never present in synthetic masks

    def setup(self, stage: str | None = None) -> None:
        """Build the train and val datasets (cheap: samples are drawn on access)."""
        if self.train_set is None:
            self.train_set = SyntheticSegDataset(
                self.num_train, self.image_size, self.seed, split="train"
            )
            self.val_set = SyntheticSegDataset(
                self.num_val, self.image_size, self.seed, split="val"
            )
