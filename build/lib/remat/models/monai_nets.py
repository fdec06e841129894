"""MONAI networks as segmentation nets (``monai.networks.nets``, random init).

:class:`SwinUNETR2D` is MONAI's ``SwinUNETR`` (Hatamizadeh et al. 2022, arXiv 2201.01266)
with ``spatial_dims=2``: a Swin transformer encoder of four stages (shifted-window attention,
patch merging) and a U-Net-like convolutional decoder. The strategy wraps each stage's Swin
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

    def __init__(self, in_channels: int = 3, num_classes: int = 1, img_size: int | None = None,
                 feature_size: int = 24, depths: Sequence[int] = (2, 2, 2, 2),
                 num_heads: Sequence[int] = (3, 6, 12, 24), window_size: int = 7,
                 drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 dropout_path_rate: float = 0.0, norm_name: str | tuple = "instance",
                 use_checkpoint: bool = False) -> None:
        min_side = 64 if "instance" in str(norm_name).lower() else 32
        if img_size is not None:
            _check_side(int(img_size), int(img_size), min_side)
        super().__init__(in_channels=in_channels, out_channels=num_classes,
                         feature_size=feature_size, depths=tuple(depths),
                         num_heads=tuple(num_heads), window_size=window_size,
                         drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
                         dropout_path_rate=dropout_path_rate, norm_name=norm_name,
                         use_checkpoint=use_checkpoint, spatial_dims=2)
        self.min_side = min_side

    def forward(self, x_in: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> logits ``[B, num_classes, H, W]``."""
        _check_side(int(x_in.shape[-2]), int(x_in.shape[-1]), self.min_side)
        return super().forward(x_in)


def _check_side(h: int, w: int, min_side: int) -> None:
    if h % 32 or w % 32 or min(h, w) < min_side:
        least = " and at least 64 with instance norm" if min_side == 64 else ""
        raise ValueError(
            f"SwinUNETR input {h}x{w} px: each side must be a multiple of 32 (2**5: five 2x "
            f"downsamplings){least}; set data.image_size to e.g. "
            f"{max(min_side, -(-max(h, w) // 32) * 32)}")
