"""Sweep presets and launchers: constant effective batch, and a failing job does not stop
the others (real submitit_local multirun)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from remat.report import main as report_main
from remat.reporting import collect
from remat.train import train
from tests.helpers import TINY_TRAINER, compose_train

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("accumulation,batch", [(1, 8), (2, 4), (4, 2)])
def test_ablation_keeps_the_effective_batch_constant(tmp_path, accumulation, batch):
    cfg = compose_train(tmp_path, ["+sweep=ablation", f"accumulate_grad_batches={accumulation}"])
    assert cfg.data.batch_size == batch
    assert cfg.data.batch_size * cfg.accumulate_grad_batches == cfg.effective_batch_size == 8
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    assert params == {"strategy": "none,full,sqrtn,selective",
                      "precision": "32-true,bf16-mixed", "accumulate_grad_batches": "1,2,4"}


def test_ablation_rejects_an_accumulation_that_does_not_divide(tmp_path):
    cfg = compose_train(tmp_path, ["+sweep=ablation", "accumulate_grad_batches=3"])
    with pytest.raises(Exception, match="effective_batch_size=8 is not divisible by "
                                        "accumulate_grad_batches=3"):
        _ = cfg.data.batch_size


def test_ablation_job_whose_batch_does_not_resolve_writes_a_failed_summary(tmp_path):
    cfg = compose_train(tmp_path, ["+sweep=ablation", "accumulate_grad_batches=3", *TINY_TRAINER])
    with pytest.raises(Exception, match="effective_batch_size=8 is not divisible"):
        train(cfg)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["batch_size"] is None
    assert summary["accumulate_grad_batches"] == 3 and summary["image_size"] == 256
    assert summary["error"].startswith("data.batch_size: ValueError: effective_batch_size=8 "
                                       "is not divisible by accumulate_grad_batches=3")
    assert [(j.job, j.status) for j in collect(tmp_path)] == [(tmp_path.name, "failed")]


@pytest.mark.slow  # > 15 s on 2 cores: make test-all
def test_submitit_local_multirun_with_one_failing_job(tmp_path):
    sweep = tmp_path / "sweep"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=submitit_local",
         "hydra.launcher.timeout_min=10", "accumulate_grad_batches=1,0",
         "data.image_size=32", "data.num_train=2", "data.num_val=2", "data.batch_size=2",
         "trainer.max_steps=1", "trainer.max_epochs=1", "trainer.accelerator=cpu",
         "callbacks=minimal", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    # Hydra runs every job, then reports the failure (non-zero exit)
    assert proc.returncode != 0
    assert "accumulate_grad_batches must be an integer >= 1" in proc.stderr + proc.stdout
    done = json.loads((sweep / "0" / "summary.json").read_text())
    failed = json.loads((sweep / "1" / "summary.json").read_text())
    assert done["status"] == "completed" and done["global_step"] == 1
    assert failed["status"] == "failed" and "got 0" in failed["error"]
    assert list((sweep / ".submitit").glob("*")), "jobs did not go through submitit"
    jobs = collect(sweep)
    assert [(j.job, j.status) for j in jobs] == [("0", "completed"), ("1", "failed")]
    # the sweep's own Hydra callback (SweepReport) reported every job, the failed one too
    rows = (sweep / "report.md").read_text().splitlines()
    assert [r.split("|")[1:3] for r in rows[2:]] == [[" 0 ", " completed "], [" 1 ", " failed "]]
    for name in ("report_memory_time.png", "report_metric_memory.png"):
        assert (sweep / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # and `python -m remat.report <sweep>` reads the real multirun into its CSV
    (sweep / "report.csv").unlink()
    assert report_main([str(sweep)]) == 0
    csv_rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert [(r["job"], r["status"]) for r in csv_rows] == [("0", "completed"), ("1", "failed")]
    assert int(csv_rows[0]["peak_memory_bytes"]) > 0
