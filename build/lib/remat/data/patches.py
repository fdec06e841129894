"""Random training patches from large images, optionally centred on foreground pixels.

Large tiles (Inria 5000 x 5000, Massachusetts 1500 x 1500, Dubai up to 2149 x 1479) are
trained on random ``patch_size`` crops. Thin or rare structures (roads, vessels, membranes)
fill few pixels, so a uniform crop often holds none; :class:`PatchSampler` can centre a share
of the crops on a random foreground pixel instead (the "foreground oversampling" of nnU-Net,
Isensee et al. 2021, Nature Methods 18:203, which forces a third of the patches onto
foreground). Images smaller than a patch are padded: image with 0, mask with the ignore index,
so the padding is neither learned nor scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from remat.data.sizes import as_pair


@dataclass(frozen=True)
class Box:
    """A crop window in pixels: rows ``top:top+height``, columns ``left:left+width``."""

    top: int
    left: int
    height: int
    width: int


class PatchSampler:
    """Choose where to crop a training patch from a mask.

    Args:
        patch_size: patch side in pixels, or ``(height, width)``.
        foreground_prob: probability in ``[0, 1]`` that the patch is centred on a pixel drawn
            uniformly from the foreground (then clamped to the image); otherwise, and when the
            mask has no foreground, the top-left corner is uniform over all valid positions.
        foreground_classes: class indices that count as foreground (``(1,)`` for binary
            tasks). The ignore index never counts.

    Call with a mask ``[H, W]`` (any integer dtype) and an optional ``torch.Generator``; it
    returns a :class:`Box` of size ``min(patch, image)`` per side.

    Raises:
        ValueError: bad ``patch_size``, ``foreground_prob`` outside ``[0, 1]``, or
            ``foreground_prob > 0`` with no ``foreground_classes``.
    """

    def __init__(self, patch_size: int | Sequence[int], foreground_prob: float = 0.0,
                 foreground_classes: Sequence[int] = (1,)) -> None:
        self.patch = as_pair(patch_size, "data.patch_size")
        if not 0.0 <= float(foreground_prob) <= 1.0:
            raise ValueError(f"data.foreground_prob must be in [0, 1], got {foreground_prob}")
        self.foreground_prob = float(foreground_prob)
        self.foreground_classes = tuple(int(c) for c in foreground_classes)
        if self.foreground_prob > 0 and not self.foreground_classes:
            raise ValueError("data.foreground_classes is empty but data.foreground_prob > 0")

    def foreground(self, mask: torch.Tensor) -> torch.Tensor:
        """Bool ``[H, W]``: pixels whose class is one of ``foreground_classes``."""
        hit = torch.zeros(mask.shape, dtype=torch.bool)
        for index in self.foreground_classes:
            hit |= mask == index
        return hit

    def __call__(self, mask: torch.Tensor, generator: torch.Generator | None = None) -> Box:
        height, width = mask.shape[-2:]
        ph, pw = min(self.patch[0], height), min(self.patch[1], width)
        draw = torch.rand(1, generator=generator).item()
        if self.foreground_prob > 0 and draw < self.foreground_prob:
            rows, cols = torch.nonzero(self.foreground(mask), as_tuple=True)
            if rows.numel():
                pick = int(torch.randint(rows.numel(), (1,), generator=generator))
                top = min(max(int(rows[pick]) - ph // 2, 0), height - ph)
                left = min(max(int(cols[pick]) - pw // 2, 0), width - pw)
                return Box(top, left, ph, pw)
        top = int(torch.randint(height - ph + 1, (1,), generator=generator))
        left = int(torch.randint(width - pw + 1, (1,), generator=generator))
        return Box(top, left, ph, pw)


def crop_pad(tensor: torch.Tensor, box: Box, size: tuple[int, int], fill: float | int
             ) -> torch.Tensor:
    """Crop ``tensor [..., H, W]`` to ``box``, then pad bottom/right with ``fill`` to ``size``.

    Returns a new tensor ``[..., size[0], size[1]]`` of the same dtype.
    """
    crop = tensor[..., box.top:box.top + box.height, box.left:box.left + box.width]
    if (box.height, box.width) == tuple(size):
        return crop.clone()
    out = torch.full((*tensor.shape[:-2], *size), fill, dtype=tensor.dtype)
    out[..., :box.height, :box.width] = crop
    return out
