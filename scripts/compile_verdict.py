"""Turn ``remat.bench`` runs with compiled rows into the docs' result files: one table per
run (every row's measured peak and step time over eager ``none``'s) and one verdict table
over all runs: at each ``torch_compile_budget`` point (and at plain ``torch.compile``, budget
1.0), the fastest remat row (a plan or strategy, eager or compiled; ``none`` rows aside)
whose measured peak is no higher, with its step time over the compiled row's, by medians of
the interleaved rounds and by each row's fastest step.

    python scripts/compile_verdict.py --run unet_r34=outputs/bench/<date>/<time>/bench.json \\
        --run gpt_small=... --run vit_s=... --out docs/results

Writes ``<out>/plans_vs_compile_<name>.csv`` per run and ``<out>/plans_vs_compile_summary.csv``;
their ``.md`` companions (setup, command, reading) are written by hand. The summary keeps the
rows of models not given (one model's run can be redone alone); a given model's rows are
replaced, in the summary's order.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

MIB = 2**20
BUDGET = re.compile(r"torch_compile_budget\(memory_budget=([0-9.]+)\)")


def _label(row: dict) -> str:
    name = row["strategy"]
    if row.get("compiled"):
        name = name.replace(f" (compiled, {row['compiled']})", "") + ", compiled"
    return name


def _is_remat(row: dict) -> bool:
    base = row["strategy"].split(" (compiled")[0]
    return base != "none" and not base.startswith("torch_compile_budget")


def _times(row: dict, none: dict) -> tuple[float, float]:
    """Median and fastest step over eager ``none``'s median and fastest."""
    return (row["median_ms"] / none["median_ms"], min(row["step_ms"]) / min(none["step_ms"]))


def run_table(record: dict) -> list[dict[str, str]]:
    rows = record["rows"]
    none = next(r for r in rows if r["strategy"] == "none")
    out = []
    for r in rows:
        median, fastest = _times(r, none)
        out.append({
            "row": _label(r),
            "measured peak": f"{r['peak_bytes'] / MIB:.1f} MiB",
            "x eager none": f"{r['peak_bytes'] / none['peak_bytes']:.2f}",
            "step x eager none (median)": f"{median:.2f}",
            "step x eager none (fastest)": f"{fastest:.2f}",
            "recompute FLOPs x none": (f"{r['flops_ratio']:.3f}" if r.get("flops_ratio")
                                       and not r.get("compiled") else "-"),
            "grad rel err": f"{r['grad_rel_error']:.1e}" if r["grad_rel_error"] else "0",
        })
    return out


def verdict(name: str, record: dict) -> list[dict[str, str]]:
    rows = record["rows"]
    none = next(r for r in rows if r["strategy"] == "none")
    points = []
    for r in rows:
        if not r.get("compiled"):
            continue
        base = r["strategy"].split(" (compiled")[0]
        match = BUDGET.fullmatch(base)
        if base == "none":
            points.append(("1.0", r))
        elif match:
            points.append((match.group(1), r))
    out = []
    for budget, point in points:
        candidates = [r for r in rows if _is_remat(r) and r["peak_bytes"] <= point["peak_bytes"]]
        p_median, p_fastest = _times(point, none)
        best = min(candidates, key=lambda r: r["median_ms"], default=None)
        entry = {"model": name, "torch.compile budget": budget,
                 "compile: peak, step x eager none":
                     f"{point['peak_bytes'] / MIB:.1f} MiB, {p_median:.2f}"}
        if best is None:
            entry.update({"fastest remat row at no higher peak": "none reaches it",
                          "remat: peak, step x eager none": "-",
                          "remat / compile step (median)": "-",
                          "remat / compile step (fastest)": "-"})
        else:
            median, fastest = _times(best, none)
            entry.update({
                "fastest remat row at no higher peak": _label(best),
                "remat: peak, step x eager none":
                    f"{best['peak_bytes'] / MIB:.1f} MiB, {median:.2f}",
                "remat / compile step (median)": f"{median / p_median:.2f}",
                "remat / compile step (fastest)": f"{fastest / p_fastest:.2f}"})
        out.append(entry)
    return out


def _write(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True,
                        help="NAME=path/to/bench.json (one per model)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    new: dict[str, list[dict[str, str]]] = {}
    for item in args.run:
        name, _, path = item.partition("=")
        record = json.loads(Path(path).read_text())
        _write(args.out / f"plans_vs_compile_{name}.csv", run_table(record))
        new[name] = verdict(name, record)
    path = args.out / "plans_vs_compile_summary.csv"
    kept = list(csv.DictReader(path.open())) if path.is_file() else []
    models = list(dict.fromkeys([r["model"] for r in kept] + list(new)))
    summary = [row for model in models
               for row in new.get(model, [r for r in kept if r["model"] == model])]
    _write(path, summary)


if __name__ == "__main__":
    main()
