"""``full``: every block of every chain is its own checkpointed segment."""

from __future__ import annotations

from remat.strategies.segmented import SegmentStrategy
from remat.strategies.segments import every_k_segments


class FullCheckpoint(SegmentStrategy):
    """Checkpoint each block alone: keep only block inputs, recompute all inside a block.

    Lowest activation memory of the segment strategies for a chain whose blocks are of
    similar size; about one extra forward pass of the stages in backward.
    """

    name = "full"

    def segments_for(self, n: int) -> list[tuple[int, int]]:
        return every_k_segments(n, 1)
