"""Helpers shared by the strategy tests."""

from __future__ import annotations

import collections

import torch
from torch import nn


def first_inner(module: nn.Module) -> nn.Module:
    """The first descendant of ``module`` with parameters of its own (``module`` itself if
    there is none): remat's recompute runs a unit's ``forward``, not its ``__call__``, so the
    unit's own hooks run once per step and its children's run again in the recompute."""
    for child in module.modules():
        if child is not module and any(True for _ in child.parameters(recurse=False)):
            return child
    return module


def count_calls(modules: list[nn.Module], inner: bool = False):
    """Count calls of each module (keyed by ``id``) with forward PRE-hooks: a recompute may
    stop early, before forward hooks fire. With ``inner``, a module's calls are those of
    :func:`first_inner` of it (what a recompute calls again). Returns ``(counts, handles)``."""
    counts = collections.Counter({id(m): 0 for m in modules})
    hooked = {id(first_inner(m) if inner else m): id(m) for m in modules}

    def hook(module, args):  # keyed by the module called: a deep copy counts apart
        key = id(module)
        counts[hooked.get(key, key)] += 1

    return counts, [(first_inner(m) if inner else m).register_forward_pre_hook(hook)
                    for m in modules]


def train_step(model: nn.Module, x: torch.Tensor, seed: int = 123):
    """One training forward + backward under ``seed``: output, gradients (params that got
    one) and ``state_dict`` (BatchNorm statistics included), all copied."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_function(got, ref, rtol: float = 1e-5, atol: float = 1e-6,
                         exact_output: bool = False) -> None:
    """``got``/``ref`` from :func:`train_step`: outputs (exactly, or within tolerance) and
    gradients within tolerance."""
    if exact_output:
        assert torch.equal(got[0], ref[0])
    else:
        torch.testing.assert_close(got[0], ref[0], rtol=rtol, atol=atol)
    assert got[1].keys() == ref[1].keys()
    for key, grad in got[1].items():
        torch.testing.assert_close(grad, ref[1][key], rtol=rtol, atol=atol, msg=key)


def sgd_steps(model: nn.Module, x: torch.Tensor, steps: int = 2, seed: int | None = None):
    """``steps`` SGD steps in train mode (dropout, BatchNorm), seeded first when ``seed`` is
    given: the last output, the last gradients by name, and the ``state_dict`` after."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if seed is not None:
        torch.manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return out.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}
