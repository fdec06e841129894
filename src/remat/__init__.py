"""remat: activation checkpointing strategies for Lightning + Hydra training."""

import re

import torch

__version__ = "0.1.0"

#: oldest torch (major, minor) remat is tested on; equal to pyproject's lower bound. Older
#: releases lack private internals remat needs (see remat._compat).
TORCH_MIN = (2, 13)


def torch_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.14.1+cu130"`` -> ``(2, 14)``).

    Raises:
        ValueError: ``version`` does not start with ``<major>.<minor>``.
    """
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str | None = None) -> None:
    """Raise unless ``version`` (default: the installed ``torch.__version__``) is at least
    :data:`TORCH_MIN`.

    Raises:
        ImportError: one line naming the torch remat needs and the one found.
    """
    version = torch.__version__ if version is None else version
    if torch_release(version) < TORCH_MIN:
        need = ".".join(map(str, TORCH_MIN))
        raise ImportError(f"remat needs torch>={need}, found torch {version}; "
                          f"install it with: pip install 'torch>={need}'")


check_torch()  # before any module imports a torch internal that an older torch lacks
