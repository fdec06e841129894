"""``sqrtn``: ceil(sqrt(N)) segments per chain (Chen et al. 2016)."""

from __future__ import annotations

from remat.strategies.segmented import SegmentStrategy
from remat.strategies.segments import sqrt_segments


class SqrtN(SegmentStrategy):
    """Split each chain of N blocks into ceil(sqrt(N)) contiguous near-equal segments.

    Source: Chen, Xu, Zhang, Guestrin, "Training Deep Nets with Sublinear Memory Cost",
    arXiv 1604.06174 (2016): O(sqrt(N)) activation memory for about one extra forward.
    """

    name = "sqrtn"

    def segments_for(self, n: int) -> list[tuple[int, int]]:
        return sqrt_segments(n)
