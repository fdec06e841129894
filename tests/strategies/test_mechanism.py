"""The wrapping mechanism: pickling, norms and state, caches, errors that name the unit,
autocast, and peak memory never above ``none`` (``src/remat/strategies/recompute.py``)."""

from __future__ import annotations

import copy
import io
import pickle
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat.strategies.recompute as recompute
from remat.measure import PeakMemory
from remat.strategies import (
    RecomputeError,
    SelectiveCheckpoint,
    StageError,
    build_strategy,
    unwrap_all,
)
from tests.strategies import axes
from tests.strategies.common import assert_same_function, train_step
from tests.strategies.test_selective import TinyGPT

# eager strategies (peaks measured with MemTracker), plus an op list of selective's own
STRATEGIES = [*axes.variants(axes.eager), ("selective", {"ops": ["aten.addmm"]})]
RECOMPUTING = [*axes.variants(axes.recomputing), ("selective", {"ops": ["aten.addmm"]})]
COMPILED = axes.variants(axes.compiled)  # compiled code: pickled, not measured


def _step(model, x, seed=5):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def _assert_same(got, ref):
    assert torch.equal(got[0], ref[0])
    assert got[1].keys() == ref[1].keys()
    for key, grad in ref[1].items():
        torch.testing.assert_close(got[1][key], grad, rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(depth=4, p=0.2, attn_p=0.0)


@pytest.mark.parametrize("strategy,overrides", [*STRATEGIES, *COMPILED])
def test_wrapped_models_pickle_deepcopy_and_torch_save(gpt, strategy, overrides):
    x = torch.randn(2, 16, 32)
    ref = _step(copy.deepcopy(gpt), x)
    model = copy.deepcopy(gpt)
    build_strategy(strategy, **overrides).apply(model, ["blocks"])
    _step(model, x)  # runtime state (compiled code, learned buffers) exists before copying
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)]
    is_compiled = (strategy, overrides) in COMPILED
    if not is_compiled:  # each copy compiles again: one copy shows it for compiled code
        copies = [*copies, copy.deepcopy(model)]
    for copied in copies[: 1 if is_compiled else None]:
        forwards = [(m, vars(m)["forward"]) for m in copied.modules() if "forward" in vars(m)]
        assert forwards and all(f.module is m for m, f in forwards)  # bound to the copy
        got = _step(copied, x)
        if is_compiled:
            torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
        else:
            _assert_same(got, ref)


@pytest.mark.parametrize("strategy,overrides", [*STRATEGIES, *COMPILED, ("none", {})])
def test_torch_compile_of_a_wrapped_model_gives_eager_gradients_without_recompiling(
        gpt, strategy, overrides):
    torch._dynamo.reset()
    x = torch.randn(2, 16, 32)
    ref = _step(copy.deepcopy(gpt), x)
    model = copy.deepcopy(gpt)
    build_strategy(strategy, **overrides).apply(model, ["blocks"])
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        out = compiled(x)
        out.square().mean().backward()
    got = out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for key, grad in ref[1].items():
        torch.testing.assert_close(got[1][key], grad, rtol=1e-5, atol=1e-6, msg=key)
    # one graph per graph-break-free region, compiled once for three steps
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= (2 if strategy == "offload"
                                                                       else 1)
    build_strategy(strategy, **overrides).verify(model)  # traced units count as called


@pytest.mark.slow
@pytest.mark.parametrize("strategy,overrides", [("full", {}), ("sqrtn", {}),
                                                ("selective", {"policy": "matmul"}),
                                                ("offload", {"segments": "sqrtn"})])
def test_torch_compile_inductor_gives_eager_gradients(gpt, strategy, overrides):
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    x = torch.randn(2, 16, 32)
    ref = _step(copy.deepcopy(gpt), x)
    model = copy.deepcopy(gpt)
    build_strategy(strategy, **overrides).apply(model, ["blocks"])
    compiled = torch.compile(model, backend="inductor")
    # eager's dropout masks; config.patch, since pytest's monkeypatch undo deletes the key
    with inductor_config.patch(fallback_random=True):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(5)
            compiled(x).square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[1][name], rtol=1e-4, atol=1e-5, msg=name)


# --- norms and state ------------------------------------------------------------------


class NormBlock(nn.Module):
    def __init__(self, norm: str, c: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = {"instance": lambda: nn.InstanceNorm2d(c, affine=True,
                                                           track_running_stats=True),
                     "lazy": lambda: nn.LazyBatchNorm2d(),
                     "cumulative": lambda: nn.BatchNorm2d(c, momentum=None),
                     "spectral": lambda: nn.Identity()}[norm]()
        if norm == "spectral":
            self.conv = nn.utils.parametrizations.spectral_norm(self.conv)

    def forward(self, x):
        return x + F.relu(self.norm(self.conv(x)))


@pytest.mark.parametrize("norm", ["instance", "lazy", "cumulative", "spectral"])
@pytest.mark.parametrize("strategy,overrides", RECOMPUTING)
def test_every_norm_and_stateful_buffer_is_updated_once_per_forward(norm, strategy, overrides):
    x = torch.randn(2, 4, 8, 8)
    models = {}
    for name in ("none", strategy):  # built twice: a lazy module cannot be copied yet
        torch.manual_seed(0)
        models[name] = nn.Sequential(*[NormBlock(norm) for _ in range(3)])
    build_strategy(strategy, **overrides).apply(models[strategy], ["*"])
    results = {}
    for name, model in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.1) if norm != "lazy" else None
        for _ in range(3):
            out, grads = _step(model, x)
            if opt is None:
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            opt.step()
        results[name] = (out, grads, copy.deepcopy(model.state_dict()))
    _assert_same(results[strategy][:2], results["none"][:2])
    for key, value in results["none"][2].items():
        assert torch.equal(results[strategy][2][key], value), key
    if norm in ("lazy", "cumulative"):  # InstanceNorm keeps no count
        assert int(results[strategy][2]["0.norm.num_batches_tracked"]) == 3


def test_sync_batchnorm_in_a_recomputed_unit_is_refused_when_it_would_sync(monkeypatch):
    model = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))))
    build_strategy("full").apply(model, ["0"])
    model.train()
    model(torch.randn(3, 4)).sum().backward()  # not distributed: nothing to sync twice
    dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                 get_world_size=lambda group=None: 2)
    monkeypatch.setattr(recompute.torch, "distributed", dist)
    with pytest.raises(StageError, match=r"'0\.0\.1' is a SyncBatchNorm inside the "
                                         r"recomputed unit '0\.0'.*sync_batchnorm"):
        model(torch.randn(3, 4))


# --- key/value caches -----------------------------------------------------------------


class CacheLayer(nn.Module):
    """Appends its keys to a cache it is given, as decoder layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, layer_past=None, use_cache=False):
        if layer_past is not None and use_cache:
            layer_past.append(x.detach())
        return self.fc(x).tanh()


class CacheModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CacheLayer() for _ in range(4))

    def forward(self, x, cache):
        for layer in self.layers:
            x = layer(x, cache, use_cache=True)  # the cache as a positional argument
        return x


def test_a_kv_cache_is_dropped_in_training_with_a_warning_and_kept_in_eval():
    torch.manual_seed(0)
    model = CacheModel()
    ref = copy.deepcopy(model)
    build_strategy("sqrtn").apply(model, ["layers"])
    x = torch.randn(2, 4)
    recompute._warned.discard(CacheLayer.__qualname__)
    cache: list = []
    with pytest.warns(UserWarning, match=r"CacheLayer at 'layers\.0'.*layer_past=None, "
                                         r"use_cache=False"):
        out = model.train()(x, cache)
    out.sum().backward()
    assert cache == []  # nothing appended, neither in the forward nor in the recompute
    ref_cache: list = []
    torch.testing.assert_close(out, ref.train()(x, ref_cache))
    assert len(ref_cache) == 4
    with torch.no_grad():
        model.eval()(x, cache)
    assert len(cache) == 4  # eval: the strategy does nothing, the cache fills


# --- errors name the unit -------------------------------------------------------------


class Router(nn.Module):
    """A branch that flips between forward and recompute (a router), on state the replay
    does not rewind: a count kept in a list (a plain ``int`` attribute is rewound; see
    tests/strategies/test_module_state.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.small, self.big = nn.Linear(4, 4), nn.Linear(4, 16)
        self.calls = [0]

    def forward(self, x):
        self.calls[0] += 1
        if self.calls[0] % 2:
            return self.small(x).relu()
        return self.big(x).relu()[:, :4]


def test_a_recompute_that_differs_from_the_forward_names_the_unit():
    model = nn.Sequential(nn.Linear(4, 4), Router())
    build_strategy("full").apply(model, ["1"])
    out = model.train()(torch.randn(2, 4))
    with pytest.raises(RecomputeError, match=r"recomputing '1' \(strategy 'full'\).*router"):
        out.sum().backward()


def test_an_input_changed_in_place_after_the_forward_names_the_unit():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    build_strategy("full").apply(model, ["1"])
    model.train()
    h = model[0](torch.randn(2, 4))
    out = model[1](h)
    h.add_(1)  # changes the kept input of unit '1' after its forward call
    with pytest.raises(RecomputeError, match=r"input.*of the recomputed unit '1\.0'.*in place"):
        out.sum().backward()


# --- units that write their kept input in place ------------------------------------------


def _conv_chain() -> nn.Sequential:
    """torchvision's ResNet stem and DeepLab's ASPP branches, MobileNetV3's Hardswish: in-place
    activations as members of a chain, each a one-block segment under ``full``. Not only
    ReLU: its second application changes nothing, so a replay that applied it twice, or
    read the changed values, would pass unseen."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                         nn.Hardswish(inplace=True), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.SiLU(inplace=True), nn.Conv2d(8, 2, 1))


def _steps(model: nn.Module, x: torch.Tensor, n: int = 3) -> list:
    return [train_step(model, x, seed=i) for i in range(n)]


@pytest.mark.parametrize("name", ["full", "sqrtn", "every_k", "selective", "offload"])
def test_in_place_activation_units_compute_none_s_function(name):
    """Each step (the first, which learns which units write their input, and the later
    ones) gives none's outputs, gradients and BatchNorm statistics exactly."""
    x = torch.randn(2, 3, 12, 12)
    reference = _steps(_conv_chain(), x)
    model = _conv_chain()
    build_strategy(name).apply(model, [""])
    for got, ref in zip(_steps(model, x), reference, strict=True):
        assert_same_function(got, ref, rtol=0, atol=0, exact_output=True)
        for key, value in ref[2].items():
            assert torch.equal(got[2][key], value), key


class _ReluInPlace(nn.Module):
    """Writes its input in place without declaring it (no ``inplace`` attribute)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.relu_()


def test_in_place_activations_that_declare_it_join_before_the_first_step():
    """``inplace=True`` members join the segment before them when the strategy is applied,
    so the first step keeps no copy of their input: every step's peak is ``none``'s."""
    from remat.measure import PeakMemory

    model = _conv_chain()
    report = build_strategy("full").apply(model, "auto")
    assert report.segments[""] == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 7)]  # no forward yet
    x = torch.randn(2, 3, 32, 32)
    reference = _conv_chain()
    peaks = []
    for net in (reference, model):
        with PeakMemory("cpu", modules=[net]) as memory:
            net(x).sum().backward()
        peaks.append(memory.peak_bytes)
    assert peaks[1] <= peaks[0], peaks  # was 1.4x none's before the joins were learned


def test_a_segment_that_starts_at_an_in_place_block_joins_the_one_before_it():
    """``full``: the activations' one-block segments join the BatchNorms' before them (the
    planner's :func:`~remat.planner.search.replayable_segments`) once they have written
    their input, said once for the chain."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), _ReluInPlace(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), _ReluInPlace(),
                          nn.Conv2d(8, 2, 1))
    report = build_strategy("full").apply(model, "auto")  # a Sequential: the net itself
    recompute._warned.clear()  # said once a process: other tests' chains said it already
    with pytest.warns(UserWarning) as caught:
        _steps(model, torch.randn(2, 3, 12, 12))
    said = [str(w.message) for w in caught if "writes its input in place" in str(w.message)]
    assert len(said) == 1  # one line for the chain, not one per block that joins
    assert "'2' writes its input in place" in said[0] and "[2:3] joins" in said[0]
    assert "later blocks of this chain that write their input join the same way" in said[0]
    assert model[0]._remat_wrap.chain.bounds == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 7)]
    assert report.segments[""] == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 7)]  # the report too


def test_an_in_place_block_at_a_chains_start_runs_without_a_checkpoint():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 6),
                                                        nn.Tanh(), nn.Linear(6, 2)))
    x = torch.randn(4, 6)
    reference = _steps(copy.deepcopy(base), x)
    build_strategy("sqrtn").apply(base, ["1"])  # segments [0:2], [2:4]
    recompute._warned.clear()
    with pytest.warns(UserWarning, match=r"'1\.0' writes.*runs without a checkpoint"):
        got = _steps(base, x)
    for g, r in zip(got, reference, strict=True):
        assert_same_function(g, r, rtol=0, atol=0, exact_output=True)
    assert base[1][1]._remat_wrap.chain.bounds == [(0, 1), (1, 2), (2, 4)]


class WritesInput(nn.Module):
    """A block that writes its input first (``x.mul_``, or into a slice of it)."""

    def __init__(self, part: bool = False) -> None:
        super().__init__()
        self.part = part
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        if self.part:
            x[:, :2].zero_()
        else:
            x.mul_(2)
        return torch.tanh(self.fc(x))


class Loop(nn.Module):
    """A parent that computes each block's input (``h * 1``): kept inputs of the segment."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.ModuleList([WritesInput(part=i % 2 == 1) for i in range(4)])

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h * 1) + h
        return h


@pytest.mark.parametrize("name,stages", [("full", ["1"]), ("sqrtn", ["blocks"]),
                                         ("full", ["blocks"])])
def test_blocks_that_write_inputs_the_parent_computed_recompute_from_copies(name, stages):
    """Inputs no replay makes again (a lone unit's, a parent's ``h * 1``): copied before the
    first write, on every step; a second backward through the same graph (retain_graph)
    replays from the copy again."""
    torch.manual_seed(0)
    base = (Loop() if stages == ["blocks"]
            else nn.Sequential(nn.Linear(6, 6), WritesInput(), nn.Linear(6, 2)))
    x = torch.randn(4, 6)
    results = []
    for strategy in (build_strategy("none"), build_strategy(name)):
        model = copy.deepcopy(base)
        strategy.apply(model, stages)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            out = model(x).square().sum()
            out.backward(retain_graph=True)
            out.backward()
            results.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for got, ref in zip(results[2:], results[:2], strict=True):
        for key, grad in ref.items():
            torch.testing.assert_close(got[key], grad, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("policy", ["matmul", "attention"])
def test_selective_blocks_that_write_their_input_compute_none_s_function(policy):
    """The attention policy caches every op but the attention core, the in-place write into
    the input too: its replay, given a copy of the input, must run that op again (autograd
    saves what the op writes, not what the cache hands back); ELU's backward reads it."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ELU(inplace=True),
                         nn.Conv2d(4, 2, 1))
    loop = Loop()
    for net, stages, x in ((base, [""], torch.randn(2, 3, 12, 12)),
                           (loop, ["blocks"], torch.randn(4, 6))):
        reference = _steps(copy.deepcopy(net), x, n=2)
        build_strategy("selective", policy=policy).apply(net, stages)
        for got, ref in zip(_steps(net, x, n=2), reference, strict=True):
            assert_same_function(got, ref, rtol=0, atol=0, exact_output=True)


class _AddPos(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 8, 1, 1) * 0.1)
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        x += self.pos  # in place on its input, at the top of the block
        return x + torch.relu(self.bn(self.conv(x)))


def test_blocks_with_parameters_that_write_their_input_keep_a_copy_not_a_join():
    """Joined, a chain of such blocks became one segment whose recompute peaked at 1.05x
    none; each keeping a copy of its input, ``full`` peaks below none from step 2 on."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[_AddPos() for _ in range(4)])
    x = torch.randn(2, 3, 32, 32)
    peaks = {}
    for name in ("none", "full"):
        model = copy.deepcopy(base)
        report = build_strategy(name).apply(model, [""])
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with PeakMemory(torch.device("cpu"), split=False) as peak:
                model(x).square().mean().backward()
        peaks[name] = peak.peak_bytes
    assert report.segments[""] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]  # not joined
    assert peaks["full"] < peaks["none"], peaks


def _exactly_none_s_function(base: nn.Module, x: torch.Tensor, apply) -> None:
    """Three steps of ``base`` after ``apply(base)`` give a copy's (unwrapped) outputs,
    gradients and state bit for bit."""
    reference = _steps(copy.deepcopy(base), x)
    apply(base)
    for got, ref in zip(_steps(base, x), reference, strict=True):
        assert_same_function(got, ref, rtol=0, atol=0, exact_output=True)


class _StrideView(nn.Module):
    def forward(self, x):
        return x[:, :, ::1]  # a view of its input: no copy


class _WriteThroughView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        x.view(x.shape).add_(1)  # writes the storage of the view's base: the segment's input
        return self.conv(x)


@pytest.mark.parametrize("name", ["full", "sqrtn", "every_k", "selective", "offload"])
def test_a_block_that_writes_through_a_view_an_earlier_block_made_computes_none_s_function(
        name):
    """The write reaches a kept input of the segment through a tensor the call did not get
    from outside (a view made inside the segment): the watch covered only the call's own
    inputs, so sqrtn raised RecomputeError; now every kept input is watched and copied."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(4, 4, 1), _StrideView(), _WriteThroughView(),
                         nn.Conv2d(4, 4, 1), _StrideView(), _WriteThroughView())
    x = torch.randn(2, 4, 8, 8)
    _exactly_none_s_function(base, x, lambda net: build_strategy(name).apply(net, [""]))


class _MulInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((1, 4, 1, 1), 1.5))
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        x.mul_(self.scale)  # in place on its input, inside a segment of several blocks
        return self.conv(torch.tanh(x))


@pytest.mark.parametrize("kwargs", [{"segments": "sqrtn"}, {"segments": "full"}, {}])
def test_offload_segments_whose_blocks_write_their_inputs_compute_none_s_function(kwargs):
    """On a machine without CUDA offload keeps a segment's inputs where they are (host
    memory already), but marked them as copies: a later block's in-place write reached the
    kept input unseen (gradients off by 0.074 on a user's chain, silently)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(4, 4, 1), _AddPosSmall(), _MulInput(), nn.Conv2d(4, 4, 1),
                         _MulInput(), _StrideView(), _WriteThroughView(), nn.Conv2d(4, 4, 1))
    x = torch.randn(2, 4, 8, 8)
    _exactly_none_s_function(
        base, x, lambda net: build_strategy("offload", **kwargs).apply(net, [""]))


class _AddPosSmall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 4, 1, 1) * 0.1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        x += self.pos
        return self.conv(torch.relu(x))


class _Segments(SelectiveCheckpoint):
    def __init__(self, bounds: list[tuple[int, int]]) -> None:
        super().__init__()
        self.bounds = bounds

    def segments_for(self, n: int) -> list[tuple[int, int]]:
        return self.bounds


@pytest.mark.parametrize("bounds", [[(0, 3)], [(0, 1), (1, 3)], [(0, 2), (2, 3)]])
def test_selective_segments_of_several_blocks_compute_none_s_function(bounds):
    """A selective segment of several blocks (a plan's, or one joined to the block before
    it) settles what it keeps after its last call: settled after each call, a later call's
    reads of an earlier call's output found it dropped (uninitialised values, gradients
    off by 1e20)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                         nn.Sequential(nn.Hardswish(), nn.Conv2d(8, 8, 3, padding=1)),
                         nn.Sequential(nn.SiLU(), nn.Conv2d(8, 1, 1)))
    x = torch.randn(2, 3, 16, 16)
    _exactly_none_s_function(base, x, lambda net: _Segments(bounds).apply(net, [""]))


# --- autocast -------------------------------------------------------------------------


class Tied(nn.Module):
    """An embedding whose weight the head uses again (cast once before the stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.teacher = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.blocks[0](x)  # a no_grad pass casts the stage's weight first
        h = self.embed(x)
        h = self.blocks(h)
        return F.linear(h, self.embed.weight)


@pytest.mark.parametrize("policy", ["matmul", "attention"])
def test_selective_under_autocast_with_weights_cast_before_the_stage(policy):
    torch.manual_seed(0)
    base = Tied()
    x = torch.randn(4, 8)
    results = []
    for strategy in (build_strategy("none"), build_strategy("selective", policy=policy)):
        model = copy.deepcopy(base).train()
        strategy.apply(model, ["blocks.*"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
        results.append({n: p.grad.float() for n, p in model.named_parameters()
                        if p.grad is not None})
    assert results[1].keys() == results[0].keys()
    for key, grad in results[0].items():
        torch.testing.assert_close(results[1][key], grad, rtol=2e-2, atol=2e-2, msg=key)


# --- peak memory ----------------------------------------------------------------------


class ConvBNReLU(nn.Module):
    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)), inplace=True)
        return F.relu(self.b2(self.c2(y)) + x)


class MLP(nn.Module):
    def __init__(self, c: int = 64) -> None:
        super().__init__()
        self.f1, self.f2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        return x + self.f2(F.gelu(self.f1(x)))


BLOCK_KINDS = {
    "conv_bn_relu": (lambda: nn.Sequential(nn.Conv2d(3, 16, 3, padding=1),
                                           nn.Sequential(*[ConvBNReLU() for _ in range(4)])),
                     lambda: torch.randn(4, 3, 32, 32), ["1"]),
    "transformer_fused": (lambda: TinyGPT(width=64, depth=4, p=0.1, attn_p=0.0),
                          lambda: torch.randn(4, 64, 64), ["blocks"]),
    "transformer_math": (lambda: TinyGPT(width=64, depth=4, p=0.1, attn_p=0.1),
                         lambda: torch.randn(4, 64, 64), ["blocks"]),
    "mlp": (lambda: nn.Sequential(nn.Linear(64, 64), nn.Sequential(*[MLP() for _ in range(4)])),
            lambda: torch.randn(4, 64, 64), ["1"]),
}


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_no_strategy_raises_peak_memory_above_none(kind):
    make, make_input, stages = BLOCK_KINDS[kind]
    torch.manual_seed(0)
    base, x = make(), make_input()
    peaks = {}
    for name, overrides in [("none", {}), *STRATEGIES]:
        model = copy.deepcopy(base).train()
        build_strategy(name, **overrides).apply(model, stages)
        model(x).sum().backward()  # a first step: buffers learned, nothing lazy left
        model.zero_grad(set_to_none=True)
        with PeakMemory("cpu", modules=[model]) as peak:
            model(x).square().mean().backward()
        peaks[f"{name}{overrides}"] = peak.peak_bytes
    none = peaks.pop("none{}")
    above = {k: round(v / none, 3) for k, v in peaks.items() if v > none}
    assert not above, above


def test_unwrap_all_leaves_no_trace(gpt):
    model = copy.deepcopy(gpt)
    for name, overrides in STRATEGIES:
        build_strategy(name, **overrides).apply(model, ["blocks"])
        assert unwrap_all(model) > 0
        assert not any("forward" in vars(m) or "_remat_wrap" in vars(m) for m in model.modules())
        assert not model._forward_hooks


@pytest.mark.parametrize("shape", [(2, 3, 2, 2), (4, 3, 32, 32)], ids=["tiny", "small"])
def test_one_segment_over_a_whole_norm_chain_is_not_above_none(shape):
    """every_k with k = the chain's length: one segment recomputes all four conv-BN blocks,
    whose running statistics the replay writes into copies; at a tiny input (activations
    as small as the statistics) that once put the segment above none."""
    make, _, stages = BLOCK_KINDS["conv_bn_relu"]
    torch.manual_seed(0)
    base, x = make(), torch.randn(shape)
    peaks = {}
    for name, overrides in (("none", {}), ("every_k", {"k": 4})):
        model = copy.deepcopy(base).train()
        build_strategy(name, **overrides).apply(model, stages)
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)
        with PeakMemory("cpu", modules=[model]) as peak:
            model(x).square().mean().backward()
        peaks[name] = peak.peak_bytes
    assert peaks["every_k"] <= peaks["none"], peaks
