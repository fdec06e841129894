"""The strategy contract: ``apply(model, stages) -> StrategyReport`` and ``remove(model)``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from torch import nn


@dataclass
class StrategyReport:
    """What a strategy did to a model.

    Attributes:
        strategy: registry name of the strategy (``none``, ``full``, ``sqrtn``, ...).
        stages: resolved dotted paths of the stages it was asked to act on.
        wrapped: dotted paths of the modules (blocks) whose activations are now recomputed.
        segments: chain path -> half-open block ranges, one per checkpointed segment.
        kept_boundaries: number of segment inputs kept in the forward pass (one per segment).
    """

    strategy: str
    stages: list[str] = field(default_factory=list)
    wrapped: list[str] = field(default_factory=list)
    segments: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def kept_boundaries(self) -> int:
        return sum(len(v) for v in self.segments.values())

    def to_dict(self) -> dict:
        """JSON-ready form (tuples become lists)."""
        out = asdict(self)
        out["segments"] = {k: [list(s) for s in v] for k, v in self.segments.items()}
        out["kept_boundaries"] = self.kept_boundaries
        return out


class CheckpointStrategy(ABC):
    """Base class of every activation checkpointing strategy.

    A strategy acts on any ``nn.Module`` in place: the wrapped model computes the same
    function (outputs, gradients, BatchNorm running statistics, dropout masks) and keeps
    the same ``state_dict`` keys; only peak memory and step time change. Under ``eval()``
    or ``torch.no_grad()`` a strategy does nothing.
    """

    name: str = "base"

    @abstractmethod
    def apply(self, model: nn.Module, stages: Iterable[str]) -> StrategyReport:
        """Wrap the stages of ``model`` (dotted paths with globs) in place.

        Applying twice is the same as applying once; applying over another strategy
        replaces it.
        """

    @abstractmethod
    def remove(self, model: nn.Module) -> None:
        """Restore the original behaviour of every module of ``model`` this kind wraps."""

    def verify(self, model: nn.Module) -> None:
        """Check, after one training forward, that the wrapping is on the code path used.

        The default checks nothing; strategies that patch modules override it.
        """
        return None

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"
