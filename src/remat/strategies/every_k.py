"""``every_k``: segments of k blocks (Megatron-LM's "uniform" recompute method)."""

from __future__ import annotations

from remat.strategies.segmented import SegmentStrategy
from remat.strategies.segments import every_k_segments


class EveryK(SegmentStrategy):
    """Checkpoint each run of ``k`` consecutive blocks as one segment.

    Source: Megatron-LM ``--recompute-method uniform --recompute-num-layers k``
    (Korthikanti et al. 2022, arXiv 2205.05198). ``k >= N`` gives one segment per chain.

    Raises:
        ValueError: ``k < 1``.
    """

    name = "every_k"

    def __init__(self, k: int = 2) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"strategy.k must be an int >= 1, got {k!r} (every_k: blocks "
                             "per segment)")
        self.k = k

    def segments_for(self, n: int) -> list[tuple[int, int]]:
        return every_k_segments(n, self.k)
