"""A run resumed into its own folder lists every step once in ``metrics.csv``: the rows a
killed run logged after its last checkpoint (steps the resumed run trains again) move to
``metrics.replayed.csv``."""

from __future__ import annotations

import csv

from remat.loggers import CSVLogger
from remat.train import train
from tests.helpers import TINY, compose_train

LOGGED = ["trainer.log_every_n_steps=1"]


def _rows(path):
    return list(csv.DictReader(path.open()))


def test_rows_past_the_checkpoint_move_aside_and_every_step_is_logged_once(tmp_path):
    run = tmp_path / "run"
    first = train(compose_train(run, [*TINY, *LOGGED]))
    metrics = run / "csv" / "metrics.csv"
    steps = first["global_step"]
    assert steps == 2
    before = _rows(metrics)
    # what a run killed (SIGKILL) during the next epoch had logged past its checkpoint
    columns = list(before[0])
    killed = [{**dict.fromkeys(columns, ""), "epoch": "1", "step": str(s),
               "train/loss_step": "9.5"} for s in (steps, steps + 1)]
    with metrics.open("a", newline="") as handle:
        csv.DictWriter(handle, fieldnames=columns).writerows(killed)
    resumed = train(compose_train(run, [*TINY, *LOGGED, "trainer.max_epochs=2",
                                        f"ckpt_path={first['last_model_path']}"]))
    assert resumed["global_step"] == 4
    rows = _rows(metrics)
    losses = [(r["step"], r["train/loss_step"]) for r in rows if r.get("train/loss_step")]
    assert [s for s, _ in losses] == ["0", "1", "2", "3"]  # each step once, in order
    assert "9.5" not in [v for _, v in losses]
    assert rows[:len(before)] == before  # the first run's own rows, unchanged
    aside = _rows(run / "csv" / "metrics.replayed.csv")
    assert [(r["step"], r["train/loss_step"]) for r in aside] == [("2", "9.5"), ("3", "9.5")]


def test_set_aside_leaves_this_run_s_rows_and_earlier_steps(tmp_path):
    root = tmp_path / "logs"
    (root / "csv").mkdir(parents=True)
    path = root / "csv" / "metrics.csv"
    path.write_text("epoch,step,loss\n0,0,1.0\n0,1,0.9\n0,2,0.8\n,3,0.7\n")
    logger = CSVLogger(save_dir=str(root), name="csv", version="")
    logger.log_metrics({"loss": 0.5}, step=2)  # this run's, at the resumed step
    assert logger.set_aside_steps_from(2) == 2
    assert [(r["step"], r["loss"]) for r in _rows(path)] == [("0", "1.0"), ("1", "0.9"),
                                                            ("2", "0.5")]
    assert [r["step"] for r in _rows(root / "csv" / "metrics.replayed.csv")] == ["2", "3"]
    assert logger.set_aside_steps_from(2) == 0  # nothing earlier is left past step 2
