"""GPT (learned and rotary positions), RoPE, sampling, the LR schedule and SequenceModule."""

from __future__ import annotations

import math

import pytest
import torch

from remat.models import GPT, SequenceModule, warmup_cosine
from remat.models.gpt import RotaryEmbedding


def _gpt(pos: str, **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0,
               pos_embedding=pos, **kw)


def test_rotary_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    # place the same q at position m and k at position n inside sequences of length 12
    seq_q, seq_k = torch.zeros(1, 1, 12, 8), torch.zeros(1, 1, 12, 8)
    seq_q[..., :, :], seq_k[..., :, :] = q, k
    rq, rk = rope(seq_q)[0, 0], rope(seq_k)[0, 0]
    scores = rq @ rk.T  # scores[m, n]
    assert torch.allclose(scores[5, 2], scores[9, 6], atol=1e-5)  # m - n = 3
    assert torch.allclose(scores[3, 3], (q @ k.transpose(-1, -2)).squeeze(), atol=1e-5)
    assert not torch.allclose(scores[5, 2], scores[5, 3], atol=1e-3)
    assert torch.allclose(rq.norm(dim=-1), q.norm().expand(12), atol=1e-5)  # rotations


def test_rotary_position_zero_is_identity_and_dtype_is_kept():
    rope = RotaryEmbedding(4)
    x = torch.randn(2, 3, 5, 4, dtype=torch.bfloat16)
    y = rope(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y[:, :, 0], x[:, :, 0])
    with pytest.raises(ValueError, match="even head size"):
        RotaryEmbedding(5)


def test_rotary_gpt_has_no_position_table_and_runs_past_block_size():
    learned, rotary = _gpt("learned"), _gpt("rotary")
    assert "pos_emb.weight" in learned.state_dict()
    assert not any("pos_emb" in k or "rotary" in k for k in rotary.state_dict())
    n_rotary = sum(p.numel() for p in rotary.parameters())
    assert sum(p.numel() for p in learned.parameters()) - n_rotary == 16 * 16
    x = torch.randint(0, 20, (2, 24))
    assert rotary(x).shape == (2, 24, 20)
    with pytest.raises(ValueError, match=r"sequence length 24 exceeds model.block_size=16"):
        learned(x)
    with pytest.raises(ValueError, match=r"model.pos_embedding='alibi'; expected one of "
                                         r"learned, rotary"):
        _gpt("alibi")


@pytest.mark.parametrize("pos", ["learned", "rotary"])
def test_gpt_is_causal_and_position_aware(pos):
    model = _gpt(pos).eval()
    x = torch.randint(0, 20, (1, 12))
    y = x.clone()
    y[0, 8] = (x[0, 8] + 1) % 20
    a, b = model(x), model(y)
    assert torch.equal(a[:, :8], b[:, :8])  # the future does not leak into the past
    assert not torch.allclose(a[:, 8:], b[:, 8:])
    # same tokens in another order: without positions the last output would be the same
    swapped = model(torch.tensor([[1, 2, 3, 3], [2, 1, 3, 3]]))[:, -1]
    assert not torch.allclose(swapped[0], swapped[1], atol=1e-4)


def test_rotary_gpt_trains_under_bf16_autocast():
    model = _gpt("rotary").train()
    x = torch.randint(0, 20, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    logits.float().logsumexp(-1).mean().backward()
    assert logits.dtype == torch.bfloat16
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())


def test_generate_is_seeded_and_top_k_1_is_greedy():
    model = _gpt("rotary").eval()
    prompt = torch.tensor([[1, 2, 3]])
    a = model.generate(prompt, 20, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 20, generator=torch.Generator().manual_seed(3))
    assert a.shape == (1, 23) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)
    greedy = model.generate(prompt, 5, top_k=1)
    ids = prompt
    for _ in range(5):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, ids)
    with pytest.raises(ValueError, match="temperature > 0"):
        model.generate(prompt, 1, temperature=0.0)


def test_generate_crops_the_context_to_block_size_for_learned_positions():
    model = _gpt("learned").eval()
    out = model.generate(torch.zeros(1, 10, dtype=torch.long), 12)  # 22 > block_size 16
    assert out.shape == (1, 22)


def test_warmup_cosine_schedule_values():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine(opt, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(120):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    with pytest.raises(ValueError, match="total_steps >= 1"):
        warmup_cosine(opt, total_steps=-1)


def test_sequence_module_samples_with_a_vocabulary():
    module = SequenceModule(vocab_size=5, block_size=8, n_layer=1, n_head=1, n_embd=8,
                            sample_tokens=7, sample_prompt="ab")
    chars = "abcde"
    text = module.sample(lambda s: torch.tensor([chars.index(c) for c in s]),
                         lambda ids: "".join(chars[i] for i in ids))
    assert len(text) == 9 and text.startswith("ab") and set(text) <= set(chars)
    assert module.net.training  # restored after sampling in eval mode
