"""Bench rows on Hugging Face layers (segment strategies called with keyword arguments)
and remat strategies under ``torch.compile``."""

from __future__ import annotations

import pytest

from remat.bench import bench
from tests.helpers import compose_config
from tests.test_bench import HF_LLAMA_TINY


def test_bench_hf_llama_none_full_sqrtn_match_and_stay_below_none(tmp_path, capsys):
    cfg = compose_config("bench", tmp_path, [*HF_LLAMA_TINY, "strategies=[none,full,sqrtn]"])
    record = bench(cfg)
    rows = {r["strategy"]: r for r in record["rows"]}
    assert list(rows) == ["none", "full", "sqrtn", "hf_gradient_checkpointing"]
    assert all(r["grads_match"] for r in rows.values())
    assert all(r["peak_ratio"] < 1.0 for name, r in rows.items() if name != "none")
    assert "hf_gradient_checkpointing" in capsys.readouterr().out


@pytest.mark.slow  # > 15 s on 2 cores: make test-all
def test_compiled_full_and_sqrtn_rows_on_a_gpt_small_like_stack(tmp_path):
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_small", "model.n_layer=4", "model.n_embd=32", "model.n_head=4",
        "data.batch_size=1", "data.block_size=64", "strategies=[none]",
        "reference_points=false", "warmup=1", "steps=1", "device=cpu", "compiled=true",
        "compile_backend=aot_eager", "compile_strategies=[none,full,sqrtn]"])
    record = bench(cfg)
    assert record["notes"] == []  # no compiled row left out
    rows = {r["strategy"]: r for r in record["rows"]}
    assert list(rows) == ["none", "none (compiled, aot_eager)", "full (compiled, aot_eager)",
                          "sqrtn (compiled, aot_eager)"]
    assert all(r["grads_match"] for r in rows.values())
    assert rows["full (compiled, aot_eager)"]["peak_ratio"] < 1.0
    assert rows["sqrtn (compiled, aot_eager)"]["peak_ratio"] < 1.0
