"""trainer=fsdp (FSDP2 through Lightning's ModelParallelStrategy) on 2 CPU processes (gloo):
every strategy gives the single-process full-batch gradients.

One ``torch.distributed.run`` launch trains every case of :data:`CASES` (tests/fsdp_script.py)
while this process trains the single-process references; each case is then one test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fsdp_script import MEMORY_BATCH, STEPS, memory_module, run_case
from tests.helpers import launch_report
from tests.strategies import axes

SCRIPT = Path(__file__).with_name("fsdp_script.py")
# multi-process runs (gloo ports, 2 processes each) run one at a time under xdist
pytestmark = pytest.mark.xdist_group("gloo")
STRATEGIES = axes.names(lambda s: s.shardable, baseline=True)
COMPILED = axes.names(axes.compiled)
# compiled code is checked in fp32 without accumulation only: each compiled case costs the
# launch a compile on both ranks (about 5 s), and accumulation and bf16 are the eager
# strategies' concern (the compiled graph is the same)
ALL_CASES = [f"{s}:{a}:{p}" for s in STRATEGIES
             for a, p in ((1, "32-true"), (2, "32-true"), (1, "bf16-mixed"))
             if s not in COMPILED or (a, p) == (1, "32-true")]
# `make test`: every strategy in fp32, and accumulation and bf16 under one segment strategy
# (none's three are the references); the rest of the grid is tests/test_fsdp_grid.py (slow)
CASES = [c for c in ALL_CASES if c.endswith(":1:32-true") or c.split(":")[0] in ("none", "sqrtn")]
GRID_CASES = [c for c in ALL_CASES if c not in CASES or c == "none:1:bf16-mixed"]
MEMORY = ["memory:sqrtn"]
GRID_MEMORY = ["memory:none", "memory:selective"]
# batch-norm statistics: `none` is the reference; `make test` checks one segment strategy
# and selective, the grid the others
NORMS = ["bn:none", "bn:sqrtn", "bn:selective"]
GRID_NORMS = ["bn:none", "bn:full", "bn:offload"]


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=path, OMP_NUM_THREADS="1")


def launch(out: Path, cases: list[str]) -> tuple[dict, dict]:
    """Train ``cases`` in one 2-process launch (results written under ``out``) while this
    process trains the single-process references: ``(results per case and rank,
    references)``."""
    log = open(out / "log.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(SCRIPT), str(out), *cases], env=_env(), stdout=log,
        stderr=subprocess.STDOUT)
    try:
        torch.manual_seed(0)
        references = {c: run_case(c, world_size=1)
                      for c in ("none:1:32-true", "none:2:32-true", "none:1:bf16-mixed")}
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert proc.returncode == 0, launch_report((out / "log.txt").read_text())
    results = {c: [torch.load(out / c.replace(":", "_") / f"rank{r}.pt") for r in (0, 1)]
               for c in cases}
    return results, references


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(results per case and rank, single-process references)``."""
    return launch(tmp_path_factory.mktemp("fsdp"), [*MEMORY, *NORMS, *CASES])


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


def check_gradients(runs, case: str) -> None:
    """Both ranks hold the same parameters and gradients, equal to the single process on
    the full batch (fp32), or within bf16's rounding of it and equal to FSDP ``none``."""
    results, references = runs
    rank0, rank1 = results[case]
    strategy, accumulate, precision = case.split(":")
    assert len(rank0["grads"]) == len(rank1["grads"]) == STEPS
    # parameters after the last step: the same full values on both ranks
    assert rank0["params"].keys() == rank1["params"].keys()
    for key, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][key]), key
    if precision == "32-true":
        reference = references[f"none:{accumulate}:{precision}"]
        for step in range(STEPS):
            for key, grad in reference["grads"][step].items():
                assert torch.equal(rank0["grads"][step][key], rank1["grads"][step][key]), key
                torch.testing.assert_close(rank0["grads"][step][key], grad, rtol=1e-5,
                                           atol=1e-6, msg=f"step {step} {key}")
        return
    # bf16-mixed: one process on the whole batch rounds differently from two on halves
    # (measured 0.2-0.6 % of the gradient norm); every eager strategy equals FSDP `none`
    # bit for bit
    single = references["none:1:bf16-mixed"]
    sharded_none = results["none:1:bf16-mixed"][0]
    for step in range(STEPS):
        ours, ref = _flat(rank0["grads"][step]), _flat(single["grads"][step])
        assert ((ours - ref).norm() / ref.norm()).item() < 2e-2, f"step {step}"
        assert torch.equal(ours, _flat(sharded_none["grads"][step])), f"step {step}"


def check_memory(runs, case: str) -> None:
    """remat.estimate's world_size trace (fake process group) against MemTracker on each of
    the 2 real gloo ranks: the goal is 5 %; the trace counts the same tensors."""
    from remat.measure.trace import trace_step

    results, _ = runs
    strategy = case.split(":", 1)[1]
    _, peak = trace_step(lambda: memory_module(strategy), *MEMORY_BATCH, torch.device("cpu"),
                         "32-true", world_size=2)
    _, unsharded = trace_step(lambda: memory_module(strategy), *MEMORY_BATCH,
                              torch.device("cpu"), "32-true")
    for rank in (0, 1):
        measured = results[case][rank]
        assert abs(peak.peak_bytes - measured["peak_bytes"]) <= 0.05 * measured["peak_bytes"]
        for key in ("parameters", "gradients", "optimizer_state"):
            assert peak.categories[key] == measured["categories"][key], (rank, key)
    # sharding halves the optimizer state (AdamW's 4-byte step counters stay whole)
    assert peak.categories["optimizer_state"] * 2 == pytest.approx(
        unsharded.categories["optimizer_state"], rel=1e-4)
    assert peak.peak_bytes < unsharded.peak_bytes


def check_batchnorm(runs: tuple[dict, dict], case: str) -> None:
    """Each rank normalises its own half of the batch (no SyncBatchNorm), so the reference
    is FSDP `none`: a recomputing strategy must update every rank's running statistics once
    per forward, exactly as `none` does, and give its gradients."""
    results, _ = runs
    base = results["bn:none"]
    for rank in (0, 1):
        ours = results[case][rank]
        assert ours["buffers"].keys() == base[rank]["buffers"].keys()
        assert any("running_mean" in k for k in ours["buffers"])
        for key, value in base[rank]["buffers"].items():
            assert torch.equal(ours["buffers"][key], value), (rank, key)
        for step in range(STEPS):
            for key, grad in base[rank]["grads"][step].items():
                assert torch.equal(ours["grads"][step][key], grad), (rank, step, key)
    # the ranks saw different halves: their statistics differ, their parameters do not
    assert not torch.equal(base[0]["buffers"]["net.blocks.0.1.running_mean"],
                           base[1]["buffers"]["net.blocks.0.1.running_mean"])
    for key, value in base[0]["params"].items():
        assert torch.equal(value, base[1]["params"][key]), key


@pytest.mark.parametrize("case", NORMS[1:])
def test_fsdp_batchnorm_statistics_and_gradients_equal_none(runs, case):
    check_batchnorm(runs, case)


@pytest.mark.parametrize("case", CASES)
def test_fsdp_gradients_equal_single_process_full_batch(runs, case):
    check_gradients(runs, case)


@pytest.mark.parametrize("case", MEMORY)
def test_per_rank_estimate_equals_memtracker_on_each_rank_of_a_real_run(runs, case):
    check_memory(runs, case)
