"""Every strategy computes the same function whatever the parent does with a chain's blocks.

The call patterns are the ones real models use (see ``src/remat/strategies/recompute.py``):
a plain loop, a loop that keeps every block's output (MONAI UNETR's skips, Hugging Face's
``output_hidden_states``), parallel heads fed the same input, code between the blocks that
draws random numbers (layer drop, dropout in the parent), keyword arguments and tuple
returns (Hugging Face layers), the same block called twice, dense connections (DenseNet),
in-place changes between blocks, blocks called by index in another order, two chains
called alternately, one block held several times by a chain (ALBERT's shared layer), and
forward hooks on a block.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat.strategies import StageError, build_strategy, is_recomputing
from tests.strategies import axes
from tests.strategies.common import count_calls, sgd_steps

# every_k k=8: one segment longer than any chain here
RECOMPUTING = [*axes.variants(axes.recomputing), ("every_k", {"k": 8})]
ALL = [*axes.variants(axes.eager), ("every_k", {"k": 8})]
WIDTH = 8


class Block(nn.Module):
    """Linear, BatchNorm, dropout; optional keyword arguments and a tuple return."""

    def __init__(self, tuple_out: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(0.3)
        self.tuple_out = tuple_out

    def forward(self, x, mask=None, scale: float = 1.0, extra=None):
        y = self.drop(F.gelu(self.norm(self.fc(x))))
        if mask is not None:
            y = y * mask
        y = x + scale * y
        return (y, y.mean()) if self.tuple_out else y


class Loop(nn.Module):
    """``x = blk(x)``."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


class Collect(Loop):
    """Keeps every block's output, as MONAI UNETR does for its skip connections."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(WIDTH, 2) for _ in range(6))

    def forward(self, x):
        outs = []
        for blk in self.blocks:
            x = blk(x)
            outs.append(x)
        return sum(head(o) for head, o in zip(self.heads, outs, strict=True))


class Parallel(Loop):
    """Every member gets the same input (parallel heads)."""

    def forward(self, x):
        return torch.stack([blk(x) for blk in self.blocks]).sum(0)


class RandomBetween(Loop):
    """Layer drop and dropout in the parent, between the blocks: random numbers drawn
    between two calls of one segment."""

    def forward(self, x):
        for blk in self.blocks:
            if self.training and torch.rand(()) < 0.3:
                continue
            x = F.dropout(blk(x), 0.2, self.training) * 2 + 1
        return x


class Keywords(nn.Module):
    """Hugging Face style: the same keyword arguments for every layer, tuple returns."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(tuple_out=True) for _ in range(6))

    def forward(self, x):
        mask = (torch.arange(WIDTH) % 3 != 0).float()
        hidden = ()
        for layer in self.layers:
            hidden = (*hidden, x)
            outputs = layer(x, mask=mask, scale=0.5, extra=None)
            x = outputs[0]
        return x + sum(hidden)


class Twice(Loop):
    """The same blocks called twice (weight sharing)."""

    def forward(self, x):
        for _ in range(2):
            for blk in self.blocks:
                x = blk(x)
        return x


class Dense(Loop):
    """DenseNet style: every block reads the sum of all earlier outputs (and the input)."""

    def forward(self, x):
        feats = [x]
        for blk in self.blocks:
            feats.append(blk(sum(feats)))
        return feats[-1]


class InPlaceBetween(Loop):
    """The parent changes a block's output in place before the next block reads it."""

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
            x.mul_(0.5)
        return x


class SubsetReversed(Loop):
    """Some blocks only, in reverse order (a parent that indexes its ModuleList)."""

    def forward(self, x):
        for i in (5, 3, 2, 0):
            x = self.blocks[i](x)
        return x


class Interleaved(Loop):
    """Two chains called alternately: ``b[i](a[i](x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.other = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x):
        for a, b in zip(self.blocks, self.other, strict=True):
            x = b(a(x))
        return x


class Pair(NamedTuple):
    main: torch.Tensor
    aux: torch.Tensor


class Head(nn.Module):
    """A single-module stage with ``None``, ints and a tensor tuple in, a NamedTuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, skip=None, repeat: int = 1, pair=(None, None)):
        y = x
        for _ in range(repeat):
            y = self.drop(torch.tanh(self.fc(y)))
        if pair[0] is not None:
            y = y + pair[0] * pair[1]
        return Pair(y, {"mean": y.mean(), "skip": skip})


class WithHead(Loop):
    def __init__(self) -> None:
        super().__init__(n=2)
        self.head = Head()

    def forward(self, x):
        x = self.blocks[1](self.blocks[0](x))
        out = self.head(x, skip=None, repeat=2, pair=(x, x.sigmoid()))
        return out.main + out.aux["mean"]


class SharedList(Loop):
    """One block held four times (ALBERT's shared layer, universal transformers)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block()] * 4)


class SharedSequential(nn.Module):
    """``nn.Sequential(*[block] * 4)`` called as a whole, twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block()] * 4)

    def forward(self, x):
        return self.blocks(self.blocks(x))


PATTERNS = {"loop": (Loop, ["blocks"]), "collect": (Collect, ["blocks"]),
            "parallel": (Parallel, ["blocks"]), "random_between": (RandomBetween, ["blocks"]),
            "keywords": (Keywords, ["layers"]), "twice": (Twice, ["blocks"]),
            "module_stage": (WithHead, ["blocks", "head"]), "dense": (Dense, ["blocks"]),
            "in_place_between": (InPlaceBetween, ["blocks"]),
            "subset_reversed": (SubsetReversed, ["blocks"]),
            "interleaved": (Interleaved, ["blocks", "other"]),
            "shared_list": (SharedList, ["blocks"]),
            "shared_sequential": (SharedSequential, ["blocks"])}


def _steps(model, x, steps=2):
    """Two SGD steps (dropout, BatchNorm in train mode); last output, grads, state."""
    return sgd_steps(model, x, steps, seed=11)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("strategy,overrides", ALL)
def test_every_call_pattern_gives_the_function_of_none(pattern, strategy, overrides):
    make, stages = PATTERNS[pattern]
    torch.manual_seed(0)
    base = make()
    x = torch.randn(4, WIDTH, requires_grad=True)
    ref = _steps(copy.deepcopy(base), x)
    model = copy.deepcopy(base)
    build_strategy(strategy, **overrides).apply(model, stages)
    got = _steps(model, x)
    assert torch.equal(got[0], ref[0])
    assert got[1].keys() == ref[1].keys()
    for key, grad in ref[1].items():
        torch.testing.assert_close(got[1][key], grad, rtol=1e-5, atol=1e-6, msg=key)
    for key, value in ref[2].items():  # BatchNorm statistics, num_batches_tracked
        assert torch.equal(got[2][key], value), key


@pytest.mark.parametrize("pattern", ["loop", "collect", "keywords", "parallel"])
@pytest.mark.parametrize("strategy,overrides", RECOMPUTING)
def test_recompute_happens_for_every_block(pattern, strategy, overrides):
    make, stages = PATTERNS[pattern]
    torch.manual_seed(0)
    model = make()
    build_strategy(strategy, **overrides).apply(model, stages)
    blocks = list(model.get_submodule(stages[0]))
    counts, _ = count_calls(blocks, inner=True)
    model.train()
    model(torch.randn(4, WIDTH)).sum().backward()
    assert [counts[id(b)] for b in blocks] == [2] * len(blocks)  # forward + recompute


def test_sqrtn_keeps_one_input_per_segment_of_a_plain_loop():
    """Segments of a ModuleList really share one region: the inputs of later blocks of a
    segment are recomputed, not kept."""
    from remat.measure import PeakMemory

    torch.manual_seed(0)
    base = Loop(n=9)
    x = torch.randn(256, WIDTH)
    peaks = {}
    for name in ("none", "full", "sqrtn", "every_k"):
        model = copy.deepcopy(base).train()
        build_strategy(name, **({"k": 9} if name == "every_k" else {})).apply(model, ["blocks"])
        with PeakMemory("cpu", modules=[model]) as peak:
            model(x).sum().backward()
        peaks[name] = peak.peak_bytes
    # one segment of 9 blocks keeps 1 input and recomputes 9 blocks' activations at once;
    # full keeps 9 inputs and recomputes one block at a time; sqrtn lies between
    assert peaks["full"] < peaks["none"] and peaks["sqrtn"] < peaks["none"]
    assert peaks["every_k"] < peaks["none"]


def test_forward_hooks_see_each_blocks_true_output_once_per_step():
    torch.manual_seed(0)
    base = Loop()
    x = torch.randn(4, WIDTH)
    seen = {}
    for name in ("none", "sqrtn"):
        model = copy.deepcopy(base).train()
        build_strategy(name).apply(model, ["blocks"])
        outputs: list[torch.Tensor] = []
        inner: list[bool] = []
        model.blocks[0].register_forward_hook(
            lambda m, a, out, outputs=outputs: outputs.append(out.detach()))
        model.blocks[0].fc.register_forward_hook(
            lambda m, a, out, inner=inner: inner.append(is_recomputing()))
        torch.manual_seed(3)
        model(x).sum().backward()
        seen[name] = (outputs, inner)
    assert len(seen["sqrtn"][0]) == 1 and torch.equal(seen["sqrtn"][0][0], seen["none"][0][0])
    assert seen["none"][1] == [False] and seen["sqrtn"][1] == [False, True]
    assert not is_recomputing()


@pytest.mark.parametrize("strategy,overrides", RECOMPUTING)
def test_a_shared_block_is_recomputed_once_per_call(strategy, overrides):
    """A chain holding one block four times: each of its four calls is one member of its
    segment, recomputed once (forward 4 calls + recompute 4 calls)."""
    torch.manual_seed(0)
    model = SharedList()
    build_strategy(strategy, **overrides).apply(model, ["blocks"])
    counts, _ = count_calls([model.blocks[0]], inner=True)
    model.train()
    model(torch.randn(4, WIDTH)).sum().backward()
    assert counts[id(model.blocks[0])] == 8


def test_a_module_listed_in_two_stages_is_refused_naming_both():
    torch.manual_seed(0)
    model = Interleaved()
    model.other[0] = model.blocks[0]
    with pytest.raises(StageError) as err:
        build_strategy("sqrtn").apply(model, ["blocks", "other"])
    assert "'other.0'" in str(err.value) and "'blocks.0'" in str(err.value)
