"""Shared fixtures: the real-data root and small helpers used across the suite."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

#: Set to ``1``: a real-data test whose data is missing fails instead of being skipped.
REQUIRE_DATA_ENV = "REMAT_REQUIRE_DATA"

# The suite runs tiny models, where thread start-up costs more than it saves (notably on a
# shared 2-core machine); subprocess tests set their own.
torch.set_num_threads(1)
# The planner keeps this CPU's calibration on disk; the suite keeps its own, outside $HOME.
os.environ.setdefault("REMAT_CACHE_DIR", os.path.join(tempfile.gettempdir(), "remat-test-cache"))


def missing_data(reason: str) -> None:
    """A test that needs real data it cannot find: skipped with ``reason``, or failed when
    ``$REMAT_REQUIRE_DATA=1`` (``.ci/run`` sets it: there a missing copy is a broken set-up,
    never a reason to pass)."""
    if os.environ.get(REQUIRE_DATA_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_DATA_ENV}=1)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def remat_data_dir() -> Path:
    """Root of the real datasets, from ``$REMAT_DATA_DIR`` (unset or not a folder:
    :func:`missing_data`)."""
    value = os.environ.get("REMAT_DATA_DIR")
    if not value:
        missing_data("REMAT_DATA_DIR is not set: point it at the folder that holds "
                     "Kvasir-SEG/, ISBI2012-EM-membrane/, ... to run the real-data tests")
    path = Path(value)
    if not path.is_dir():
        missing_data(f"REMAT_DATA_DIR={value} is not a directory")
    return path


def _real_copy(remat_data_dir: Path, folder: str, *required: str) -> Path:
    """``remat_data_dir/folder`` if it holds every ``required`` folder, else
    :func:`missing_data`."""
    root = remat_data_dir / folder
    missing = [d for d in required if not (root / d).is_dir()]
    if missing:
        missing_data(f"{folder} not found under {remat_data_dir} (expected "
                     + ", ".join(f"{root / d}/" for d in missing) + ")")
    return root


@pytest.fixture(scope="session")
def kvasir_root(remat_data_dir: Path) -> Path:
    """The real Kvasir-SEG copy (``images/*.jpg``, ``masks/*.jpg``)."""
    return _real_copy(remat_data_dir, "Kvasir-SEG", "images", "masks")


@pytest.fixture(scope="session")
def isbi_root(remat_data_dir: Path) -> Path:
    """The real ISBI 2012 copy (``train/image/<n>.png``, ``train/label/<n>.png``)."""
    return _real_copy(remat_data_dir, "ISBI2012-EM-membrane", "train/image", "train/label")


@pytest.fixture(scope="session")
def dubai_root(remat_data_dir: Path) -> Path:
    """The real Dubai aerial copy (``Tile <t>/images/*.jpg``, ``Tile <t>/masks/*.png``)."""
    return _real_copy(remat_data_dir, "Dubai-aerial-semantic-segmentation",
                      *(f"Tile {t}/{kind}" for t in range(1, 9) for kind in ("images", "masks")))


@pytest.fixture(scope="session")
def shakespeare_root(remat_data_dir: Path) -> Path:
    """The real tiny Shakespeare copy (``tinyshakespeare/input.txt``)."""
    root = remat_data_dir / "tinyshakespeare"
    if not (root / "input.txt").is_file():
        missing_data(f"tiny Shakespeare not found: {root / 'input.txt'}")
    return root


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (``make test``): the tests of a module that
    defines a module- or session-scoped fixture (a training run several tests read) go to
    one worker, so that the fixture is built once, not once per worker. A test marked
    ``xdist_group`` already (the multi-process runs, ``"gloo"``) keeps its group."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        module = item.nodeid.split("::", 1)[0]
        defs = item._fixtureinfo.name2fixturedefs.values()
        if any(d[-1].scope != "function" and d[-1].baseid == module for d in defs):
            item.add_marker(pytest.mark.xdist_group(module))
