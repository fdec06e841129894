import pytest
from torch import nn

from remat.strategies import StageError, build_strategy, resolve_stages


def _net():
    enc = nn.Module()
    for i in range(1, 4):
        setattr(enc, f"layer{i}", nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    enc.stem = nn.Linear(4, 4)
    net = nn.Module()
    net.encoder = enc
    net.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    return net


def test_glob_matches_per_dotted_component_in_model_order():
    names = [p for p, _ in resolve_stages(_net(), ["encoder.layer*"])]
    assert names == ["encoder.layer1", "encoder.layer2", "encoder.layer3"]


def test_duplicates_collapse():
    names = [p for p, _ in resolve_stages(_net(), ["encoder.layer1", "encoder.layer?"])]
    assert names == ["encoder.layer1", "encoder.layer2", "encoder.layer3"]


def test_unknown_stage_lists_close_matches():
    with pytest.raises(StageError, match=r"'encoder.layr1' matches no module.*encoder\.layer1"):
        resolve_stages(_net(), ["encoder.layr1"])


def test_nested_stages_rejected():
    with pytest.raises(StageError, match="lies inside"):
        resolve_stages(_net(), ["encoder.layer1", "encoder.layer1.0"])


def test_segment_strategy_rejects_non_chain_and_names_chain_children():
    with pytest.raises(StageError, match=r"'encoder' is a Module, not an nn.Sequential.*"
                                         r"encoder\.layer1"):
        build_strategy("sqrtn").apply(_net(), ["encoder"])


def test_unknown_strategy_lists_valid_names():
    valid = "compile, every_k, full, none, offload, selective, sqrtn, timm_native"
    with pytest.raises(ValueError, match=f"unknown strategy 'sqrt'; valid strategies: {valid}"):
        build_strategy("sqrt")


def test_every_k_rejects_k_below_one():
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        build_strategy("every_k", k=0)


class _LoopsOverChildren(nn.Module):
    """A parent that iterates a Sequential's children itself (as some timm
    ``features_only`` models do), bypassing the Sequential's own forward."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU())
                                      for _ in range(3)])

    def forward(self, x):
        for stage in self.blocks:
            x = stage(x)
        return x


def test_verify_catches_a_chain_the_forward_bypasses():
    import torch

    model = _LoopsOverChildren()
    strategy = build_strategy("full")
    strategy.apply(model, ["blocks"])
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    with pytest.raises(StageError, match=r"never called it.*'blocks\.\*'"):
        strategy.verify(model)
    strategy.apply(model, ["blocks.*"])  # the children are called: fine
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    strategy.verify(model)
