"""Shared fixtures: the real-data root and small helpers used across the suite."""

from __future__ import annotations

import ast
import functools
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



# --- pytest-xdist (`make test`: -n 2 --dist loadgroup) ---------------------------------------
# xdist 3.8's loadgroup reads a test's group from an "@group" suffix it writes into the node
# id, which pytest 9.2 no longer lets it write (pytest-dev/pytest-xdist#1386): every test
# would go to any worker. The scheduler below keeps the two rules the suite needs, read from
# each test module's source so that a new module follows them without a list to update:
# - a module with `pytestmark = pytest.mark.xdist_group("<name>")` runs on one worker with
#   every other module of that group ("gloo": the multi-process DDP/FSDP launches, whose
#   ports and 2 processes each must not meet another launch);
# - a module that defines a module-, class-, package- or session-scoped fixture runs on one
#   worker, so that the fixture (a training run several tests read) is built once.
# Every other test is scheduled alone, as `--dist load` does.
_SHARED_SCOPES = {"module", "class", "package", "session"}


def _decorator_call(node: ast.expr, name: str) -> ast.Call | None:
    """``node`` if it is a call of ``pytest.<name>`` / ``pytest.mark.<name>`` / ``<name>``."""
    if isinstance(node, ast.Call):
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr == name) or (
                isinstance(func, ast.Name) and func.id == name):
            return node
    return None


def _string_arg(call: ast.Call, keyword: str) -> str | None:
    values = [*call.args[:1], *(k.value for k in call.keywords if k.arg == keyword)]
    for value in values:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None


@functools.cache
def module_group(path: str) -> str | None:
    """The xdist work unit of every test of the module at ``path`` (relative to the rootdir),
    or ``None`` when its tests are scheduled one by one (rules above)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    shared = False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            marks = (node.value.elts if isinstance(node.value, ast.List | ast.Tuple)
                     else [node.value])
            for mark in marks:
                call = _decorator_call(mark, "xdist_group")
                if call is not None and (name := _string_arg(call, "name")):
                    return name
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            for deco in node.decorator_list:
                call = _decorator_call(deco, "fixture")
                if call is not None and _string_arg(call, "scope") in _SHARED_SCOPES:
                    shared = True
    return path if shared else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup``: xdist's group scheduler, with the groups of :func:`module_group`
    (an ``@group`` suffix, should xdist write one again, still wins)."""
    if config.getoption("dist", None) != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    root = config.rootpath

    class ModuleGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return super()._split_scope(nodeid)
            return module_group(str(root / nodeid.split("::", 1)[0])) or nodeid

    return ModuleGroupScheduling(config, log)
