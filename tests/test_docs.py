"""The docs site's pages agree with their sources: the benchmark pages with the result files
they are rendered from, the API pages with the packages' public names, every page with the
toctree. (``make docs`` builds the site with warnings as errors; this runs without Sphinx.)"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _renderer():
    """``scripts/render_docs_tables.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("render_docs_tables",
                                                  ROOT / "scripts" / "render_docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


render = _renderer()


def test_rendered_benchmark_pages_equal_their_result_files():
    """Re-render every benchmark page in memory: the committed page must be exactly that (a
    table edited on the page, or a CSV changed without rendering, fails)."""
    pages = render.render_all()
    assert len(pages) == len(render.PAGES) + 1  # the index too
    stale = [str(p.relative_to(ROOT)) for p, text in pages.items()
             if not p.is_file() or p.read_text() != text]
    assert not stale, f"render again with python scripts/render_docs_tables.py: {stale}"
    on_disk = sorted((DOCS / "benchmarks").glob("*.md"))
    assert on_disk == sorted(pages), "a page in docs/benchmarks/ that no result renders"


def test_every_result_is_on_a_page_with_its_command_and_table_mark():
    assert render.unused_results() == []
    for csv_path in sorted(render.RESULTS.glob("*.csv")):
        text = csv_path.with_suffix(".md").read_text()
        assert re.search(r"```bash\n.+?```", text, re.S), f"{csv_path.stem}: no command"
        assert text.count(render.TABLE_MARK) <= 1, csv_path.stem
        assert text.startswith("## "), f"{csv_path.stem}: no heading"
    for _, _, names in render.PAGES.values():
        assert len(names) == len(set(names))


def test_every_csv_row_is_on_its_page_cell_for_cell():
    """Each result's table sits on its committed page as one block: the header, then every
    CSV row in order, each cell as the CSV holds it."""
    import csv

    for page, (_, _, names) in render.PAGES.items():
        lines = (render.BENCHMARKS / f"{page}.md").read_text().split("\n")
        for name in names:
            with (render.RESULTS / f"{name}.csv").open(newline="") as f:
                rows = list(csv.reader(f))
            table = ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
                     for row in rows]
            table.insert(1, "| " + " | ".join("---" for _ in rows[0]) + " |")
            found = any(lines[i:i + len(table)] == table for i in range(len(lines)))
            assert found, f"docs/benchmarks/{page}.md lacks the table of {name}.csv"
    page = (render.BENCHMARKS / "strategies.md").read_text()
    assert "| sqrtn | 698 MiB | 0.78 | 3.39 s | 1.12 | yes |" in page  # a measured row


def test_markdown_table_escapes_pipes_and_refuses_ragged_rows(tmp_path):
    good = tmp_path / "good.csv"
    good.write_text('a,b\n1,"x|y"\n')
    assert render.markdown_table(good) == "| a | b |\n| --- | --- |\n| 1 | x\\|y |\n"
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2,3\n")
    with pytest.raises(ValueError, match="line 2: 3 cells, the header has 2"):
        render.markdown_table(bad)
    with pytest.raises(FileNotFoundError, match="'nothing_here'"):
        render.render_result("nothing_here")


def test_the_check_mode_names_a_stale_page(tmp_path, monkeypatch, capsys):
    """``--check`` fails on a page that differs, and passes once it is written."""
    monkeypatch.setattr(render, "BENCHMARKS", tmp_path / "benchmarks")
    monkeypatch.setattr(render, "DOCS", tmp_path)
    assert render.main(["--check"]) == 1
    assert "differs from docs/results/" in capsys.readouterr().err
    assert render.main([]) == 0
    assert render.main(["--check"]) == 0


@pytest.mark.parametrize("package", ["strategies", "planner", "measure"])
def test_the_api_page_lists_every_public_name(package):
    """Every name of the package's ``__all__`` is on its API page: classes and functions as
    autodoc entries (their docstrings), constants in the constants list."""
    module = importlib.import_module(f"remat.{package}")
    text = (DOCS / "api" / f"{package}.md").read_text()
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if callable(obj):
            kind = "autoclass" if isinstance(obj, type) else "autofunction"
            if f".. {kind}:: remat.{package}.{name}\n" not in text:
                missing.append(name)
        elif f"`remat.{package}.{name}`\n: " not in text:
            missing.append(name)
    assert not missing, f"docs/api/{package}.md lacks {missing}"


def _toctree_entries(page: Path) -> list[Path]:
    entries = []
    for block in re.findall(r"```\{toctree\}\n(.*?)```", page.read_text(), re.S):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith(":"):
                entries.append((page.parent / f"{line}.md").resolve())
    return entries


def test_every_page_is_in_a_toctree_and_every_entry_exists():
    pages = {p.resolve() for p in DOCS.rglob("*.md")
             if not {"_build", "results"} & set(p.relative_to(DOCS).parts)}
    listed = {e for p in pages for e in _toctree_entries(p)}
    assert listed - pages == set(), "toctree entries without a page"
    assert pages - listed == {(DOCS / "index.md").resolve()}, "pages in no toctree"
    for required in ("training", "strategies", "planning", "estimate-and-bench", "datasets",
                     "your-own-data", "your-own-model", "resume-eval-predict", "sequences",
                     "scale-out", "reproducing-benchmarks", "troubleshooting"):
        assert (DOCS / f"{required}.md").resolve() in listed, required


def test_the_docs_build_is_configured_as_make_docs_runs_it():
    makefile = (ROOT / "Makefile").read_text()
    assert "sphinx-build -W --keep-going -b html docs docs/_build/html" in makefile
    assert "docs/_build" in (ROOT / ".gitignore").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^docs = \[(.*?)\]", pyproject, re.M)
    assert extra and all(p in extra.group(1) for p in ("sphinx", "myst-parser", "furo"))
    conf = (DOCS / "conf.py").read_text()
    assert all(e in conf for e in ('"myst_parser"', '"sphinx.ext.autodoc"',
                                   '"sphinx.ext.napoleon"'))
