"""scripts/compile_verdict.py: the docs' verdict table picks, per compiler budget, the fastest
remat row whose measured peak is no higher, from a bench record."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _script():
    spec = importlib.util.spec_from_file_location("compile_verdict",
                                                  ROOT / "scripts" / "compile_verdict.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(strategy, peak_mib, steps, compiled=None, flops_ratio=None, err=0.0):
    return {"strategy": strategy + (f" (compiled, {compiled})" if compiled else ""),
            "peak_bytes": int(peak_mib * MIB), "median_ms": sorted(steps)[len(steps) // 2],
            "step_ms": list(steps), "compiled": compiled, "flops_ratio": flops_ratio,
            "grad_rel_error": err}


RECORD = {"rows": [
    _row("none", 1000, [100, 100, 100], flops_ratio=1.0),
    _row("budget(memory=900MiB)", 700, [120, 110, 130], flops_ratio=1.1),
    _row("none", 950, [90, 95, 92], compiled="inductor", err=1e-3),
    _row("torch_compile_budget(memory_budget=0.5)", 650, [100, 98, 99], compiled="inductor"),
    _row("torch_compile_budget(memory_budget=0.1)", 500, [110, 111, 112], compiled="inductor"),
    _row("budget(memory=900MiB)", 640, [105, 104, 103], compiled="inductor"),
]}


def test_verdict_picks_the_fastest_remat_row_at_no_higher_peak():
    rows = _script().verdict("net", RECORD)
    by = {r["torch.compile budget"]: r for r in rows}
    assert list(by) == ["1.0", "0.5", "0.1"]
    # 1.0 (compiled none, 950 MiB): both plans fit; the compiled one is faster (median 104)
    assert by["1.0"]["fastest remat row at no higher peak"] == "budget(memory=900MiB), compiled"
    assert by["1.0"]["remat / compile step (median)"] == f"{104 / 92:.2f}"
    assert by["1.0"]["remat / compile step (fastest)"] == f"{103 / 90:.2f}"
    assert by["0.5"]["remat: peak, step x eager none"] == "640.0 MiB, 1.04"
    # no remat row at or below 500 MiB
    assert by["0.1"]["fastest remat row at no higher peak"] == "none reaches it"


def test_script_writes_a_table_per_run_and_the_summary(tmp_path):
    record = tmp_path / "bench.json"
    record.write_text(json.dumps(RECORD))
    argv = sys.argv
    sys.argv = ["compile_verdict.py", "--run", f"net={record}", "--out", str(tmp_path)]
    try:
        _script().main()
    finally:
        sys.argv = argv
    table = list(csv.DictReader((tmp_path / "plans_vs_compile_net.csv").open()))
    assert [r["row"] for r in table] == [
        "none", "budget(memory=900MiB)", "none, compiled",
        "torch_compile_budget(memory_budget=0.5), compiled",
        "torch_compile_budget(memory_budget=0.1), compiled", "budget(memory=900MiB), compiled"]
    assert table[1]["recompute FLOPs x none"] == "1.100" and table[5]["grad rel err"] == "0"
    summary = list(csv.DictReader((tmp_path / "plans_vs_compile_summary.csv").open()))
    assert [r["torch.compile budget"] for r in summary] == ["1.0", "0.5", "0.1"]
    # another model's run alone: the summary keeps net's rows and adds the other's after them
    sys.argv = ["compile_verdict.py", "--run", f"other={record}", "--out", str(tmp_path)]
    try:
        _script().main()
        sys.argv[2] = f"net={record}"  # net again: its rows replaced in place, not appended
        _script().main()
    finally:
        sys.argv = argv
    summary = list(csv.DictReader((tmp_path / "plans_vs_compile_summary.csv").open()))
    assert [r["model"] for r in summary] == ["net"] * 3 + ["other"] * 3
