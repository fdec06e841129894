"""One training step (forward, loss, backward, optimizer step) measured for peak memory."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from remat.measure.memory import PeakMemory

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def autocast(device: torch.device | str, precision: str):
    """The autocast context Lightning uses for ``precision`` (``32-true``: none).

    Raises:
        ValueError: a precision other than ``32-true``, ``bf16-mixed``, ``16-mixed``.
    """
    if precision == "32-true":
        return nullcontext()
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        raise ValueError(f"precision={precision!r}: use 32-true, bf16-mixed or 16-mixed")
    return torch.autocast(torch.device(device).type, dtype=dtype)


def training_step(model: nn.Module, batch: dict[str, torch.Tensor],
                  optimizer: torch.optim.Optimizer | None, device: torch.device | str,
                  precision: str = "32-true", zero_grad_first: bool = False,
                  loss_scale: float = 1.0) -> torch.Tensor:
    """Forward and loss (``model.training_loss(batch)``) under autocast, ``backward``, then
    ``optimizer.step()`` and ``zero_grad(set_to_none=True)`` if an optimizer is given.

    ``zero_grad_first=True`` runs Lightning's automatic-optimization order instead
    (``lightning.pytorch.loops.optimization.automatic.Closure``): forward and loss, then
    ``zero_grad`` (when an optimizer is given), ``backward``, ``step``, so the previous step's
    gradients are still allocated during this step's forward. The optimizer step runs after
    backward, not as a closure, so MemTracker files every tensor under the right category.
    ``loss_scale`` multiplies the loss before backward (Lightning divides it by
    ``accumulate_grad_batches``). Returns the (detached) loss.
    """
    with autocast(device, precision):
        loss = model.training_loss(batch)
        if loss_scale != 1.0:
            loss = loss * loss_scale
    if optimizer is not None and zero_grad_first:
        optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        if not zero_grad_first:
            optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def lightning_micro_steps(accumulate_grad_batches: int) -> list[tuple[bool, bool]]:
    """``(zero_grad, optimizer_step)`` for the batches of one optimizer step in Lightning's
    order with gradient accumulation: the first batch zeroes the gradients (after its
    forward), the last one steps; batches in between only accumulate. Batches 2..k-1 of a
    step do the same work on the same allocations, so at most 3 are returned (first, one
    accumulating, last): the peak of the k-batch step is the peak of these.

    Raises:
        ValueError: ``accumulate_grad_batches`` < 1.
    """
    k = int(accumulate_grad_batches)
    if k < 1:
        raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}")
    if k == 1:
        return [(True, True)]
    return [(True, False)] + [(False, False)] * (min(k, 3) - 2) + [(False, True)]


def step_peak_memory(model: nn.Module, batch: dict[str, torch.Tensor],
                     optimizer: torch.optim.Optimizer | None, device: torch.device | str,
                     precision: str = "32-true", tracker: str = "auto",
                     zero_grad_first: bool = False, loss_scale: float = 1.0) -> PeakMemory:
    """Peak memory of one :func:`training_step`, split by category where MemTracker runs.

    The first optimizer step allocates the optimizer state (Adam: two tensors per
    parameter) after backward has freed the activations; later steps run forward and
    backward with that state (and, in Lightning's order, the previous gradients) alive, so
    either can be the higher one (:func:`remat.measure.trace.trace_step` measures two).
    Returns the finished :class:`PeakMemory` (``peak_bytes``, ``categories``).
    """
    optimizers = [optimizer] if optimizer is not None else []
    with PeakMemory(device, modules=[model], optimizers=optimizers, tracker=tracker) as peak:
        training_step(model, batch, optimizer, device, precision, zero_grad_first, loss_scale)
    return peak
