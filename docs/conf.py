"""Sphinx configuration of remat's docs: ``make docs`` (warnings are errors).

Pages are Markdown (MyST-Parser), so the same files read well on GitHub. The API pages use
autodoc with napoleon because remat's docstrings are Google style (``Args:``, ``Returns:``,
``Raises:`` sections with shapes and units): napoleon renders them as they are written, with
no second copy of the reference to keep in step. Furo is the theme (a clean, readable layout
with a sidebar for the many pages); without it installed the build falls back to alabaster.
Nothing is executed at build time (no notebooks), so a build takes seconds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the worktree's package, also without an install

project = "remat"
author = "remat contributors"
copyright = "remat contributors, MIT licence"  # noqa: A001 - Sphinx's name

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
# docs/results/ holds the result files the benchmark pages are rendered from
# (scripts/render_docs_tables.py); they are not pages themselves.
exclude_patterns = ["_build", "results", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autosummary_generate = False  # the API page lists members itself; no generated stubs
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo" if importlib.util.find_spec("furo") else "alabaster"
html_title = "remat"
