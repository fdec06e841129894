"""The wrapped model computes the same function as the unwrapped one (GUIDE.md sec. 3)."""

import copy

import pytest
import segmentation_models_pytorch as smp
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.strategies import build_strategy
from tests.strategies import axes
from tests.strategies.common import count_calls

STAGES = ["encoder.layer*"]
# every strategy that, with its defaults, recomputes segments of a chain
SEGMENT_STRATEGIES = axes.names(axes.recomputing)


def _train_steps(model, x, steps=3):
    """A few SGD steps; returns last output, grads, state_dict (BN stats included)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        (out.square().mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return out.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", SEGMENT_STRATEGIES)
def test_unet_outputs_gradients_and_batchnorm_stats_equal_none(unet, name):
    x = torch.randn(2, 3, 64, 64)
    ref = _train_steps(copy.deepcopy(unet), x)
    model = copy.deepcopy(unet)
    report = build_strategy(name).apply(model, STAGES)
    assert report.wrapped and len(report.segments) == 4
    out, grads, state = _train_steps(model, x)
    assert torch.equal(out, ref[0])
    assert grads.keys() == ref[1].keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref[1][key], rtol=1e-5, atol=1e-6)
    assert state.keys() == ref[2].keys()
    for key, value in state.items():
        assert torch.equal(value, ref[2][key]), key
    assert int(state["encoder.layer1.0.bn1.num_batches_tracked"]) == 3


def test_plain_torch_checkpoint_would_double_count_batchnorm(unet):
    """Control: without remat's guard the recompute updates BatchNorm a second time."""
    model = copy.deepcopy(unet).train()
    layer = model.encoder.layer1
    out = checkpoint(layer, torch.randn(2, 64, 16, 16, requires_grad=True), use_reentrant=False)
    out.sum().backward()
    assert int(layer[0].bn1.num_batches_tracked) == 2




@pytest.mark.parametrize("name", SEGMENT_STRATEGIES)
def test_recompute_happens_in_training_and_not_in_eval_or_no_grad(unet, name):
    model = copy.deepcopy(unet)
    build_strategy(name).apply(model, STAGES)
    blocks = list(model.encoder.layer2)
    counts, handles = count_calls(blocks, inner=True)
    x = torch.randn(2, 3, 64, 64)
    model.train()
    model(x).sum().backward()
    assert [counts[id(b)] for b in blocks] == [2] * len(blocks)  # forward + recompute
    for key in counts:
        counts[key] = 0
    model.eval()
    ref = copy.deepcopy(model)
    build_strategy("none").apply(ref, STAGES)
    out = model(x)
    out.sum().backward()
    assert [counts[id(b)] for b in blocks] == [1] * len(blocks)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert [counts[id(b)] for b in blocks] == [2] * len(blocks)  # eval fwd+bwd, no_grad fwd
    model.train()
    with torch.no_grad():
        model(x)
    assert [counts[id(b)] for b in blocks] == [3] * len(blocks)  # no recompute under no_grad
    for h in handles:
        h.remove()


def test_apply_twice_equals_once_and_remove_restores(unet):
    model = copy.deepcopy(unet)
    keys = list(model.state_dict())
    strategy = build_strategy("sqrtn")
    first = strategy.apply(model, STAGES)
    second = strategy.apply(model, STAGES)
    assert first == second
    assert list(model.state_dict()) == keys
    counts, handles = count_calls(list(model.encoder.layer1), inner=True)
    model.train()
    model(torch.randn(1, 3, 64, 64)).sum().backward()
    assert [counts[id(b)] for b in model.encoder.layer1] == [2, 2]  # recomputed once, not twice
    strategy.remove(model)
    assert "forward" not in vars(model.encoder.layer1)
    for key in counts:
        counts[key] = 0
    model(torch.randn(1, 3, 64, 64)).sum().backward()
    assert [counts[id(b)] for b in model.encoder.layer1] == [1] * len(model.encoder.layer1)
    for h in handles:
        h.remove()


def test_state_dict_loads_across_strategies(unet):
    wrapped = copy.deepcopy(unet)
    build_strategy("full").apply(wrapped, STAGES)
    plain = smp.Unet("resnet18", encoder_weights=None, classes=1,
                     decoder_channels=(32, 16, 16, 8, 8))
    plain.load_state_dict(wrapped.state_dict())  # strict: same keys
    wrapped.eval()
    plain.eval()
    x = torch.randn(1, 3, 64, 64)
    assert torch.equal(wrapped(x), plain(x))


def test_deepcopy_of_wrapped_model_runs_its_own_blocks(unet):
    model = copy.deepcopy(unet)
    build_strategy("sqrtn").apply(model, STAGES)
    clone = copy.deepcopy(model)
    assert clone.encoder.layer1.forward.__self__ is clone.encoder.layer1
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    clone.train()
    model.train()
    assert not torch.equal(clone(torch.randn(1, 3, 64, 64)), model(torch.randn(1, 3, 64, 64)))


class _Block(nn.Module):
    def __init__(self, width=16, p=0.3):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(torch.relu(self.fc(self.norm(x))))


@pytest.mark.parametrize("container", [nn.Sequential, nn.ModuleList])
@pytest.mark.parametrize("name", SEGMENT_STRATEGIES)
def test_dropout_masks_and_inputs_without_grad(container, name):
    torch.manual_seed(0)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(16, 16)
            blocks = [_Block() for _ in range(5)]
            self.blocks = (nn.Sequential(*blocks) if container is nn.Sequential
                           else nn.ModuleList(blocks))

        def forward(self, x):
            x = self.stem(x)
            if isinstance(self.blocks, nn.Sequential):
                return self.blocks(x)
            for block in self.blocks:
                x = block(x)
            return x

    base = Stack()
    base.stem.requires_grad_(False)  # frozen stem: block inputs do not require grad
    x = torch.randn(4, 16)  # input without grad
    results = []
    for strategy in ("none", name):
        model = copy.deepcopy(base).train()
        build_strategy(strategy).apply(model, ["blocks"])
        torch.manual_seed(123)
        out = model(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_out, ref_grads), (out, grads) = results
    assert torch.equal(out, ref_out)
    for key, grad in ref_grads.items():
        if key.startswith("stem."):
            assert grad is None and grads[key] is None
        else:
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_gradients_within_bf16_tolerance(unet):
    x = torch.randn(2, 3, 64, 64)
    results = []
    for name in ("none", "sqrtn"):
        model = copy.deepcopy(unet).train()
        build_strategy(name).apply(model, STAGES)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
        results.append({n: p.grad.float() for n, p in model.named_parameters()})
    for key, grad in results[0].items():
        torch.testing.assert_close(results[1][key], grad, rtol=2e-2, atol=2e-2)
