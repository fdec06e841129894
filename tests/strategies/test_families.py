"""Guarantees of GUIDE.md sec. 3, parametrised over strategy x model family.

Families: smp U-Net with a ResNet encoder (BatchNorm, in-place ReLU), smp U-Net with a
``tu-`` timm encoder (``features_only``), a timm ViT (dropout, drop path), the GPT block
stack (dropout inside and outside attention) with learned and with rotary positions, and the
ViT segmenter (timm ViT encoder + BatchNorm upsampling decoder).
"""

from __future__ import annotations

import copy

import pytest
import torch

from remat.strategies import build_strategy
from tests.strategies.common import count_calls
from tests.strategies.families import build

STRATEGIES = [("full", {}), ("sqrtn", {}), ("every_k", {"k": 2}),
              ("selective", {"policy": "matmul"}), ("selective", {"policy": "attention"}),
              ("offload", {}), ("offload", {"segments": "sqrtn"})]


# the families of this matrix (tests/strategies/families.py builds these and more)
FAMILIES = ["unet_resnet", "unet_timm", "vit", "gpt", "gpt_rotary", "vit_seg"]
_CACHE: dict[str, tuple] = {}


def _family(name):
    if name not in _CACHE:
        family = build(name)
        _CACHE[name] = (family.model, family.stages, family.make_input().args[0])
    model, stages, x = _CACHE[name]
    return copy.deepcopy(model), stages, x


def _run(model, x, steps=2, seed=7, autocast=False, freeze_first=False):
    """SGD steps with dropout active; returns outputs, grads and state of the last step."""
    model.train()
    if freeze_first:
        next(iter(model.children())).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    torch.manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = out.float().square().mean()
        loss.backward()
        grads = {n: (None if p.grad is None else p.grad.float().clone())
                 for n, p in model.named_parameters()}
        opt.step()
    return out.detach().float(), loss.detach(), grads, copy.deepcopy(model.state_dict())


def _pair(family, strategy, overrides, **kw):
    model, stages, x = _family(family)
    ref = _run(copy.deepcopy(model), x, **kw)
    build_strategy(strategy, **overrides).apply(model, stages)
    return ref, _run(model, x, **kw), model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy,overrides", STRATEGIES)
def test_same_function_same_dropout_same_batchnorm_stats(family, strategy, overrides):
    (ref_out, ref_loss, ref_grads, ref_state), (out, loss, grads, state), _ = _pair(
        family, strategy, overrides)
    assert torch.equal(out, ref_out)
    assert torch.equal(loss, ref_loss)
    for key, grad in ref_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6, msg=key)
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():  # BatchNorm running stats, num_batches_tracked
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy,overrides", STRATEGIES[:2])
def test_frozen_first_module_keeps_none_gradients(family, strategy, overrides):
    (_, _, ref_grads, _), (_, _, grads, _), model = _pair(family, strategy, overrides,
                                                          steps=1, freeze_first=True)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen
    for key, grad in ref_grads.items():
        if key in frozen:
            assert grad is None and grads[key] is None, key
        else:
            assert grads[key] is not None, key
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_gradients_within_bf16_tolerance(family):
    (_, _, ref_grads, _), (_, _, grads, _), _ = _pair(family, "sqrtn", {}, steps=1,
                                                      autocast=True)
    for key, grad in ref_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=2e-2, atol=2e-2, msg=key)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy,overrides", STRATEGIES)
def test_recompute_happens_on_the_code_path_used_and_not_in_eval(family, strategy, overrides):
    model, stages, x = _family(family)
    report = build_strategy(strategy, **overrides).apply(model, stages)
    blocks = [model.get_submodule(p) for p in report.wrapped]
    calls, handles = count_calls(blocks, inner=True)
    model.train()
    model(x).float().sum().backward()
    assert [calls[id(b)] for b in blocks] == [2] * len(blocks)  # forward + recompute
    ref = copy.deepcopy(model)
    build_strategy("none").apply(ref, stages)
    model.eval()
    ref.eval()
    out = model(x)
    out.float().sum().backward()
    assert [calls[id(b)] for b in blocks] == [3] * len(blocks)  # eval: no recompute
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    for h in handles:
        h.remove()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy,overrides", STRATEGIES)
def test_apply_twice_is_once_remove_restores_state_dict_keys_stable(family, strategy,
                                                                    overrides):
    model, stages, x = _family(family)
    keys = list(model.state_dict())
    strategy = build_strategy(strategy, **overrides)
    assert strategy.apply(model, stages) == strategy.apply(model, stages)
    assert list(model.state_dict()) == keys
    fresh, _, _ = _family(family)
    fresh.load_state_dict(model.state_dict())
    strategy.remove(model)
    patched = [n for n, m in model.named_modules() if "forward" in vars(m)]
    assert patched == []
