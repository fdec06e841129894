"""Image sizes in configs: one side (``256``) or ``[height, width]`` (``[512, 768]``), in pixels.

Every key that takes an image size (``data.image_size``, ``data.patch_size``,
``model.inference.patch_size``) goes through :func:`as_pair`, so a square size and its
``[h, w]`` spelling mean the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def as_pair(size: int | Sequence[int], name: str = "patch_size") -> tuple[int, int]:
    """``256`` or ``[256, 512]`` (a list, tuple or omegaconf ``ListConfig``) ->
    ``(height, width)`` in pixels.

    Args:
        size: one positive int (a square) or two (height, width).
        name: the config key, for the message (``data.image_size``).

    Raises:
        ValueError: not one or two positive ints; the message names ``name`` and the value.
    """
    if _positive_int(size):
        return (int(size), int(size))  # type: ignore[arg-type]
    values = tuple(size) if isinstance(size, Sequence) and not isinstance(size, str) else ()
    if len(values) != 2 or not all(_positive_int(v) for v in values):
        shown = list(values) if values else size
        raise ValueError(f"{name} must be a positive int or [height, width] of positive ints "
                         f"(pixels), got {shown!r}")
    return (int(values[0]), int(values[1]))


def as_spatial(size: int | Sequence[int], dims: int, name: str = "patch_size"
               ) -> tuple[int, ...]:
    """``96`` or ``[96, 96, 64]`` -> a ``dims``-tuple of sides (pixels or voxels): one int
    is the side of a square (``dims=2``) or cube (``dims=3``).

    Raises:
        ValueError: not one positive int or ``dims`` of them; names ``name``.
    """
    if _positive_int(size):
        return (int(size),) * dims  # type: ignore[arg-type]
    values = tuple(size) if isinstance(size, Sequence) and not isinstance(size, str) else ()
    if len(values) != dims or not all(_positive_int(v) for v in values):
        shown = list(values) if values else size
        raise ValueError(f"{name} must be a positive int or {dims} positive ints "
                         f"({'[height, width]' if dims == 2 else '[depth, height, width]'}), "
                         f"got {shown!r}")
    return tuple(int(v) for v in values)


def same_size(a: Any, b: Any) -> bool:
    """Whether two size settings (int, ``[h, w]`` or None) name the same size: ``128`` and
    ``[128, 128]`` do; None equals only None. Values that are no size compare as given."""
    if a is None or b is None:
        return a is b
    try:
        return as_pair(a) == as_pair(b)
    except ValueError:
        return a == b
