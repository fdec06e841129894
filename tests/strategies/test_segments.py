import math

import pytest

from remat.strategies import balanced_segments, every_k_segments, sqrt_segments


def _assert_partition(bounds, n):
    flat = [i for start, end in bounds for i in range(start, end)]
    assert flat == list(range(n))
    assert all(end > start for start, end in bounds)


@pytest.mark.parametrize("n", range(0, 65))
def test_sqrt_segments_partition_into_ceil_sqrt_near_equal_parts(n):
    bounds = sqrt_segments(n)
    _assert_partition(bounds, n)
    assert len(bounds) == (math.ceil(math.sqrt(n)) if n else 0)
    sizes = [end - start for start, end in bounds]
    assert not sizes or max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n", range(0, 65))
def test_every_k_segments_partition_for_every_k(n):
    for k in range(1, 70):
        bounds = every_k_segments(n, k)
        _assert_partition(bounds, n)
        assert all(end - start == k for start, end in bounds[:-1])
        if n and k >= n:
            assert bounds == [(0, n)]


def test_known_values():
    assert sqrt_segments(16) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert sqrt_segments(6) == [(0, 2), (2, 4), (4, 6)]
    assert sqrt_segments(5) == [(0, 2), (2, 4), (4, 5)]
    assert every_k_segments(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert balanced_segments(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert balanced_segments(2, 5) == [(0, 1), (1, 2)]


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_every_k_rejects_bad_k(k):
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        every_k_segments(4, k)


def test_negative_n_rejected():
    with pytest.raises(ValueError, match=">= 0"):
        sqrt_segments(-1)
