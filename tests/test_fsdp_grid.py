"""The rest of tests/test_fsdp.py's grid (``make test-all``): accumulation and bf16-mixed
under the strategies ``make test`` checks in fp32 only, the per-rank estimate under ``none`` and
``selective``, and batch-norm statistics under ``full`` and ``offload``; one 2-process
launch, the same checks."""

from __future__ import annotations

import pytest

from tests.test_fsdp import (
    GRID_CASES,
    GRID_MEMORY,
    GRID_NORMS,
    check_batchnorm,
    check_gradients,
    check_memory,
    launch,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gloo")]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("fsdp_grid"), [*GRID_MEMORY, *GRID_NORMS, *GRID_CASES])


@pytest.mark.parametrize("case", GRID_CASES)
def test_fsdp_gradients_equal_single_process_full_batch(grid, case):
    check_gradients(grid, case)


@pytest.mark.parametrize("case", GRID_MEMORY)
def test_per_rank_estimate_equals_memtracker_on_each_rank_of_a_real_run(grid, case):
    check_memory(grid, case)


@pytest.mark.parametrize("case", GRID_NORMS[1:])
def test_fsdp_batchnorm_statistics_and_gradients_equal_none(grid, case):
    check_batchnorm(grid, case)
