"""A plain ViT segmenter for high-resolution inputs: timm ViT encoder + light upsampling decoder.

The encoder is timm's ``VisionTransformer`` (Dosovitskiy et al. 2021, arXiv 2010.11929), random
init, no class token: an ``H x W`` image becomes ``(H/p) * (W/p)`` patch tokens (4096 for
1024 x 1024 with ``p = 16``) that run through ``encoder.blocks``, one ``nn.Sequential`` chain,
so every remat strategy applies to it (stage ``encoder.blocks``). The decoder follows SETR's
progressive upsampling (SETR-PUP, Zheng et al. 2021, arXiv 2012.15840): the tokens are
reshaped to their ``H/p x W/p`` grid, then each stage doubles the resolution (bilinear) and
applies a 3x3 convolution, BatchNorm and ReLU; a 1x1 convolution gives the class logits and a
last bilinear resize of the logits reaches the input size when ``p`` is not
``2 ** len(decoder_channels)``. The default two stages end at 1/4 of the input resolution
(like most segmentation heads), so at 1024 px the decoder does not hold full-resolution
feature maps and the encoder's activations dominate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from remat.data.sizes import as_pair


class ViTSegmenter(nn.Module):
    """ViT encoder + progressive upsampling decoder: ``[B, in_channels, H, W]`` ->
    logits ``[B, num_classes, H, W]``; ``H`` and ``W`` must be multiples of ``patch_size``.

    Args:
        img_size: side of the training images, or ``[h, w]`` (px); sizes the learned position
            table, which timm resamples for other multiples of ``patch_size``
            (``dynamic_img_size``).
        patch_size: patch side (px), 16 as in ViT-B/16.
        in_channels, num_classes: input channels; output channels (1 for binary).
        embed_dim, depth, num_heads, mlp_ratio: encoder width, blocks, heads, MLP ratio
            (ViT-Ti: 192, 12, 3, 4; ViT-S: 384, 12, 6, 4).
        decoder_channels: channels of the upsampling stages (each stage x2 resolution; the
            logits are then resized to the input size).
        drop_rate, attn_drop_rate, drop_path_rate: encoder dropout, attention dropout,
            stochastic depth.

    Raises:
        ValueError: ``img_size`` not a multiple of ``patch_size`` (names
            ``model.net.img_size``); sizes < 1; empty ``decoder_channels``; at forward, an
            input whose side is not a multiple of ``patch_size`` (names the size, the patch
            and ``data.image_size``).
    """

    def __init__(self, img_size: int | Sequence[int] = 1024, patch_size: int = 16,
                 in_channels: int = 3,
                 num_classes: int = 1, embed_dim: int = 192, depth: int = 12,
                 num_heads: int = 3, mlp_ratio: float = 4.0,
                 decoder_channels: Sequence[int] = (128, 64), drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        shown = img_size if isinstance(img_size, int) else list(img_size)
        img_size = as_pair(img_size, "model.net.img_size")  # a side or [h, w] (px)
        if min(*img_size, patch_size, in_channels, num_classes, embed_dim, depth,
               num_heads) < 1:
            raise ValueError("ViTSegmenter sizes (img_size, patch_size, in_channels, "
                             "num_classes, embed_dim, depth, num_heads) must all be >= 1")
        if img_size[0] % patch_size or img_size[1] % patch_size:
            raise ValueError(f"model.net.img_size={shown} is not divisible by "
                             f"model.net.patch_size={patch_size}; use a multiple of {patch_size}")
        if embed_dim % num_heads:
            raise ValueError(f"model.net.embed_dim={embed_dim} must be divisible by "
                             f"model.net.num_heads={num_heads}")
        if not decoder_channels or min(decoder_channels) < 1:
            raise ValueError(f"model.net.decoder_channels must be a non-empty list of "
                             f"positive ints, got {list(decoder_channels)}")
        self.patch_size = patch_size
        self.encoder = VisionTransformer(
            img_size=img_size, patch_size=patch_size, in_chans=in_channels, num_classes=0,
            global_pool="", embed_dim=embed_dim, depth=depth, num_heads=num_heads,
            mlp_ratio=mlp_ratio, class_token=False, dynamic_img_size=True,
            pos_drop_rate=drop_rate, proj_drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
            drop_path_rate=drop_path_rate)
        stages, channels = [], embed_dim
        for out in decoder_channels:
            stages.append(nn.Sequential(
                nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                nn.Conv2d(channels, out, 3, padding=1, bias=False),
                nn.BatchNorm2d(out), nn.ReLU(inplace=True)))
            channels = out
        self.decoder = nn.Sequential(*stages)
        self.head = nn.Conv2d(channels, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> logits ``[B, num_classes, H, W]``."""
        h, w = x.shape[-2:]
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(
                f"ViTSegmenter input {h}x{w} px is not divisible by the patch size {p} "
                f"(model.net.patch_size); set data.image_size to a multiple of {p}"
            )
        tokens = self.encoder.forward_features(x)  # [B, (H/p)(W/p), D]
        grid = tokens.transpose(1, 2).reshape(x.shape[0], -1, h // p, w // p)
        logits = self.head(self.decoder(grid))
        if logits.shape[-2:] != (h, w):
            logits = F.interpolate(logits, size=(h, w), mode="bilinear", align_corners=False)
        return logits
