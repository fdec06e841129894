"""Download-and-verify helpers and the prepare scripts' manifests (offline: no network)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from remat.data.download import git_blob_sha1, parse_manifest, verify_tree

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_git_blob_hash_matches_git(tmp_path: Path):
    path = tmp_path / "hello.txt"
    path.write_bytes(b"hello\n")
    # `printf 'hello\n' | git hash-object --stdin`
    assert git_blob_sha1(path) == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_verify_tree_reports_missing_and_changed_files(tmp_path: Path):
    (tmp_path / "a b").mkdir()
    (tmp_path / "a b" / "x.png").write_bytes(b"hello\n")
    (tmp_path / "y.png").write_bytes(b"changed")
    manifest = parse_manifest(
        "ce013625030ba8dba906f756967f9e9ca394464a  a b/x.png\n\n"
        "ce013625030ba8dba906f756967f9e9ca394464a  y.png\n"
        "ce013625030ba8dba906f756967f9e9ca394464a  z.png\n")
    assert verify_tree(tmp_path, manifest) == ["hash mismatch: y.png", "missing: z.png"]
    with pytest.raises(ValueError, match="manifest line 1"):
        parse_manifest("not-a-hash  x.png")


@pytest.mark.parametrize("name,fixture,count", [
    ("prepare_isbi2012", "isbi_root", 90),
    ("prepare_dubai_aerial", "dubai_root", 144),
])
def test_prepare_manifest_matches_the_real_copy(name: str, fixture: str, count: int,
                                                request: pytest.FixtureRequest):
    root = request.getfixturevalue(fixture)
    module = _script(name)
    assert len(module.MANIFEST) == count and root.name == module.FOLDER
    assert verify_tree(root, module.MANIFEST) == []
    assert module.main(["--verify-only", "--dest", str(root)]) == 0
