"""Plans fit their budgets at the trace level, as measured, and compute the same function."""

import json
import math
import re

import pytest
import torch
from omegaconf import open_dict

from remat.build import build_from_config
from remat.measure import format_bytes
from remat.measure.parity import compare_gradients, gradients_of
from remat.measure.trace import trace_step
from remat.planner import InfeasibleBudget, Plan, Planner, PlanStrategy
from remat.planner import planner as planner_module
from remat.planner.planner import full_segments
from remat.planner.profile import find_candidates
from remat.strategies import NoCheckpoint, StageError
from tests.helpers import compose_config

# tiny GPT with dropout: blocks chain, plus the embeddings and head around it
GPT = ["model=gpt_tiny", "device=cpu", "data.batch_size=2", "+data.block_size=64"]


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    cfg = compose_config("estimate", tmp_path_factory.mktemp("plan"), GPT)
    build, _, batch, size = build_from_config(cfg)
    planner = Planner(build.with_strategy, batch, size, "32-true", device="cpu",
                      max_traces=3, default_stages=["blocks"])
    return planner, build.with_strategy


def _real_peak(build, strategy, planner):
    _, peak = trace_step(lambda: build(strategy), planner.batch_size, planner.size,
                         torch.device("cpu"), "32-true", fake=False)
    return peak.peak_bytes


def test_plans_fit_their_budgets_as_traced_and_as_measured(gpt):
    planner, build = gpt
    plan_floor, floor = planner.floor()
    none = planner.none.allocator_peak
    assert floor.allocator_peak < 0.8 * none  # checkpointing the chain saves memory here
    seen, flops = set(), []
    for frac in (0.25, 0.95):
        allowed = int(floor.allocator_peak + frac * (none - floor.allocator_peak))
        budget = planner.budget_for(allowed)
        plan = planner.plan(budget).plan
        # the allocator's peak (tensors, the batch, kernel temporaries) is what must fit
        assert plan.predicted_peak_bytes < plan.predicted_allocator_peak_bytes
        assert plan.predicted_allocator_peak_bytes <= budget - plan.margin_bytes
        assert plan.margin_bytes == planner.margin_for(budget) == int(budget * planner.margin)
        measured = _real_peak(build, PlanStrategy(plan), planner)
        # the fake trace is the real step's MemTracker peak
        assert abs(measured - plan.predicted_peak_bytes) <= 0.03 * measured
        assert plan.recompute_flops >= 0 and plan.predicted_overhead >= 1.0
        seen.add(plan.summary())
        flops.append(plan.recompute_flops)
    assert len(seen) == 2  # different budgets give different plans
    assert flops[0] > flops[1]  # a larger budget recomputes less


def test_a_larger_budget_never_gets_a_plan_that_ranks_costlier(gpt, monkeypatch):
    planner, _ = gpt
    floor_plan, floor = planner.floor()
    none = planner.none.allocator_peak
    small = planner.budget_for(int(floor.allocator_peak + 0.6 * (none - floor.allocator_peak)))
    first = planner.plan(small, refine=False).plan
    assert planner.modelled_cost(first) < planner.modelled_cost(floor_plan)
    # a search that, for a budget one byte larger, meets only the floor's plan (as a search
    # whose targets depend on the budget may): the plan traced for the smaller one still fits
    monkeypatch.setattr(planner_module, "best_plan",
                        lambda *a, **k: (0.0, 0, planner._choice_of(floor_plan)))
    larger = planner.plan(small + 1, refine=False).plan
    assert planner.modelled_cost(larger) <= planner.modelled_cost(first)
    assert larger.predicted_allocator_peak_bytes <= small + 1 - larger.margin_bytes
    # each answer is its own copy: the second budget did not overwrite the first's
    assert (first.budget_bytes, larger.budget_bytes) == (small, small + 1)


def test_a_plan_traced_below_the_floor_answers_budgets_the_floor_misses(gpt, monkeypatch):
    planner, _ = gpt
    true_plan, true_floor = planner.floor()
    # a floor whose candidates missed the least plan (as they miss a refined plan that peaks
    # lower: SwinUNETR 3D at 96^3), while that plan was traced before
    higher = next((p, t) for p, t in planner.traced_fitting(planner.none.allocator_peak - 1)
                  if t.allocator_peak > true_floor.allocator_peak)
    monkeypatch.setattr(planner, "_floor", higher)
    budget = planner.budget_for(true_floor.allocator_peak)
    assert budget - planner.margin_for(budget) < higher[1].allocator_peak
    planned = planner.plan(budget)
    assert planned.plan.predicted_allocator_peak_bytes <= budget - planned.plan.margin_bytes
    assert planned.floor_bytes == true_floor.allocator_peak
    # below it, the message names the least peak traced, not the floor's candidates'
    with pytest.raises(InfeasibleBudget) as err:
        planner.plan(budget - 2**20)
    assert f"reaches is {format_bytes(true_floor.allocator_peak)} " in str(err.value)
    assert planner.lowest()[1] == true_floor and repr(planner.lowest()[0].units) == repr(
        true_plan.units)


def test_plan_beats_or_equals_fixed_strategies_that_fit(gpt):
    planner, _ = gpt
    for _, ref in planner.references(["blocks"]):
        traced = planner.trace(PlanStrategy(ref))
        budget = planner.budget_for(traced.allocator_peak)
        plan = planner.plan(budget).plan
        assert plan.predicted_allocator_peak_bytes <= traced.allocator_peak
        assert planner.modelled_cost(plan) <= planner.modelled_cost(ref) + 1e-12


def test_plan_computes_the_same_function(gpt):
    planner, build = gpt
    plan_floor, _ = planner.floor()
    mixed = planner.plan(planner.budget_for(int(0.97 * planner.none.allocator_peak))).plan
    ref_model = build(NoCheckpoint())
    for plan in (plan_floor, mixed):
        model = build(PlanStrategy(plan))
        model.load_state_dict(ref_model.state_dict())
        results = []
        for m in (ref_model, model):
            m.train()
            m.zero_grad(set_to_none=True)
            torch.manual_seed(5)  # the same dropout masks
            m.training_loss(m.example_batch(2, 64)).backward()
            results.append(gradients_of(m))
        parity = compare_gradients(results[0], results[1])
        assert parity.match, parity
    assert any(u.changed for u in mixed.units)


def test_a_plan_at_the_floor_keeps_the_last_unit_whose_backward_sets_the_peak(tmp_path):
    """tests.models.nets.PinnedPeakNet: a chain of elementwise blocks (saved bytes, no
    FLOPs), then a wide head whose backward is the peak of every plan that recomputes the
    chain. The floor recomputes the head too (its convolutions' FLOPs), though keeping it
    peaks the same: the backward runs the head first, before the chain's recompute. At the
    floor's budget the plan keeps the head (0 recompute FLOPs; the search alone gave the
    floor's 679 MFLOP) and its real step has the predicted peak and none's gradients."""
    cfg = compose_config("estimate", tmp_path, [
        "model=custom", "model.net._target_=tests.models.nets.PinnedPeakNet",
        "model.stages=auto", "device=cpu", "data.image_size=64", "data.batch_size=2"])
    build, _, batch, size = build_from_config(cfg)
    planner = Planner(build.with_strategy, batch, size, "32-true", device="cpu",
                      objective="flops", max_traces=2)
    assert planner.unit_order() == ["blocks", "head"]
    _, floor = planner.floor()
    assert floor.step_flops > planner.none.step_flops  # the floor recomputes the head
    planned = planner.plan(planner.budget_for(floor.allocator_peak))
    plan = planned.plan
    assert plan.recompute_flops == 0
    assert plan.predicted_allocator_peak_bytes == floor.allocator_peak
    assert [s for u in plan.units if u.path == "head" for s in u.segments] == [
        (i, i + 1, "keep") for i in range(5)]
    assert len(planned.traces) <= planner.max_traces + planner_module.REFINE_TRACES
    measured = _real_peak(build.with_strategy, PlanStrategy(plan), planner)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.03 * measured
    ref_model, model = build.with_strategy(NoCheckpoint()), build.with_strategy(
        PlanStrategy(plan))
    model.load_state_dict(ref_model.state_dict())
    example = ref_model.example_batch(batch, size)
    grads = []
    for m in (ref_model, model):
        m.train()
        m.training_loss(example).backward()
        grads.append(gradients_of(m))
    assert compare_gradients(*grads).match


def test_frontier_stops_at_the_device_memory(gpt, monkeypatch):
    """Budgets above the device's memory are refused (gpt_medium at 8192 tokens needs
    154 GiB without checkpointing, an H100 has 80 GB): the frontier ends there."""
    import dataclasses

    from remat.planner.frontier import frontier

    planner, _ = gpt
    _, floor = planner.floor()
    low = planner.budget_for(floor.allocator_peak)
    device = (low + planner.budget_for(planner.none.allocator_peak)) // 2
    monkeypatch.setattr(planner, "spec", dataclasses.replace(planner.spec, memory_bytes=device))
    points = frontier(planner, 3)
    assert [p.budget_bytes for p in points] == [low, (low + device) // 2, device]
    assert all(p.peak_bytes is not None and p.peak_bytes < device for p in points)
    # one budget from the floor to the top (the floor is none's, or the device's memory):
    # one point, not three of the same plan
    monkeypatch.setattr(planner, "spec", dataclasses.replace(planner.spec, memory_bytes=low))
    (point,) = frontier(planner, 3)
    assert point.budget_bytes == low and point.peak_bytes is not None
    monkeypatch.setattr(planner, "spec", dataclasses.replace(planner.spec,
                                                             memory_bytes=low - 1))
    (point,) = frontier(planner, 3)
    assert point.peak_bytes is None and "more than the device's memory" in point.note


def test_plan_file_round_trip_and_replay_checks(gpt, tmp_path):
    planner, build = gpt
    plan, _ = planner.floor()
    path = plan.save(tmp_path / "plan.json")
    again = Plan.load(path)
    assert again.to_dict() == plan.to_dict()
    assert PlanStrategy(path=str(path)).plan.units == plan.units
    data = json.loads(path.read_text())
    assert data["units"][0]["segments"][0].keys() == {"start", "end", "mode"}
    # a plan of another network is refused, naming the file
    other = dict(data, fingerprint="0" * 16)
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="made for another network"):
        build(PlanStrategy(path=str(tmp_path / "other.json")))
    for bad, match in (({"version": 1}, "not a remat plan"),
                       (dict(data, version=99), "plan version 99"),
                       (dict(data, units=[{"path": "blocks"}]), "malformed unit")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            Plan.load(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        Plan.load(tmp_path / "broken.json")
    with pytest.raises(FileNotFoundError, match="python -m remat.plan"):
        Plan.load(tmp_path / "missing.json")
    # segments that do not fit the chain
    broken = dict(data, units=[{"path": "blocks", "kind": "chain",
                                "segments": [{"start": 0, "end": 2, "mode": "recompute"}]}])
    with pytest.raises(ValueError, match="do not partition"):  # StageError, via Hydra
        build(PlanStrategy(broken))


def test_infeasible_budget_says_the_floor_and_what_would_fit(gpt):
    planner, _ = gpt
    _, floor = planner.floor()
    with pytest.raises(InfeasibleBudget) as err:
        planner.plan(int(floor.allocator_peak * 0.97))
    text = str(err.value)
    assert "no plan fits" in text and "smallest peak" in text
    # planned for the CPU: the allocator's peak, and the tensors' a CPU run reports beside it
    assert floor.allocator_peak > floor.peak_bytes
    assert (f"is {format_bytes(floor.allocator_peak)} ({format_bytes(floor.peak_bytes)} of "
            "it tensors, the peak a CPU run reports;") in text
    assert "parameters" in text and "optimizer_state" in text
    assert "largest unit" in text
    # the smaller shapes offered were traced with the floor's plan and fit (a scaled guess
    # offered shapes that did not: a U-Net batch 1 "about 185.8 MiB" traced 219.1)
    budget = int(floor.allocator_peak * 0.97)
    for key, value in (("data.batch_size", 1), ("data.block_size", 56)):
        found = re.search(rf"{key}=(\d+) \(traced: ([\d.]+ \w+) with this plan\)", text)
        assert found, text
        assert int(found.group(1)) == value
        kwargs = {"batch_size": value} if key == "data.batch_size" else {"size": value}
        job = {**planner._job(PlanStrategy(planner.lowest()[0])), **kwargs}
        peak = planner_module._traced(planner_module.trace_steps([job])[0]).allocator_peak
        assert found.group(2) == format_bytes(peak)
        assert peak <= budget - planner.margin_for(budget)
    # bf16-mixed is offered only where it fits as traced (a GPT's "at best about 92.2 MiB"
    # planned at 180.8): here its attention temporaries do not shrink enough
    job = {**planner._job(PlanStrategy(planner.lowest()[0])), "precision": "bf16-mixed"}
    bf16 = planner_module._traced(planner_module.trace_steps([job])[0]).allocator_peak
    assert bf16 > budget - planner.margin_for(budget) and "bf16-mixed" not in text
    # the least budget that holds the floor with its margin, which then plans
    found = re.search(r"the least budget that holds it with its margin \(([\d.]+) (\w+)\) is "
                      r"strategy\.memory=([\d.]+)MiB\.", text)
    assert found, text
    least = float(found.group(3))
    # rounded up to 0.1 MiB: it holds the floor, 0.1 MiB less does not
    exact = planner.budget_for(floor.allocator_peak) / 2**20
    assert exact <= least < exact + 0.1
    assert found.group(1, 2) == tuple(format_bytes(planner.margin_for(int(least * 2**20)))
                                      .split())
    plan = planner.plan(f"{least}MiB").plan
    assert plan.predicted_allocator_peak_bytes + plan.margin_bytes <= least * 2**20
    with pytest.raises(InfeasibleBudget):
        planner.plan(f"{least - 0.1:.1f}MiB")
    # the size is named by the key the run read it from (data.patch_size under data=folder;
    # the planner said data.image_size, a key folder data does not have)
    planner.size_key = "model.block_size"
    try:
        with pytest.raises(InfeasibleBudget) as err:
            planner.plan(int(floor.allocator_peak * 0.97))
    finally:
        planner.size_key = None
    assert "or model.block_size=" in str(err.value) and "data.block_size" not in str(err.value)


def test_a_shape_the_network_refuses_is_not_offered_and_the_budget_message_stays(
        gpt, monkeypatch):
    """torchvision's DeepLabV3 refuses batch 1 in training (a BatchNorm after global
    pooling): tracing that suggestion raised torch's error in place of the planner's."""
    planner, _ = gpt
    _, floor = planner.floor()
    real = planner._trace_jobs

    def refuse_batch_1(jobs):
        if any(job["batch_size"] == 1 for job in jobs):
            raise ValueError("Expected more than 1 value per channel when training")
        return real(jobs)

    monkeypatch.setattr(planner, "_trace_jobs", refuse_batch_1)
    with pytest.raises(InfeasibleBudget) as err:
        planner.plan(int(floor.allocator_peak * 0.97))
    text = str(err.value)
    assert "no plan fits" in text and "no smaller data.batch_size fits with this plan" in text
    assert "or data.block_size=56 (traced:" in text


@pytest.fixture(scope="module")
def gpt_long(tmp_path_factory):
    """The tiny GPT at 512 tokens, where activations dominate its peak."""
    cfg = compose_config("estimate", tmp_path_factory.mktemp("long"), [
        "model=gpt_tiny", "data.batch_size=2", "+data.block_size=512"])
    build, _, batch, size = build_from_config(cfg)
    return build.with_strategy, batch, size


@pytest.mark.slow  # two planners at 512 tokens, one tracing every candidate: 35 s
def test_floor_skips_candidates_modelled_far_above_and_plans_as_before(gpt_long, monkeypatch):
    """One segment over the 4 blocks is modelled at 3x the floor and not traced. The
    floor, the plans (same targets, same traces) and the infeasible message are those of
    a planner that traces every candidate. Roofline device (h100): both planners model
    the same step times."""
    build, batch, size = gpt_long

    def planner():
        return Planner(build, batch, size, "32-true", device="h100", max_traces=3,
                       default_stages=["blocks"])

    skipping = planner()
    plan, floor = skipping.floor()
    candidates = {repr(p.units): p for p in skipping.floor_candidates()}
    traced = candidates.keys() & skipping.cache.keys()
    monkeypatch.setattr(planner_module, "FLOOR_SKIP_RATIO", math.inf)  # trace them all
    every = planner()
    every_plan, every_floor = every.floor()
    assert candidates.keys() <= every.cache.keys()
    # h100 has a host link: the fixed partitions offload; traced: block by block, by 2
    assert len(candidates) == 3 and len(traced) == 2
    assert "offload" in plan.summary()  # the floor moves the blocks' inputs to host memory
    for key in candidates.keys() - traced:  # one segment: modelled above 2x, traced above
        assert skipping.modelled(candidates[key]) > 2 * floor.allocator_peak
        assert every.cache[key].allocator_peak > floor.allocator_peak
    assert every_floor == floor and every_plan.to_dict() == plan.to_dict()
    none = skipping.none.allocator_peak
    for frac in (0.1, 0.5):
        budget = skipping.budget_for(int(floor.allocator_peak
                                         + frac * (none - floor.allocator_peak)))
        got, want = skipping.plan(budget), every.plan(budget)
        assert got.plan.to_dict() == want.plan.to_dict() and got.traces == want.traces
        assert got.floor_bytes == floor.allocator_peak
    assert candidates.keys() - traced <= every.cache.keys() - skipping.cache.keys()
    with pytest.raises(InfeasibleBudget, match=re.escape(
            f"smallest peak any plan reaches is {format_bytes(every_floor.allocator_peak)} ")):
        skipping.plan(int(floor.allocator_peak * 0.97))


@pytest.mark.slow  # > 15 s on 2 cores: make test-all
def test_offload_lowers_the_floor_for_a_gpu_and_keeps_the_function(gpt_long):
    """Planning for a GPU with a host link (h100), offload segments keep their inputs in
    host memory: the traced floor is below recomputing block by block, a budget between
    the two gets a plan with offload that fits as traced, and that plan (its copies made
    on this CPU as a GPU run makes them) gives none's gradients."""
    build, batch, size = gpt_long
    planner = Planner(build, batch, size, "32-true", device="h100", max_traces=3,
                      default_stages=["blocks"])
    floor_plan, floor = planner.floor()
    by_block = planner._plan_of({"blocks": planner._option("blocks", full_segments(4))})
    assert by_block.summary() == "blocks: recompute 0, recompute 1, recompute 2, recompute 3"
    recomputed = planner.trace(PlanStrategy(by_block))
    assert "offload" in floor_plan.summary()
    assert floor.allocator_peak < recomputed.allocator_peak
    assert floor.step_flops == recomputed.step_flops  # the same recompute
    budget = planner.budget_for(floor.allocator_peak)
    assert budget < planner.budget_for(recomputed.allocator_peak)
    plan = planner.plan(budget).plan
    assert "offload" in plan.summary()
    assert plan.predicted_allocator_peak_bytes <= budget - plan.margin_bytes
    assert Plan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()

    ref, model = build(NoCheckpoint()), build(PlanStrategy(plan))
    model.load_state_dict(ref.state_dict())
    model_strategy = model.strategy
    model_strategy._offload._copy_host_tensors = True  # copy on this CPU as on a GPU
    results = []
    for m in (ref, model):
        m.train()
        torch.manual_seed(5)  # the same dropout masks
        m.training_loss(m.example_batch(batch, size)).backward()
        results.append(gradients_of(m))
    assert compare_gradients(results[0], results[1]).match


def test_meta_host_is_for_fake_traces_only():
    from remat.strategies.offload import HostOffload

    with pytest.raises(ValueError, match="fake traces only"):
        HostOffload(False, host="meta").pack(torch.randn(4, requires_grad=True) * 2)
    with pytest.raises(ValueError, match="host must be 'cpu' or 'meta'"):
        HostOffload(False, host="cuda")


@pytest.mark.slow  # > 15 s on 2 cores: make test-all
def test_first_plan_is_traced_beside_the_fixed_strategies_modelled_cheaper(gpt_long,
                                                                          monkeypatch):
    """Beside the search's first plan, the references :meth:`Planner.plan` would trace at
    its end if that plan were kept, one per idle CPU: the same traces, made earlier."""
    build, batch, size = gpt_long
    planner = Planner(build, batch, size, "32-true", device="h100", max_traces=3,
                      default_stages=["blocks"])
    full = planner.floor_candidates()[1]  # block by block: selective is modelled cheaper
    cheaper = [r for _, r in planner.references(["blocks"])
               if planner.modelled_cost(r) < planner.modelled_cost(full)]
    assert cheaper and all(repr(r.units) not in planner.cache for r in cheaper)
    monkeypatch.setattr(planner_module, "side_by_side", lambda: 2)
    traced = planner._trace_first(full)
    first = min(cheaper, key=planner.modelled_cost)
    assert repr(first.units) in planner.cache and len(planner.cache) == 3  # none, two
    alone = Planner(build, batch, size, "32-true", device="h100", max_traces=3,
                    default_stages=["blocks"])
    monkeypatch.setattr(planner_module, "side_by_side", lambda: 1)
    assert alone._trace_first(full) == traced and len(alone.cache) == 2
    assert alone.trace(PlanStrategy(first)) == planner.cache[repr(first.units)]


def test_candidates_cover_the_whole_network_and_bad_units_are_named():
    import segmentation_models_pytorch as smp

    net = smp.Unet("resnet18", encoder_weights=None, decoder_channels=[16, 8, 8, 8, 8])
    paths = [u.path for u in find_candidates(net)]
    assert paths == ["encoder.layer1", "encoder.layer2", "encoder.layer3", "encoder.layer4",
                     "decoder.blocks", "segmentation_head"]
    assert [u.kind for u in find_candidates(net, ["decoder.blocks.4"])] == ["module"]
    with pytest.raises(StageError, match="matches no module"):
        find_candidates(net, ["decoder.blockz"])
    with pytest.raises(ValueError, match="no unit the planner can wrap"):
        find_candidates(torch.nn.Linear(2, 2))


def test_budget_above_the_device_or_unparseable_is_named(gpt):
    planner, _ = gpt
    with pytest.raises(ValueError, match="strategy.memory"):
        planner.plan("lots")
    with pytest.raises(ValueError, match="more than the device's memory"):
        planner.plan(planner.spec.memory_bytes * 2)


def test_estimate_config_keeps_working_with_a_builder(tmp_path):
    cfg = compose_config("estimate", tmp_path, GPT)
    with open_dict(cfg):
        cfg.model.stages = ["blocks"]
    build, key, batch, size = build_from_config(cfg)
    assert key == "data.block_size" and (batch, size) == (2, 64)
    assert build.with_strategy(NoCheckpoint(), ["blocks.0"]).strategy_report.stages == ["blocks.0"]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor",
                                                                  marks=pytest.mark.slow)])
def test_plan_under_torch_compile_gives_eager_none_gradients_and_keeps_dropout_masks(
        backend):
    """A mixed plan (a recomputed module unit, recompute segments, a selective block, a kept
    block) on a GPT stack with dropout, compiled whole with ``torch.compile(model,
    backend=...)``: the eager ``none`` outputs and gradients (the masks drawn in the forward
    are the ones backward uses), one graph, and no recompile in the later steps.
    ``aot_eager``: AOTAutograd's partitioner, no code generation; ``inductor`` with
    ``fallback_random`` (eager's random ops, so eager's masks) and its float tolerance."""
    import copy

    import torch._dynamo
    import torch._inductor.config as inductor_config

    tol = {"rtol": 1e-5, "atol": 1e-6} if backend == "aot_eager" else {"rtol": 1e-4,
                                                                         "atol": 1e-5}

    from remat.planner import UnitPlan
    from tests.strategies.test_selective import TinyGPT

    torch.manual_seed(0)
    gpt = TinyGPT(depth=4, p=0.3, attn_p=0.0)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))

    def step(model, seed=5):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        out = model(x)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone()
                              for n, p in getattr(model, "_orig_mod", model).named_parameters()}

    ref = step(gpt.train())
    other_masks = step(gpt, seed=6)
    assert not torch.allclose(other_masks[1]["blocks.0.mlp.0.weight"],
                              ref[1]["blocks.0.mlp.0.weight"])  # dropout changes gradients
    plan = Plan(units=[UnitPlan("stem", "module", [(0, 1, "recompute")]),
                       UnitPlan("blocks", "chain", [(0, 2, "recompute"), (2, 3, "selective"),
                                                    (3, 4, "keep")])])
    model = copy.deepcopy(gpt)
    report = PlanStrategy(plan).apply(model)
    assert report.wrapped == ["stem", "blocks.0", "blocks.1", "blocks.2"]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    counts = torch._dynamo.utils.counters
    counts.clear()
    # config.patch, not monkeypatch: pytest's undo deletes a torch config key
    with inductor_config.patch(fallback_random=True):
        got = step(compiled)
        frames = counts["frames"]["total"]
        assert counts["stats"]["unique_graphs"] == 1
        for _ in range(2):  # later steps reuse the graph: no frame compiled again
            got = step(compiled)
    assert counts["frames"]["total"] == frames and counts["stats"]["unique_graphs"] == 1
    assert not counts["graph_break"]
    torch.testing.assert_close(got[0], ref[0], **tol)
    assert got[1].keys() == ref[1].keys()
    for key, grad in ref[1].items():
        torch.testing.assert_close(got[1][key], grad, msg=key, **tol)
    PlanStrategy(plan).verify(model)  # every wrapped unit was traced


def test_calibrate_times_units_on_the_device_present(tmp_path):
    cfg = compose_config("estimate", tmp_path, GPT)
    build, _, batch, size = build_from_config(cfg)
    with pytest.raises(ValueError, match="calibrate=true times the units on the device present"):
        Planner(build.with_strategy, batch, size, device="h100", calibrate=True)
    from remat.planner.devices import get_device
    from remat.planner.profile import calibrate_profile, profile_model

    profile = profile_model(lambda: build.with_strategy(NoCheckpoint()), None,
                            get_device("cpu"), batch, size, "32-true")
    roofline = {p: c.time for p, c in profile.blocks.items()}
    calibrate_profile(profile, lambda: build.with_strategy(NoCheckpoint()), batch, size,
                      "32-true", torch.device("cpu"), rounds=1)
    measured = {p: c.time for p, c in profile.blocks.items()}
    assert measured.keys() == roofline.keys() and measured != roofline
    assert all(t > 0 for t in measured.values()) and profile.step_time > max(measured.values())
    assert all(c.selective_time <= c.time for c in profile.blocks.values())


def test_candidates_of_a_named_sequential_use_its_member_names():
    """MONAI's Convolution is an nn.Sequential whose children are named (conv, adn): the
    blocks are the paths named_modules gives (SwinUNETR failed with KeyError '...conv1.0')."""
    from collections import OrderedDict

    from monai.networks.blocks import Convolution

    net = torch.nn.Module()
    net.stem = torch.nn.Sequential(OrderedDict(conv=torch.nn.Conv2d(1, 2, 3),
                                               act=torch.nn.ReLU()))
    net.block = Convolution(2, 2, 4)
    named = dict(net.named_modules())
    units = {u.path: u.blocks for u in find_candidates(net)}
    assert units["stem"] == ["stem.conv", "stem.act"]
    assert units["block"] and all(b in named for b in units["block"])


@pytest.mark.slow  # > 15 s on 2 cores: make test-all
def test_a_shared_in_place_activation_in_a_chain_plans_and_keeps_the_function(tmp_path):
    """MONAI's SegResNet puts its one ``ReLU(inplace=True)`` module (``act_mod``) into its
    final ``nn.Sequential`` (``conv_final.1``): the profile found no module of that name
    (KeyError), and the fixed strategies' one-block segments recomputed the ReLU from the
    input it overwrites (RecomputeError). Planned, every plan holds the ReLU inside a
    segment that starts before it, and trains with none's gradients."""
    from remat.planner.search import replayable

    cfg = compose_config("estimate", tmp_path, ["model=monai_swinunetr", "device=cpu",
                                                "data.image_size=32", "data.batch_size=2"])
    with open_dict(cfg):
        cfg.model.net = {"_target_": "monai.networks.nets.SegResNet", "spatial_dims": 2,
                         "in_channels": 3, "out_channels": 1, "init_filters": 8}
        cfg.model.stages = []
    build, _, batch, size = build_from_config(cfg)
    planner = Planner(build.with_strategy, batch, size, "32-true", device="h100",
                      max_traces=2)
    final = planner.blocks["conv_final"]
    assert final[1].mutated and not replayable(final, 1, 3, "recompute")
    plan, floor = planner.floor()
    mid = planner.plan(planner.budget_for(
        (floor.allocator_peak + planner.none.allocator_peak) // 2)).plan
    for p in (plan, mid):
        for unit in p.units:
            assert all(replayable(planner.blocks[unit.path], *s) for s in unit.segments)

    def grads(strategy):
        torch.manual_seed(0)
        model = build.with_strategy(strategy).train()
        torch.manual_seed(1)
        model.training_loss(model.example_batch(batch, size)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = grads(NoCheckpoint())
    for p in (plan, mid):
        assert compare_gradients(reference, grads(PlanStrategy(p))).match


def test_fixed_points_of_auto_stages_are_the_whole_network_s(gpt):
    """``model.stages=auto`` lists no stages: the frontier's "(default stages)" rows built
    on an empty list each said only "would wrap nothing" (a trial, model=custom)."""
    from remat.planner.frontier import fixed_points

    planner, build = gpt
    points = fixed_points(planner, build, [])
    labels = [p.label for p in points]
    assert labels[0] == "none" and labels.count("none") == 1
    assert all(label.endswith("(whole network)") for label in labels[1:]) and len(labels) > 2
    assert all(p.peak_bytes is not None and p.note in (None, "") for p in points), [
        (p.label, p.note) for p in points if p.peak_bytes is None]


def test_references_on_stages_that_name_a_units_blocks_are_those_strategies(gpt):
    """Default stages that name the blocks of a candidate chain one by one (DynUNet's
    ``downsamples.*``, a chain the planner takes whole) make each block a chain of one: the
    reference is the strategy as a run applies it, traced to the same peak and FLOPs. They
    were kept blocks before (a tiny DynUNet's plan at ``full``'s peak missed ``full``)."""
    from remat.strategies import build_strategy

    planner, build = gpt
    refs = dict(planner.references(["blocks.*"]))
    n = len(planner.blocks["blocks"])
    sqrtn = next(u for u in refs["sqrtn (default stages)"].units if u.path == "blocks")
    assert sqrtn.segments == full_segments(n)  # one segment per block-stage, not sqrt(n)
    # stages that are the whole network's units: no second set of the same plans
    assert [u.path for u in planner.profile.units] == ["blocks"]
    assert "sqrtn (default stages)" not in dict(planner.references(["blocks"]))
    traced = planner.trace(PlanStrategy(refs["sqrtn (default stages)"]))
    real = planner.trace(build_strategy("sqrtn"), lambda s: build(s, ["blocks.*"]),
                         key="blocks.*")
    assert traced.allocator_peak == real.allocator_peak and traced.step_flops == real.step_flops
    # a stage inside a block, or naming nothing the planner has: no default-stage plans
    for stages in (["blocks.0.attn"], ["nothing"]):
        assert not any("default stages" in label for label, _ in planner.references(stages))


def test_kept_draw_bytes_are_what_a_compiled_region_keeps():
    """A dropout's mask is one byte an element (bool, also behind eager's bernoulli_ of
    floats), an attention kernel's one per score; other draws keep their output."""
    from remat.strategies.recompute import kept_draw_bytes

    aten = torch.ops.aten
    x = torch.randn(4, 8)
    assert kept_draw_bytes(aten.native_dropout.default, (x, 0.1, True),
                           (x, x > 0)) == 32
    assert kept_draw_bytes(aten.bernoulli_.float, (x, 0.9), x) == 32
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 24, 8)
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert kept_draw_bytes(sdpa, (q, k, k, 0.1), (q,)) == 2 * 4 * 16 * 24
    assert kept_draw_bytes(aten.randn.default, ([3, 3],), torch.randn(3, 3)) == 36


def test_a_compiled_trace_holds_the_dropout_masks_of_recomputed_blocks(tmp_path):
    """``compile=true`` plans (``Planner(compiled=True)``) trace eager steps whose recomputed
    regions hold, until their backward, what the compiled regions keep of their draws: the
    masks of the tiny GPT's attention (B x H x T x T) and of its two residual dropouts
    (B x T x C) per block. ``full`` peaks by at least two blocks' masks more (the peak falls
    during the backward, when the first blocks' masks are still held), at most all four;
    none recomputes nothing and does not change."""
    from remat.strategies import build_strategy

    batch, size = 2, 256
    cfg = compose_config("estimate", tmp_path, ["model=gpt_tiny", "device=cpu",
                                                f"data.batch_size={batch}",
                                                f"+data.block_size={size}"])
    build, _, batch, size = build_from_config(cfg)
    heads, width, blocks = cfg.model.n_head, cfg.model.n_embd, cfg.model.n_layer
    masks = batch * heads * size * size + 2 * batch * size * width  # bytes, one block

    def peak(strategy, compiled):
        from remat.strategies.recompute import trace_as_compiled

        def built():
            trace_as_compiled(compiled)
            return build.with_strategy(strategy)

        return trace_step(built, batch, size, torch.device("cpu"), "32-true")[1].peak_bytes

    full = build_strategy("full")
    extra = peak(full, True) - peak(full, False)
    assert 2 * masks <= extra <= blocks * masks
    assert peak(NoCheckpoint(), True) == peak(NoCheckpoint(), False)


def test_a_plan_for_compile_true_is_not_reused_for_an_eager_run():
    """The request a plan is saved with records ``compile``: resuming with the other value
    plans again; a plan saved before the key existed counts as eager."""
    from remat.planner.budget import BudgetStrategy

    budget = BudgetStrategy("300MiB", device="cpu")
    saved = budget.request(["blocks"], compiled=True)
    assert saved["compiled"] is True
    assert budget.differences(saved, ["blocks"], compiled=True) == []
    assert budget.differences(saved, ["blocks"], compiled=False) == ["compile: True -> False"]
    older = {k: v for k, v in budget.request(["blocks"]).items() if k != "compiled"}
    assert budget.differences(older, ["blocks"]) == []
    assert budget.differences(older, ["blocks"], compiled=True) == ["compile: False -> True"]
