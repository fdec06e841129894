"""A GPT-style decoder-only transformer whose blocks form one chain (``blocks``).

Pre-LN blocks (Radford et al. 2019, GPT-2) with causal ``scaled_dot_product_attention``,
a 4x MLP with GELU, dropout, learned or rotary position embeddings and an output head tied to
the token embedding (Press & Wolf 2017). No key/value cache: this model is for training.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

POS_EMBEDDINGS = ("learned", "rotary")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE; Su et al. 2021, arXiv 2104.09864, sec. 3.4.2).

    Rotates each pair of query/key features ``(x_i, x_{i + d/2})`` by the angle
    ``pos * base^(-2i/d)``, so attention scores depend on relative positions only. Features are
    paired as halves (GPT-NeoX's layout) rather than neighbours (the paper's); the two differ by
    a fixed permutation of the head features, which the projections absorb. No parameters; the
    frequencies are a non-persistent buffer, so ``state_dict`` keys do not change.

    Args:
        head_dim: features per head ``d`` (even).
        base: frequency base (10000 in the paper).

    Raises:
        ValueError: odd ``head_dim``.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary position embedding needs an even head size "
                             f"(model.n_embd / model.n_head), got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, heads, T, d]`` -> the same, rotated by position ``0..T-1``; dtype kept."""
        t = x.shape[-2]
        angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32),
                             self.inv_freq.to(x.device))
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``[B, T, C]`` -> ``[B, T, C]``.

    With ``rotary=True`` queries and keys are rotated by :class:`RotaryEmbedding` first.

    Raises:
        ValueError: ``n_embd`` not divisible by ``n_head``; odd head size with rotary.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0,
                 rotary: bool = False) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} must be divisible by model.n_head={n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)
        self.rotary = RotaryEmbedding(n_embd // n_head) if rotary else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``; ``[B,T,C]``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0,
                 rotary: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, rotary)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def sample_tokens(logits_fn: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor,
                  new_tokens: int, block_size: int, temperature: float = 1.0,
                  top_k: int | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample ``new_tokens`` tokens after the prompt ``idx`` ``[B, T0]`` (int64).

    Each step runs ``logits_fn`` (``[B, T]`` -> ``[B, T, vocab]``) on the last
    ``block_size`` tokens (no key/value cache) and samples from ``softmax(logits /
    temperature)``, restricted to the ``top_k`` likeliest when given, with ``generator``
    (so the global RNG is not consumed). The loop of :meth:`GPT.generate`, for any network
    (``SequenceModule`` samples every network with it). Returns ``[B, T0 + new_tokens]``.
    Call with the network in ``eval()`` mode.

    Raises:
        ValueError: ``temperature <= 0``, ``top_k < 1`` or ``block_size < 1``.
    """
    if temperature <= 0 or (top_k is not None and top_k < 1) or block_size < 1:
        raise ValueError(f"sampling needs temperature > 0, top_k >= 1 or None and "
                         f"block_size >= 1, got {temperature}, {top_k}, {block_size}")
    for _ in range(new_tokens):
        logits = logits_fn(idx[:, -block_size:])[:, -1].float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return idx


class GPT(nn.Module):
    """Decoder-only language model: token ids ``[B, T]`` (int64) -> logits ``[B, T, vocab]``.

    Args:
        vocab_size: number of token ids.
        block_size: longest sequence (the size of the learned position table; with rotary
            positions it is only the length the model is meant for, longer inputs work).
        n_layer, n_head, n_embd: depth, heads, width.
        dropout: on embeddings, attention weights, residual branches.
        pos_embedding: ``learned`` (a table added to the token embeddings, GPT-2) or
            ``rotary`` (RoPE inside every attention, Su et al. 2021; no table).

    Raises:
        ValueError: a sequence longer than ``block_size`` with learned positions; bad sizes;
            unknown ``pos_embedding``.
    """

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, pos_embedding: str = "learned") -> None:
        super().__init__()
        if min(vocab_size, block_size, n_layer, n_head, n_embd) < 1:
            raise ValueError("GPT sizes (vocab_size, block_size, n_layer, n_head, n_embd) "
                             "must all be >= 1")
        if pos_embedding not in POS_EMBEDDINGS:
            raise ValueError(f"model.pos_embedding={pos_embedding!r}; expected one of "
                             f"{', '.join(POS_EMBEDDINGS)}")
        self.block_size = block_size
        self.pos_embedding = pos_embedding
        rotary = pos_embedding == "rotary"
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = None if rotary else nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head, dropout, rotary)
                                      for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():  # scaled residual init (GPT-2)
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` -> logits ``[B, T, vocab_size]``."""
        t = idx.shape[1]
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            if t > self.block_size:
                raise ValueError(f"sequence length {t} exceeds model.block_size="
                                 f"{self.block_size} (learned position embeddings)")
            x = x + self.pos_emb(torch.arange(t, device=idx.device))
        return self.head(self.ln_f(self.blocks(self.drop(x))))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``new_tokens`` tokens after the prompt ``idx`` ``[B, T0]`` (int64).

        Each step feeds the last ``block_size`` tokens (no key/value cache) and samples from
        ``softmax(logits / temperature)``, restricted to the ``top_k`` likeliest when given.
        Returns ``[B, T0 + new_tokens]``. Call in ``eval()`` mode for dropout-free samples.

        Raises:
            ValueError: ``temperature <= 0`` or ``top_k < 1``.
        """
        return sample_tokens(self, idx, new_tokens, self.block_size, temperature, top_k,
                             generator)
