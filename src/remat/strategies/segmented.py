"""Segment checkpointing of chains, shared by ``full``, ``sqrtn`` and ``every_k``.

A chain (``nn.Sequential`` or ``nn.ModuleList``) of N blocks is cut into contiguous
segments; each segment runs under ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` so only its input is kept and its inside is recomputed in backward.

The chain is patched in place by binding a new ``forward`` on the instance (a
``types.MethodType``, so ``copy.deepcopy`` follows the copy), which leaves parameters,
buffers and ``state_dict`` keys untouched. ``nn.ModuleList`` has no forward of its own: the
first block of each segment runs the whole segment and the other blocks pass their first
argument through, which is right for the usual ``for blk in blocks: x = blk(x, *extra)``.

BatchNorm: torch re-runs the forward during recompute, which would update running
statistics and ``num_batches_tracked`` a second time. During recompute the segment's
BatchNorm layers therefore write their statistics into throw-away copies of those buffers
(batch statistics still normalise, so the recomputed values are the same).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from remat.strategies.base import CheckpointStrategy, StrategyReport
from remat.strategies.stages import StageError, require_chain, resolve_stages

_SEGMENTS = "_remat_segments"      # attribute on a patched chain or block
_PATCHED = "_remat_patched"        # marks an instance-level forward bound by remat
_STRATEGY = "_remat_strategy"      # the SegmentStrategy that runs the segments
_CALLS = "_remat_calls"            # training forwards that went through the patch


_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def no_running_stat_updates(blocks: Iterable[nn.Module]) -> Iterator[None]:
    """Recompute without touching BatchNorm running statistics or ``num_batches_tracked``.

    The recompute must save the same tensors as the forward (torch checks it), so the
    BatchNorm call itself is left as is and only writes into throw-away copies of the
    statistic buffers, which are swapped back afterwards.
    """
    norms = [m for b in blocks for m in b.modules()
             if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    originals = [{k: m._buffers[k] for k in _STAT_BUFFERS if m._buffers.get(k) is not None}
                 for m in norms]
    for m, bufs in zip(norms, originals, strict=True):
        for k, buf in bufs.items():
            m._buffers[k] = buf.clone()
    try:
        yield
    finally:
        for m, bufs in zip(norms, originals, strict=True):
            m._buffers.update(bufs)


def _context_fn(blocks: list[nn.Module], extra: Callable[[], tuple] | None = None
                ) -> Callable[[], tuple]:
    """``context_fn`` for ``checkpoint``: the BatchNorm guard around the recompute, plus a
    strategy's own (forward, recompute) context pair if ``extra`` is given."""

    def make() -> tuple:
        if extra is None:
            return contextlib.nullcontext(), no_running_stat_updates(blocks)
        forward_ctx, recompute_ctx = extra()
        return forward_ctx, _entered_together(no_running_stat_updates(blocks), recompute_ctx)

    return make


@contextlib.contextmanager
def _entered_together(*contexts) -> Iterator[None]:
    """Enter ``contexts`` when this context is entered (not when it is built)."""
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


def _run_blocks(blocks: list[nn.Module], x, *args, **kwargs):
    for block in blocks:
        x = _original_forward_call(block, x, *args, **kwargs)
    return x


def _original_forward_call(block: nn.Module, *args, **kwargs):
    """Call a block through ``__call__`` (hooks run) unless remat patched it."""
    if getattr(block, _PATCHED, False):
        return type(block).forward(block, *args, **kwargs)
    return block(*args, **kwargs)


def checkpoint_blocks(blocks: list[nn.Module], x, *args,
                      context_fn: Callable[[], tuple] | None = None, **kwargs):
    """Run ``blocks`` one after another on ``x`` as one checkpointed segment.

    Only ``x`` (and ``args``) are kept; every activation inside is recomputed in backward,
    with the forward's RNG state (same dropout masks) and no BatchNorm statistic updates.
    ``context_fn`` (optional) returns a strategy's own (forward, recompute) context pair, e.g.
    from ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
    """
    fn = functools.partial(_run_blocks, blocks)
    return checkpoint(fn, x, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=_context_fn(blocks, context_fn), **kwargs)


def _sequential_forward(self: nn.Sequential, x):
    """Replacement ``forward`` of a segmented ``nn.Sequential``."""
    if not (self.training and torch.is_grad_enabled()):
        return type(self).forward(self, x)
    blocks = list(self)
    strategy = getattr(self, _STRATEGY)
    object.__setattr__(self, _CALLS, getattr(self, _CALLS, 0) + 1)
    for start, end in getattr(self, _SEGMENTS):
        x = strategy.run_segment(blocks[start:end], x)
    return x


def _segment_head_forward(self: nn.Module, x, *args, **kwargs):
    """Replacement ``forward`` of the first block of a ModuleList segment."""
    if not (self.training and torch.is_grad_enabled()):
        return type(self).forward(self, x, *args, **kwargs)
    blocks = getattr(self, _SEGMENTS)
    object.__setattr__(self, _CALLS, getattr(self, _CALLS, 0) + 1)
    if len(blocks) > 1 and (args or kwargs):
        raise StageError(
            f"a ModuleList segment of {len(blocks)} blocks starting at a "
            f"{type(self).__name__} is called with extra arguments; the later blocks may "
            "need other ones, so the segment cannot run as one unit. Use strategy=full "
            "(one block per segment) for this chain, or make it an nn.Sequential"
        )
    if len(blocks) == 1:
        return getattr(self, _STRATEGY).run_segment(blocks, x, *args, **kwargs)
    return getattr(self, _STRATEGY).run_segment(blocks, x)


def _segment_tail_forward(self: nn.Module, x, *args, **kwargs):
    """Replacement ``forward`` of a later block of a ModuleList segment: already computed."""
    if not (self.training and torch.is_grad_enabled()):
        return type(self).forward(self, x, *args, **kwargs)
    return x


def _patch(module: nn.Module, fn: Callable, segments, strategy) -> None:
    """Bind ``fn`` as ``module``'s forward; ``segments`` and ``strategy`` (the object that
    runs it) are kept on the module for ``fn``."""
    object.__setattr__(module, _SEGMENTS, segments)
    object.__setattr__(module, _STRATEGY, strategy)
    module.forward = types.MethodType(fn, module)
    object.__setattr__(module, _PATCHED, True)


def unpatch(module: nn.Module) -> bool:
    """Remove a remat ``forward`` patch from one module; returns whether there was one."""
    if not getattr(module, _PATCHED, False):
        return False
    for attr in ("forward", _SEGMENTS, _STRATEGY, _CALLS, _PATCHED):
        module.__dict__.pop(attr, None)
    return True


def never_called(model: nn.Module) -> list[str]:
    """Paths of chains (or segment heads) remat wrapped whose forward has not run in training.

    A parent that iterates over a chain's children instead of calling the chain bypasses
    the patch, so nothing would be recomputed there.
    """
    return [name for name, m in model.named_modules()
            if getattr(m, _PATCHED, False) and getattr(m, _SEGMENTS, None) is not None
            and getattr(m, _CALLS, 0) == 0]


def unpatch_all(model: nn.Module) -> int:
    """Remove every remat wrapping under ``model`` (segment and compile patches, and timm
    checkpointing that ``timm_native`` switched on); returns how many modules were restored.
    Every strategy's ``apply`` starts with it, so strategies replace each other, never nest.
    """
    from remat.strategies.timm_native import switch_off_timm_native

    return sum(unpatch(m) + switch_off_timm_native(m) for m in list(model.modules()))


class SegmentStrategy(CheckpointStrategy):
    """Base of the strategies that cut chains into checkpointed segments.

    Subclasses define :meth:`segments_for` (half-open block ranges for a chain of ``n``).
    """

    def segments_for(self, n: int) -> list[tuple[int, int]]:  # pragma: no cover - abstract
        raise NotImplementedError

    #: Callable giving extra (forward, recompute) contexts for each checkpoint call, or
    #: ``None``; strategies that steer what is saved inside a segment (selective) define it.
    checkpoint_contexts: Callable[[], tuple] | None = None

    def run_segment(self, blocks: list[nn.Module], x, *args, **kwargs):
        """Run one segment in training; override to change how a segment is kept
        (e.g. offload its boundary)."""
        return checkpoint_blocks(blocks, x, *args, context_fn=self.checkpoint_contexts,
                                 **kwargs)

    def apply(self, model: nn.Module, stages: Iterable[str]) -> StrategyReport:
        """Checkpoint each resolved chain segment by segment (see module docstring).

        Raises:
            StageError: a stage matches nothing, or is not a chain.
        """
        resolved = resolve_stages(model, stages)
        for path, module in resolved:
            require_chain(path, module, self.name)
        report = StrategyReport(strategy=self.name, stages=[p for p, _ in resolved])
        unpatch_all(model)  # one strategy per model: applying again replaces, never nests
        for path, chain in resolved:
            blocks = list(chain)
            bounds = self.segments_for(len(blocks))
            if isinstance(chain, nn.Sequential):
                _patch(chain, _sequential_forward, bounds, self)
            else:
                for start, end in bounds:
                    _patch(blocks[start], _segment_head_forward, blocks[start:end], self)
                    for block in blocks[start + 1:end]:
                        _patch(block, _segment_tail_forward, None, self)
            report.segments[path] = bounds
            report.wrapped.extend(f"{path}.{i}" for i in range(len(blocks)))
        return report

    def remove(self, model: nn.Module) -> None:
        unpatch_all(model)

    def verify(self, model: nn.Module) -> None:
        """Call after one training forward: every wrapped chain must have run through its
        patch (the code path actually used).

        Raises:
            StageError: a wrapped chain was bypassed, e.g. its parent loops over its children.
        """
        unused = never_called(model)
        if unused:
            raise StageError(
                f"strategy '{self.name}' wrapped {', '.join(unused)}, but the training forward "
                "never called it: its parent runs the children itself, so nothing is "
                f"recomputed there. List the children as stages instead, e.g. '{unused[0]}.*'"
            )
