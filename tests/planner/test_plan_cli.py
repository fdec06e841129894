"""What a user of ``python -m remat.plan`` and ``strategy=plan`` sees: a plan of another run
shape or network refused in one line, a warning for a plan of another device, the report in
``plan.log``, a readable ``frontier.png``, and with ``effective_batch_size`` the plan and
train command of the micro-batch the table marks."""

from __future__ import annotations

import json
import logging
import shlex
from contextlib import contextmanager

import pytest
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import configure_log
from hydra.types import RunMode
from omegaconf import read_write

from remat.plan import run as plan_run
from remat.planner import InfeasibleBudget, Plan, PlanMismatch, PlanStrategy, devices
from remat.planner.frontier import MARKERS, Point, format_points, frontier_figure
from remat.planner.run import check_plan_fits, plan_for_run
from remat.train import _hydra_main as train_main
from tests.helpers import TINY, compose_app, compose_train, entry_exit


def _plan_file(tmp_path, **fields):
    """A plan.json written by hand: no units changed, made for ``fields``."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"units": [], "version": 1, "batch_size": 4, "size": 64,
                                "precision": "32-true", "device": "cpu",
                                "predicted_allocator_peak_bytes": 3 * 2**20} | fields))
    return path


@pytest.mark.parametrize(("fields", "mode"), [
    ({"batch_size": 2}, RunMode.RUN), ({"batch_size": 2}, RunMode.MULTIRUN),
    ({"fingerprint": "0123abcd", "model": "Unet"}, RunMode.RUN)])
def test_a_plan_of_another_run_shape_or_network_fails_in_one_line(tmp_path, capsys, fields,
                                                                  mode):
    """``python train.py`` (the Hydra app's function, as Hydra calls it): a single run ends
    with ``error: <message>`` alone on stderr and exit code 1 (no traceback), also where
    ``instantiate`` wraps it (the network check runs in the model's constructor);
    a multirun job raises, so Hydra runs the sweep's other jobs."""
    path = _plan_file(tmp_path, **fields)
    cfg = compose_train(tmp_path / "run", [*TINY, "strategy=plan", f"strategy.path={path}"])
    with read_write(cfg.hydra):
        cfg.hydra.mode = mode
    HydraConfig().set_config(cfg)
    message = (f"strategy.path='{path}': the plan was made for data.batch_size=2, this run "
               "has data.batch_size=4; plan again for this run (python -m remat.plan ... "
               "data.batch_size=4) or set data.batch_size back" if "batch_size" in fields else
               f"strategy.path='{path}': this plan was made for another network (Unet, "
               "parameters differ); plan again for this model with python -m remat.plan")
    if mode is RunMode.RUN:
        with pytest.raises(SystemExit) as stop:
            train_main.__wrapped__(cfg)
        assert stop.value.code == 1 and stop.value.__cause__ is None
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    else:
        with pytest.raises(PlanMismatch) as raised:
            train_main.__wrapped__(cfg)
        assert str(raised.value) == message
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "strategy.path=" in summary["error"]


def test_a_plan_for_another_device_warns_and_trains(tmp_path, caplog):
    cfg = compose_train(tmp_path, TINY)  # trainer.accelerator=cpu
    path = _plan_file(tmp_path, device="h100")
    with caplog.at_level(logging.WARNING, logger="remat.planner.run"):
        strategy = plan_for_run(cfg, PlanStrategy(path=str(path)))
    assert isinstance(strategy, PlanStrategy)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"strategy.path='{path}': the plan was made for device h100, this run "
                        "trains on cpu; its predicted peak (3.0 MiB) holds on h100 only. "
                        "Plan again for this device: strategy=budget strategy.device=cpu (or "
                        "python -m remat.plan ... strategy.device=cpu)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat.planner.run"):
        plan_for_run(cfg, PlanStrategy(path=str(_plan_file(tmp_path, device="cpu"))))
    assert not caplog.records  # a cpu plan on this CPU


def test_a_budget_planned_for_another_device_warns(tmp_path, caplog):
    """strategy=budget strategy.device=h100 on this CPU trains, saying the predicted peak
    holds on the H100 only (it was silent)."""
    from remat.planner import BudgetStrategy

    cfg = compose_train(tmp_path, [*TINY, "strategy=budget", "strategy.memory=0.5",
                                   "strategy.device=h100"])
    with caplog.at_level(logging.WARNING, logger="remat.planner.run"):
        strategy = plan_for_run(cfg, BudgetStrategy(memory=0.5, device="h100"))
    assert isinstance(strategy, PlanStrategy) and strategy.plan.device == "h100"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        "strategy.device=h100: the plan was made for device h100, this run trains on cpu")


def test_the_device_present_is_named_as_the_device_table_does(monkeypatch):
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "_present_cuda", lambda: devices.DEVICES["h100"])
    assert devices.present_device_name("auto") == "h100"
    assert devices.present_device_name("gpu") == "h100"
    assert devices.present_device_name("cpu") == "cpu"  # a CPU run on a GPU machine
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    assert devices.present_device_name("auto") == "cpu"


def test_frontier_figure_keeps_title_and_legend_inside_and_labels_off_the_points():
    points = [Point("plan", "plan", 4 * 2**20, 4 * 2**20, 10, 1.3, 1.1),
              Point("plan", "plan", 5 * 2**20, 5 * 2**20, 0, 1.0, 1.0),
              Point("fixed", "none", None, 5 * 2**20, 0, 1.0, 1.0)]
    for stages in ("default stages", "whole network"):  # two by two at the same point
        points += [Point("fixed", f"{name} ({stages})", None, 4 * 2**20, 10, 1.3, 1.2)
                   for name in ("full", "sqrtn", "every_k k=2")]
    title = ("GPT, batch 2, size 32, 32-true, accumulate_grad_batches=4, one of 8 FSDP2 "
             "ranks, on this CPU (calibrated) (cpu; measured here: 1024x1024 float32 matmul "
             "and a 64 MiB copy, best of 9, kept per machine (Intel Xeon | 2 threads | torch "
             "2.14.1))")  # wrapped
    fig = frontier_figure(points, title, objective="time")
    fig.canvas.draw()
    flops_ax, time_ax = fig.axes
    width, height = fig.bbox.width, fig.bbox.height
    for artist in (fig._suptitle, time_ax.get_legend()):
        box = artist.get_window_extent()
        assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height
    for ax in (flops_ax, time_ax):
        assert not time_ax.get_legend().get_window_extent().overlaps(ax.get_window_extent())
        assert not ax.texts  # no labels at the points
    assert [t.get_text() for t in time_ax.get_legend().get_texts()] == [
        "remat plans (budgets)", "none", "full", "sqrtn", "every_k k=2"]
    # the plan at 4 MiB costs 1.3x none's FLOPs but only 1.1x its modelled time: each panel
    # draws its own measure, and the objective's panel says it is the objective
    assert list(flops_ax.lines[0].get_ydata()) == [1.3, 1.0]
    assert list(time_ax.lines[0].get_ydata()) == [1.1, 1.0]
    assert "objective" in time_ax.get_ylabel() and "objective" not in flops_ax.get_ylabel()
    markers = {MARKERS[n] for n in ("full", "sqrtn", "every_k k=2")}
    assert len(markers) == 3  # three strategies at one point: three markers


@contextmanager
def _hydra_job_logging(cfg):
    """The plan app's job logging as Hydra configures it (console and plan.log), undone
    after the block."""
    names = ["", "remat.plan.report"]
    kept = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level,
                logging.getLogger(n).propagate) for n in names}
    configure_log(cfg.hydra.job_logging, cfg.hydra.verbose)
    try:
        yield
    finally:
        for name, (handlers, level, propagate) in kept.items():
            logger = logging.getLogger(name)
            for handler in logger.handlers:
                if handler not in handlers:
                    handler.close()
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate


def test_the_report_reaches_plan_log_and_the_console_once(tmp_path, capsys):
    cfg = compose_app("plan", tmp_path, ["model=gpt_tiny", "+data.block_size=32",
                                         "data.batch_size=1", "strategy.device=h100",
                                         "budgets=0", "fixed=false", "strategy.memory=0.5",
                                         "strategy.max_traces=1"])
    with _hydra_job_logging(cfg):
        result = plan_run(cfg)
    command = "  python train.py " + " ".join(result["train_overrides"])
    # planned on synthetic tokens: the command trains on a text dataset
    assert command == (f"  python train.py model=gpt_tiny data=tinyshakespeare data.block_size=32 "
                       f"data.batch_size=1 strategy=plan strategy.path={tmp_path / 'plan.json'}")
    console = capsys.readouterr().out.splitlines()
    head = ("plan for GPT, batch 1, size 32, 32-true, on NVIDIA H100 SXM5 80GB (h100; NVIDIA "
            "H100 Tensor Core GPU datasheet (SXM5))")
    for line in (head, "(keep everything)", command):
        assert console.count(line) == 1, line  # plain, and not again by the root's handler
    log_lines = (tmp_path / f"{cfg.hydra.job.name}.log").read_text().splitlines()
    assert log_lines[0].endswith(f"[remat.plan.report][INFO] - {head}")
    assert "(keep everything)" in log_lines and command in log_lines


def test_effective_batch_writes_the_marked_micro_batch_plan_and_its_command(tmp_path, caplog):
    # data.batch_size x accumulate_grad_batches is one row of the search (its planner is
    # reused): the table marks the other one
    plan_args = ["model=gpt_tiny", "+data.block_size=32", "data.batch_size=1",
                 "accumulate_grad_batches=2", "strategy.device=h100", "budgets=0", "fixed=false",
                 "strategy.memory=0.5", "strategy.max_traces=1", "effective_batch_size=2"]
    with caplog.at_level(logging.INFO, logger="remat.plan.report"):
        result = plan_run(compose_app("plan", tmp_path, plan_args))
    marked = [r for r in result["micro_batches"] if r.get("fastest")]
    assert [(r["micro_batch"], r["accumulate_grad_batches"]) for r in marked] == [(2, 1)]
    path = tmp_path / "plan.json"
    saved = json.loads(path.read_text())
    # the marked row's plan, not the one of data.batch_size=1 x accumulate_grad_batches=2
    assert saved["batch_size"] == 2 and saved["accumulate_grad_batches"] == 1
    assert saved == result["plan"] == marked[0]["plan"]
    assert result["train_overrides"] == [
        "model=gpt_tiny", "data=tinyshakespeare", "data.block_size=32", "data.batch_size=2",
        "accumulate_grad_batches=1", "strategy=plan", f"strategy.path={path}"]
    printed = "\n".join(r.getMessage() for r in caplog.records).splitlines()
    assert ("plan for micro-batch 2 x accumulate_grad_batches 1 (the fastest that fits):"
            in printed)
    command = next(line for line in printed if line.startswith("  python train.py "))

    # the printed command's overrides are accepted by the replay check; batch 1 is not
    train_cfg = compose_train(tmp_path / "train", shlex.split(command)[2:])
    check_plan_fits(Plan.load(path), train_cfg, str(path))
    with pytest.raises(PlanMismatch, match="made for data.batch_size=2, this run has "
                                           "data.batch_size=1"):
        check_plan_fits(Plan.load(path), compose_train(tmp_path / "b1", plan_args[:4]),
                        str(path))


@pytest.mark.slow  # about 20 s: each infeasible row works out what would fit instead
def test_effective_batch_with_no_micro_batch_that_fits_is_an_infeasible_budget(tmp_path):
    cfg = compose_app("plan", tmp_path, ["model=gpt_tiny", "+data.block_size=32",
                                         "data.batch_size=1", "strategy.device=h100",
                                         "budgets=0", "fixed=false", "strategy.memory=1MiB",
                                         "strategy.max_traces=1", "effective_batch_size=2"])
    with pytest.raises(InfeasibleBudget, match=r"^effective_batch_size=2: no micro-batch fits "
                                               r"strategy.memory=1MiB; micro-batch 1: "
                                               r"strategy.memory=1.0 MiB: "
                                               r"no plan fits\. The smallest peak"):
        plan_run(cfg)  # remat.plan's main: the message on stderr, exit code 2
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow  # > 15 s on 2 cores: make test-all
def test_bad_planner_settings_and_infeasible_budgets_end_a_run_without_a_traceback(
        tmp_path, capsys):
    """``python train.py strategy=budget strategy.memory=abc`` and ``python -m remat.plan
    strategy.memory=0``: one line naming the key (exit code 1); a budget below what any plan needs:
    what would fit, on stderr, exit code 2 (as remat.plan gives it)."""
    from remat.plan import _hydra_main as plan_main

    def as_single_run(cfg):
        with read_write(cfg.hydra):
            cfg.hydra.mode = RunMode.RUN
        HydraConfig().set_config(cfg)
        return cfg

    cfg = compose_train(tmp_path / "bad", [*TINY, "strategy=budget", "strategy.memory=abc"])
    with pytest.raises(SystemExit) as stop:
        train_main.__wrapped__(as_single_run(cfg))
    assert stop.value.code == 1
    assert capsys.readouterr().err.startswith("error: strategy.memory='abc': cannot read")
    cfg = compose_app("plan", tmp_path / "plan", ["strategy.memory=0"])
    with pytest.raises(SystemExit) as stop:
        plan_main.__wrapped__(as_single_run(cfg))
    assert str(stop.value.code).startswith("error: strategy.memory=0: a memory budget must be > 0")
    cfg = compose_train(tmp_path / "tight", [*TINY, "strategy=budget", "strategy.memory=2MiB",
                                             "strategy.device=h100"])
    with pytest.raises(SystemExit) as stop:
        train_main.__wrapped__(as_single_run(cfg))
    assert stop.value.code == 2
    assert "no plan fits" in capsys.readouterr().err


def test_the_printed_train_command_chooses_an_experiment_as_train_py_does(tmp_path):
    """``remat.plan`` takes ``experiment=...`` as ``train.py`` does (its defaults list had
    no experiment group: Hydra refused it without ``+``), and the train command it prints
    says ``experiment=...``, which ``train.py`` composes."""
    from remat.plan import train_overrides

    compose_app("plan", tmp_path / "plan", ["experiment=shakespeare_gpt", "strategy.memory=1GiB",
                                            "data.batch_size=4"])
    overrides = train_overrides(tmp_path / "plan.json")
    assert overrides == ["experiment=shakespeare_gpt", "data.batch_size=4", "strategy=plan",
                         f"strategy.path={tmp_path / 'plan.json'}"]
    cfg = compose_train(tmp_path / "train", overrides)
    assert cfg.monitor == "val/loss" and cfg.strategy.path == str(tmp_path / "plan.json")
    # without an experiment a sequence model monitors its own val/loss (its model config
    # chooses monitor_preset/val_loss; train.yaml's val/dice is a segmentation metric)
    compose_app("plan", tmp_path / "plan2", ["model=gpt_tiny", "data=tinyshakespeare",
                                             "strategy.memory=1GiB"])
    overrides = train_overrides(tmp_path / "plan.json")
    assert overrides == ["model=gpt_tiny", "data=tinyshakespeare", "strategy=plan",
                         f"strategy.path={tmp_path / 'plan.json'}"]
    cfg = compose_train(tmp_path / "train2", overrides)
    assert (cfg.monitor, cfg.monitor_mode) == ("val/loss", "min")
    # planned on synthetic tokens (no data=): the command trains on a text dataset (the
    # default data gives images, and train.py failed in its datamodule on block_size)
    compose_app("plan", tmp_path / "plan3", ["model=gpt_tiny", "+data.block_size=64",
                                             "strategy.memory=1GiB"])
    overrides = train_overrides(tmp_path / "plan.json")
    assert overrides == ["model=gpt_tiny", "data=tinyshakespeare", "data.block_size=64",
                         "strategy=plan", f"strategy.path={tmp_path / 'plan.json'}"]
    cfg = compose_train(tmp_path / "train3", overrides)
    assert cfg.data.block_size == 64 and "tinyshakespeare" in str(cfg.data.root)


def test_remat_plan_does_not_overwrite_a_plan_a_run_may_train_with(tmp_path):
    """A second ``remat.plan`` with a budget into a folder that holds a ``plan.json`` stops
    before planning and leaves the file as it was (a strategy=plan run replays that path)."""
    from remat.planner import PlanInputError

    (tmp_path / "plan.json").write_text('{"units": []}')
    with pytest.raises(PlanInputError, match="plan.json exists: a run may train with it"):
        plan_run(compose_app("plan", tmp_path, ["strategy.memory=1GiB"]))
    assert (tmp_path / "plan.json").read_text() == '{"units": []}'


def test_the_printed_frontier_says_its_peaks_are_the_allocators():
    # remat.plan's table shows allocator peaks, train's estimate line tensor peaks: the
    # table says which, so the two numbers of one plan are not read as a contradiction
    text = format_points([Point("plan", "plan", 300 * 2**20, 250 * 2**20, 10, 1.1, 1.2)])
    header, row = text.splitlines()
    assert "(peak: allocator, with the batch and kernel temporaries)" in header
    assert row.split()[1:] == ["300.0", "MiB", "250.0", "MiB", "1.100", "1.200"]


@pytest.mark.parametrize("app", ["plan", "estimate"])
def test_a_user_error_in_plan_or_estimate_ends_in_one_line(app, tmp_path, capsys):
    # as train.py and remat.eval: a config/data/model error is one line, exit code 1 (a
    # 3D net on 2D images printed a traceback above the message)
    assert entry_exit(app, compose_app(app, tmp_path, ["model=monai_unet3d"])) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: model=monai_unet3d is a 3D network (model.spatial_dims=3) but "
        "data=synthetic_seg serves 2D images")


@pytest.mark.slow  # > 20 s; the pool it rests on: test_planner.py::test_a_larger_budget_*
def test_a_cheaper_plan_traced_for_the_frontier_replaces_the_plan(tmp_path, monkeypatch,
                                                                  caplog):
    from remat.planner import Planner

    original = Planner.plan
    calls = []

    def first_finds_only_the_floor(self, memory, refine=True, max_traces=None):
        calls.append(memory)
        if len(calls) > 1:
            return original(self, memory, refine, max_traces)
        floor_plan, floor = self.floor()  # fits any budget the floor fits, costs the most
        budget = self.budget_for(self.none.allocator_peak) - 1
        return original(self, budget, refine, max_traces).__class__(
            self._finish(floor_plan, floor, budget, self.margin_for(budget)),
            floor.allocator_peak, [], 0.0)

    monkeypatch.setattr(Planner, "plan", first_finds_only_the_floor)
    cfg = compose_app("plan", tmp_path, ["model=gpt_tiny", "+data.block_size=32",
                                         "data.batch_size=2", "strategy.device=h100",
                                         "strategy.max_traces=2", "budgets=2", "fixed=false",
                                         "strategy.memory=0.999"])
    with caplog.at_level(logging.INFO, logger="remat.plan.report"):
        result = plan_run(cfg)
    assert "a plan traced for the frontier fits the budget and costs less" in caplog.text
    saved = Plan.load(tmp_path / "plan.json")
    assert saved.to_dict() == result["plan"]
    # no frontier point at a budget at most the plan's is cheaper than it
    for point in result["frontier"]:
        if point["budget_bytes"] <= saved.budget_bytes and point["overhead"] is not None:
            assert saved.predicted_overhead <= point["overhead"] + 1e-9
    assert saved.predicted_allocator_peak_bytes + saved.margin_bytes <= saved.budget_bytes
