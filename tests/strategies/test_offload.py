"""``offload``: saved activations go to host memory; weights stay; the function stays the same.

This machine has no GPU, so the tests prove the mechanism on CPU with the strategy's test
switch that copies host tensors too (what a CUDA run copies): which tensors are moved (all
activations a stage saves, or only the segment inputs; never a weight), and that a moved
segment input has no other reference left, so on a GPU its device memory would be freed.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import remat.strategies.offload as offload_module
from remat.strategies import build_strategy
from remat.strategies.offload import HostOffload, OffloadCheckpoint, is_weight
from tests.strategies.test_selective import TinyGPT

UNET_STAGES = ["encoder.layer*"]
GPT_STAGES = ["blocks"]
MODES = {
    "alone": {},
    "full": {"segments": "full"},
    "sqrtn": {"segments": "sqrtn"},
    "every_k": {"segments": "every_k", "k": 2},
}
# The GPT runs every mode; the U-Net one mode of each kind.


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(depth=4)


@pytest.fixture
def packed(monkeypatch):
    """Shapes of the tensors the offload hooks move to host memory (copying on CPU too, as
    a CUDA run would)."""
    shapes: list[tuple[int, ...]] = []
    pack = HostOffload.pack

    def counting_pack(self, tensor):
        self.copy_host_tensors = True
        if self.moves(tensor):
            shapes.append(tuple(tensor.shape))
        return pack(self, tensor)

    monkeypatch.setattr(offload_module.HostOffload, "pack", counting_pack)
    return shapes


def _input(model_name: str, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    shape = (batch, 3, 64, 64) if model_name == "unet" else (batch, 16, 32)
    return torch.randn(shape, generator=gen)


def _stages(model_name):
    return UNET_STAGES if model_name == "unet" else GPT_STAGES


def _wrapped(base, model_name, strategy):
    model = copy.deepcopy(base)
    strategy.apply(model, _stages(model_name))
    return model






@pytest.mark.parametrize("model_name,mode", [("unet", "alone"), ("unet", "full"),
                                             ("gpt", "alone"), ("gpt", "full")])
def test_apply_twice_equals_once_and_remove_restores(unet, gpt, packed, model_name, mode):
    model = copy.deepcopy(unet if model_name == "unet" else gpt)
    keys = list(model.state_dict())
    strategy = OffloadCheckpoint(**MODES[mode])
    first = strategy.apply(model, _stages(model_name))
    second = strategy.apply(model, _stages(model_name))
    assert first == second and first.strategy == "offload"
    assert list(model.state_dict()) == keys
    x = _input(model_name, batch=1)
    model.train()
    model(x).sum().backward()
    once = len(packed)
    packed.clear()
    model(x).sum().backward()
    assert len(packed) == once  # not nested: each tensor packed once
    strategy.remove(model)
    assert all("forward" not in vars(m) for m in model.modules())
    assert list(model.state_dict()) == keys
    packed.clear()
    model(x).sum().backward()
    assert packed == []


def _segment_inputs(model, heads):
    """Shapes of the inputs of the segment heads in the first forward (not the recompute)."""
    shapes = []

    def hook(module, args):
        if len(shapes) < len(heads):
            shapes.append(tuple(args[0].shape))

    handles = [h.register_forward_pre_hook(hook) for h in heads]
    return shapes, handles


@pytest.mark.parametrize("model_name,mode", [("unet", "full"), ("unet", "every_k"),
                                             ("gpt", "full"), ("gpt", "sqrtn"),
                                             ("gpt", "every_k")])
def test_combined_mode_packs_only_the_segment_inputs(unet, gpt, packed, model_name, mode):
    model = copy.deepcopy(unet if model_name == "unet" else gpt)
    report = OffloadCheckpoint(**MODES[mode]).apply(model, _stages(model_name))
    chains = [model.get_submodule(path) for path in report.segments]
    heads = [chain[start] for chain, path in zip(chains, report.segments, strict=True)
             for start, _ in report.segments[path]]
    shapes, handles = _segment_inputs(model, heads)
    model.train()
    out = model(_input(model_name, batch=1))
    assert len(packed) == report.kept_boundaries == len(heads)  # one tensor per segment
    assert packed == shapes
    out.sum().backward()
    for h in handles:
        h.remove()


def test_alone_mode_packs_everything_the_stage_saves(gpt, packed):
    x = _input("gpt", batch=1)
    counts = {}
    for mode in ("alone", "full"):
        model = _wrapped(gpt, "gpt", OffloadCheckpoint(**MODES[mode])).train()
        packed.clear()
        model(x).sum().backward()
        counts[mode] = len(packed)
    assert counts["alone"] > 5 * counts["full"], counts


def test_segment_inputs_are_released_when_the_pack_copies(gpt):
    """A copying pack, as on CUDA: nothing but the host copy keeps a segment input alive.

    Under plain ``full`` the checkpoint itself keeps the segment inputs, under ``offload``
    only their host copies remain.
    """
    alive = {}
    for name, strategy in (("full", build_strategy("full")),
                           ("offload", OffloadCheckpoint(segments="full"))):
        if name == "offload":
            strategy._copy_host_tensors = True
        model = _wrapped(gpt, "gpt", strategy).train()
        refs = []

        def keep(module, args, refs=refs):
            if len(refs) < len(gpt.blocks):
                refs.append(weakref.ref(args[0]))

        handles = [b.register_forward_pre_hook(keep) for b in model.blocks]
        torch.manual_seed(0)
        out = model(_input("gpt"))
        gc.collect()
        alive[name] = [r() is not None for r in refs]
        out.square().mean().backward()
        for h in handles:
            h.remove()
    assert alive["full"] == [True] * len(gpt.blocks)
    assert alive["offload"] == [False] * len(gpt.blocks)


def test_weights_are_never_moved():
    lin = nn.Linear(4, 4)
    buf = torch.zeros(4)
    hooks = HostOffload(pin_memory=False, buffers=frozenset({buf.untyped_storage()._cdata}),
                        copy_host_tensors=True)
    x = torch.randn(2, 4, requires_grad=True)  # so the weight's cast is saved too
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    weight_cast = [t for t in _saved(y) if t.dtype == torch.bfloat16 and t.shape == (4, 4)]
    assert weight_cast and all(is_weight(t) for t in weight_cast)  # autocast copy of a leaf
    frozen = nn.Parameter(torch.randn(3), requires_grad=False)
    assert is_weight(lin.weight) and is_weight(lin.weight.t()) and is_weight(frozen[1:])
    assert not hooks.moves(lin.weight) and not hooks.moves(buf) and not hooks.moves(buf[:2])
    activation = torch.relu(lin(x))
    assert not is_weight(activation) and hooks.moves(activation)
    assert not HostOffload(pin_memory=False).moves(activation)  # on CPU: nothing to move


def _saved(t: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor autograd saved for the graph that produced ``t``."""
    found, seen, todo = [], set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_"):
                value = getattr(fn, name)
                found.extend(v for v in (value if isinstance(value, tuple) else (value,))
                             if isinstance(v, torch.Tensor))
        todo.extend(f for f, _ in fn.next_functions)
    return found


def test_alone_mode_moves_activations_and_no_weight(gpt, packed):
    model = _wrapped(gpt, "gpt", OffloadCheckpoint()).train()
    model(_input("gpt", batch=1)).sum().backward()
    weight_shapes = {tuple(p.shape) for p in model.blocks.parameters()}
    weight_shapes |= {tuple(reversed(s)) for s in weight_shapes}  # transposed views
    assert packed and not weight_shapes & set(packed) - {(1, 16, 32), (16, 32)}


class _Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, scale):
        return x + self.drop(torch.relu(self.fc(self.norm(x)))) * scale


class _ListStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        scale = torch.full((1,), 0.5)
        for block in self.blocks:
            x = block(x, scale)
        return x


@pytest.mark.parametrize("mode", ["alone", "full"])
def test_module_list_chain_with_extra_arguments(packed, mode):
    torch.manual_seed(0)
    base = _ListStack()
    x = torch.randn(4, 16)
    results = []
    for strategy in (build_strategy("none"), OffloadCheckpoint(**MODES[mode])):
        model = copy.deepcopy(base).train()
        strategy.apply(model, ["blocks"])
        torch.manual_seed(1)
        out = model(x)
        out.sum().backward()
        results.append((out.detach(), [p.grad for p in model.parameters()]))
    assert torch.equal(results[1][0], results[0][0])
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if mode == "full":  # each block's input and its extra argument
        assert packed == [(4, 16), (1,)] * 3


def test_both_modes_take_any_module(gpt):
    model = copy.deepcopy(gpt)
    report = OffloadCheckpoint().apply(model, ["blocks.0"])
    assert report.stages == ["blocks.0"] and report.wrapped == [] and report.segments == {}
    report = OffloadCheckpoint(segments="full").apply(model, ["blocks.0"])
    assert report.wrapped == ["blocks.0"] and report.segments == {"blocks.0": [(0, 1)]}


@pytest.mark.parametrize("kwargs,match", [
    ({"segments": "half"}, r"unknown segments 'half'; valid: null .*full, sqrtn, every_k"),
    ({"segments": "every_k", "k": 0}, r"k must be an int >= 1, got 0"),
    ({"k": 1.5}, r"k must be an int >= 1, got 1\.5"),
    ({"pin_memory": "yes"}, r"pin_memory must be true or false"),
])
def test_bad_arguments_are_clear_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadCheckpoint(**kwargs)


def test_every_k_segments_follow_k(gpt):
    report = OffloadCheckpoint(segments="every_k", k=3).apply(copy.deepcopy(gpt), ["blocks"])
    assert report.segments == {"blocks": [(0, 3), (3, 4)]}
    assert repr(OffloadCheckpoint()) == "OffloadCheckpoint(pin_memory=True, segments=None, k=2)"
