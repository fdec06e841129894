"""Peak memory of a model with frozen parameters (a LoRA base, a frozen encoder): measured,
and without the gradients the frozen parameters do not get."""

from __future__ import annotations

import copy

import torch
from torch import nn

from remat.measure import PeakMemory


def _peak(model: nn.Module, x: torch.Tensor) -> tuple[int, dict[str, int]]:
    with PeakMemory("cpu", modules=[model]) as peak:
        model(x).sum().backward()
    return peak.peak_bytes, peak.breakdown


def test_frozen_parameters_are_measured_without_their_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(500, 64), nn.Linear(64, 256), nn.ReLU(),
                          nn.Linear(256, 500))
    x = torch.randint(0, 500, (4, 32))
    trained, _ = _peak(copy.deepcopy(model), x)
    frozen = copy.deepcopy(model)
    frozen[0].weight.requires_grad_(False)  # embeddings, as LoRA fine-tuning freezes them
    frozen[1].requires_grad_(False)
    peak, _ = _peak(frozen, x)
    assert frozen[0].weight.grad is None and frozen[3].weight.grad is not None
    # the frozen weights get no gradient: at least the embedding's 500 x 64 fp32 less
    assert trained - peak >= 500 * 64 * 4
    assert peak > sum(p.numel() * 4 for p in model.parameters())  # weights still counted
