"""Measured peak memory of a training run against the start-of-run estimate: the measured
batches cover optimizer steps at every accumulation, and a resumed run measures its own."""

from __future__ import annotations

import pytest

from remat.train import train
from tests.helpers import TINY_TRAINER, compose_train

# 64 px synthetic images, batch 2: 16 images give 8 batches, two optimizer steps at k=4
SMALL = ["data.image_size=64", "data.num_train=16", "data.num_val=2", "data.batch_size=2",
         "callbacks.run_report.estimate=true", *TINY_TRAINER]


def _close(summary: dict) -> tuple[int, int]:
    measured, estimate = summary["peak_memory_bytes"], summary["memory_estimate"]
    assert estimate is not None, summary["memory_estimate_note"]
    return measured, estimate["peak_bytes"]


@pytest.mark.parametrize("accumulation", [
    1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_measured_peak_covers_optimizer_steps_and_matches_the_estimate(tmp_path, accumulation):
    summary = train(compose_train(tmp_path, [*SMALL, "strategy=sqrtn", "trainer.max_steps=2",
                                             f"accumulate_grad_batches={accumulation}"]))
    measured = summary["peak_memory_measured"]
    assert measured["optimizer_steps"] == [1, 2]
    assert measured["batches"] == 2 * accumulation  # every batch of both steps
    assert summary["memory_estimate"]["accumulate_grad_batches"] == accumulation
    real, predicted = _close(summary)
    assert abs(real - predicted) <= 0.03 * real, (accumulation, real, predicted)


@pytest.mark.slow  # ~20 s
def test_accumulation_raises_the_peak_the_old_two_batch_window_missed(tmp_path):
    """With k=4 the first two batches hold no optimizer state yet: the peak of the steps is
    higher than theirs."""
    summary = train(compose_train(tmp_path, [*SMALL, "trainer.max_steps=2",
                                             "accumulate_grad_batches=4"]))
    peaks = summary["peak_memory_measured"]["batch_peaks_bytes"]  # in order
    assert len(peaks) == 8
    assert summary["peak_memory_bytes"] == max(peaks) > 1.05 * max(peaks[:2])


@pytest.mark.slow  # > 15 s on 2 cores: make test-all
def test_resumed_run_with_another_strategy_measures_its_own_steps(tmp_path):
    # 160 px: activations outweigh the optimizer step, so the strategies' peaks differ
    big = [*SMALL, "data.image_size=160", "data.num_train=4"]
    first = train(compose_train(tmp_path / "a", [*big, "strategy=none", "trainer.max_steps=2"]))
    resumed = train(compose_train(tmp_path / "b", [
        *big, "strategy=full", "trainer.max_steps=4", "trainer.max_epochs=2",
        f"ckpt_path={first['last_model_path']}"]))
    assert resumed["strategy"] == "full" and resumed["global_step"] == 4
    measured = resumed["peak_memory_measured"]
    assert measured["optimizer_steps"] == [3, 4]  # this run's steps, not the checkpoint's
    assert measured["previous_runs"][0]["optimizer_steps"] == [1, 2]
    assert resumed["memory_estimate"]["strategy"] == "full"
    assert resumed["peak_memory_bytes"] < 0.97 * first["peak_memory_bytes"]  # full keeps less
    real, predicted = _close(resumed)
    assert abs(real - predicted) <= 0.03 * real, (real, predicted)
