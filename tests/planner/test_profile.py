"""The profile's per-block costs are what the strategies keep on a real run (MemTracker)."""

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from remat.models.gpt import Block as GPTBlock
from remat.planner.devices import get_device
from remat.planner.profile import profile_model
from remat.strategies import NoCheckpoint, SelectiveCheckpoint

WIDTH, HEADS, TOKENS, BATCH = 32, 2, 64, 2


class Attention(nn.Module):
    """Pre-norm self-attention written out: ``q @ k^T``, softmax, ``@ v``, residual. The
    score matmul's output feeds the softmax, which saves its own output, so autograd does
    not save the scores; the ``matmul`` preset stores them all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (c // HEADS) ** -0.5
        y = scores.softmax(dim=-1) @ v
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


class Chain(nn.Module):
    """The least a profiled model needs: ``net``, ``example_batch``, ``training_loss``."""

    def __init__(self, block: str) -> None:
        super().__init__()
        make = {"attention": Attention,
                "gpt": lambda: GPTBlock(WIDTH, HEADS, dropout=0.1)}[block]
        # a chain of two blocks, "0.0" and "0.1" (a chain of one is looked into: its one
        # member's children would be the units)
        self.net = nn.Sequential(nn.Sequential(make(), make()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def example_batch(self, batch_size: int, size: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(batch_size, size, WIDTH)}

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self(batch["x"]).square().mean()


def kept_after_forward(block: str, strategy) -> int:
    """Bytes one block's forward leaves alive for its backward on a real run, its input
    included (MemTracker: what the chain's forward adds, less its output, plus its input;
    half of it: the chain's two blocks are alike and each keeps its own input)."""
    torch.manual_seed(0)
    model = Chain(block).train()
    strategy.apply(model, ["net.0"])
    model(torch.randn(BATCH, TOKENS, WIDTH)).sum().backward()  # a first call, as in training
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        x = torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True)
        before = tracker.get_tracker_snapshot()
        out = model(x)
        after = tracker.get_tracker_snapshot()
    added = sum(s["Total"] for s in after.values()) - sum(s["Total"] for s in before.values())
    kept = added - out.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    assert kept % 2 == 0
    return kept // 2


@pytest.fixture(scope="module")
def profiles():
    return {block: profile_model(lambda block=block: Chain(block), None, get_device("h100"),
                                 BATCH, TOKENS, "32-true").blocks["0.0"]
            for block in ("attention", "gpt")}


@pytest.mark.parametrize("block", ["attention", "gpt"])
def test_profile_keeps_what_the_strategies_keep(profiles, block):
    cost = profiles[block]
    assert cost.saved_bytes == kept_after_forward(block, NoCheckpoint())
    # a selective block keeps its input (the checkpoint's) and the preset's cache
    inputs = sum(cost.inputs.values())
    selective = kept_after_forward(block, SelectiveCheckpoint("matmul"))
    assert inputs + sum(cost.selective_saved.values()) == selective
    assert selective < cost.saved_bytes


def test_selective_cost_keeps_no_output_that_would_raise_the_recompute_above_none(profiles):
    cost = profiles["attention"]
    qkv = BATCH * TOKENS * 3 * WIDTH * 4
    # autograd does not save the qkv output (it saves contiguous copies of q, k and v); the
    # preset caches it, as the recompute consumes it before the tensors autograd saved are
    # all back. The q @ k^T scores are not cached: held until the softmax runs again, beside
    # the recomputed copies, they would take the recompute above what none holds
    assert sorted(cost.selective_saved.values()) == [qkv]
    assert not set(cost.selective_saved) & set(cost.saved)
    assert sum(cost.selective_saved.values()) <= cost.saved_bytes
    # both attention matmuls (q @ k^T, softmax @ v) run again, the projections do not
    assert cost.selective_flops == 2 * 2 * BATCH * HEADS * TOKENS * TOKENS * (WIDTH // HEADS)
