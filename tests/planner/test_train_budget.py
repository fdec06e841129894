"""``strategy=budget`` trains with its plan, ``python -m remat.plan`` writes one that
``strategy=plan`` replays, and a plan of another run shape is refused naming the key."""

import json

import pytest

from remat.plan import run as plan_run
from remat.planner import InfeasibleBudget
from remat.train import train
from tests.helpers import TINY, compose_app, compose_train

# plain SGD (no optimizer state): activations, not Adam's moments, set the peak
NET = ["model.arch_kwargs.decoder_channels=[32,16,16,8,8]", "data.image_size=128",
       "model.optimizer._target_=torch.optim.SGD", "~model.optimizer.weight_decay"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The CLI's frontier-free run for a budget between the floor and none."""
    out = tmp_path_factory.mktemp("plan")
    cfg = compose_app("plan", out, [*NET, "data.batch_size=4", "strategy.device=cpu",
                                    "budgets=0", "fixed=false", "strategy.memory=0.5",
                                    "strategy.max_traces=2"])
    first = plan_run(cfg)
    none = first["none_peak_bytes"]
    plan = first["plan"]
    return out, none, plan


def test_plan_cli_writes_a_plan_for_the_budget(planned):
    out, none, plan = planned
    assert (out / "plan.json").is_file() and (out / "plan_report.json").is_file()
    assert plan["predicted_peak_bytes"] == none  # half the RAM: no checkpointing needed
    assert plan["device"] == "cpu" and plan["batch_size"] == 4 and plan["size"] == 128


def test_train_with_a_budget_shows_predicted_and_measured_peak(tmp_path, planned):
    _, none, _ = planned
    budget = int(0.92 * none)
    cfg = compose_train(tmp_path, [*TINY, *NET, "strategy=budget", f"strategy.memory={budget}",
                                   "strategy.device=cpu", "strategy.max_traces=1",
                                   "strategy.margin=0.0"])
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["strategy"] == "budget"
    plan = summary["plan"]
    assert plan["budget_bytes"] == budget and plan["none_peak_bytes"] == none
    assert plan["predicted_peak_bytes"] <= budget
    assert any(s["mode"] != "keep" for u in plan["units"] for s in u["segments"])
    # the run's own MemTracker peak (first two optimizer steps) is the prediction
    assert plan["measured_peak_bytes"] == summary["peak_memory_bytes"]
    assert abs(plan["measured_over_predicted"] - 1) <= 0.03
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({k: v for k, v in plan.items()
                                  if not k.startswith("measured")}))
    again = train(compose_train(tmp_path / "again", [*TINY, *NET, "strategy=plan",
                                                     f"strategy.path={replay}"]))
    assert again["plan"]["units"] == plan["units"]
    assert again["peak_memory_bytes"] == summary["peak_memory_bytes"]
    with pytest.raises(ValueError, match=r"made for data.batch_size=4, this run has "
                                         r"data.batch_size=2"):
        train(compose_train(tmp_path / "other", [*TINY, *NET, "data.batch_size=2",
                                                 "strategy=plan", f"strategy.path={replay}"]))
    failed = json.loads((tmp_path / "other" / "summary.json").read_text())
    assert failed["status"] == "failed" and "strategy.path" in failed["error"]


@pytest.mark.slow  # the planner-level message: test_planner.py::test_infeasible_budget_*
def test_infeasible_budget_fails_before_training(tmp_path):
    cfg = compose_train(tmp_path, [*TINY, *NET, "strategy=budget", "strategy.memory=1MiB",
                                   "strategy.device=cpu"])
    with pytest.raises(InfeasibleBudget, match="no plan fits"):
        train(cfg)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "smallest peak" in summary["error"]
    assert not (tmp_path / "checkpoints").exists()


def test_bad_budget_keys_fail_naming_the_key(tmp_path):
    for override, match in (("strategy.memory=lots", "strategy.memory='lots'"),
                            ("strategy.device=v100x", "strategy.device='v100x'")):
        cfg = compose_train(tmp_path / override.split("=")[0], [*TINY, "strategy=budget",
                                                                 override])
        with pytest.raises(Exception, match=match):
            train(cfg)


def _frontier(tmp_path, extra):
    cfg = compose_app("plan", tmp_path, ["model=gpt_tiny", "+data.block_size=32",
                                         "data.batch_size=2", "strategy.device=cpu",
                                         "strategy.max_traces=2",
                                         *extra])
    return plan_run(cfg)


@pytest.mark.slow  # > 15 s on 2 cores: make test-all
def test_plan_cli_frontier_files(tmp_path):
    result = _frontier(tmp_path, ["budgets=2", "fixed=false"])
    rows = (tmp_path / "frontier.csv").read_text().splitlines()
    assert rows[0].startswith("kind,label,budget_bytes,peak_bytes,recompute_flops")
    plans = [p for p in result["frontier"] if p["kind"] == "plan"]
    assert len(plans) == 2 and len(rows) == 3
    assert (tmp_path / "frontier.png").stat().st_size > 1000
    # the first budget is the floor's: its plan recomputes, the last (none's peak) does not
    # planned for this CPU: kernel temporaries measured, 0.5% margin
    assert plans[0]["peak_bytes"] <= plans[0]["budget_bytes"] * (1 - 0.005)
    assert plans[0]["flops_ratio"] > 1.0 and plans[-1]["flops_ratio"] == 1.0
    assert plans[-1]["peak_bytes"] == result["none_allocator_peak_bytes"]
    assert result["none_allocator_peak_bytes"] > result["none_peak_bytes"]  # + the batch


@pytest.mark.slow
def test_plan_cli_fixed_points_and_micro_batches(tmp_path):
    result = _frontier(tmp_path, ["budgets=3", "strategy.memory=0.5",
                                   "effective_batch_size=4"])
    labels = [p["label"] for p in result["frontier"] if p["kind"] == "fixed"]
    assert "none" in labels and "selective matmul (whole network)" in labels
    # gpt_tiny's stages, [blocks], are its one unit: the default-stage rows were the whole
    # network's again, without a modelled time
    assert "sqrtn (whole network)" in labels and "sqrtn (default stages)" not in labels
    assert all(p["overhead"] is not None for p in result["frontier"] if p["kind"] == "fixed"
               and p["peak_bytes"])
    floor = min(p["peak_bytes"] for p in result["frontier"] if p["kind"] == "plan")
    fixed = [p for p in result["frontier"] if p["kind"] == "fixed" and p["peak_bytes"]]
    for p in fixed:  # the floor plan is never above the fixed strategies' least peak
        assert floor <= p["peak_bytes"] or p["label"] == "none"
    rows = result["micro_batches"]
    assert [r["micro_batch"] for r in rows] == [1, 2, 4]
    assert sum(1 for r in rows if r.get("fastest")) == 1
