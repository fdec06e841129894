"""Lightning DDP on 2 CPU processes: every strategy gives the single-process gradients."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from tests.ddp_script import make_module, make_windows
from tests.strategies import axes

SCRIPT = Path(__file__).with_name("ddp_script.py")
# multi-process runs (gloo ports, 2 processes each) run one at a time under xdist
pytestmark = pytest.mark.xdist_group("gloo")


def _single_process_grads(strategy: str, samples: int) -> dict[str, torch.Tensor]:
    module = make_module(strategy).train()
    batch = default_collate(make_windows()[:samples])
    module.training_loss(batch).backward()
    return {n: p.grad for n, p in module.named_parameters()}


# launcher ddp: sqrtn with accumulation in `make test` (about 20 s a launch on 2 cores);
# selective with accumulation, and every other eager strategy of the registry, in test-all
# (none and full take the same path as sqrtn: one region per unit; selective's recompute on
# 2 ranks with accumulation is checked in `make test` by tests/test_fsdp.py)
DDP = [("sqrtn", 2, "ddp"), pytest.param("selective", 2, "ddp", marks=pytest.mark.slow),
       *(pytest.param(name, 1, "ddp", marks=pytest.mark.slow)
         for name in axes.names(axes.eager, baseline=True) if name not in ("sqrtn", "selective"))]
# ddp_spawn pickles the wrapped module into each process (every strategy's pickling is
# tested in-process: tests/strategies/test_mechanism.py); a spawn launch costs 20 s
SPAWN = [pytest.param("every_k", 2, "ddp_spawn", marks=pytest.mark.slow),
         pytest.param("selective", 1, "ddp_spawn", marks=pytest.mark.slow),
         pytest.param("offload", 1, "ddp_spawn", marks=pytest.mark.slow)]


@pytest.mark.parametrize("strategy,accumulate,launcher", [*DDP, *SPAWN])
def test_ddp_gradients_equal_on_ranks_and_to_full_batch(tmp_path, strategy, accumulate,
                                                        launcher):
    path = os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(SCRIPT), strategy, str(accumulate), str(tmp_path),
                           launcher], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0 = torch.load(tmp_path / "rank0.pt")
    rank1 = torch.load(tmp_path / "rank1.pt")
    reference = _single_process_grads("none", samples=2 * accumulate)
    assert rank0.keys() == rank1.keys() == reference.keys()
    for key, grad in reference.items():
        assert torch.equal(rank0[key], rank1[key]), key
        torch.testing.assert_close(rank0[key], grad, rtol=1e-5, atol=1e-6, msg=key)
