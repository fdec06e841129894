"""``selective``: per-op save/recompute computes the same function as ``none``, and the
policy really decides which ops run again in backward."""

from __future__ import annotations

import collections
import contextlib
import copy

import pytest
import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.strategies import build_strategy
from remat.strategies.selective import SelectiveCheckpoint

UNET_STAGES = ["encoder.layer*"]
GPT_STAGES = ["blocks"]
POLICIES = {
    "matmul": {"policy": "matmul"},
    "attention": {"policy": "attention"},
    "ops": {"ops": ["aten.addmm", "aten.convolution", "aten._safe_softmax"]},
}


class PreLNBlock(nn.Module):
    """LayerNorm -> causal SDPA (qkv Linear) -> residual; LayerNorm -> GELU MLP -> residual."""

    def __init__(self, width: int = 32, heads: int = 4, p: float = 0.1, attn_p: float = 0.1):
        super().__init__()
        self.heads, self.attn_p = heads, attn_p
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.attn_p if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """A Linear stem and pre-LN blocks in an ``nn.Sequential`` called ``blocks``."""

    def __init__(self, width: int = 32, heads: int = 4, depth: int = 3, p: float = 0.1,
                 attn_p: float = 0.1):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.Sequential(*[PreLNBlock(width, heads, p, attn_p) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(self.stem(x))


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
    return TinyGPT()


def _input(name: str, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    shape = (batch, 3, 64, 64) if name == "unet" else (batch, 16, 32)
    return torch.randn(shape, generator=gen)


def _train_steps(model, x, steps=3):
    """SGD steps with a fixed seed per step (same dropout masks); last output, grads, state."""
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


def _wrapped(base, model_name, strategy):
    model = copy.deepcopy(base)
    strategy.apply(model, UNET_STAGES if model_name == "unet" else GPT_STAGES)
    return model


def _frozen_step(model, model_name, x):
    """One step with the first layer frozen, so the stage inputs do not require grad."""
    if model_name == "unet":
        model.encoder.conv1.requires_grad_(False)
        model.encoder.bn1.requires_grad_(False)
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
                model = _wrapped(base, model_name, build_strategy("none"))
                cache[kind, model_name] = RUNS[kind](model, model_name)
            return cache[kind, model_name]
        return RUNS[kind](_wrapped(base, model_name, strategy), model_name)

    return go


CASES = [(m, p) for m in ("unet", "gpt") for p in POLICIES]


@pytest.mark.parametrize("model_name,policy", CASES)
def test_outputs_gradients_and_batchnorm_stats_equal_none(run, model_name, policy):
    ref_out, ref_grads, ref_state = run("train", model_name)
    out, grads, state = run("train", model_name, SelectiveCheckpoint(**POLICIES[policy]))
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], rtol=1e-5, atol=1e-6)
    assert state.keys() == ref_state.keys()
    for key, value in state.items():
        assert torch.equal(value, ref_state[key]), key
    if model_name == "unet":
        assert int(state["encoder.layer1.0.bn1.num_batches_tracked"]) == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_masks_match_none_under_the_same_seed(gpt, policy):
    x = _input("gpt")
    losses, grads = [], []
    for strategy, seed in (("none", 7), (policy, 7), ("none", 8)):
        model = _wrapped(gpt, "gpt", SelectiveCheckpoint(**POLICIES[policy])
                         if strategy != "none" else build_strategy("none")).train()
        torch.manual_seed(seed)
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert not torch.equal(losses[0], losses[2])  # dropout is active: the seed matters
    assert torch.equal(losses[1], losses[0])
    for key, grad in grads[0].items():
        torch.testing.assert_close(grads[1][key], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_name,policy", CASES)
def test_frozen_first_layer_and_input_without_grad(run, model_name, policy):
    ref = run("frozen", model_name)
    grads = run("frozen", model_name, SelectiveCheckpoint(**POLICIES[policy]))
    frozen = {"unet": ("encoder.conv1.", "encoder.bn1."), "gpt": ("stem.",)}[model_name]
    for key, grad in ref.items():
        if key.startswith(frozen):
            assert grad is None and grads[key] is None, key
        else:
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_name,policy", CASES)
def test_bf16_autocast_gradients_within_bf16_tolerance(run, model_name, policy):
    ref = run("bf16", model_name)
    grads = run("bf16", model_name, SelectiveCheckpoint(**POLICIES[policy]))
    for key, grad in ref.items():
        torch.testing.assert_close(grads[key], grad, rtol=2e-2, atol=2e-2)


def _count_calls(modules):
    counts = collections.Counter()

    def hook(module, args):  # pre-hook: recompute may stop early, before forward hooks
        counts[id(module)] += 1

    return counts, [m.register_forward_pre_hook(hook) for m in modules]


def _blocks(model, model_name):
    return list(model.encoder.layer2) if model_name == "unet" else list(model.blocks)


@pytest.mark.parametrize("model_name,policy", CASES)
def test_no_recompute_in_eval_or_no_grad(unet, gpt, model_name, policy):
    base = unet if model_name == "unet" else gpt
    model = _wrapped(base, model_name, SelectiveCheckpoint(**POLICIES[policy]))
    blocks = _blocks(model, model_name)
    counts, handles = _count_calls(blocks)
    x = _input(model_name, batch=1)
    model.train()
    model(x).sum().backward()
    assert [counts[id(b)] for b in blocks] == [2] * len(blocks)  # forward + recompute
    counts.clear()
    ref = copy.deepcopy(model)  # same weights and BatchNorm statistics, unwrapped
    build_strategy("none").apply(ref, UNET_STAGES if model_name == "unet" else GPT_STAGES)
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
    assert [counts[id(b)] for b in blocks] == [3] * len(blocks)  # no recompute at all
    for h in handles:
        h.remove()


@pytest.mark.parametrize("model_name", ["unet", "gpt"])
def test_apply_twice_equals_once_and_remove_restores(unet, gpt, model_name):
    base = unet if model_name == "unet" else gpt
    model = copy.deepcopy(base)
    keys = list(model.state_dict())
    stages = UNET_STAGES if model_name == "unet" else GPT_STAGES
    strategy = SelectiveCheckpoint("attention")
    first = strategy.apply(model, stages)
    second = strategy.apply(model, stages)
    assert first == second
    assert first.strategy == "selective"
    assert all(end - start == 1 for segs in first.segments.values() for start, end in segs)
    assert list(model.state_dict()) == keys
    blocks = _blocks(model, model_name)
    counts, handles = _count_calls(blocks)
    x = _input(model_name, batch=1)
    model.train()
    model(x).sum().backward()
    assert [counts[id(b)] for b in blocks] == [2] * len(blocks)  # recomputed once, not twice
    strategy.remove(model)
    assert all("forward" not in vars(m) for m in model.modules())
    assert list(model.state_dict()) == keys
    counts.clear()
    model(x).sum().backward()
    assert [counts[id(b)] for b in blocks] == [1] * len(blocks)
    for h in handles:
        h.remove()


class _OpLog(TorchDispatchMode):
    """Counts the aten ops that reach it, by overload packet name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _under(outer, inner):
    with outer, inner:
        yield


def _recomputed_ops(strategy, model, x, model_name):
    """Ops that run again in backward: an op log entered *below* SAC's recompute mode
    sees only the ops that mode replays, not the ones it serves from its cache."""
    log = _OpLog()
    make = strategy.checkpoint_contexts

    def contexts():
        forward_ctx, recompute_ctx = make()
        return forward_ctx, _under(log, recompute_ctx)

    strategy.checkpoint_contexts = contexts
    model = _wrapped(model, model_name, strategy).train()
    torch.manual_seed(0)
    model(x).square().mean().backward()
    return log.ops


MATMUL_LIKE = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "linear"}


def test_matmul_policy_recomputes_norms_and_activations_not_convolutions(unet):
    ops = _recomputed_ops(SelectiveCheckpoint("matmul"), unet, _input("unet", 1), "unet")
    assert ops["native_batch_norm"] > 0 and ops["relu_"] > 0
    assert not MATMUL_LIKE & set(ops), ops


@pytest.mark.parametrize("attn_p", [0.1, 0.0])  # math SDPA with dropout, fused SDPA kernel
def test_matmul_policy_on_transformer_recomputes_no_matmul(attn_p):
    torch.manual_seed(0)
    model = TinyGPT(attn_p=attn_p)
    ops = _recomputed_ops(SelectiveCheckpoint("matmul"), model, _input("gpt"), "gpt")
    assert ops["native_layer_norm"] > 0 and ops["gelu"] > 0 and ops["bernoulli_"] > 0
    assert not MATMUL_LIKE & set(ops), ops
    if attn_p:  # attention dropout draws random numbers: recomputed whatever the policy
        assert ops["_safe_softmax"] > 0
    else:
        assert not any(name.startswith("_scaled_dot_product") for name in ops), ops


@pytest.mark.parametrize("attn_p", [0.1, 0.0])
def test_attention_policy_recomputes_only_the_attention_core(attn_p):
    torch.manual_seed(0)
    model = TinyGPT(attn_p=attn_p)
    ops = _recomputed_ops(SelectiveCheckpoint("attention"), model, _input("gpt"), "gpt")
    if attn_p:  # SDPA falls back to its math form on CPU: bmm, softmax, dropout
        assert ops["bmm"] > 0 and ops["_safe_softmax"] > 0 and ops["bernoulli_"] > 0
    else:
        assert ops["_scaled_dot_product_flash_attention_for_cpu"] > 0
    assert not {"mm", "addmm", "native_layer_norm", "gelu"} & set(ops), ops


def test_attention_policy_recomputes_nothing_in_a_convnet(unet):
    ops = _recomputed_ops(SelectiveCheckpoint("attention"), unet, _input("unet", 1), "unet")
    assert not set(ops) - {"detach", "empty"}, ops  # detach: never cached; empty: factory


def test_op_list_saves_the_listed_ops_only(gpt):
    ops = _recomputed_ops(SelectiveCheckpoint(ops=["aten.addmm"]), gpt, _input("gpt"), "gpt")
    assert "addmm" not in ops and ops["_safe_softmax"] > 0 and ops["bmm"] > 0


class _InPlace(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.fc, self.mode = nn.Linear(8, 8), mode

    def forward(self, x):
        y = self.fc(x)
        if self.mode == "after_read":  # a recomputed op reads y, then y changes in place
            return y.mul_(y.sigmoid())
        if self.mode == "silu":  # autograd backs y up (clone) before silu_ changes it
            return F.silu(y, inplace=True) * 2
        return y.relu_() + 1  # in place on a saved matmul output


@pytest.mark.parametrize("mode", ["relu", "silu"])
def test_in_place_op_on_a_saved_output_matches_none(mode):
    torch.manual_seed(0)
    base = nn.Module()
    base.blocks = nn.Sequential(_InPlace(mode), _InPlace(mode))
    x = torch.randn(4, 8)
    grads = []
    for strategy in (build_strategy("none"), SelectiveCheckpoint("matmul")):
        model = copy.deepcopy(base)
        strategy.apply(model, ["blocks"])
        model.blocks(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_in_place_change_after_a_recomputed_read_is_refused():
    base = nn.Module()
    base.blocks = nn.Sequential(_InPlace("after_read"))
    SelectiveCheckpoint("matmul").apply(base, ["blocks"])
    with pytest.raises(RuntimeError, match=r"aten\.mul_.*sigmoid"):
        base.blocks(torch.randn(4, 8))


@pytest.mark.parametrize("kwargs,match", [
    ({"policy": "sparse"}, r"unknown policy 'sparse'; valid policies: matmul, attention, ops"),
    ({"ops": ["aten.not_an_op"]}, r"unknown op 'aten\.not_an_op'"),
    ({"ops": ["aten.mm", "aten.convolutoin"]}, r"'aten\.convolutoin'.*aten\.convolution"),
    ({"ops": "aten.mm"}, r"ops must be a list"),
    ({"ops": ["aten.native_dropout"]}, r"draws random numbers"),
    ({"policy": "attention", "ops": ["aten.mm"]}, r"ops is only used with policy='ops'"),
    ({"policy": "ops"}, r"policy='ops' needs ops"),
])
def test_bad_arguments_are_clear_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SelectiveCheckpoint(**kwargs)


def test_op_names_resolve_in_every_spelling():
    strategy = SelectiveCheckpoint(ops=["aten.mm", "torch.ops.aten.bmm", "addmm",
                                        "aten.convolution.default"])
    assert strategy.policy == "ops"
    assert torch.ops.aten.mm in strategy._save
    assert torch.ops.aten.convolution.default in strategy._save
    assert repr(strategy).startswith("SelectiveCheckpoint(policy='ops', ops=['aten.mm'")
