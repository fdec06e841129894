"""Pretrained encoder weights from a local file (``model.pretrained=<file>`` of the
segmentation models): no download, the file a user already has."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

#: the file kinds :func:`load_encoder_weights` reads
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def read_state_dict(path: str | os.PathLike[str], key: str = "model.pretrained"
                    ) -> dict[str, torch.Tensor]:
    """The tensors of a weights file: ``.safetensors`` (``safetensors.torch.load_file``) or a
    ``torch.save`` file (``.pth``/``.pt``/``.bin``, read with ``weights_only=True``; a
    ``{"state_dict": ...}`` or ``{"model": ...}`` wrapper is unpacked), on the CPU.

    Raises:
        FileNotFoundError: no such file (names ``key``).
        ValueError: another suffix, or a file that holds no tensors by name.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{key}={path}: no such file; give a weights file "
                                f"({', '.join(WEIGHT_SUFFIXES)})")
    if path.suffix not in WEIGHT_SUFFIXES:
        raise ValueError(f"{key}={path}: not a weights file; use one of "
                         f"{', '.join(WEIGHT_SUFFIXES)}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path), device="cpu")
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        for wrapper in ("state_dict", "model"):
            if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
                state = state[wrapper]
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ValueError(f"{key}={path}: the file holds no tensors by name")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _renamings(names: set[str]) -> list[tuple[str, str]]:
    """``(prefix to strip, prefix to add)`` pairs that map a file's names onto the module's:
    as they are, a whole model's ``encoder.`` dropped, timm's names under smp's
    ``model.`` (a ``tu-`` encoder)."""
    pairs = [("", ""), ("encoder.", ""), ("", "model."), ("net.encoder.", ""),
             ("module.", "")]
    return [p for p in pairs if not p[0] or any(n.startswith(p[0]) for n in names)]


def load_encoder_weights(net: nn.Module, path: str | os.PathLike[str],
                         key: str = "model.pretrained") -> tuple[nn.Module, int]:
    """Load a weights file into ``net.encoder`` (smp models and remat's ViT segmenter; the
    whole ``net`` where it has no ``encoder``). The file's names may be the encoder's own,
    a whole model's (``encoder.``), or a timm model's for an smp ``tu-`` encoder (smp keeps
    it as ``encoder.model``, timm's feature wrapper names ``stages.0`` ``stages_0``);
    tensors the encoder lacks (a classifier head) are skipped.
    Every tensor of the encoder must be in the file with its shape.

    Returns:
        ``(the module loaded, tensors skipped)``.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_state_dict`; the file misses tensors
            of the encoder or has other shapes (the message names ``key`` and a few).
    """
    target = getattr(net, "encoder", None)
    target = target if isinstance(target, nn.Module) else net
    state = read_state_dict(path, key)
    wanted = target.state_dict()
    # timm's features_only wrapper (smp's tu- encoders) names ``stages.0`` ``stages_0``:
    # names also match with every "." read as "_", where that is unambiguous
    flat: dict[str, str | None] = {}
    for name in wanted:
        flat[name.replace(".", "_")] = None if name.replace(".", "_") in flat else name
    best: dict[str, torch.Tensor] = {}
    for strip, add in _renamings(set(state)):
        mapped = {add + k[len(strip):]: v for k, v in state.items() if k.startswith(strip)}
        for loose in (False, True):
            found = {(flat.get(k.replace(".", "_")) if loose else k): v
                     for k, v in mapped.items()}
            found = {k: v for k, v in found.items() if k in wanted}
            if len(found) > len(best):
                best = found
    missing = [k for k in wanted if k not in best]
    if missing:
        raise ValueError(
            f"{key}={path}: {len(missing)} of the {len(wanted)} tensors of "
            f"{type(target).__name__} are not in the file (e.g. {', '.join(missing[:3])}); "
            f"the file has e.g. {', '.join(list(state)[:3])}")
    wrong = [f"{k} {tuple(v.shape)} (file) vs {tuple(wanted[k].shape)}"
             for k, v in best.items() if v.shape != wanted[k].shape]
    if wrong:
        raise ValueError(f"{key}={path}: other shapes than {type(target).__name__}'s: "
                         f"{'; '.join(wrong[:3])}")
    target.load_state_dict(best, strict=True)
    return target, len(state) - len(best)
