"""Gradient parity of two models: does a strategy compute the same gradients as ``none``?"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# (rtol, atol) per precision: fp32 tight; mixed precision rounds each op to 8 (bf16) or
# 11 (fp16) mantissa bits, and a recompute may round differently from the first forward.
TOLERANCES = {"32-true": (1e-5, 1e-6), "bf16-mixed": (2e-2, 2e-2), "16-mixed": (1e-2, 1e-2)}


@dataclass
class GradientParity:
    """Result of :func:`compare_gradients`: ``match`` (bool), the largest absolute
    difference over all parameters (``max_abs_diff``, in the gradients' units), the names
    of the parameters that differ or are missing on one side (``mismatched``), and the
    largest relative error of one parameter's gradient, ``|b - a| / |a|`` in the 2-norm
    (``max_rel_error``, scale-free: compiled kernels that reorder float sums give ~1e-6 to
    1e-4, dropout masks drawn again in backward ~1)."""

    match: bool
    max_abs_diff: float
    mismatched: list[str] = field(default_factory=list)
    max_rel_error: float = 0.0


def gradients_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of ``model``'s ``.grad`` tensors by parameter name (``None`` skipped)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def compare_gradients(reference: nn.Module | dict[str, torch.Tensor],
                      other: nn.Module | dict[str, torch.Tensor],
                      rtol: float = 1e-5, atol: float = 1e-6) -> GradientParity:
    """Compare two models' gradients parameter by parameter (``torch.allclose``).

    Args:
        reference, other: models after ``backward`` (or :func:`gradients_of` dicts).
        rtol, atol: tolerances of ``torch.allclose``; :data:`TOLERANCES` per precision.

    A parameter with a gradient on one side only counts as mismatched.
    """
    ref = reference if isinstance(reference, dict) else gradients_of(reference)
    got = other if isinstance(other, dict) else gradients_of(other)
    mismatched = sorted(set(ref) ^ set(got))
    diff = rel = 0.0
    for name in sorted(set(ref) & set(got)):
        a, b = ref[name], got[name].to(ref[name].device)
        if a.shape != b.shape:
            mismatched.append(name)
            continue
        if a.numel():
            delta = a.float() - b.float()
            diff = max(diff, delta.abs().max().item())
            norm = a.float().norm().item()
            rel = max(rel, delta.norm().item() / norm if norm else
                      (0.0 if not delta.any() else float("inf")))
        if not torch.allclose(b, a, rtol=rtol, atol=atol):
            mismatched.append(name)
    return GradientParity(not mismatched, float(diff), mismatched, float(rel))
