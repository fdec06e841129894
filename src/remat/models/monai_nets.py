"""MONAI networks as segmentation nets (``monai.networks.nets``, random init).

:class:`SwinUNETR2D` / :class:`SwinUNETR3D` are MONAI's ``SwinUNETR`` (Hatamizadeh et al.
2022, arXiv 2201.01266) with ``spatial_dims=2`` / ``3``: a Swin transformer encoder of
four stages (shifted-window attention, patch merging) and a U-Net-like convolutional
decoder. The strategy wraps each stage's Swin
blocks, ``swinViT.layers1.0.blocks`` ... ``swinViT.layers4.0.blocks`` (glob
``swinViT.layers*.0.blocks``): ``nn.ModuleList``s that the stage walks as
``x = blk(x, attn_mask)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from monai.networks.nets import SwinUNETR


class SwinUNETR2D(SwinUNETR):
    """MONAI ``SwinUNETR`` for 2D images: ``[B, in_channels, H, W]`` -> logits
    ``[B, num_classes, H, W]``, with sizes checked against the config keys.

    The encoder halves the resolution five times (patch embedding with ``patch_size=2``, then
    four stages), so ``H`` and ``W`` must be multiples of ``2**5 = 32``; with instance norm
    (MONAI's default ``norm_name``) the 1/32 bottleneck must hold more than one pixel, so
    they must also be at least 64.

    Args:
        in_channels, num_classes: input channels; output channels (1 for binary).
        img_size: the training image side (px, ``data.image_size``) to check at build time,
            or ``None`` to check only at forward.
        feature_size, depths, num_heads, window_size, drop_rate, attn_drop_rate,
            dropout_path_rate, norm_name: ``SwinUNETR`` arguments (MONAI defaults: 24,
            (2, 2, 2, 2), (3, 6, 12, 24), 7, 0, 0, 0, ``"instance"``).
        use_checkpoint: MONAI's own per-block checkpointing; keep it off under a remat
            strategy (the two would nest).

    Raises:
        ValueError: ``img_size`` or, at forward, an input side that is not a multiple of 32
            (or below 64 with instance norm), naming ``data.image_size``.
    """

    spatial_dims = 2

    def __init__(self, in_channels: int = 3, num_classes: int = 1,
                 img_size: int | Sequence[int] | None = None,
                 feature_size: int = 24, depths: Sequence[int] = (2, 2, 2, 2),
                 num_heads: Sequence[int] = (3, 6, 12, 24), window_size: int = 7,
                 drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 dropout_path_rate: float = 0.0, norm_name: str | tuple = "instance",
                 use_checkpoint: bool = False) -> None:
        min_side = 64 if "instance" in str(norm_name).lower() else 32
        if img_size is not None:
            sides = [int(img_size)] * self.spatial_dims if isinstance(img_size, int) \
                else [int(v) for v in img_size]
            _check_sides(sides, min_side)
        super().__init__(in_channels=in_channels, out_channels=num_classes,
                         feature_size=feature_size, depths=tuple(depths),
                         num_heads=tuple(num_heads), window_size=window_size,
                         drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
                         dropout_path_rate=dropout_path_rate, norm_name=norm_name,
                         use_checkpoint=use_checkpoint, spatial_dims=self.spatial_dims)
        self.min_side = min_side

    def forward(self, x_in: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> logits ``[B, num_classes, H, W]`` (3D: ``[B, C, D, H, W]``)."""
        _check_sides([int(v) for v in x_in.shape[2:]], self.min_side)
        return super().forward(x_in)


class SwinUNETR3D(SwinUNETR2D):
    """MONAI ``SwinUNETR`` for volumes: ``[B, in_channels, D, H, W]`` -> logits
    ``[B, num_classes, D, H, W]`` (the 3D network of the paper; 62 M parameters at
    ``feature_size=48``). Sides: multiples of 32, at least 64 with instance norm, as for
    :class:`SwinUNETR2D`; ``img_size`` is ``data.patch_size`` (``[d, h, w]`` voxels).
    Same arguments and errors as :class:`SwinUNETR2D`."""

    spatial_dims = 3


def _check_sides(sides: list[int], min_side: int) -> None:
    if any(v % 32 for v in sides) or min(sides) < min_side:
        least = " and at least 64 with instance norm" if min_side == 64 else ""
        key = "data.image_size" if len(sides) == 2 else "data.patch_size"
        unit = "px" if len(sides) == 2 else "voxels"
        raise ValueError(
            f"SwinUNETR input {'x'.join(map(str, sides))} {unit}: each side must be a "
            f"multiple of 32 (2**5: five 2x downsamplings){least}; set {key} to e.g. "
            f"{max(min_side, -(-max(sides) // 32) * 32)}")
