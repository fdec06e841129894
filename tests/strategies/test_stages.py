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


def test_a_stage_that_is_not_a_chain_is_one_unit():
    report = build_strategy("sqrtn").apply(_net(), ["encoder", "blocks"])
    assert report.wrapped == ["encoder", "blocks.0", "blocks.1", "blocks.2"]
    assert report.segments == {"encoder": [(0, 1)], "blocks": [(0, 2), (2, 3)]}


def test_unknown_strategy_lists_valid_names():
    valid = "compile, every_k, full, none, offload, selective, sqrtn, timm_native"
    with pytest.raises(ValueError, match=f"unknown strategy 'sqrt'; valid strategies: {valid}"):
        build_strategy("sqrt")


def test_every_k_rejects_k_below_one():
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        build_strategy("every_k", k=0)


class _RunsChildrenItself(nn.Module):
    """A parent that runs the children of a module itself (as timm ``features_only``
    wrappers do with their model's stages), so that module's own forward never runs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.body.__class__ = type("Body", (nn.Module,), {})  # a plain module, not a chain

    def forward(self, x):
        for layer in self.body.children():
            x = layer(x)
        return x


def test_a_bypassed_stage_warns_at_the_first_training_forward_and_verify_raises():
    import torch

    model = _RunsChildrenItself()
    strategy = build_strategy("full")
    strategy.apply(model, ["body"])
    with pytest.warns(UserWarning, match=r"wrapped body, but the training forward never called"):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    with pytest.raises(StageError, match=r"never called it.*'body\.\*'"):
        strategy.verify(model)
    strategy.apply(model, ["body.*"])  # the children are called: fine
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    strategy.verify(model)


def test_a_parent_looping_over_a_chain_calls_its_wrapped_members():
    import torch

    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU())
                                          for _ in range(3)])

        def forward(self, x):
            for stage in self.blocks:  # not blocks(x): the members are still called
                x = stage(x)
            return x

    model = Loop()
    strategy = build_strategy("sqrtn")
    strategy.apply(model, ["blocks"])
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    strategy.verify(model)
