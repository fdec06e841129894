"""The suite's own set-up: real-data tests skip without their data, and fail instead when
``REMAT_REQUIRE_DATA=1`` (CI), so a broken CI set-up cannot pass by skipping."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REQUIRE_DATA_ENV, _real_copy, missing_data, module_group


def test_missing_data_skips_with_the_reason(monkeypatch):
    monkeypatch.delenv(REQUIRE_DATA_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="Kvasir-SEG not found"):
        missing_data("Kvasir-SEG not found")


def test_missing_data_fails_when_data_is_required(monkeypatch):
    monkeypatch.setenv(REQUIRE_DATA_ENV, "1")
    with pytest.raises(pytest.fail.Exception,
                       match=r"Kvasir-SEG not found \(REMAT_REQUIRE_DATA=1\)"):
        missing_data("Kvasir-SEG not found")


def test_a_copy_without_its_folders_names_what_is_missing(monkeypatch, tmp_path: Path):
    monkeypatch.setenv(REQUIRE_DATA_ENV, "1")
    (tmp_path / "Kvasir-SEG" / "images").mkdir(parents=True)
    with pytest.raises(pytest.fail.Exception, match=r"Kvasir-SEG/masks/"):
        _real_copy(tmp_path, "Kvasir-SEG", "images", "masks")
    (tmp_path / "Kvasir-SEG" / "masks").mkdir()
    assert _real_copy(tmp_path, "Kvasir-SEG", "images", "masks") == tmp_path / "Kvasir-SEG"


@pytest.mark.parametrize("marks,group", [
    ('pytest.mark.xdist_group("gloo")', "gloo"),
    ('[pytest.mark.slow, pytest.mark.xdist_group("gloo")]', "gloo"),
    ("pytest.mark.slow", None),
])
def test_a_module_joins_the_group_its_pytestmark_names(tmp_path: Path, marks, group):
    # a multi-process launch module outside the "gloo" group would run beside another one
    path = tmp_path / f"test_{abs(hash(marks))}.py"
    path.write_text(f"import pytest\n\npytestmark = {marks}\n\n\ndef test_x():\n    pass\n")
    assert module_group(str(path)) == group
