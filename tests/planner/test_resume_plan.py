"""A ``strategy=budget`` run resumed from its checkpoint trains on with the plan it trained
with (saved in every checkpoint) instead of planning again; another budget or run shape, or
a checkpoint from before plans were kept, plans again and says why. A ``strategy=plan`` run
resumed trains on with the checkpoint's plan, whatever became of the file it replayed."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from remat.planner import Plan, PlanMismatch, UnitPlan
from remat.strategies import STRATEGY_STATE_KEY
from remat.train import train
from tests.helpers import TINY_TRAINER, compose_train

# gpt_tiny (4 blocks, width 64) on 128-character windows, batch 8: 4 steps per epoch. The
# budget lies between the smallest peak a plan reaches (~15 MiB) and none's (~46 MiB), so
# the plan recomputes; planned for this CPU with objective=time, i.e. timed unit costs.
BUDGET = "36MiB"


def tiny_gpt(root) -> list[str]:
    return ["model=gpt_tiny", "data=tinyshakespeare", f"data.root={root}",
            "data.block_size=128", "data.batch_size=8", "data.train_windows=32",
            "data.val_windows=2", "model.sample_tokens=4", *TINY_TRAINER]


def gpt(root, memory: str = BUDGET) -> list[str]:
    return [*tiny_gpt(root), "strategy=budget", f"strategy.memory={memory}",
            "strategy.device=cpu", "strategy.max_traces=2"]


def resume(ckpt, steps: int) -> list[str]:
    """Train on to ``steps`` optimizer steps from ``ckpt`` (the first part's last.ckpt ends
    Lightning's epoch 0 at its max_steps: the rest runs as epoch 1)."""
    return [f"trainer.max_steps={steps}", "trainer.max_epochs=2", f"ckpt_path={ckpt}"]


def plain(plan: dict) -> dict:
    """A summary's plan without what this process measured or where it came from."""
    return {k: v for k, v in plan.items() if not k.startswith("measured") and k != "origin"}


@pytest.fixture(scope="module")
def first(tmp_path_factory, shakespeare_root):
    """The first part of the run: planned at start, stopped after 2 of 4 steps."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    summary = train(compose_train(run_dir, [*gpt(shakespeare_root), "trainer.max_steps=2"]))
    assert summary["global_step"] == 2
    assert any(s["mode"] != "keep" for u in summary["plan"]["units"] for s in u["segments"])
    return run_dir, summary


def copy_of(first, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(first[0], run_dir)
    return run_dir


def no_planning(*args, **kwargs):
    raise AssertionError("the planner ran on resume")


@pytest.fixture
def planner_calls(monkeypatch, first):
    """Stand in for the planner: record each call, return the first run's plan at once."""
    calls = []

    def make_plan(build, batch_size, size, memory, *args, **kwargs):
        calls.append(memory)
        return SimpleNamespace(plan=Plan.from_dict(plain(first[1]["plan"])), seconds=0.0)

    monkeypatch.setattr("remat.planner.budget.make_plan", make_plan)
    return calls


@pytest.mark.parametrize("name", ["path", "last"])
def test_resume_trains_on_with_the_checkpoints_plan(tmp_path, first, shakespeare_root,
                                                    monkeypatch, caplog, name):
    run_dir = copy_of(first, tmp_path)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)[STRATEGY_STATE_KEY]
    assert saved["plan"] == plain(first[1]["plan"])  # plain data, weights_only
    assert saved["request"]["budget_bytes"] == 36 * 2**20
    monkeypatch.setattr("remat.planner.budget.make_plan", no_planning)
    monkeypatch.setattr("remat.planner.planner.Planner.__init__", no_planning)
    with caplog.at_level("INFO", logger="remat"):
        resumed = train(compose_train(run_dir, [
            *gpt(shakespeare_root), *resume(ckpt if name == "path" else "last", 4)]))
    assert f"resuming with the plan saved in ckpt_path={ckpt}" in caplog.text
    assert resumed["status"] == "completed" and resumed["global_step"] == 4
    assert plain(resumed["plan"]) == plain(first[1]["plan"])
    assert resumed["plan"]["origin"] == f"the plan saved in ckpt_path={ckpt}"
    # this process's own peak, beside what the first part measured under the same plan
    earlier = resumed["peak_memory_measured"]["previous_runs"]
    assert earlier == [{"peak_bytes": first[1]["peak_memory_bytes"], "optimizer_steps": [1, 2],
                        "strategy": "plan", "plan": Plan.from_dict(saved["plan"]).summary(),
                        "compiled": False, "peak_method": "tensors"}]
    assert resumed["peak_memory_measured"]["optimizer_steps"] == [3, 4]
    assert resumed["plan"]["measured_peak_bytes"] == resumed["peak_memory_bytes"]
    # the resumed run's checkpoints keep the plan too (a second resume reuses it again)
    again = torch.load(ckpt, weights_only=True)
    assert again["global_step"] == 4 and again[STRATEGY_STATE_KEY]["plan"] == saved["plan"]


@pytest.mark.parametrize(("override", "why"), [
    ("strategy.memory=40MiB", "strategy.memory: 36.0 MiB -> 40.0 MiB"),
    ("data.batch_size=4", "data.batch_size: 8 -> 4"),
])
def test_resume_with_another_budget_or_shape_plans_again(tmp_path, first, shakespeare_root,
                                                         planner_calls, caplog, override,
                                                         why):
    ckpt = first[0] / "checkpoints" / "last.ckpt"
    with caplog.at_level("INFO", logger="remat"):
        resumed = train(compose_train(tmp_path, [*gpt(shakespeare_root), override,
                                                 *resume(ckpt, 3)]))
    assert len(planner_calls) == 1
    assert f"not reusing the plan saved in ckpt_path={ckpt}" in caplog.text
    assert why in caplog.text
    assert resumed["global_step"] == 3
    assert resumed["plan"]["origin"].startswith("strategy=budget, planned for")


def test_resume_from_a_checkpoint_without_a_plan_plans_again(tmp_path, first, shakespeare_root,
                                                            planner_calls, caplog):
    old = torch.load(first[0] / "checkpoints" / "last.ckpt", weights_only=True)
    del old[STRATEGY_STATE_KEY]  # as written before checkpoints kept their plan
    torch.save(old, tmp_path / "old.ckpt")
    with caplog.at_level("INFO", logger="remat"):
        resumed = train(compose_train(tmp_path / "run", [*gpt(shakespeare_root),
                                                         *resume(tmp_path / "old.ckpt", 3)]))
    assert planner_calls == [36 * 2**20]
    assert "holds no plan" in caplog.text and resumed["global_step"] == 3


def test_resume_of_another_network_fails_naming_the_checkpoint(tmp_path, first,
                                                              shakespeare_root, monkeypatch):
    """Same budget and shape, another network: the checkpoint's weights do not fit it
    either, so it fails at once instead of planning (up to a minute) first."""
    ckpt = first[0] / "checkpoints" / "last.ckpt"
    monkeypatch.setattr("remat.planner.budget.make_plan", no_planning)
    with pytest.raises(Exception, match=r"ckpt_path=.*last.ckpt: this plan was made for "
                                        r"another network .*trained with that network"):
        train(compose_train(tmp_path, [*gpt(shakespeare_root), "model.n_embd=32",
                                       *resume(ckpt, 3)]))


# strategy=plan: two hand-written plans for gpt_tiny's 4 blocks at the run shape of tiny_gpt
# (batch 8, 128 tokens, fp32), so the run-shape check applies to them
def blocks_plan(*segments: tuple[int, int, str]) -> Plan:
    return Plan([UnitPlan("blocks", "chain", list(segments))], model="GPT", batch_size=8,
                size=128, precision="32-true", device="cpu")


TRAINED = blocks_plan((0, 2, "recompute"), (2, 4, "keep"))  # what the first part trains with
OTHER = blocks_plan((0, 1, "keep"), (1, 4, "recompute"))  # what the file holds later


@pytest.fixture(scope="module")
def replayed(tmp_path_factory, shakespeare_root):
    """The first part of a strategy=plan run: plan/plan.json replayed, 2 of 4 steps."""
    root = tmp_path_factory.mktemp("replayed")
    TRAINED.save((root / "plan").mkdir() or root / "plan" / "plan.json")
    summary = train(compose_train(root / "run", [*tiny_gpt(shakespeare_root), "strategy=plan",
                                                 f"strategy.path={root}/plan/plan.json",
                                                 "trainer.max_steps=2"]))
    assert summary["global_step"] == 2
    assert summary["strategy_report"]["segments"] == {"blocks": [[0, 2]]}
    return root


def resume_replay(tmp_path, replayed, shakespeare_root, caplog, change, ckpt=None,
                  extra=()):
    """Copy the first part, ``change(plan_file)``, resume it to 4 steps with the same
    ``strategy.path``; the summary, the checkpoint resumed and remat's warnings."""
    shutil.copytree(replayed, tmp_path / "copy")
    plan_file = tmp_path / "copy" / "plan" / "plan.json"
    change(plan_file)
    run_dir = tmp_path / "copy" / "run"
    last = run_dir / "checkpoints" / "last.ckpt"
    with caplog.at_level("INFO", logger="remat"):
        summary = train(compose_train(run_dir, [
            *tiny_gpt(shakespeare_root), "strategy=plan", f"strategy.path={plan_file}",
            *resume(ckpt or last, 4), *extra]))
    warnings = [r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and r.name.startswith("remat")]
    return summary, last, plan_file, warnings


def trained_on_with_the_checkpoints_plan(summary, last):
    assert summary["status"] == "completed" and summary["global_step"] == 4
    assert plain(summary["plan"]) == TRAINED.to_dict()
    assert summary["plan"]["origin"] == f"the plan saved in ckpt_path={last}"
    assert summary["strategy_report"]["segments"] == {"blocks": [[0, 2]]}  # applied
    assert summary["strategy_report"]["wrapped"] == ["blocks.0", "blocks.1"]
    # the resumed run's checkpoint keeps that plan for the next resume
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 4
    assert saved[STRATEGY_STATE_KEY]["plan"] == TRAINED.to_dict()


def test_replayed_plan_resumes_with_the_checkpoints_plan_when_the_file_changed(
        tmp_path, replayed, shakespeare_root, caplog):
    """The user planned again into the same folder: the run goes on as it trained."""
    summary, last, plan_file, warnings = resume_replay(
        tmp_path, replayed, shakespeare_root, caplog, OTHER.save)
    trained_on_with_the_checkpoints_plan(summary, last)
    assert warnings == [
        f"strategy.path={str(plan_file)!r} holds another plan than it trained with: resuming "
        f"with the plan saved in ckpt_path={last}, not the file's; to train with the file's "
        "plan, start a new run (without ckpt_path)"]
    assert (f"strategy=plan: resuming with the plan saved in ckpt_path={last}, the one this "
            "run trained with" in caplog.text)
    assert Plan.load(plan_file) == OTHER  # the file is left as the user wrote it


def test_replayed_plan_resumes_when_the_file_is_gone(tmp_path, replayed, shakespeare_root,
                                                     caplog):
    summary, last, plan_file, warnings = resume_replay(
        tmp_path, replayed, shakespeare_root, caplog, lambda path: path.unlink(),
        ckpt="last")
    trained_on_with_the_checkpoints_plan(summary, last)
    assert warnings == []
    assert f"(strategy.path={str(plan_file)!r} is gone (no such file))" in caplog.text


def test_replayed_plan_resumes_quietly_when_the_file_is_unchanged(tmp_path, replayed,
                                                                  shakespeare_root, caplog):
    summary, last, plan_file, warnings = resume_replay(
        tmp_path, replayed, shakespeare_root, caplog, lambda path: None)
    trained_on_with_the_checkpoints_plan(summary, last)
    assert warnings == []
    assert f"(strategy.path={str(plan_file)!r} holds the same plan)" in caplog.text


def test_replayed_plan_from_the_checkpoint_is_checked_against_the_run(
        tmp_path, replayed, shakespeare_root, caplog):
    """Another batch size than the checkpoint's plan was made for: one-line error naming
    the checkpoint, before anything trains (the file, gone, is not what is checked)."""
    last = tmp_path / "copy" / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(PlanMismatch) as raised:
        resume_replay(tmp_path, replayed, shakespeare_root, caplog,
                      lambda path: path.unlink(), extra=["data.batch_size=4"])
    assert str(raised.value) == (
        f"the plan saved in ckpt_path={last}: the plan was made for data.batch_size=8, this "
        "run has data.batch_size=4; set data.batch_size back (a resumed run trains on with "
        "the plan it trained with; for another plan start a new run)")


def test_replay_from_a_checkpoint_without_a_plan_reads_the_file(tmp_path, replayed,
                                                                shakespeare_root, caplog):
    """Checkpoints from before plans were kept: the file is read, as it was."""
    def older_checkpoint_and_other_plan(plan_file):
        last = plan_file.parent.parent / "run" / "checkpoints" / "last.ckpt"
        old = torch.load(last, weights_only=True)
        del old[STRATEGY_STATE_KEY]
        torch.save(old, last)
        OTHER.save(plan_file)

    summary, last, plan_file, warnings = resume_replay(
        tmp_path, replayed, shakespeare_root, caplog, older_checkpoint_and_other_plan)
    assert summary["global_step"] == 4 and plain(summary["plan"]) == OTHER.to_dict()
    assert summary["plan"]["origin"] == f"strategy.path={str(plan_file)!r}"
    assert summary["strategy_report"]["segments"] == {"blocks": [[1, 4]]}
    assert f"ckpt_path={last} holds no plan" in caplog.text and warnings == []
