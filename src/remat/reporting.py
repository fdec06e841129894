"""The sweep report: every job of a multirun folder as a table, a CSV and two plots.

Reads every job's ``summary.json`` (written by :func:`remat.train.train`, also for failed
runs) and ``config.yaml`` under the directory, and writes ``report.md``,
``report.csv``, ``report_memory_time.png`` (peak memory against step time) and
``report_metric_memory.png`` (validation metric against peak memory) into it; :func:`report`
also prints the table. Jobs without a summary or with ``status: failed`` are listed with
their status, never dropped; a job whose files are broken (an empty or truncated
``summary.json``, an unreadable ``config.yaml``, a truncated ``checkpoints/last.ckpt``, as a
full disk leaves them) is listed with what is wrong, and the rest of the sweep is reported.
When a job's config has a top-level ``reference:`` list (entries ``{metric, value, model,
source}``), the published value is printed beside ours. Used by ``python -m remat.report``
(the entry) and by :class:`remat.callbacks.SweepReport` after every job of a multirun.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from remat.callbacks.run_dir import ended_here
from remat.measure import format_bytes
from remat.run_config import RESUMES

COLUMNS = ["job", "status", "strategy", "compiled", "precision", "accumulation", "batch", "size",
           "peak_memory_bytes", "step_ms", "throughput", "metric", "value", "published",
           "checkpoint", "error"]


@dataclass
class Job:
    """One job of a sweep as the report shows it; bytes, milliseconds, samples/s."""

    job: str
    status: str
    strategy: str | None = None
    precision: str | None = None
    accumulation: int | None = None
    batch: int | None = None
    size: int | None = None
    peak_memory_bytes: int | None = None
    step_ms: float | None = None
    throughput: float | None = None
    metric: str | None = None
    value: float | None = None
    published: list[str] = field(default_factory=list)
    error: str | None = None
    checkpoint: str | None = None
    compiled: bool = False  # compile=true: the network ran under torch.compile

    @property
    def label(self) -> str:
        """The strategy as the table and plots show it (``sqrtn +compile`` when compiled)."""
        return str(self.strategy or "?") + (" +compile" if self.compiled else "")


def _job_dirs(root: Path) -> list[Path]:
    """Job folders under ``root``: any folder holding a ``summary.json``, a ``config.yaml`` or
    Hydra's ``.hydra/`` (a job that died before writing its summary still has those), but
    a run's resume attempts (``<job>/resumes/<time>/``: the job's own row reports them)."""
    found = set()
    for marker in ("summary.json", "config.yaml", ".hydra"):
        for path in root.rglob(marker):
            parts = path.parent.relative_to(root).parts
            if ".hydra" in path.parent.parts or RESUMES in parts:
                continue
            found.add(path.parent)
    return sorted(found, key=lambda p: [(0, int(s), "") if s.isdigit() else (1, 0, s)
                                        for s in p.relative_to(root).parts])


def _load_summary(path: Path) -> dict[str, Any] | None:
    """The summary dict, None when the file does not exist.

    Raises:
        ValueError: the file is empty, not JSON (e.g. truncated) or not a JSON object; the
            message names the file.
    """
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        what = "empty" if path.stat().st_size == 0 else f"not valid JSON ({err})"
        raise ValueError(f"{path}: corrupt summary.json, {what}; rerun that job") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: corrupt summary.json, expected a JSON object, got "
                         f"{type(data).__name__}")
    return data


def _load_config(job_dir: Path) -> dict[str, Any]:
    """The job's config (its ``config.yaml``, else Hydra's ``.hydra/config.yaml``).

    Raises:
        ValueError: the file cannot be parsed; the message names it.
    """
    for path in (job_dir / "config.yaml", job_dir / ".hydra" / "config.yaml"):
        if path.is_file():
            try:
                conf = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            except Exception as err:  # noqa: BLE001 - any YAML error, named with its path
                raise ValueError(f"{path}: unreadable config ({err})") from err
            return conf if isinstance(conf, dict) else {}
    return {}


def _checkpoint_state(job_dir: Path) -> str | None:
    """``ok`` when ``checkpoints/last.ckpt`` is a complete torch zip file, a short reason when
    it is truncated or unreadable, None when there is none (only the zip's directory at the
    end of the file is read)."""
    path = job_dir / "checkpoints" / "last.ckpt"
    if not path.is_file():
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            archive.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        return f"corrupt ({err})"
    return "ok"


def read_job(root: Path, job_dir: Path) -> Job:
    """One :class:`Job` from ``job_dir``'s ``summary.json`` and ``config.yaml``.

    Raises:
        ValueError: a ``summary.json`` or ``config.yaml`` that cannot be parsed (path named).
    """
    name = str(job_dir.relative_to(root)) if job_dir != root else job_dir.name
    summary = _load_summary(job_dir / "summary.json")
    config = _load_config(job_dir)
    checkpoint = _checkpoint_state(job_dir)
    if summary is None:
        data = config.get("data") or {}
        return Job(name, "missing", precision=config.get("precision"),
                   accumulation=config.get("accumulate_grad_batches"),
                   batch=data.get("batch_size"), checkpoint=checkpoint,
                   error="no summary.json (job killed or never started)")
    metric = summary.get("monitor") or config.get("monitor") or "val/loss"
    metrics = summary.get("metrics") or {}
    size = summary.get("size") or summary.get("image_size") or summary.get("block_size")
    if isinstance(size, list):
        size = "x".join(map(str, size))
    step_ms = summary.get("median_step_ms")
    batch = summary.get("batch_size")
    throughput = summary.get("samples_per_s")
    if throughput is None and step_ms and batch:
        throughput = batch * 1000.0 / step_ms
    job = Job(name, str(summary.get("status", "unknown")), summary.get("strategy"),
              summary.get("precision"), summary.get("accumulate_grad_batches"), batch, size,
              summary.get("peak_memory_bytes"), step_ms, throughput, metric,
              metrics.get(metric), error=summary.get("error"), checkpoint=checkpoint)
    job.compiled = bool(summary.get("compiled"))
    if job.status == "running" and ended_here(job_dir):  # its summary could not say so
        job.status = "killed"
        job.error = ("its summary says running, but no process holds the folder (killed, "
                     "e.g. SIGKILL or out of memory)" + (
                         "; resume it with ckpt_path=<job>/checkpoints/last.ckpt"
                         if checkpoint == "ok" else ""))
    if checkpoint not in (None, "ok"):
        job.error = "; ".join(e for e in (job.error, f"last.ckpt {checkpoint}") if e)
    for ref in config.get("reference") or []:
        if isinstance(ref, dict) and ref.get("metric") and ref.get("value") is not None:
            ours = metrics.get(ref["metric"])
            shown = "n/a" if ours is None else f"{ours:.3f}"
            job.published.append(f"{ref['metric']} {shown} vs {ref['value']} "
                                  f"({ref.get('model', '?')}, {ref.get('source', '?')})")
    return job


def collect(root: Path) -> list[Job]:
    """Every job under ``root``, sorted: finished jobs by precision, accumulation, then peak
    memory (lowest first); failed and missing jobs after them.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: no job under ``root``.

    A job whose ``summary.json`` or ``config.yaml`` cannot be read is listed with status
    ``unreadable`` and the reason (the file named), not raised.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"report: {root} is not a directory (expected a Hydra "
                                "multirun dir such as multirun/<date>/<time>)")
    dirs = _job_dirs(root)
    if not dirs:
        raise ValueError(f"report: no runs under {root}: expected job folders holding "
                         "summary.json / config.yaml (e.g. multirun/<date>/<time>/0/)")
    jobs = []
    for job_dir in dirs:
        try:
            jobs.append(read_job(root, job_dir))
        except ValueError as err:  # a broken file lists the job; the sweep is still reported
            name = str(job_dir.relative_to(root)) if job_dir != root else job_dir.name
            jobs.append(Job(name, "unreadable", error=str(err),
                            checkpoint=_checkpoint_state(job_dir)))
    done = [j for j in jobs if j.status == "completed"]
    rest = [j for j in jobs if j.status != "completed"]
    done.sort(key=lambda j: (str(j.precision), j.accumulation or 0,
                             j.peak_memory_bytes if j.peak_memory_bytes is not None else math.inf,
                             str(j.strategy), j.compiled))
    return done + rest


def _cells(job: Job) -> list[str]:
    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)
    return [job.job, job.status, job.label, str(job.precision or "?"),
            str(job.accumulation or "?"), str(job.batch or "?"), str(job.size or "?"),
            format_bytes(job.peak_memory_bytes), num(job.step_ms, ".1f"),
            num(job.throughput, ".2f"), str(job.metric or ""), num(job.value, ".4f"),
            "; ".join(job.published), job.checkpoint or "-",
            (job.error or "").splitlines()[0][:80] if job.error else ""]


HEADERS = ["job", "status", "strategy", "precision", "accum.", "batch", "size", "peak memory",
           "step (ms)", "samples/s", "metric", "value", "published", "last.ckpt", "error"]


def markdown(jobs: list[Job]) -> str:
    """The report table as GitHub markdown."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + " --- |" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in _cells(j)) + " |" for j in jobs]
    return "\n".join(lines) + "\n"


def _plots(jobs: list[Job], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [j for j in jobs if j.status == "completed" and j.peak_memory_bytes is not None]
    written = []
    for name, xs, ys, xlabel, ylabel in (
        ("report_memory_time.png", [j.step_ms for j in done],
         [j.peak_memory_bytes / 2**20 for j in done], "median step time (ms)",
         "peak memory (MiB)"),
        ("report_metric_memory.png", [j.peak_memory_bytes / 2**20 for j in done],
         [j.value for j in done], "peak memory (MiB)",
         f"{done[0].metric if done else 'metric'}"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for j, x, y in zip(done, xs, ys, strict=True):
            if x is None or y is None:
                continue
            ax.scatter(x, y, marker="*" if j.strategy == "none" else "o", s=80)
            ax.annotate(f"{j.label} {j.precision} x{j.accumulation}", (x, y), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        tmp = out / f".{name}.{os.getpid()}.tmp.png"
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out / name)
        plt.close(fig)
        written.append(out / name)
    return written


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` atomically (temporary file in the folder, then rename): a report that
    several jobs of a sweep refresh at once is never half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def report(root: Path | str, out: Path | str | None = None, quiet: bool = False) -> list[Job]:
    """Collect the jobs under ``root``, print the table (rich; not with ``quiet``) and write
    ``report.md``, ``report.csv`` and the two PNG plots into ``out`` (default ``root``).

    Raises:
        FileNotFoundError, ValueError: see :func:`collect`.
    """
    root = Path(root)
    jobs = collect(root)
    out = Path(out) if out is not None else root
    out.mkdir(parents=True, exist_ok=True)
    _write_text(out / "report.md", markdown(jobs))
    rows = io.StringIO(newline="")
    writer = csv.writer(rows)
    writer.writerow(COLUMNS)
    for j in jobs:
        writer.writerow([j.job, j.status, j.strategy, j.compiled, j.precision, j.accumulation,
                         j.batch, j.size, j.peak_memory_bytes, j.step_ms, j.throughput, j.metric,
                         j.value, "; ".join(j.published), j.checkpoint or "", j.error or ""])
    _write_text(out / "report.csv", rows.getvalue())
    plots = _plots(jobs, out)
    if quiet:
        return jobs
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{root} ({len(jobs)} jobs)")
    for header in HEADERS:
        table.add_column(header, overflow="fold")
    for j in jobs:
        style = None if j.status == "completed" else "red"
        table.add_row(*_cells(j), style=style)
    Console(width=200).print(table)
    print(f"wrote {out / 'report.md'}, {out / 'report.csv'}, "
          + ", ".join(str(p) for p in plots))
    return jobs
