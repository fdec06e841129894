"""Table and plots of a sweep: ``python -m remat.report multirun/<date>/<time>``.

Reads every job's ``summary.json`` (written by :func:`remat.train.train`, also for failed
runs) and ``config.yaml`` under the directory, prints a table (strategy, precision,
accumulation, batch, size, peak memory, step time, throughput, validation metric), and
writes ``report.md``, ``report.csv``, ``report_memory_time.png`` (peak memory against
step time) and ``report_metric_memory.png`` (validation metric against peak memory) into
the directory. Jobs without a summary or with ``status: failed`` are listed with their
status, never dropped; a job whose files are broken (an empty or truncated
``summary.json``, an unreadable ``config.yaml``, a truncated ``checkpoints/last.ckpt``, as a
full disk leaves them) is listed with what is wrong, and the rest of the sweep is reported.
When a job's config has a top-level ``reference:`` list (entries ``{metric, value, model,
source}``), the published value is printed beside ours. Also ``remat-report``, and written
after every job of a multirun by :class:`remat.callbacks.SweepReport`.
"""

from __future__ import annotations

import argparse
import sys

from remat.reporting import report


def main(argv: list[str] | None = None) -> int:
    """``python -m remat.report <multirun dir> [--out DIR]``; exit code 1 with the reason on
    bad input."""
    parser = argparse.ArgumentParser(prog="python -m remat.report", description=__doc__.split(
        "\n")[0])
    parser.add_argument("root", help="Hydra multirun dir, e.g. multirun/2026-01-01/12-00-00")
    parser.add_argument("--out", default=None, help="where to write (default: the dir itself)")
    args = parser.parse_args(argv)
    try:
        report(args.root, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
