"""Segment math: split a chain of ``n`` blocks into contiguous, checkpointed segments.

Every function returns half-open block ranges ``[(start, end), ...]`` that partition
``range(n)`` exactly, in order. Only the input of each segment is kept in the forward pass;
the activations inside a segment are recomputed in backward.
"""

from __future__ import annotations

import math


def _check_n(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"number of blocks must be an int >= 0, got {n!r}")


def balanced_segments(n: int, num_segments: int) -> list[tuple[int, int]]:
    """Split ``n`` blocks into ``min(num_segments, n)`` contiguous segments of near-equal size.

    Sizes differ by at most one block; the longer segments come first.

    Raises:
        ValueError: ``n < 0`` or ``num_segments < 1``.
    """
    _check_n(n)
    if not isinstance(num_segments, int) or num_segments < 1:
        raise ValueError(f"num_segments must be an int >= 1, got {num_segments!r}")
    if n == 0:
        return []
    num_segments = min(num_segments, n)
    base, extra = divmod(n, num_segments)
    bounds, start = [], 0
    for i in range(num_segments):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def sqrt_segments(n: int) -> list[tuple[int, int]]:
    """``ceil(sqrt(n))`` near-equal segments (Chen et al. 2016, arXiv 1604.06174, sec. 4.1).

    Keeping one boundary per segment plus one segment's activations during its recompute
    gives O(sqrt(n)) activation memory for about one extra forward pass.
    """
    _check_n(n)
    return balanced_segments(n, math.isqrt(n - 1) + 1) if n else []


def every_k_segments(n: int, k: int) -> list[tuple[int, int]]:
    """Segments of ``k`` blocks, the last one shorter if ``k`` does not divide ``n``.

    This is Megatron-LM's "uniform" recompute method (``--recompute-num-layers k``);
    ``k >= n`` gives one segment.

    Raises:
        ValueError: ``k < 1`` or ``n < 0``.
    """
    _check_n(n)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"every_k: k must be an int >= 1, got {k!r}")
    return [(start, min(start + k, n)) for start in range(0, n, k)]
