"""A GPT-style decoder-only transformer whose blocks form one chain (``blocks``).

Pre-LN blocks (Radford et al. 2019, GPT-2) with causal ``scaled_dot_product_attention``,
a 4x MLP with GELU, dropout, learned position embeddings and an output head tied to the
token embedding (Press & Wolf 2017). No key/value cache: this model is for training.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``[B, T, C]`` -> ``[B, T, C]``.

    Raises:
        ValueError: ``n_embd`` not divisible by ``n_head``.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} must be divisible by model.n_head={n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``; ``[B,T,C]``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model: token ids ``[B, T]`` (int64) -> logits ``[B, T, vocab]``.

    Args:
        vocab_size: number of token ids.
        block_size: longest sequence (learned position embeddings).
        n_layer, n_head, n_embd: depth, heads, width.
        dropout: on embeddings, attention weights, residual branches.

    Raises:
        ValueError: a sequence longer than ``block_size``; bad sizes.
    """

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        if min(vocab_size, block_size, n_layer, n_head, n_embd) < 1:
            raise ValueError("GPT sizes (vocab_size, block_size, n_layer, n_head, n_embd) "
                             "must all be >= 1")
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head, dropout) for _ in range(n_layer)])
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
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        return self.head(self.ln_f(self.blocks(x)))
