"""``python -m remat.report`` over a real multirun, and over hand-made broken sweeps."""

import csv
import json
from pathlib import Path

import pytest
import torch

from remat.reporting import collect, report
from tests.helpers import run_python

REPO = Path(__file__).resolve().parents[1]
# 6 images of 32 px, batch 2: 3 training steps in one epoch, then one validation
TINY = ["data.image_size=32", "data.num_train=6", "data.num_val=2", "data.batch_size=2",
        "trainer.max_steps=3", "trainer.max_epochs=1", "trainer.accelerator=cpu",
        "callbacks=minimal", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "model.arch_kwargs.decoder_channels=[16,16,8,8,8]"]


# ~70 s on 2 cores: a real multirun's report (SweepReport, the CLI, the plots) is checked in
# `make test` by tests/test_sweep.py; this adds the 2 x 2 grid's rows and their order
@pytest.mark.slow
def test_multirun_then_report_gives_four_rows_and_plots(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_python([str(REPO / "train.py"), "-m", "strategy=none,sqrtn",
                       "precision=32-true,bf16-mixed", *TINY, f"hydra.sweep.dir={sweep}"],
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))  # one per job, each with its checkpoint
    assert len(summaries) == 4
    assert all(json.loads(p.read_text())["global_step"] == 3 for p in summaries)
    assert all((p.parent / "checkpoints" / "last.ckpt").is_file() for p in summaries)
    # the sweep's own Hydra callback (SweepReport) already wrote the report
    assert (sweep / "report.md").read_text().count("| completed |") == 4
    out = run_python(["-m", "remat.report", str(sweep)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert len(rows) == 4
    assert {(r["strategy"], r["precision"]) for r in rows} == {
        (s, p) for s in ("none", "sqrtn") for p in ("32-true", "bf16-mixed")}
    assert all(r["status"] == "completed" and int(r["peak_memory_bytes"]) > 0 for r in rows)
    assert all(0.0 <= float(r["value"]) <= 1.0 and r["metric"] == "val/dice" for r in rows)
    # sorted: by precision, then peak memory
    assert [r["precision"] for r in rows] == ["32-true", "32-true", "bf16-mixed", "bf16-mixed"]
    assert int(rows[0]["peak_memory_bytes"]) <= int(rows[1]["peak_memory_bytes"])
    for name in ("report_memory_time.png", "report_metric_memory.png"):
        assert (sweep / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (sweep / "report.md").read_text().count("| completed |") == 4
    assert "sqrtn" in out.stdout and "bf16-mixed" in out.stdout


def _job(root, name, summary=None, config=None, raw=None):
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    if raw is not None:
        (job / "summary.json").write_text(raw)
    elif summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))
    if config is not None:
        (job / "config.yaml").write_text(config)
    return job


DONE = {"status": "completed", "strategy": "sqrtn", "precision": "32-true",
        "accumulate_grad_batches": 2, "batch_size": 4, "image_size": 256,
        "peak_memory_bytes": 3 * 2**30, "median_step_ms": 500.0, "monitor": "val/dice",
        "metrics": {"val/dice": 0.81}}


def test_failed_and_missing_jobs_are_listed_and_references_shown(tmp_path):
    config = ("precision: 32-true\naccumulate_grad_batches: 1\ndata: {batch_size: 8}\n"
              "reference:\n  - {metric: val/dice, value: 0.876, model: ResUNet++, "
              "source: 'Jha et al. 2021, Table 3'}\n")
    _job(tmp_path, "0", DONE, config)
    _job(tmp_path, "1", {"status": "failed", "strategy": "full", "precision": "32-true",
                         "error": "ValueError: accumulate_grad_batches must be >= 1"})
    _job(tmp_path, "2", None, config)
    jobs = report(tmp_path)
    assert [(j.job, j.status) for j in jobs] == [("0", "completed"), ("1", "failed"),
                                                 ("2", "missing")]
    assert jobs[0].throughput == pytest.approx(8.0)  # 4 samples / 0.5 s
    assert jobs[0].published == ["val/dice 0.810 vs 0.876 (ResUNet++, Jha et al. 2021, "
                                 "Table 3)"]
    assert jobs[2].batch == 8 and "no summary.json" in jobs[2].error
    md = (tmp_path / "report.md").read_text()
    assert "| failed |" in md and "| missing |" in md and "0.876" in md


def test_directory_without_runs_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"no runs under {tmp_path}"):
        collect(tmp_path)
    proc = run_python(["-m", "remat.report", str(tmp_path / "nope")], tmp_path)
    assert proc.returncode == 1 and "is not a directory" in proc.stderr


def test_broken_files_of_a_full_disk_list_the_job_and_report_the_rest(tmp_path):
    """A truncated and an empty summary.json, a truncated last.ckpt: those jobs are listed
    with what is wrong; the sweep's other jobs are reported."""
    truncated = _job(tmp_path, "0", raw='{"status": "compl')
    empty = _job(tmp_path, "1", raw="")
    good = _job(tmp_path, "2", summary=DONE)
    (good / "checkpoints").mkdir()
    torch.save({"state_dict": {"w": torch.zeros(64)}}, good / "checkpoints" / "last.ckpt")
    cut = _job(tmp_path, "3", summary=DONE)
    (cut / "checkpoints").mkdir()
    torch.save({"state_dict": {"w": torch.zeros(4096)}}, cut / "checkpoints" / "last.ckpt")
    data = (cut / "checkpoints" / "last.ckpt").read_bytes()
    (cut / "checkpoints" / "last.ckpt").write_bytes(data[: len(data) // 2])
    jobs = {j.job: j for j in report(tmp_path)}
    assert jobs["0"].status == jobs["1"].status == "unreadable"
    assert f"{truncated / 'summary.json'}: corrupt summary.json, not valid JSON" in jobs["0"].error
    assert f"{empty / 'summary.json'}: corrupt summary.json, empty" in jobs["1"].error
    assert jobs["2"].status == "completed" and jobs["2"].checkpoint == "ok"
    assert jobs["2"].value == pytest.approx(0.81)
    assert jobs["3"].status == "completed" and jobs["3"].checkpoint.startswith("corrupt")
    assert "last.ckpt corrupt" in jobs["3"].error
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert [r["status"] for r in rows] == ["completed", "completed", "unreadable", "unreadable"]


def test_job_folders_with_digit_and_word_names_sort_without_error(tmp_path):
    # Hydra's numbered jobs next to a logger's named folder holding a config.yaml
    _job(tmp_path, "0", summary=DONE)
    _job(tmp_path, "wandb", config="precision: 32-true\n")
    _job(tmp_path, "1", summary=DONE)
    jobs = collect(tmp_path)
    assert [j.job for j in jobs if j.status == "completed"] == ["0", "1"]
    assert [j.job for j in jobs if j.status == "missing"] == ["wandb"]


def test_a_compiled_job_is_told_apart_from_its_eager_twin(tmp_path):
    """A sweep over compile=false,true: the same strategy twice, one compiled."""
    _job(tmp_path, "0", summary=DONE)
    _job(tmp_path, "1", summary={**DONE, "peak_memory_bytes": 2 * 2**30,
                                 "compiled": {"backend": "inductor", "graphs": 2,
                                              "options": {"layout_optimization": False}}})
    jobs = {j.job: j for j in report(tmp_path)}
    assert not jobs["0"].compiled and jobs["1"].compiled
    rows = {r["job"]: r for r in csv.DictReader((tmp_path / "report.csv").open())}
    assert (rows["0"]["compiled"], rows["1"]["compiled"]) == ("False", "True")
    md = (tmp_path / "report.md").read_text()
    assert "| sqrtn +compile |" in md and "| sqrtn |" in md


def test_a_killed_job_is_told_from_a_running_one(tmp_path):
    """A job killed by SIGKILL leaves a summary saying 'running': the report said so too.
    A job whose folder a live process holds, or one claimed on another host (a cluster
    node: its lock may not reach here), stays 'running'."""
    import socket
    import subprocess
    import sys

    from remat.callbacks import claim_run_dir, release_run_dir
    from tests.helpers import subprocess_env

    running = {**DONE, "status": "running"}
    for name in ("dead", "live", "elsewhere"):
        _job(tmp_path, name, running)
    code = ("import sys, time; from remat.callbacks import claim_run_dir; "
            "claim_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(float(sys.argv[2]))")
    dead = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dead"), "0"],
                          env=subprocess_env(), capture_output=True, text=True)
    assert dead.stdout.strip() == "held"
    (tmp_path / "elsewhere" / ".lock").write_text("pid 1 on another-node\n")
    live = claim_run_dir(tmp_path / "live")
    try:
        jobs = {j.job: j for j in report(tmp_path, quiet=True)}
    finally:
        release_run_dir(live)
    assert jobs["dead"].status == "killed" and "no process holds" in jobs["dead"].error
    assert (tmp_path / "dead" / ".lock").read_text().split()[3] == socket.gethostname()
    assert jobs["live"].status == "running" and jobs["elsewhere"].status == "running"


def test_a_jobs_resume_attempts_are_not_jobs(tmp_path):
    """A resumed job keeps each attempt's Hydra files and config in <job>/resumes/<time>/;
    the report listed them as jobs ('missing', or 'failed' for a refused resume)."""
    _job(tmp_path, "0", DONE)
    attempt = tmp_path / "0" / "resumes" / "2026-12-05_13-33-01_ab12"
    (attempt / ".hydra").mkdir(parents=True)
    (attempt / "config.yaml").write_text("precision: 32-true\n")
    (attempt / "summary.json").write_text(json.dumps({"status": "failed"}))
    assert [(j.job, j.status) for j in report(tmp_path, quiet=True)] == [("0", "completed")]
