"""``offload``: saved activations go through ``save_on_cpu``; the function stays the same.

This machine has no GPU, so the tests prove the mechanism on CPU: which tensors pass through
the pack hook of ``save_on_cpu`` (all that a stage saves, or only the segment inputs), and
that a copying pack (what ``save_on_cpu`` does on CUDA) leaves no other reference to the
segment inputs, so on a GPU their device memory would be freed.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import weakref

import pytest
import segmentation_models_pytorch as smp
import torch
from torch import nn
from torch.autograd.graph import save_on_cpu

import remat.strategies.offload as offload_module
from remat.strategies import build_strategy
from remat.strategies.offload import OffloadCheckpoint
from remat.strategies.stages import StageError
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
CASES = [("unet", "alone"), ("unet", "full")] + [("gpt", m) for m in MODES]


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """On 2 cores shared with other jobs, a second OpenMP thread mostly waits for a core:
    these small models run about 10x faster on one thread (same results, none vs strategy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def unet():
    torch.manual_seed(0)
    return smp.Unet("resnet18", encoder_weights=None, classes=1,
                    decoder_channels=(32, 16, 16, 8, 8))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(depth=4)


@pytest.fixture
def packed(monkeypatch):
    """Shapes of the tensors that pass through the pack hook of ``save_on_cpu``."""
    shapes: list[tuple[int, ...]] = []

    class CountingSaveOnCpu(save_on_cpu):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack = self.pack_hook

            def counting_pack(tensor):
                shapes.append(tuple(tensor.shape))
                return pack(tensor)

            self.pack_hook = counting_pack

    monkeypatch.setattr(offload_module, "save_on_cpu", CountingSaveOnCpu)
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


def _train_steps(model, x, steps=3):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        torch.manual_seed(100 + step)
        out = model(x)
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return out.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}


def _frozen_step(model, model_name, x):
    if model_name == "unet":
        model.encoder.conv1.requires_grad_(False)
        model.encoder.bn1.requires_grad_(False)  # stage inputs do not require grad
    else:
        model.stem.requires_grad_(False)
    model.train()
    torch.manual_seed(3)
    model(x).square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _bf16_step(model, model_name, x):
    model.train()
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().square().mean().backward()
    return {n: p.grad.float() for n, p in model.named_parameters()}


RUNS = {
    "train": lambda model, name: _train_steps(model, _input(name)),
    "frozen": lambda model, name: _frozen_step(model, name, _input(name)),
    "bf16": lambda model, name: _bf16_step(model, name, _input(name, batch=1)),
}


@pytest.fixture(scope="module")
def run(unet, gpt):
    """``run(kind, model_name, strategy)``; the ``none`` runs are computed once per module."""
    cache = {}

    def go(kind, model_name, strategy=None):
        base = unet if model_name == "unet" else gpt
        if strategy is None:
            if (kind, model_name) not in cache:
                cache[kind, model_name] = RUNS[kind](
                    _wrapped(base, model_name, build_strategy("none")), model_name)
            return cache[kind, model_name]
        return RUNS[kind](_wrapped(base, model_name, strategy), model_name)

    return go


@pytest.mark.parametrize("model_name,mode", CASES)
def test_outputs_gradients_and_batchnorm_stats_equal_none(run, model_name, mode):
    ref_out, ref_grads, ref_state = run("train", model_name)
    out, grads, state = run("train", model_name, OffloadCheckpoint(**MODES[mode]))
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], rtol=1e-5, atol=1e-6)
    assert state.keys() == ref_state.keys()
    for key, value in state.items():
        assert torch.equal(value, ref_state[key]), key
    if model_name == "unet":
        assert int(state["encoder.layer1.0.bn1.num_batches_tracked"]) == 3


@pytest.mark.parametrize("mode", MODES)
def test_dropout_masks_match_none_under_the_same_seed(gpt, mode):
    x = _input("gpt")
    losses, grads = [], []
    for strategy, seed in (("none", 7), (mode, 7), ("none", 8)):
        model = _wrapped(gpt, "gpt", OffloadCheckpoint(**MODES[mode]) if strategy != "none"
                         else build_strategy("none")).train()
        torch.manual_seed(seed)
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert not torch.equal(losses[0], losses[2])  # dropout is active: the seed matters
    assert torch.equal(losses[1], losses[0])
    for key, grad in grads[0].items():
        torch.testing.assert_close(grads[1][key], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_name,mode", CASES)
def test_frozen_first_layer_and_input_without_grad(run, model_name, mode):
    ref = run("frozen", model_name)
    grads = run("frozen", model_name, OffloadCheckpoint(**MODES[mode]))
    frozen = {"unet": ("encoder.conv1.", "encoder.bn1."), "gpt": ("stem.",)}[model_name]
    for key, grad in ref.items():
        if key.startswith(frozen):
            assert grad is None and grads[key] is None, key
        else:
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_name,mode", CASES)
def test_bf16_autocast_gradients_within_bf16_tolerance(run, model_name, mode):
    ref = run("bf16", model_name)
    grads = run("bf16", model_name, OffloadCheckpoint(**MODES[mode]))
    for key, grad in ref.items():
        torch.testing.assert_close(grads[key], grad, rtol=2e-2, atol=2e-2)


def _count_calls(modules):
    counts = collections.Counter()

    def hook(module, args):  # pre-hook: recompute may stop early, before forward hooks
        counts[id(module)] += 1

    return counts, [m.register_forward_pre_hook(hook) for m in modules]


def _blocks(model, model_name):
    return list(model.encoder.layer2) if model_name == "unet" else list(model.blocks)


@pytest.mark.parametrize("model_name,mode", CASES)
def test_nothing_happens_in_eval_or_no_grad(unet, gpt, packed, model_name, mode):
    base = unet if model_name == "unet" else gpt
    model = _wrapped(base, model_name, OffloadCheckpoint(**MODES[mode]))
    blocks = _blocks(model, model_name)
    counts, handles = _count_calls(blocks)
    x = _input(model_name, batch=1)
    model.train()
    model(x).sum().backward()
    calls = 1 if mode == "alone" else 2  # the alone mode never recomputes
    assert [counts[id(b)] for b in blocks] == [calls] * len(blocks)
    assert packed
    counts.clear()
    packed.clear()
    ref = copy.deepcopy(model)  # same weights and BatchNorm statistics, unwrapped
    build_strategy("none").apply(ref, _stages(model_name))
    model.eval()
    ref.eval()
    out = model(x)
    out.sum().backward()
    assert torch.equal(out, ref(x))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    model.train()
    ref.train()
    with torch.no_grad():
        torch.manual_seed(0)
        out = model(x)
        torch.manual_seed(0)
        assert torch.equal(out, ref(x))
    assert [counts[id(b)] for b in blocks] == [3] * len(blocks)
    assert packed == []  # save_on_cpu never entered
    for h in handles:
        h.remove()


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


def test_segment_inputs_are_released_when_the_pack_copies(gpt, monkeypatch):
    """A copying pack, as on CUDA: nothing but the host copy keeps a segment input alive.

    ``save_on_cpu(pin_memory=True)`` copies every packed tensor into a new host tensor
    (not page-locked here, without CUDA); under plain ``full`` the checkpoint itself keeps
    the segment inputs, under ``offload`` only their copies remain.
    """
    alive = {}
    for name, strategy in (("full", build_strategy("full")),
                           ("offload", OffloadCheckpoint(segments="full"))):
        if name == "offload":
            monkeypatch.setattr(strategy, "host_memory", lambda: save_on_cpu(pin_memory=True))
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


def test_why_save_on_cpu_wraps_the_checkpoint_call():
    """The design in one experiment (torch's behaviour, not remat's): non-reentrant
    checkpoint packs its inputs through the saved-tensor hooks around the call, and keeps
    the inside for itself; hooks given as its ``context_fn`` forward context miss the
    inputs and take every inside activation away from the checkpoint instead."""
    from torch.utils.checkpoint import checkpoint

    lin = nn.Linear(8, 8)
    calls = collections.Counter()

    def fn(x):
        calls["fn"] += 1
        return torch.relu(lin(x)).sin()

    def hooks():
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: (packed.append(t), t)[1], lambda t: t)

    x = torch.randn(4, 8, requires_grad=True)
    packed: list[torch.Tensor] = []
    with hooks():
        checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert [t is x or t.data_ptr() == x.data_ptr() for t in packed] == [True]
    assert calls["fn"] == 2  # forward + recompute
    packed.clear()
    calls.clear()
    checkpoint(fn, x, use_reentrant=False,
               context_fn=lambda: (hooks(), contextlib.nullcontext())).sum().backward()
    assert len(packed) > 1 and calls["fn"] == 1  # inside saved by the hooks, no recompute


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


def test_alone_mode_takes_any_module_and_segments_need_a_chain(gpt):
    model = copy.deepcopy(gpt)
    report = OffloadCheckpoint().apply(model, ["blocks.0"])
    assert report.stages == ["blocks.0"] and report.wrapped == [] and report.segments == {}
    with pytest.raises(StageError, match="strategy 'offload' splits chains"):
        OffloadCheckpoint(segments="full").apply(model, ["blocks.0"])


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
