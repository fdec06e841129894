"""Shared fixtures: the real-data root and small helpers used across the suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The suite runs tiny models, where thread start-up costs more than it saves (notably on a
# shared 2-core machine); subprocess tests set their own.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def remat_data_dir() -> Path:
    """Root of the real datasets, from ``$REMAT_DATA_DIR``.

    A missing variable or folder is a test failure, not a skip: CI (``.ci/run``) and
    ``make test`` always set it, so its absence means the set-up is broken.
    """
    value = os.environ.get("REMAT_DATA_DIR")
    if not value:
        pytest.fail("REMAT_DATA_DIR is not set; run the suite through `make test` or set it to "
                    "the folder that holds Kvasir-SEG/, ISBI2012-EM-membrane/, ...")
    path = Path(value)
    if not path.is_dir():
        pytest.fail(f"REMAT_DATA_DIR={value} is not a directory")
    return path


@pytest.fixture(scope="session")
def kvasir_root(remat_data_dir: Path) -> Path:
    """The real Kvasir-SEG copy (``images/*.jpg``, ``masks/*.jpg``)."""
    root = remat_data_dir / "Kvasir-SEG"
    if not (root / "images").is_dir() or not (root / "masks").is_dir():
        pytest.fail(f"Kvasir-SEG not found under {root} (expected images/ and masks/)")
    return root
