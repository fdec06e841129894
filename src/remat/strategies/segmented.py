"""Base of the strategies that recompute: ``full``, ``sqrtn``, ``every_k``, ``selective`` and
``offload`` with segments.

Any stage is a unit:

- a *chain* (``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``, also subclasses
  with a ``forward`` of their own) is cut into contiguous segments by
  :meth:`RecomputeStrategy.segments_for`; each member is wrapped, and the calls of one
  segment's members share one checkpointed region (:mod:`remat.strategies.recompute`), so
  whatever the parent does with the members (a plain loop, keyword arguments, collecting
  every output, parallel heads) it gets their true outputs;
- any other module is checkpointed as one unit with its real call signature and return
  type (tensors, ``None``, ints, tuples, kwargs in; tensor, tuple, list, dict, NamedTuple or
  Hugging Face ``ModelOutput`` out), gradients flowing through every tensor in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from remat import _compat
from remat.strategies import wrapping
from remat.strategies.base import CheckpointStrategy, StrategyReport
from remat.strategies.recompute import ChainPlan, refuse_sync_batchnorm, run_recomputed
from remat.strategies.stages import child_path

CHAIN_TYPES = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def chain_members(chain: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, member)`` of a chain stage in the order it holds them, by their real names
    (an ``nn.Sequential`` built from an ``OrderedDict``, or a subclass such as MONAI's
    ``Convolution``, names them ``conv``, ``adn``, ...; its ``named_modules`` paths use those)."""
    return [(name, m) for name, m in _compat.child_table(chain).items() if m is not None]


class RecomputeStrategy(CheckpointStrategy):
    """A strategy that checkpoints units and recomputes them in backward.

    Subclasses define :meth:`segments_for` (half-open member ranges for a chain of ``n``),
    and may steer a unit's checkpoint with :attr:`checkpoint_contexts` (what is saved inside
    it), :meth:`boundary_hooks` (where the kept inputs live) and :meth:`compile_context_fn`
    (what ``torch.compile`` may save).
    """

    recomputes = True
    #: How a plan writes this strategy's segments (a :class:`remat.planner.UnitPlan`
    #: segment's mode): ``recompute`` (whole segment), ``selective``, ``offload``.
    segment_mode = "recompute"

    #: Callable giving a (forward, recompute) context pair for each checkpointed region, or
    #: ``None``; strategies that steer what is saved inside a unit (selective) define it.
    checkpoint_contexts: Callable[[], tuple] | None = None

    def segments_for(self, n: int) -> list[tuple[int, int]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def boundary_hooks(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
        """``(pack, unpack)`` applied to the tensors a region keeps (its inputs), or
        ``None`` to keep them as they are (offload moves them to host memory)."""
        return None

    def compile_context_fn(self) -> Callable[[], tuple] | None:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` under ``torch.compile``:
        it must be a plain function or a ``functools.partial`` (dynamo's rule), or ``None``."""
        return None

    def wrap_stage(self, path: str, module: nn.Module, report: StrategyReport) -> None:
        if isinstance(module, CHAIN_TYPES):
            members = chain_members(module)
            bounds = self.segments_for(len(members))
            plan = ChainPlan(path, bounds, joins=True)
            plan.join_declared_writers([member for _, member in members])
            for name, member, indices in wrapping.distinct_members(members):
                wrapping.install(member, wrapping.Wrap(
                    self, child_path(path, name), self.run, chain=plan, index=indices[0],
                    indices=indices if len(indices) > 1 else ()))
            report.segments[path] = plan.bounds  # joins show (ChainPlan.join_writer)
            report.wrapped.extend(child_path(path, name) for name, _ in members)
        else:
            wrapping.install(module, wrapping.Wrap(self, path, self.run))
            report.segments[path] = [(0, 1)]
            report.wrapped.append(path)

    def preflight(self, model: nn.Module) -> None:
        """Refuse a recomputed unit holding a SyncBatchNorm that would sync twice.

        Raises:
            StageError: names the SyncBatchNorm module (see
                :func:`~remat.strategies.recompute.refuse_sync_batchnorm`).
        """
        for _, module, wrap in wrapping.wraps_of(model):
            if wrap.owner is self and self.recomputes:
                refuse_sync_batchnorm(module, wrap.path)

    def run(self, module: nn.Module, wrap: wrapping.Wrap, forward: Callable[..., Any],
            args: tuple, kwargs: dict) -> Any:
        """Runner of the wrap (see :mod:`remat.strategies.wrapping`)."""
        return run_recomputed(self, module, wrap, forward, args, kwargs)


#: The name the segment strategies were first written against.
SegmentStrategy = RecomputeStrategy
