"""Hugging Face ``transformers`` models as remat networks (optional: nothing here imports
``transformers`` until a model of it is used).

A causal LM such as ``transformers.LlamaForCausalLM`` built from a config (random init, no
download) or loaded from a local ``save_pretrained`` folder (:func:`load_pretrained`,
``model.pretrained``) is given to :class:`remat.models.SequenceModule` as ``net``; the
strategy wraps its decoder layers (``model.layers`` for Llama, ``transformer.h`` for GPT-2).
With ``model.lora`` the net is wrapped by PEFT (:func:`apply_lora`): the base frozen, LoRA
adapters trained, the stages found under PEFT's prefix (:func:`lora_stage_paths`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.strategies.references import is_hf_model

log = logging.getLogger(__name__)

__all__ = ["apply_lora", "causal_lm_logits", "check_config_keys", "config_vocab_size",
           "is_hf_model", "is_peft_model", "load_pretrained", "lora_config",
           "lora_stage_paths", "parameter_counts"]


def check_config_keys(net: nn.Module, key: str = "model.net.config") -> None:
    """Refuse a setting of a Hugging Face net's config that misspells one the config class
    has: ``PretrainedConfig`` keeps any keyword as an attribute, so
    ``+model.net.config.num_hiden_layers=2`` built the default 4 layers without a word.
    Settings that resemble no key of the class (another architecture's, such as Llama's
    ``intermediate_size`` on a ``GPT2Config`` built from the ``hf_llama`` preset) are named in
    one warning: the model reads them only if its own code asks for them by name.

    Args:
        net: the network; nothing is checked unless its ``config`` is a
            ``transformers.PretrainedConfig``.
        key: the config key the settings came from, for the message.

    Raises:
        ValueError: names the setting and the closest key of the config class.
    """
    import difflib

    config = getattr(net, "config", None)
    if config is None or not hasattr(config, "to_dict") or not is_hf_model(net):
        return
    try:
        known = set(type(config)().to_dict())
    except Exception:  # noqa: BLE001 - a config class that needs arguments: not checked
        return
    # the names a class maps onto its own keys (GPT-2's num_hidden_layers -> n_layer)
    names = known | set(getattr(type(config), "attribute_map", {}) or {})
    unknown = []
    for extra in sorted(set(config.to_dict()) - known):
        near = difflib.get_close_matches(extra, sorted(names), n=1, cutoff=0.8)
        if near:
            raise ValueError(f"{key}.{extra}: {type(config).__name__} has no setting "
                             f"{extra!r}, so it would be ignored; did you mean "
                             f"{key}.{near[0]}?")
        unknown.append(extra)
    if unknown:
        log.warning("%s: %s has no setting %s: %s ignores a setting its own code does not "
                    "read; remove it (%s) or give %s's own keys", key, type(config).__name__,
                    ", ".join(map(repr, unknown)), type(net).__name__,
                    " ".join(f"~{key}.{extra}" for extra in unknown), type(config).__name__)


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


#: what PEFT puts before every module path of the model it wraps (``get_peft_model``)
PEFT_PREFIX = "base_model.model."

#: ``model.lora`` keys with short names, and the ``peft.LoraConfig`` field each sets
LORA_ALIASES = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout",
                "target_modules": "target_modules"}


def load_pretrained(folder: str | os.PathLike[str]) -> nn.Module:
    """The causal LM saved in ``folder`` by ``save_pretrained`` (``config.json`` and the
    weights), loaded offline: ``transformers.AutoModelForCausalLM.from_pretrained(folder,
    local_files_only=True)``, nothing downloaded, in training mode. The parameters keep the
    saved dtype.

    Raises:
        FileNotFoundError: ``folder`` is not a folder, or has no ``config.json`` (one line
            naming ``model.pretrained``).
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model.pretrained={folder}: no such folder; give a folder written by "
            "save_pretrained (config.json and the weights), e.g. one you downloaded with "
            "huggingface-cli download <model> --local-dir <folder>")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.pretrained={folder}: the folder has no config.json, so it is not a "
            "model saved by save_pretrained")
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype="auto")
    # from_pretrained returns the model in eval mode, which Lightning keeps for training:
    # dropout would be off and every strategy idle (a strategy does nothing in eval())
    return net.train()


def lora_config(lora: Mapping[str, Any], hf: bool = True) -> Any:
    """A ``peft.LoraConfig`` from ``model.lora``: ``r`` (rank), ``alpha`` (scale
    ``alpha / r``), ``dropout`` (on the adapter's input), ``target_modules`` (module names,
    e.g. ``[q_proj, v_proj]`` for Llama, ``[c_attn]`` for GPT-2), and any other
    ``LoraConfig`` field by its own name (``bias``, ``use_rslora``, ``modules_to_save``...).
    ``hf``: the model is a Hugging Face causal LM (``task_type="CAUSAL_LM"``).

    Raises:
        ValueError: a key that is neither a short name nor a ``LoraConfig`` field (the
            message lists both), or a value ``LoraConfig`` refuses; names ``model.lora``.
    """
    import dataclasses

    from peft import LoraConfig

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in dict(lora).items():
        name = LORA_ALIASES.get(key, key)
        if name not in fields or name in ("task_type", "peft_type"):
            raise ValueError(
                f"model.lora.{key}: not a LoRA setting; use {', '.join(LORA_ALIASES)} or a "
                "field of peft.LoraConfig (e.g. bias, use_rslora, modules_to_save)")
        kwargs[name] = list(value) if name == "target_modules" and not isinstance(
            value, str) else value
    try:
        return LoraConfig(task_type="CAUSAL_LM" if hf else None, **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"model.lora={dict(lora)}: {err}") from err


def apply_lora(net: nn.Module, lora: Mapping[str, Any]) -> nn.Module:
    """``net`` with LoRA adapters (``peft.get_peft_model`` with :func:`lora_config`): every
    parameter of ``net`` frozen, a trainable low-rank pair ``lora_A`` ``[r, in]``,
    ``lora_B`` ``[out, r]`` added beside each target module. Returns the ``PeftModel``;
    its module paths start with :data:`PEFT_PREFIX` (see :func:`lora_stage_paths`).

    Raises:
        ValueError: a bad ``model.lora`` (see :func:`lora_config`), or a ``target_modules``
            entry that names no module of ``net`` (the message names ``model.lora``).
    """
    from peft import get_peft_model

    config = lora_config(lora, hf=is_hf_model(net))
    try:
        return get_peft_model(net, config)
    except ValueError as err:
        raise ValueError(f"model.lora.target_modules={config.target_modules}: {err}") from err


def is_peft_model(net: nn.Module) -> bool:
    """Whether ``net`` is a ``peft.PeftModel`` (False when peft was never imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(net, peft.PeftModel)


def lora_stage_paths(stages: Any) -> Any:
    """The stage paths of a model for the same model inside PEFT's wrapper:
    :data:`PEFT_PREFIX` put before each path (globs kept) that does not start with it, so
    ``model.stages=[model.layers]`` of ``model=hf_llama`` still names the decoder layers.
    ``"auto"`` and non-string settings are returned as they are."""
    if isinstance(stages, str):
        return stages if stages == "auto" else lora_stage_paths([stages])
    if not isinstance(stages, Sequence):
        return stages
    return [s if not isinstance(s, str) or s.startswith(PEFT_PREFIX) else PEFT_PREFIX + s
            for s in stages]


def parameter_counts(net: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter elements of ``net`` (tied tensors counted once)."""
    seen: dict[int, nn.Parameter] = {id(p): p for p in net.parameters()}
    total = sum(p.numel() for p in seen.values())
    return sum(p.numel() for p in seen.values() if p.requires_grad), total
