"""``compile``: torch.compile's partitioner under an activation memory budget.

Most tests use the ``aot_eager`` backend (AOTAutograd and the same min-cut partitioner as
inductor, without code generation); two use ``inductor`` (about 30 s together with a cold
inductor cache on 2 CPU cores, a few seconds warm).
"""

import copy
import math

import pytest
import torch
from torch import nn

from remat.strategies import build_strategy
from remat.strategies.compiled import CompileBudget, is_compiled_stage
from remat.strategies.stages import StageError
from tests.strategies.common import assert_same_function, train_step

WIDTH = 64


class Block(nn.Module):
    def __init__(self, width=WIDTH, p=0.0, norm="layer"):
        super().__init__()
        self.norm = nn.BatchNorm1d(width) if norm == "batch" else nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, n=4, **kwargs):
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.Sequential(*[Block(**kwargs) for _ in range(n)])

    def forward(self, x):
        return self.blocks(self.stem(x))


def _stack(**kwargs):
    torch.manual_seed(0)
    return Stack(**kwargs)






@pytest.mark.parametrize("budget", [-0.1, 1.5, math.nan, "0.5", None, True])
def test_budget_outside_unit_interval_or_not_a_number_is_rejected(budget):
    with pytest.raises(ValueError, match=r"budget must be a number in \[0, 1\]"):
        CompileBudget(budget=budget)


def test_unknown_backend_or_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown torch.compile backend"):
        CompileBudget(backend="no_such_backend")
    with pytest.raises(ValueError, match="needs backend='inductor'"):
        CompileBudget(backend="aot_eager", mode="max-autotune")
    with pytest.raises(ValueError, match="unknown torch.compile mode"):
        CompileBudget(mode="fastest")


def test_registry_style_construction_and_repr():
    strategy = CompileBudget(budget=0.25, backend="aot_eager")
    assert repr(strategy) == ("CompileBudget(budget=0.25, backend='aot_eager', mode=None, "
                              "dynamic=None)")
    assert CompileBudget(budget=1).budget == 1.0


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_outputs_gradients_and_state_dict_match_eager(budget):
    base = _stack()
    x = torch.randn(16, WIDTH)
    ref = train_step(copy.deepcopy(base), x)
    model = copy.deepcopy(base)
    keys = list(model.state_dict())
    report = CompileBudget(budget, backend="aot_eager").apply(model, ["blocks"])
    assert report.strategy == "compile"
    assert report.stages == report.wrapped == ["blocks"]
    assert list(model.state_dict()) == keys
    for _ in range(2):  # second step runs the cached graph
        assert_same_function(train_step(model, x), ref)


def _saved_activation_bytes(model, x):
    """Bytes autograd keeps for backward after one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.sum().backward()
    return sum(sizes)


def test_lower_budget_saves_fewer_activation_bytes():
    """Budgets 1.0 > 0.5 > 0.0 on the same stack, in one process: each model also gets its
    own budget, though dynamo would reuse one graph across identical models compiled with
    the same backend object."""
    base = Stack(n=4, p=0.0)
    x = torch.randn(32, WIDTH)
    model = copy.deepcopy(base).train()
    saved = {"eager": _saved_activation_bytes(model, x)}
    for budget in (1.0, 0.5, 0.0):
        model = copy.deepcopy(base).train()
        CompileBudget(budget, backend="aot_eager").apply(model, ["blocks"])
        model(x).sum().backward()  # compile first, then count what the compiled graph keeps
        saved[budget] = _saved_activation_bytes(model, x)
        assert model.blocks._remat_wrap.state.backend.random_ops == []  # p=0: none
    one = x.numel() * x.element_size()  # x and the stem's output have the same size
    assert saved["eager"] >= saved[1.0] > saved[0.5] > saved[0.0]
    # budget 0 keeps the stage's input only (plus x, which the eager stem keeps)
    assert saved[0.0] == 2 * one, saved


def test_batchnorm_running_stats_update_once_per_step():
    base = _stack(norm="batch")
    x = torch.randn(16, WIDTH)
    ref_model = copy.deepcopy(base)
    model = copy.deepcopy(base)
    CompileBudget(0.0, backend="aot_eager").apply(model, ["blocks"])
    for _ in range(3):
        ref = train_step(ref_model, x)
        got = train_step(model, x)
    assert_same_function(got, ref)
    assert int(got[2]["blocks.0.norm.num_batches_tracked"]) == 3
    for key, value in ref[2].items():
        torch.testing.assert_close(got[2][key], value, rtol=1e-5, atol=1e-6, msg=key)


def _plain_budget_backend(budget):
    inner = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return inner(gm, example_inputs)

    return backend


def test_control_plain_budget_compile_corrupts_dropout_gradients():
    """Control for the workaround below (pytorch/pytorch#190758): a plain budget-0 compile
    recomputes dropout in backward with a new mask. If this fails, torch fixed the bug."""
    base = _stack(p=0.5)
    x = torch.randn(16, WIDTH)
    ref = train_step(copy.deepcopy(base), x)
    model = copy.deepcopy(base)
    model.blocks.compile(backend=_plain_budget_backend(0.0))
    got = train_step(model, x)
    assert got[2].keys() == ref[2].keys()  # nn.Module.compile() keeps state_dict keys too
    assert torch.equal(got[0], ref[0])  # same forward masks ...
    assert not torch.allclose(got[1]["blocks.0.fc1.weight"], ref[1]["blocks.0.fc1.weight"])


def test_dropout_masks_kept_so_gradients_match_eager_at_every_budget():
    """aot_eager draws eager's masks (same ATen ops, same generator); the masks are saved,
    not redrawn in backward, while the rest still follows the budget."""
    base = _stack(p=0.5)
    x = torch.randn(16, WIDTH)
    ref = train_step(copy.deepcopy(base), x)
    saved = {}
    for budget in (1.0, 0.5, 0.0):
        model = copy.deepcopy(base)
        CompileBudget(budget, backend="aot_eager").apply(model, ["blocks"])
        got = train_step(model, x)
        assert torch.equal(got[0], ref[0])
        assert_same_function(got, ref)
        random_ops = model.blocks._remat_wrap.state.backend.random_ops
        assert random_ops == ([] if budget == 1.0 else ["aten.native_dropout.default"] * 4)
        saved[budget] = _saved_activation_bytes(model, x)
    assert saved[1.0] > saved[0.5] > saved[0.0]


def test_eval_and_no_grad_run_the_eager_forward():
    base = _stack(norm="batch", p=0.5)
    x = torch.randn(8, WIDTH)
    model = copy.deepcopy(base)
    CompileBudget(0.0, backend="aot_eager").apply(model, ["blocks"])
    wrap = model.blocks._remat_wrap
    model.eval()
    base.eval()
    assert torch.equal(model(x), base(x))
    model(x).sum().backward()  # eval with grad: eager too
    model.train()
    base.train()
    with torch.no_grad():
        torch.manual_seed(5)
        out = model(x)
        torch.manual_seed(5)
        assert torch.equal(out, base(x))
    assert wrap.calls == 0 and wrap.state is None  # nothing compiled


def test_apply_twice_equals_once_remove_restores_and_other_strategies_replace():
    base = _stack()
    x = torch.randn(8, WIDTH)
    model = copy.deepcopy(base)
    build_strategy("sqrtn").apply(model, ["blocks"])
    strategy = CompileBudget(0.0, backend="aot_eager")
    first = strategy.apply(model, ["blocks"])
    second = strategy.apply(model, ["blocks"])
    assert first == second
    patched = [name for name, m in model.named_modules() if "forward" in vars(m)]
    assert patched == ["blocks"] and is_compiled_stage(model.blocks)  # sqrtn's patch is gone
    assert_same_function(train_step(model, x), train_step(copy.deepcopy(base), x))
    strategy.remove(model)
    assert not any("forward" in vars(m) or hasattr(m, "_remat_wrap")
                   for m in model.modules())
    build_strategy("none").apply(model, ["blocks"])
    assert torch.equal(model(x), base(x))
    CompileBudget(backend="aot_eager").apply(model, ["blocks"])
    build_strategy("full").apply(model, ["blocks"])  # a segment strategy replaces compile
    assert not is_compiled_stage(model.blocks)


def test_deepcopy_compiles_the_copy_for_its_own_parameters():
    model = _stack()
    x = torch.randn(8, WIDTH)
    CompileBudget(0.0, backend="aot_eager").apply(model, ["blocks"])
    train_step(model, x)
    clone = copy.deepcopy(model)
    assert clone.blocks.forward.module is clone.blocks
    with torch.no_grad():
        for p in clone.blocks.parameters():
            p.zero_()
    # with zero weights each residual block is the identity on the stem's output
    out = clone.train()(x)
    torch.testing.assert_close(out, clone.stem(x))
    assert clone.blocks._remat_wrap.state.backend.graphs == 1


def test_each_stage_has_its_own_compile_cache():
    """nn.Module.compile() shares one code object, so dynamo's limit of 8 cache entries
    would make the 9th differently-shaped stage run eager; remat gives each stage its own."""
    torch.manual_seed(0)
    widths = [4 + i for i in range(10)]
    model = nn.Sequential(*[nn.Sequential(nn.Linear(w, w + 1), nn.GELU()) for w in widths])
    report = CompileBudget(0.5, backend="aot_eager").apply(model, ["*"])
    assert len(report.wrapped) == 10
    model.train()
    model(torch.randn(2, 4)).sum().backward()
    CompileBudget(backend="aot_eager").verify(model)  # every stage produced a graph


def test_module_list_stage_and_bypassed_stage_are_reported():
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(Block(), Block())
            self.more = nn.ModuleList([Block()])

        def forward(self, x):
            for block in self.blocks:  # bypasses blocks.forward
                x = block(x)
            return self.more[0](x)

    model = Loop()
    strategy = CompileBudget(backend="aot_eager")
    assert strategy.apply(model, ["more"]).wrapped == ["more.0"]  # a ModuleList: its members
    strategy.apply(model, ["blocks", "more"])
    with pytest.warns(UserWarning, match=r"wrapped blocks, but the training forward never"):
        model(torch.randn(4, WIDTH)).sum().backward()
    with pytest.raises(StageError, match=r"compiled blocks, but the training forward never"):
        strategy.verify(model)


def test_verify_reports_a_stage_that_ran_eager_under_a_dispatch_mode():
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _stack()
    strategy = CompileBudget(backend="aot_eager")
    strategy.apply(model, ["blocks"])
    with MemTracker():  # dynamo skips frames while a TorchDispatchMode is active
        train_step(model, torch.randn(4, WIDTH))
    with pytest.raises(StageError, match=r"no graph for blocks.*TorchDispatchMode"):
        strategy.verify(model)


def test_a_stage_split_by_a_graph_break_is_reported_with_dynamos_reason():
    """A data-dependent branch splits one stage into two graphs: the strategy report names
    the stage with its graph count and dynamo's reason, and one warning says so; the stage
    without a break is not listed."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            y = self.a(x)
            if y.sum() > 0:  # data-dependent: dynamo breaks the graph here
                y = y * 2
            return self.b(y)

    model = nn.Sequential(Branchy(), Block())
    strategy = CompileBudget(backend="aot_eager")
    report = strategy.apply(model, ["0", "1"])
    train_step(model, torch.randn(4, WIDTH))
    with pytest.warns(UserWarning, match=r"split 1 stage\(s\) at graph breaks.*'0': 2 graphs"):
        strategy.verify(model)
    assert list(report.graph_breaks) == ["0"]
    assert report.graph_breaks["0"]["graphs"] == 2 and report.graph_breaks["0"]["breaks"] == 1
    reasons = report.graph_breaks["0"]["reasons"]
    assert all(isinstance(r, str) and r for r in reasons)
    if torch.__version__ >= "2.14":  # the message this torch gives the break
        assert any("Data-dependent branching" in r for r in reasons)
    assert report.to_dict()["graph_breaks"]["0"]["breaks"] == 1  # summary.json's form


def test_inductor_outputs_gradients_and_saved_bytes():
    """One real inductor compile (C++ kernels on CPU): equal within float tolerance, and
    budget 0 keeps only the stage input."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    holder = nn.Sequential(base)
    x = torch.randn(8, 16)
    ref = train_step(copy.deepcopy(holder), x)
    model = copy.deepcopy(holder)
    CompileBudget(0.0, backend="inductor").apply(model, ["0"])
    got = train_step(model, x)
    assert_same_function(got, ref, rtol=1e-4, atol=1e-5)  # not bitwise: fused kernels
    assert _saved_activation_bytes(model, x) == x.numel() * x.element_size()
    CompileBudget(backend="inductor").verify(model)


@pytest.mark.slow  # 13 s of inductor compiles: make test-all
def test_inductor_dropout_masks_differ_from_eager_unless_fallback_random():
    """inductor draws dropout masks with its own kernels (other numbers than eager) and keeps
    them at budget 0 (same gradients as at 1.0); torch._inductor.config.fallback_random=True
    calls the ATen ops and gives eager's masks and gradients."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 16)))
    x = torch.randn(8, 16)
    ref = train_step(copy.deepcopy(base), x)
    runs = {}
    for budget in (1.0, 0.0):
        model = copy.deepcopy(base)
        CompileBudget(budget, backend="inductor").apply(model, ["0"])
        runs[budget] = train_step(model, x)
    assert not torch.allclose(runs[1.0][0], ref[0], rtol=1e-4, atol=1e-5)
    assert_same_function(runs[0.0], runs[1.0], rtol=1e-4, atol=1e-5)
    model = copy.deepcopy(base)
    CompileBudget(0.0, backend="inductor").apply(model, ["0"])
    with torch._inductor.config.patch(fallback_random=True):  # for forward and backward
        got = train_step(model, x)
    assert_same_function(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy,overrides,segments", [
    ("sqrtn", {}, 3), ("every_k", {"k": 3}, 3), ("every_k", {"k": 9}, 1), ("full", {}, 9)])
def test_compiled_segment_keeps_one_input_as_eager(strategy, overrides, segments):
    """Under torch.compile(model) a segment of several blocks is one region for the
    partitioner: it keeps the segment's input only, as eager does, not every block's
    (torch's partitioner keeps the values passed between two checkpointed calls)."""
    torch._dynamo.reset()
    base = Stack(n=9, p=0.0)
    x = torch.randn(32, WIDTH)
    model = copy.deepcopy(base).train()
    build_strategy(strategy, **overrides).apply(model, ["blocks"])
    compiled = torch.compile(model, backend="aot_eager")
    compiled(x).sum().backward()  # compile first, then count what the compiled graph keeps
    one = x.numel() * x.element_size()
    # the stem keeps x; each segment keeps its input
    assert _saved_activation_bytes(compiled, x) == (1 + segments) * one
    ref = copy.deepcopy(base).train()
    ref(x).sum().backward()
    model.zero_grad(set_to_none=True)
    compiled(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_regions_keep_the_outputs_of_ops_that_draw_random_numbers():
    """Under torch.compile every recomputed region's policy keeps what a random op drew
    (MUST_SAVE): recomputed in the backward it would draw other numbers under inductor;
    ops with p=0 or train=False draw nothing and stay recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    from remat.strategies.recompute import compiled_region_contexts, draws_random_numbers
    from remat.strategies.selective import SelectiveCheckpoint

    aten = torch.ops.aten
    x = torch.randn(4, 4)
    assert draws_random_numbers(aten.bernoulli_.float, (x, 0.9), {})
    assert draws_random_numbers(aten.native_dropout.default, (x, 0.1, True), {})
    assert not draws_random_numbers(aten.native_dropout.default, (x, 0.1, False), {})
    assert not draws_random_numbers(aten.native_dropout.default, (x, 0.0, True), {})
    assert not draws_random_numbers(aten.mm.default, (x, x), {})
    for context_fn in (None, SelectiveCheckpoint("matmul").compile_context_fn()):
        forward_mode, _ = compiled_region_contexts(context_fn, None, 0)
        policy = forward_mode.policy_fn
        assert policy(None, aten.bernoulli_.float, x, 0.9) == CheckpointPolicy.MUST_SAVE
        assert policy(None, aten.rand.default, [4]) == CheckpointPolicy.MUST_SAVE
        assert policy(None, aten.relu.default, x) in (CheckpointPolicy.PREFER_RECOMPUTE,
                                                      CheckpointPolicy.MUST_RECOMPUTE)


class MidDropout(nn.Module):
    """A block whose dropout feeds its second layer (its output is that layer's input)."""

    def __init__(self, p):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


def _decomposing_backend():
    """AOTAutograd with inductor's partitioner and its decomposition of dropout (rand ->
    gt -> mul), no code generation: what inductor's partitioner sees, in a second."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._decomp import get_decompositions
    from torch._dynamo.backends.common import aot_autograd

    def run(graph, _):
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=run, bw_compiler=run,
                        partition_fn=min_cut_rematerialization_partition,
                        decompositions=get_decompositions([torch.ops.aten.native_dropout]))


@pytest.mark.parametrize("strategy,segments", [("full", 4), ("sqrtn", 2)])
def test_compiled_regions_keep_a_dropouts_mask_not_its_output(strategy, segments):
    """A compiled region keeps what dropout drew as its bool mask (1 byte an element) and
    recomputes the masked output from it: it kept the float output (4 bytes) as well
    (96 against 32 units of x here for ``full``), and for an attention call with dropout
    every intermediate of its decomposed kernel. The masks are the forward's (no new draw
    in the backward): gradients equal compiled ``none``'s, the same draws."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = nn.Sequential(*[MidDropout(0.5) for _ in range(4)])
    x = torch.randn(32, WIDTH)
    model = nn.Sequential(copy.deepcopy(base)).train()
    build_strategy(strategy).apply(model, ["0"])
    compiled = torch.compile(model, backend=_decomposing_backend())
    compiled(x).sum().backward()
    one = x.numel() * x.element_size()
    masks = 4 * (4 * x.numel())  # bool, each block's dropout over 4 * WIDTH features
    assert _saved_activation_bytes(compiled, x) == segments * one + masks
    ref = torch.compile(nn.Sequential(copy.deepcopy(base)).train(),
                        backend=_decomposing_backend())
    grads = []
    for m in (ref, compiled):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        m(x).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class CausalAttention(nn.Module):
    """Self-attention through SDPA with attention dropout, residual."""

    def __init__(self, width=64, heads=4):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=0.2 if self.training else 0.0, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


def test_compiled_attention_with_dropout_keeps_its_mask_and_recomputes_the_rest():
    """Compiled (inductor's decompositions), SDPA with dropout is one random call whose
    every intermediate was kept by a recomputing region: ``full`` kept 0.59x and
    ``selective`` 1.11x what compiled ``none`` keeps. Now the T x T mask stays and the
    rest is recomputed, with compiled ``none``'s gradients (the same draws)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def run(graph, _):
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=run, bw_compiler=run, decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    base = nn.Sequential(*[CausalAttention() for _ in range(3)])
    x = torch.randn(2, 128, 64)
    saved, grads = {}, {}
    for strategy in ("none", "full", "selective"):
        torch._dynamo.reset()
        model = nn.Sequential(copy.deepcopy(base)).train()
        if strategy != "none":
            build_strategy(strategy).apply(model, ["0"])
        compiled = torch.compile(model, backend=backend)
        compiled(x).sum().backward()
        saved[strategy] = _saved_activation_bytes(compiled, x)
        compiled.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        compiled(x).sum().backward()
        grads[strategy] = [p.grad for p in compiled.parameters()]
    assert saved["full"] < 0.3 * saved["none"] and saved["selective"] < saved["none"]
    for strategy in ("full", "selective"):
        for got, want in zip(grads[strategy], grads["none"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # one inductor compile of a 12-block ViT (about 40 s on 2 cores)
def test_inductor_plan_with_stochastic_depth_gives_eager_gradients():
    """A compiled plan whose selective blocks draw stochastic-depth masks, in float64 (so
    only a wrong mask, not float reordering, can move a gradient): before the random ops'
    outputs were kept, inductor's backward drew other masks (relative error 1.64)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from remat.compiling import RowBackend, compile_row
    from remat.planner import PlanStrategy
    from remat.planner.plan import Plan, UnitPlan

    cfg = OmegaConf.create({
        "_target_": "remat.models.SegmentationModule", "in_channels": 3, "num_classes": 1,
        "net": {"_target_": "remat.models.ViTSegmenter", "img_size": 64, "patch_size": 16,
                "in_channels": 3, "num_classes": 1, "embed_dim": 64, "depth": 12,
                "num_heads": 2, "decoder_channels": [32, 16], "drop_path_rate": 0.1},
        "stages": ["encoder.blocks"]})
    keep = [(i, i + 1, "keep") for i in range(4, 12)]
    plan = Plan(units=[UnitPlan("encoder.blocks", "chain",
                                [(i, i + 1, "selective") for i in range(4)] + keep),
                       UnitPlan("decoder", "chain", [(0, 1, "selective"), (1, 2, "selective")])])

    def grads(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = instantiate(cfg).train().double()
        batch = model.example_batch(2, 64, torch.Generator().manual_seed(0))
        batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
        if compiled:
            PlanStrategy(plan).apply(model.net)
            compile_row(model.net, RowBackend("inductor"))
        for _ in range(2):  # the second step runs the compiled graph
            model.zero_grad(set_to_none=True)
            torch.manual_seed(5)
            model.training_loss(batch).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    ref, got = grads(False), grads(True)
    for name, grad in ref.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_compile_true_names_the_modules_whose_random_outputs_a_compiled_plan_keeps(caplog):
    """Compiled, a recomputed segment keeps what dropout and stochastic depth drew, so the
    step can peak above the eager plan: compile=true says so at the start, naming them."""
    import logging

    from remat.compiling import random_modules, warn_random_ops_kept

    class DropPath(torch.nn.Module):  # timm's name and attribute
        def __init__(self, drop_prob):
            super().__init__()
            self.drop_prob = drop_prob

    class Attention(torch.nn.Module):  # its SDPA call's dropout_p (remat's GPT, HF)
        def __init__(self, p):
            super().__init__()
            self.attention_dropout = p

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1),
                              torch.nn.Dropout(0.0), DropPath(0.2), DropPath(0.0),
                              Attention(0.1), Attention(0.0))
    assert random_modules(net) == ["1", "3", "5"]
    log = logging.getLogger("remat.test")
    with caplog.at_level("WARNING", logger="remat.test"):
        assert warn_random_ops_kept(net, recomputes=False, log=log) == []
        assert caplog.text == ""
        assert warn_random_ops_kept(net, recomputes=True, log=log) == ["1", "3", "5"]
    assert "compile=true: 1, 3, 5 draw random numbers" in caplog.text


def test_compile_true_with_a_plan_made_for_the_eager_step_names_the_plan(caplog):
    """strategy=plan with a plan file made without compile=true, trained compiled on a
    network with dropout: the start says that plan leaves the masks out, naming it."""
    import logging
    from types import SimpleNamespace

    from remat.models.base import StrategyModule

    plan = SimpleNamespace(compiled=False)
    module = SimpleNamespace(
        compile_options={}, compiled=False,
        net=torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)),
        strategy=SimpleNamespace(recomputes=True, plan=plan, origin="strategy.path='p.json'"))
    with caplog.at_level(logging.WARNING, logger="remat"):
        StrategyModule._compile(module)
    assert ("compile=true with strategy.path='p.json': that plan was made for an eager step "
            "(compiled: false)") in caplog.text
    caplog.clear()
    plan.compiled, module.compiled = True, False
    with caplog.at_level(logging.WARNING, logger="remat"):
        StrategyModule._compile(module)
    assert "made for an eager step" not in caplog.text
