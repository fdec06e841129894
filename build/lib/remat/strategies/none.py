"""``none``: the baseline every other strategy is compared with."""

from __future__ import annotations

from remat.strategies.base import CheckpointStrategy


class NoCheckpoint(CheckpointStrategy):
    """Keep every activation; wrap nothing.

    ``apply`` still resolves the stages (so a wrong stage path fails the same way for
    every strategy) and removes any remat wrapping left on the model.
    """

    name = "none"
