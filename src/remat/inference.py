"""Full-resolution sliding-window inference for segmentation networks.

Large tiles (a 5000 x 5000 Inria tile, a 2149 x 1479 Dubai image) do not fit a network in
one pass, and a model trained on patches sees patch-sized context anyway. The image is cut
into overlapping windows of ``patch_size``; the windows run through the network in batches
under ``torch.no_grad``; each window's logits are weighted by a blending window that is
highest at its centre and the weighted logits of overlapping windows are averaged. This is
the scheme of nnU-Net (Isensee et al. 2021, Nature Methods 18:203, "Gaussian importance
weighting", sigma = 1/8 of the patch size) and of MONAI's ``sliding_window_inference``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from remat.data.sizes import as_pair, as_spatial

BLENDS = ("gaussian", "constant")


@dataclass(frozen=True)
class SlidingWindow:
    """Settings of :func:`sliding_window_inference` (the ``model.inference`` config node).

    Attributes:
        patch_size: window side in pixels (an int, or ``[height, width]``; see
            :func:`remat.data.sizes.as_pair`); for volumes an int (cube) or
            ``[depth, height, width]`` voxels.
        overlap: fraction of a window shared with its neighbour, in ``[0, 1)``; the stride is
            ``ceil(patch * (1 - overlap))`` pixels.
        batch_size: windows per forward pass (changes speed and memory, not the result).
        blend: ``"gaussian"`` (nnU-Net weighting, sigma = patch / 8) or ``"constant"`` (plain
            mean of the overlapping logits).
        size_divisor: images smaller than a window are padded (reflect) up to a multiple of
            this, so encoders that downsample 32x still get a valid input; 32 suits smp U-Nets.
    """

    patch_size: int | tuple[int, ...]
    overlap: float = 0.25
    batch_size: int = 4
    blend: str = "gaussian"
    size_divisor: int = 32

    def __post_init__(self) -> None:
        size = self.patch_size
        volume = isinstance(size, Sequence) and not isinstance(size, str) and len(size) == 3
        if not volume:
            as_pair(size, "model.inference.patch_size")  # raises naming the key
        else:
            as_spatial(size, 3, "model.inference.patch_size")
        if not 0.0 <= self.overlap < 1.0:
            raise ValueError(f"model.inference.overlap must be in [0, 1), got {self.overlap}")
        if self.batch_size < 1:
            raise ValueError(f"model.inference.batch_size must be >= 1, got {self.batch_size}")
        if self.blend not in BLENDS:
            raise ValueError(f"model.inference.blend must be one of {BLENDS}, got {self.blend!r}")
        if self.size_divisor < 1:
            raise ValueError(
                f"model.inference.size_divisor must be >= 1, got {self.size_divisor}")

    @property
    def patch(self) -> tuple[int, int]:
        """``(height, width)`` of a window in pixels."""
        return as_pair(self.patch_size, "model.inference.patch_size")

    def spatial(self, dims: int) -> tuple[int, ...]:
        """The window's sides for ``dims`` spatial axes (2: pixels, 3: voxels).

        Raises:
            ValueError: ``patch_size`` has another number of sides than ``dims``.
        """
        return as_spatial(self.patch_size, dims, "model.inference.patch_size")


def window_starts(length: int, window: int, overlap: float) -> list[int]:
    """Start offsets of windows of ``window`` pixels covering ``[0, length)``.

    The stride is ``ceil(window * (1 - overlap))``; the last window is moved back so it ends
    exactly at ``length`` (no window leaves the image). ``length <= window`` gives ``[0]``.
    """
    if length <= window:
        return [0]
    stride = max(1, math.ceil(window * (1.0 - overlap)))
    starts = list(range(0, length - window, stride))
    starts.append(length - window)
    return starts


def blend_weights(height: int, width: int, blend: str, device: torch.device | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Blending window ``[height, width]`` with positive entries.

    ``"gaussian"``: a separable Gaussian centred on the window, sigma = 1/8 of each side
    (nnU-Net, Isensee et al. 2021), normalised to a maximum of 1 and clamped below at 1e-3 so
    image borders covered by one window's edge keep a defined value. ``"constant"``: ones.
    """
    if blend == "constant":
        return torch.ones(height, width, device=device, dtype=dtype)

    def axis(n: int) -> torch.Tensor:
        centre = (n - 1) / 2.0
        sigma = max(n / 8.0, 1e-6)
        x = torch.arange(n, device=device, dtype=torch.float64)
        return torch.exp(-0.5 * ((x - centre) / sigma) ** 2)

    weights = axis(height)[:, None] * axis(width)[None, :]
    return (weights / weights.max()).clamp_min(1e-3).to(dtype)


def _pad_to(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    pad_h, pad_w = height - images.shape[-2], width - images.shape[-1]
    if pad_h == 0 and pad_w == 0:
        return images
    mode = "reflect" if pad_h < images.shape[-2] and pad_w < images.shape[-1] else "replicate"
    return F.pad(images, (0, pad_w, 0, pad_h), mode=mode)


@torch.no_grad()
def sliding_window_inference(net: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                             window: SlidingWindow) -> torch.Tensor:
    """Logits of ``net`` over whole images, computed window by window.

    Args:
        net: maps ``[N, C_in, h, w]`` to logits ``[N, C_out, h, w]`` (same spatial size).
        images: ``[B, C_in, H, W]``, any ``H``, ``W``.
        window: patch size, overlap, windows per forward pass, blending.

    Returns:
        Logits ``[B, C_out, H, W]`` (float32, on ``images.device``). Where windows overlap,
        ``sum(w * logits) / sum(w)`` with ``w`` from :func:`blend_weights`. A side shorter than
        the window is padded (reflect) to a multiple of ``window.size_divisor`` and the window
        shrinks to that size, so when one window covers the image the result is the plain
        forward pass ``net(images)``.

    Raises:
        ValueError: ``images`` is not 4-D, or ``net`` changes the spatial size of a window.
    """
    if images.ndim != 4:
        raise ValueError(f"sliding_window_inference expects images [B, C, H, W], got shape "
                         f"{tuple(images.shape)}")
    batch, _, height, width = images.shape
    div = window.size_divisor
    win_h = min(window.patch[0], math.ceil(height / div) * div)
    win_w = min(window.patch[1], math.ceil(width / div) * div)
    padded = _pad_to(images, max(height, win_h), max(width, win_w))
    full_h, full_w = padded.shape[-2:]
    corners = [(top, left) for top in window_starts(full_h, win_h, window.overlap)
               for left in window_starts(full_w, win_w, window.overlap)]
    weights = blend_weights(win_h, win_w, window.blend, device=images.device)
    out: torch.Tensor | None = None
    norm = torch.zeros(1, 1, full_h, full_w, device=images.device)
    per_pass = max(1, window.batch_size // batch)  # window positions per forward pass
    for first in range(0, len(corners), per_pass):
        chunk = corners[first:first + per_pass]
        crops = torch.cat([padded[..., t:t + win_h, c:c + win_w] for t, c in chunk])
        logits = net(crops).float()
        if logits.shape[-2:] != (win_h, win_w):
            raise ValueError(f"the network returned logits of spatial size "
                             f"{tuple(logits.shape[-2:])} for a window of {(win_h, win_w)}; "
                             "sliding-window inference needs same-size outputs")
        if out is None:
            out = torch.zeros(batch, logits.shape[1], full_h, full_w, device=images.device)
        for i, (top, left) in enumerate(chunk):
            part = logits[i * batch:(i + 1) * batch]
            out[..., top:top + win_h, left:left + win_w] += part * weights
            norm[..., top:top + win_h, left:left + win_w] += weights
    assert out is not None  # at least one window always exists
    if len(corners) == 1:  # one window: return the forward pass itself, bit for bit
        return logits[..., :height, :width].contiguous()
    return (out / norm)[..., :height, :width]


def volume_window_inference(net: Callable[[torch.Tensor], torch.Tensor], volumes: torch.Tensor,
                            window: SlidingWindow) -> torch.Tensor:
    """Logits ``[B, K, D, H, W]`` of whole volumes ``[B, C, D, H, W]`` by MONAI's
    ``sliding_window_inference`` (windows of ``window.spatial(3)`` voxels, ``overlap``,
    ``batch_size`` windows per pass, Gaussian or constant blending; volumes smaller than a
    window are padded and the logits cropped back), under ``torch.no_grad``."""
    from monai.inferers import sliding_window_inference as monai_windows

    with torch.no_grad():
        out = monai_windows(volumes, roi_size=window.spatial(3), sw_batch_size=window.batch_size,
                            predictor=net, overlap=window.overlap, mode=window.blend,
                            padding_mode="replicate")
    return torch.as_tensor(out)
