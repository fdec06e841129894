"""The package's layering holds (GUIDE.md sec. 2): read from the source with ``ast``.

- Entry modules (``python -m remat.<name>``) parse, call the library and print: nothing
  imports them, none is longer than :data:`MAX_ENTRY_LINES` lines.
- ``strategies``, ``measure`` and ``planner`` work on any ``nn.Module``: they import no
  Lightning, neither directly nor through another module.
- No module imports a private name (``_name``) of another remat module.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "remat"
ENTRY_MODULES = ("train", "bench", "plan", "eval", "estimate", "report", "predict")
MAX_ENTRY_LINES = 300
NO_LIGHTNING = ("strategies", "measure", "planner")
LIGHTNING_ROOTS = ("lightning", "pytorch_lightning", "lightning_fabric")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(SRC.rglob("*.py"))}


def _is_package(module: str) -> bool:
    return (SRC.parent / Path(*module.split(".")) / "__init__.py").is_file()


def _is_module(module: str) -> bool:
    path = SRC.parent / Path(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if _is_package(module) else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def _imports(module: str, tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` for every import anywhere in the module (function bodies
    included): ``import a.b`` gives ``("a.b", None)``, ``from a import b`` ``("a", "b")``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            found += [(node.lineno, source, a.name) for a in node.names]
    return found


def _imported_modules(module: str, tree: ast.Module) -> list[tuple[int, str]]:
    """Every module an import statement loads: ``from remat import train`` loads
    ``remat.train``, ``from remat.train import main`` loads ``remat.train`` too."""
    loaded = []
    for line, source, name in _imports(module, tree):
        loaded.append((line, source))
        if name is not None and name != "*":
            loaded.append((line, f"{source}.{name}"))
    return loaded


MODULES = _modules()


def test_the_entry_modules_are_the_console_scripts():
    scripts = re.findall(r'^remat-[\w-]+ = "remat\.(\w+):main"$',
                         (REPO / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert sorted(scripts) == sorted(ENTRY_MODULES)
    assert all(f"remat.{name}" in MODULES for name in ENTRY_MODULES)


def test_no_module_imports_an_entry_module():
    """Neither library code nor another entry module nor a script under ``scripts/`` (they
    run the entry points as commands, ``python -m remat.bench ...``)."""
    entries = {f"remat.{name}" for name in ENTRY_MODULES}
    scripts = {f"scripts.{p.stem}": ast.parse(p.read_text(), str(p))
               for p in sorted((REPO / "scripts").glob("*.py"))}
    offenders = sorted(
        f"{module} line {line} imports {target}"
        for module, tree in {**MODULES, **scripts}.items()
        for line, target in _imported_modules(module, tree)
        if any(target == e or target.startswith(e + ".") for e in entries) and target != module)
    assert offenders == []


def test_no_config_instantiates_from_an_entry_module():
    pattern = re.compile(r"_target_:\s*remat\.(" + "|".join(ENTRY_MODULES) + r")\.")
    offenders = sorted(f"{p.relative_to(SRC)}: {m.group(0)}"
                       for p in (SRC / "configs").rglob("*.yaml")
                       for m in pattern.finditer(p.read_text()))
    assert offenders == []


@pytest.mark.parametrize("name", ENTRY_MODULES)
def test_entry_module_stays_short(name):
    lines = len((SRC / f"{name}.py").read_text().splitlines())
    assert lines <= MAX_ENTRY_LINES, (
        f"remat/{name}.py has {lines} lines (> {MAX_ENTRY_LINES}): move library logic out")


@pytest.mark.parametrize("package", NO_LIGHTNING)
def test_core_packages_import_no_lightning(package):
    offenders = sorted(
        f"{module} line {line} imports {target}"
        for module, tree in MODULES.items()
        if module == f"remat.{package}" or module.startswith(f"remat.{package}.")
        for line, target in _imported_modules(module, tree)
        if target.split(".")[0] in LIGHTNING_ROOTS)
    assert offenders == []


def test_core_packages_load_no_lightning_through_other_modules():
    code = ("import sys\n"
            + "".join(f"import remat.{p}\n" for p in NO_LIGHTNING)
            + f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(LIGHTNING_ROOTS)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=300, check=True)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_no_private_name_is_imported_from_another_module():
    offenders = sorted(
        f"{module} line {line}: from {source} import {name}"
        for module, tree in MODULES.items() for line, source, name in _imports(module, tree)
        if source.split(".")[0] == "remat" and source != module and name is not None
        and name.startswith("_") and not name.startswith("__")
        and not _is_module(f"{source}.{name}") and name != "_compat")  # private modules: ok
    assert offenders == []


def test_the_checks_see_what_they_look_for():
    """The walkers find each kind of import they check (so an empty offender list means
    there is none, not that the walker missed them)."""
    tree = ast.parse("def f():\n    from remat import train\n    import lightning as L\n"
                     "from remat.strategies.selective import _flops\nfrom . import _x\n")
    loaded = [t for _, t in _imported_modules("remat.strategies.selective", tree)]
    assert "remat.train" in loaded and "lightning" in loaded
    private = [(s, n) for _, s, n in _imports("remat.strategies.selective", tree)]
    assert ("remat.strategies.selective", "_flops") in private
    assert ("remat.strategies", "_x") in private
