"""Hugging Face ``transformers`` models as remat networks (optional: nothing here imports
``transformers`` until a model of it is used).

A causal LM such as ``transformers.LlamaForCausalLM`` built from a config (random init, no
download) is given to :class:`remat.models.SequenceModule` as ``net``; the strategy wraps its
decoder layers (``model.layers`` for Llama, ``transformer.h`` for GPT-2).
"""

from __future__ import annotations

import torch
from torch import nn

from remat.strategies.references import is_hf_model

__all__ = ["causal_lm_logits", "config_vocab_size", "is_hf_model"]


def config_vocab_size(net: nn.Module) -> int | None:
    """``net.config.vocab_size`` of an HF model (its output logits' width), else ``None``."""
    config = getattr(net, "config", None)
    size = getattr(config, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def causal_lm_logits(net: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` of an HF causal LM on ``tokens`` ``[B, T]`` (int64).

    Called as ``net(input_ids=tokens, use_cache=False)``: training and remat's sampling run
    the whole window each step, so no key/value cache is built (a cache would keep every
    layer's keys and values alive, the activations checkpointing frees). No attention mask:
    text windows have no padding, and the model's causal mask applies.

    Raises:
        TypeError: the output has no ``logits`` (not a ``*ForCausalLM`` head); names the class.
    """
    out = net(input_ids=tokens, use_cache=False)
    logits = getattr(out, "logits", None)
    if logits is None:
        raise TypeError(f"model.net ({type(net).__name__}) returned {type(out).__name__} "
                        "without logits; use a causal LM head, e.g. "
                        "transformers.LlamaForCausalLM")
    return logits
