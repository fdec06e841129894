"""Networks a user might bring, importable by ``_target_`` from configs in the tests."""

from __future__ import annotations

import torch
from torch import nn


def _block(c_in: int, c_out: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


class ConvBlock(nn.Module):
    """Two convolutions with BatchNorm: a module with children and no chain of its own."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.norm2 = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(x)))


class TinyUNet(nn.Module):
    """A plain two-level U-Net: ``[B, in_channels, H, W]`` -> ``[B, out_channels, H, W]``
    (H, W even); its own attribute names, no chain at the top."""

    def __init__(self, in_channels: int = 3, out_channels: int = 1, width: int = 8) -> None:
        super().__init__()
        self.down1 = ConvBlock(in_channels, width)
        self.down2 = ConvBlock(width, 2 * width)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.fuse = ConvBlock(2 * width, width)
        self.head = nn.Conv2d(width, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down1(x)
        deep = self.down2(nn.functional.max_pool2d(skip, 2))
        return self.head(self.fuse(torch.cat([self.up(deep), skip], dim=1)))


class ReturnsTuple(TinyUNet):
    """Deep-supervision style: returns ``(logits, aux)``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().forward(x)
        return out, out


class RunsChildren(TinyUNet):
    """A parent that runs ``down2``'s children itself: ``down2``'s own forward never runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down1(x)
        d = self.down2
        deep = nn.functional.max_pool2d(skip, 2)
        deep = torch.relu(d.norm2(d.conv2(torch.relu(d.norm1(d.conv1(deep))))))
        return self.head(self.fuse(torch.cat([self.up(deep), skip], dim=1)))


class ReturnsDict(TinyUNet):
    """A mapping under keys no library uses for its logits."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(x)
        return {"main": out, "aux": out}


class ElementwiseBlock(nn.Module):
    """Four ``sin`` steps: every step saves its input, none is a matmul or convolution, so
    recomputing the block costs no counted FLOPs. Shapes: ``(B, C, H, W) -> same``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.sin(x) * 1.5
        return x


class PinnedPeakNet(nn.Module):
    """A stem convolution, a chain of :class:`ElementwiseBlock` (many saved bytes, no
    FLOPs) and a wide full-resolution head whose backward sets the peak of every plan that
    recomputes the chain, kept or recomputed itself (as SwinUNETR's last decoder block
    does). Shapes: ``(B, in_channels, H, W) -> (B, out_channels, H, W)``."""

    def __init__(self, in_channels: int = 3, out_channels: int = 1, width: int = 8,
                 depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.blocks = nn.Sequential(*[ElementwiseBlock() for _ in range(depth)])
        self.head = nn.Sequential(nn.Conv2d(width, 8 * width, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8 * width, 8 * width, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8 * width, out_channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def sequential_net(in_channels: int = 3, out_channels: int = 1, width: int = 8,
                   depth: int = 4) -> nn.Sequential:
    """A network that is itself an ``nn.Sequential`` of conv blocks and a 1x1 head:
    ``[B, in_channels, H, W]`` -> ``[B, out_channels, H, W]``."""
    blocks = [_block(in_channels, width)] + [_block(width, width) for _ in range(depth - 1)]
    return nn.Sequential(*blocks, nn.Conv2d(width, out_channels, 1))


class LeafNet(nn.Module):
    """Three convolutions held as attributes, no module with children:
    ``[B, in_channels, H, W]`` -> ``[B, out_channels, H, W]``."""

    def __init__(self, in_channels: int = 3, out_channels: int = 1, width: int = 8) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(in_channels, width, 3, padding=1)
        self.c2 = nn.Conv2d(width, width, 3, padding=1)
        self.c3 = nn.Conv2d(width, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c3(torch.relu(self.c2(torch.relu(self.c1(x)))))


class AddPos(nn.Module):
    """A block with parameters that writes its input in place (``x += self.pos``) before
    its convolution: ``[B, C, H, W]`` -> ``[B, C, H, W]``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, width, 1, 1) * 0.1)
        self.conv, self.norm = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += self.pos
        return x + torch.relu(self.norm(self.conv(x)))


class AddPosNet(nn.Module):
    """A stem, a chain ``blocks`` of :class:`AddPos` and a 1x1 head:
    ``[B, in_channels, H, W]`` -> ``[B, out_channels, H, W]``."""

    def __init__(self, in_channels: int = 3, out_channels: int = 1, width: int = 8,
                 depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.blocks = nn.Sequential(*[AddPos(width) for _ in range(depth)])
        self.head = nn.Conv2d(width, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def layer_chain(in_channels: int = 3, out_channels: int = 1, width: int = 8,
                depth: int = 3) -> nn.Sequential:
    """A network that is one ``nn.Sequential`` of lone layers (conv, BatchNorm, in-place
    ReLU, ..., a 1x1 head): ``[B, in_channels, H, W]`` -> ``[B, out_channels, H, W]``."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Conv2d(in_channels if i == 0 else width, width, 3, padding=1),
                   nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.Conv2d(width, out_channels, 1))
