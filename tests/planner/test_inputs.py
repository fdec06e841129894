"""Budgets and devices as users write them, and every bad one named clearly."""

import pytest

from remat.planner import DEVICES, get_device, parse_memory
from remat.planner.budget import BudgetStrategy


@pytest.mark.parametrize("value,expected", [
    ("12GiB", 12 * 2**30), ("12 GB", 12 * 10**9), ("800MiB", 800 * 2**20),
    ("1.5 gib", int(1.5 * 2**30)), ("24000000000", 24 * 10**9), (24_000_000_000, 24 * 10**9),
    ("2e9", 2 * 10**9), ("16G", 16 * 2**30), (0.5, 40 * 10**9), ("0.25", 20 * 10**9),
    (2**20, 2**20), ("1048576", 2**20),  # an integer is bytes, never a fraction
])
def test_parse_memory_forms(value, expected):
    assert parse_memory(value, device_memory=80 * 10**9) == expected


@pytest.mark.parametrize("value,match", [
    ("twelve", "cannot read a memory size"), ("12 parsecs", "cannot read"), ("", "cannot read"),
    (0, "must be > 0"), ("0GiB", "must be > 0"), (-3, "must be > 0"), ("-1GiB", "must be > 0"),
    (1.5, r"must be in \(0, 1\]"), ("2.5", r"must be in \(0, 1\]"),
    (1, "less than 1 MiB"), ("1000", "less than 1 MiB"),
    ("81GB", "more than the device's memory"), (None, "give a memory budget"),
    (True, "give a memory budget"), (float("nan"), "finite size"), ("inf", "cannot read"),
    (float("inf"), "finite size"),
])
def test_parse_memory_refuses(value, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_memory(value, device_memory=80 * 10**9)
    assert "strategy.memory" in str(err.value)


def test_fraction_needs_a_known_device_memory():
    with pytest.raises(ValueError, match="fraction of the device's memory"):
        parse_memory(0.8, device_memory=None)


def test_device_table_has_sources_and_the_named_gpus():
    for name in ("h100", "h200", "a100_40gb", "a100_80gb", "l4", "rtx4090"):
        spec = DEVICES[name]
        assert spec.memory_bytes > 10**10 and spec.bf16_flops > spec.fp32_flops > 0
        assert spec.bandwidth > 10**11 and "datasheet" in spec.source or "whitepaper" in spec.source
    assert get_device("H100").name == "h100" and get_device("a100-80gb").name == "a100_80gb"
    assert DEVICES["h200"].bandwidth > DEVICES["h100"].bandwidth


def test_cpu_is_calibrated_here():
    spec = get_device("cpu")
    assert spec.fp32_flops > 1e8 and spec.bandwidth > 1e8 and spec.memory_bytes > 2**30
    assert "measured" in spec.source


def test_unknown_device_lists_known_ones_and_the_by_hand_form():
    with pytest.raises(ValueError) as err:
        get_device("tpu_v5", key="strategy.device")
    text = str(err.value)
    assert "strategy.device='tpu_v5'" in text and "h100" in text and "rtx4090" in text
    assert "fp32_flops" in text and "bandwidth" in text


def test_device_by_hand():
    spec = get_device({"name": "mygpu", "memory_bytes": 48e9, "fp32_flops": 40e12,
                       "bf16_flops": 300e12, "bandwidth": 1.5e12})
    assert spec.memory_bytes == 48 * 10**9 and spec.flops_for("bf16-mixed") == 300e12
    with pytest.raises(ValueError, match="missing bandwidth"):
        get_device({"name": "x", "memory_bytes": 1, "fp32_flops": 1, "bf16_flops": 1})
    assert spec.host_bandwidth == 0  # no host link given: nothing is offloaded
    both = {"name": "mygpu", "memory_bytes": 48e9, "fp32_flops": 40e12, "bf16_flops": 300e12,
            "bandwidth": 1.5e12}
    assert get_device({**both, "host_bandwidth": 32e9}).host_bandwidth == 32e9
    assert get_device({**both, "host_bandwidth": None}).host_bandwidth == 0


@pytest.mark.parametrize("key,value,message", [
    ("host_bandwidth", -1, "host_bandwidth=-1: must be a finite number > 0"),
    ("host_bandwidth", 0, "host_bandwidth=0: must be a finite number > 0"),
    ("host_bandwidth", float("nan"), "host_bandwidth=nan: must be a finite number > 0"),
    ("host_bandwidth", float("inf"), "host_bandwidth=inf: must be a finite number > 0"),
    ("host_bandwidth", True, "host_bandwidth: must be a number"),
    ("host_bandwidth", "abc", "host_bandwidth: must be a number"),
    ("fp32_flops", 0, "fp32_flops=0: must be a finite number > 0"),
    ("bandwidth", -1.5e12, "bandwidth=-1500000000000.0: must be a finite number > 0"),
    ("memory_bytes", "48 GB", "memory_bytes: must be a number"),
])
def test_device_by_hand_refuses_figures_that_are_not_positive_numbers(key, value, message):
    """A negative, zero, infinite or non-numeric figure is named (it planned silently
    without offload, divided by zero, or printed a negative step time)."""
    device = {"name": "mygpu", "memory_bytes": 48e9, "fp32_flops": 40e12,
              "bf16_flops": 300e12, "bandwidth": 1.5e12, key: value}
    with pytest.raises(ValueError) as err:
        get_device(device, key="strategy.device")
    assert str(err.value).startswith(f"strategy.device.{message}")


def test_budget_strategy_checks_its_keys_at_construction():
    assert BudgetStrategy("12GiB", device="h100").budget_bytes == 12 * 2**30
    assert BudgetStrategy(0.5, device="a100_40gb").budget_bytes == 20 * 10**9
    with pytest.raises(ValueError, match="more than the device's memory"):
        BudgetStrategy("100GiB", device="l4")
    with pytest.raises(ValueError, match="unknown device"):
        BudgetStrategy("1GiB", device="v100x")
    with pytest.raises(ValueError, match="strategy.margin"):
        BudgetStrategy("1GiB", device="h100", margin=1.5)
    with pytest.raises(ValueError, match="strategy.objective"):
        BudgetStrategy("1GiB", device="h100", objective="speed")
    with pytest.raises(RuntimeError, match="make_plan"):
        BudgetStrategy("1GiB", device="h100").apply(None, [])


def test_a_bad_budget_is_refused_before_the_device_is_timed(monkeypatch):
    """strategy.memory=lots fails at once: the CPU calibration (seconds) comes after."""
    import remat.planner.budget as budget

    def no_device(*args, **kwargs):
        raise AssertionError("the device was looked up (and timed) first")

    monkeypatch.setattr(budget, "get_device", no_device)
    for value, match in [("lots", "cannot read a memory size"), ("-5GiB", "must be > 0")]:
        with pytest.raises(ValueError, match=match):
            budget.BudgetStrategy(memory=value)


def test_remat_plan_refuses_a_bad_budget_before_profiling(tmp_path, monkeypatch):
    """``python -m remat.plan strategy.memory=lots`` traced and timed the model (seconds)
    before reading the budget; now the budget's spelling is read first."""
    import remat.plan as plan_app
    from tests.helpers import compose_app

    def no_profile(*args, **kwargs):
        raise AssertionError("the model was profiled first")

    monkeypatch.setattr(plan_app, "planner_for", no_profile)
    for value, match in [("lots", "cannot read a memory size"), ("-5GiB", "must be > 0")]:
        cfg = compose_app("plan", tmp_path / value, [f"strategy.memory={value}"])
        with pytest.raises(ValueError, match=match):
            plan_app.run(cfg)
    assert not list(tmp_path.rglob("plan.json"))
