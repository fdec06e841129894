"""``none``: the baseline every other strategy is compared with."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from remat.strategies.base import CheckpointStrategy, StrategyReport
from remat.strategies.segmented import unpatch_all
from remat.strategies.stages import resolve_stages


class NoCheckpoint(CheckpointStrategy):
    """Keep every activation; wrap nothing.

    ``apply`` still resolves the stages (so a wrong stage path fails the same way for
    every strategy) and removes any remat wrapping left on the model.
    """

    name = "none"

    def apply(self, model: nn.Module, stages: Iterable[str]) -> StrategyReport:
        resolved = resolve_stages(model, stages)
        unpatch_all(model)
        return StrategyReport(strategy=self.name, stages=[p for p, _ in resolved])

    def remove(self, model: nn.Module) -> None:
        unpatch_all(model)
