"""The same request on the same machine gives the same plan: this CPU's figures are measured
once and kept on disk (planner.devices.calibrate_cpu), and a plan records them."""

from __future__ import annotations

import json

import pytest

from remat.build import build_from_config
from remat.planner import devices, make_plan
from tests.helpers import compose_config


@pytest.fixture
def measurements(tmp_path, monkeypatch):
    """A fresh calibration cache and a CPU whose timings change from one measurement to the
    next (as on a loaded machine): (1e11 FLOP/s, 1e10 B/s), then 3e11 and 2e9, ..."""
    monkeypatch.setenv(devices.CACHE_ENV, str(tmp_path))
    figures = iter([(1e11, 1e10), (3e11, 2e9), (5e10, 4e10)])
    monkeypatch.setattr(devices, "_measure_cpu", lambda: next(figures))
    devices.calibrate_cpu.cache_clear()
    yield tmp_path
    devices.calibrate_cpu.cache_clear()


def test_this_cpu_is_measured_once_and_kept(measurements):
    assert devices.calibrate_cpu() == (1e11, 1e10)
    devices.calibrate_cpu.cache_clear()  # as in a new process
    assert devices.calibrate_cpu() == (1e11, 1e10)  # read back, not measured again
    (entry,) = json.loads((measurements / "cpu_calibration.json").read_text()).items()
    assert "threads" in entry[0] and entry[1] == {"fp32_flops": 1e11, "bandwidth": 1e10}
    (measurements / "cpu_calibration.json").unlink()  # the documented way to measure again
    devices.calibrate_cpu.cache_clear()
    assert devices.calibrate_cpu() == (3e11, 2e9)


def test_measuring_this_cpu_leaves_the_run_s_random_numbers_alone(tmp_path, monkeypatch):
    """A budget on a machine without a calibration file measures the CPU when the strategy is
    built, before the run draws its network's weights: the first such run trained other
    weights than the same run without a budget (a trial's val Dice 0.0 against 0.185)."""
    import torch

    from remat.planner import BudgetStrategy

    monkeypatch.setenv(devices.CACHE_ENV, str(tmp_path))
    devices.calibrate_cpu.cache_clear()
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    BudgetStrategy(memory="1GiB", device="cpu")  # measures: no calibration file yet
    assert (tmp_path / "cpu_calibration.json").is_file()
    assert torch.equal(torch.rand(4), expected)
    devices.calibrate_cpu.cache_clear()


@pytest.mark.slow  # three plans of a GPT (~30 s); the calibration test above holds the cause
def test_planning_the_same_budget_twice_gives_the_same_plan(measurements, tmp_path):
    cfg = compose_config("estimate", tmp_path / "c", ["model=gpt_tiny", "data.batch_size=2",
                                                      "+data.block_size=64", "device=cpu"])
    build, _, batch, size = build_from_config(cfg)
    none = make_plan(build.with_strategy, batch, size, memory=0.5, device="cpu",
                     max_traces=1).plan.none_peak_bytes
    plans = []
    for _ in range(2):
        devices.calibrate_cpu.cache_clear()  # each plan as if in its own process
        planned = make_plan(build.with_strategy, batch, size, memory=int(0.85 * none),
                            device="cpu", max_traces=2)
        plans.append(planned.plan.to_dict())
    assert any(s["mode"] != "keep" for u in plans[0]["units"] for s in u["segments"])
    assert plans[0] == plans[1]
    figures = plans[0]["device_figures"]
    assert (figures["fp32_flops"], figures["bandwidth"]) == (1e11, 1e10)
    assert "measured here" in figures["source"] and "threads" in figures["source"]
