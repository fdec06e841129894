"""The benchmark measures what it claims: same gradients, less memory where it must."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import remat.benchmarking as bench_module
from remat.bench import bench
from remat.benchmarking import _step, format_table, run_benchmark
from remat.benchmarking import bench_sizes as _sizes
from remat.measure import DeviceSlot, PeakMemory, ProfilerPeakMemory
from remat.models import SegmentationModule, SequenceModule
from remat.strategies import (
    HFGradientCheckpointing,
    StageError,
    TorchCheckpointSequential,
    build_strategy,
)
from tests.helpers import compose_config

REPO = Path(__file__).resolve().parents[1]


def _gpt(n_layer=4, width=32, block=128):
    torch.manual_seed(0)
    return SequenceModule(vocab_size=64, block_size=block, n_layer=n_layer, n_head=4,
                          n_embd=width, dropout=0.1)


def test_transformer_stack_full_and_sqrtn_save_memory_with_matching_gradients():
    base = _gpt()
    batch = base.example_batch(2, 128, torch.Generator().manual_seed(0))
    rows = run_benchmark(base, ["blocks"], {n: build_strategy(n) for n in
                                            ("none", "full", "sqrtn", "every_k")},
                         batch, warmup=0, steps=1)
    by = {r.strategy: r for r in rows}
    assert all(r.grads_match for r in rows), format_table(rows)
    assert by["none"].peak_ratio == 1.0
    assert by["full"].peak_ratio < by["sqrtn"].peak_ratio < 1.0
    assert by["every_k"].peak_ratio < 1.0
    assert len(by["full"].step_ms) == 1 and by["full"].median_ms > 0
    # recompute FLOPs: full and sqrtn each run the blocks' forward once more, every_k too
    flops = {name: r.flops for name, r in by.items()}
    assert by["none"].flops_ratio == 1.0 and flops["none"] > 0
    assert flops["full"] == flops["sqrtn"] == flops["every_k"] > flops["none"]
    assert 1.1 < by["full"].flops_ratio < 1.5


def test_unet_encoder_strategies_match_gradients():
    torch.manual_seed(0)
    base = SegmentationModule(encoder_name="resnet18",
                              arch_kwargs={"decoder_channels": (32, 16, 16, 8, 8)})
    batch = base.example_batch(2, 64, torch.Generator().manual_seed(0))
    rows = run_benchmark(base, ["encoder.layer1", "encoder.layer2", "encoder.layer3",
                                "encoder.layer4"],
                         {n: build_strategy(n) for n in ("none", "full", "sqrtn")},
                         batch, warmup=0, steps=1)
    assert [r.strategy for r in rows] == ["none", "full", "sqrtn"]
    assert all(r.grads_match and r.max_grad_diff < 1e-5 for r in rows), format_table(rows)
    assert all(r.peak_ratio < 1.0 for r in rows[1:])


def test_benchmark_requires_the_none_reference():
    with pytest.raises(ValueError, match="must include 'none'"):
        run_benchmark(_gpt(2), ["blocks"], {"full": build_strategy("full")},
                      {"tokens": torch.zeros(1, 9, dtype=torch.long)})


@pytest.mark.slow  # about a minute (a subprocess, two sizes); bench() itself runs in-process below
def test_bench_entry_point_writes_csv_and_json(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "remat.bench", "model=gpt_tiny", "data.batch_size=1",
         "data.block_size=[32,64]", "strategies=[none,full,{name: every_k, k: 2}]",
         "warmup=0", "steps=1", f"hydra.run.dir={out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "bench.json").read_text())
    names = ["none", "full", "every_k(k=2)", "torch_checkpoint_sequential"]
    assert [(r["size"], r["strategy"]) for r in record["rows"]] == [
        (size, name) for size in (32, 64) for name in names]
    assert record["size_key"] == "data.block_size" and record["sizes"] == [32, 64]
    assert all(r["grads_match"] for r in record["rows"])
    by = {(r["size"], r["strategy"]): r for r in record["rows"]}
    assert by[(64, "none")]["peak_bytes"] > by[(32, "none")]["peak_bytes"]
    assert (out / "bench.csv").read_text().startswith("size,strategy,peak_bytes")
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "x none" in proc.stdout and "every_k(k=2)" in proc.stdout
    assert "recompute FLOPs x none" in proc.stdout
    assert by[(64, "full")]["flops_ratio"] > 1.0 == by[(64, "none")]["flops_ratio"]


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_bench_budget_row_is_planned_per_size(tmp_path, capsys, dropout):
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", f"model.dropout={dropout}", "data.batch_size=2", "data.block_size=64",
        "reference_points=false",
        "strategies=[none,{name: budget, memory: 6MiB, device: cpu, max_traces: 2}]",
        "warmup=0", "steps=1", "compiled=true", "compile_backend=aot_eager",
        "compile_strategies=[none,{name: budget, memory: 6MiB, device: cpu, max_traces: 2}]"])
    record = bench(cfg)
    label = "budget(memory=6MiB, device=cpu, max_traces=2)"
    rows = {r["strategy"]: r for r in record["rows"]}
    assert rows[label]["grads_match"] and rows[label]["flops_ratio"] >= 1.0
    assert any(n.startswith(f"size 64: {label}: ") for n in record["notes"])  # its plan
    # without dropout the compiled row runs the eager row's plan (planned once); with it,
    # a plan for the compiled step (whose segments keep dropout's masks); eager none's
    # gradients either way
    reused = f"size 64, compiled: {label}: the eager row's plan" in record["notes"]
    assert reused == (dropout == 0.0)
    if dropout:
        assert any(n.startswith(f"size 64, compiled: {label}: blocks:")
                   for n in record["notes"]), record["notes"]
    compiled = rows[f"{label} (compiled, aot_eager)"]
    assert compiled["grads_match"] and compiled["grad_rel_error"] < 1e-5


@pytest.mark.slow  # a planner (20-40 s on 2 cores): make test-all
def test_budget_at_a_row_plans_for_that_rows_training_step(tmp_path):
    """{name: budget, at: <row>}: the planner traces the row's strategy and plans for its
    peak, so the plan's row peaks no higher and recomputes no more than the row it is at
    (here the cheapest plan at selective(policy=matmul)'s peak is that policy itself)."""
    at = "selective(policy=matmul)"
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", "data.batch_size=2", "data.block_size=64", "reference_points=false",
        f"strategies=[none,{{name: selective, policy: matmul}},"
        f"{{name: budget, at: '{at}', device: cpu, max_traces: 2}}]", "warmup=0", "steps=1"])
    record = bench(cfg)
    rows = {r["strategy"]: r for r in record["rows"]}
    planned = rows[f"budget(at={at}, device=cpu, max_traces=2)"]
    assert planned["grads_match"]
    assert planned["peak_bytes"] <= rows[at]["peak_bytes"]
    assert planned["flops"] <= rows[at]["flops"]
    note = next(n for n in record["notes"] if "budget(at=" in n)
    assert f"{at}'s training step peaks at" in note and "selective 0" in note


def test_a_budget_row_above_its_row_in_the_table_is_explained():
    from remat.benchmarking import BenchRow, BudgetAtRow, budget_rows_above_their_rows

    at = BudgetAtRow(at="sqrtn", device="cpu")
    rows = [BenchRow("sqrtn", 2 * 2**20, 1.0, True, 0.0),
            BenchRow("budget(at=sqrtn)", 3 * 2**20, 1.0, True, 0.0)]
    (note,) = budget_rows_above_their_rows(rows, {"budget(at=sqrtn)": at})
    assert "budget(at=sqrtn) peaks above sqrtn in this table (3.0 MiB against 2.0 MiB)" in note
    rows[1].peak_bytes = 2 * 2**20
    assert budget_rows_above_their_rows(rows, {"budget(at=sqrtn)": at}) == []


@pytest.mark.parametrize(("rows", "match"), [
    ("[none,{name: budget, at: fulll}]",
     r"at=.fulll. is not a row a plan can be made at; rows: none"),
    ("[none,{name: budget, at: full, memory: 1GiB}]", "memory= or at=, not both"),
    ("[none,{name: budget, at: 3}]", "budget at= must name another row"),
])
def test_budget_at_a_row_refuses_what_is_not_a_row(tmp_path, rows, match):
    cfg = compose_config("bench", tmp_path, ["model=gpt_tiny", "reference_points=false",
                                             f"strategies={rows}"])
    with pytest.raises(ValueError, match=match):
        bench(cfg)


def test_budget_at_a_compiled_reference_is_refused(tmp_path):
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", "reference_points=false", "compiled=true",
        "compile_strategies=[none,{name: torch_compile_budget, memory_budget: 0.3},"
        "{name: budget, at: 'torch_compile_budget(memory_budget=0.3)'}]"])
    with pytest.raises(ValueError, match="is not a row a plan can be made at"):
        bench(cfg)


def test_timm_reference_row_where_a_timm_model_holds_the_stages(tmp_path):
    cfg = compose_config("bench", tmp_path, [
        "model=unet_convnext", "model.encoder_name=tu-convnext_atto",
        "model.arch_kwargs.decoder_channels=[32,16,16,8,8]", "data.batch_size=1",
        "data.image_size=32", "strategies=[none,sqrtn]", "warmup=0", "steps=1", "device=cpu"])
    rows = bench(cfg)["rows"]
    names = [r["strategy"] for r in rows]
    assert names == ["none", "sqrtn", "torch_checkpoint_sequential",
                     "timm_set_grad_checkpointing"]
    assert all(r["grads_match"] for r in rows)
    assert rows[3]["peak_bytes"] < rows[0]["peak_bytes"]


@pytest.mark.parametrize("model,wrong,right", [
    ("gpt_tiny", "data.image_size=64", "data.block_size"),
    ("unet_resnet18", "data.block_size=64", "data.image_size"),
])
def test_bench_size_key_of_the_other_model_kind_is_an_error(tmp_path, model, wrong, right):
    cfg = compose_config("bench", tmp_path, [f"model={model}", wrong, "device=cpu"])
    key = wrong.split("=")[0]
    with pytest.raises(ValueError, match=rf"bench: {key} does not apply to this .* model "
                                         rf"\(model._target_=.*\); set {right} instead"):
        bench(cfg)
    assert not (tmp_path / "bench.csv").exists()


def test_bench_image_size_defaults_to_512_px(tmp_path):
    assert _sizes(compose_config("bench", tmp_path, [])) == ("data.image_size", [512])


def test_bench_of_a_3d_model_takes_the_patch_side_and_never_defaults_to_512(tmp_path):
    """A 3D net measured at the default 512 px side was a 512^3 volume (the RAM ran out):
    the bench reads data.patch_size (data=msd's key) or refuses to guess."""
    patch = ["model=monai_unet3d", "+data.patch_size=[24,24,24]"]
    assert _sizes(compose_config("bench", tmp_path, patch)) == ("data.patch_size", [24])
    with pytest.raises(ValueError, match=r"not cubic/square.*data.image_size=<side>"):
        _sizes(compose_config("bench", tmp_path, ["model=monai_unet3d",
                                                  "+data.patch_size=[24,24,16]"]))
    with pytest.raises(ValueError, match=r"a 3D model needs its patch side: set "
                                         r"data.image_size"):
        _sizes(compose_config("bench", tmp_path, ["model=monai_unet3d"]))
    assert _sizes(compose_config("bench", tmp_path, ["model=monai_unet3d",
                                                     "data.image_size=[16,32]"])) == (
        "data.image_size", [16, 32])


def test_bench_sizes_must_be_positive_integers_naming_the_key(tmp_path):
    cfg = compose_config("bench", tmp_path, ["model=gpt_tiny", "data.block_size=[64,0]"])
    with pytest.raises(ValueError, match=r"data.block_size must be an integer >= 1.*\[64, 0\]"):
        bench(cfg)
    cfg = compose_config("bench", tmp_path, ["data.image_size=big"])
    with pytest.raises(ValueError, match="data.image_size must be an integer"):
        bench(cfg)


@pytest.mark.slow
def test_memory_goals_on_the_16_block_transformer_stack():
    """Issue goal: width 256, 4 heads, sequence 1024, batch 2, fp32, 16 blocks."""
    torch.manual_seed(0)
    base = SequenceModule(vocab_size=256, block_size=1024, n_layer=16, n_head=4, n_embd=256,
                          dropout=0.1)
    batch = base.example_batch(2, 1024, torch.Generator().manual_seed(0))
    names = ["none", "full", "sqrtn", "selective"]
    rows = run_benchmark(base, ["blocks"], {n: build_strategy(n) for n in names}, batch,
                         warmup=0, steps=1)
    by = {r.strategy: r for r in rows}
    print(format_table(rows))
    assert all(r.grads_match for r in rows)
    assert by["full"].peak_ratio <= 0.35
    assert by["sqrtn"].peak_ratio <= 0.50
    assert by["selective"].peak_ratio < 1.0  # policy matmul


def test_torch_checkpoint_sequential_reference_matches_and_saves_memory():
    base = _gpt()
    batch = base.example_batch(2, 128, torch.Generator().manual_seed(0))
    rows = run_benchmark(base, ["blocks"], {"none": build_strategy("none"),
                                            "torch": TorchCheckpointSequential()},
                         batch, warmup=0, steps=1)
    assert rows[1].grads_match and rows[1].peak_ratio < 1.0


def test_torch_reference_needs_sequential_stages():
    with pytest.raises(StageError, match="needs nn.Sequential stages"):
        TorchCheckpointSequential().apply(_gpt(2).net, ["blocks.0"])


# --- one model on the device at a time (issue 10 item 11) -----------------------------------

class _FakeDeviceSlot(DeviceSlot):
    """A stand-in device on the CPU: a model 'on the device' holds float64 tensors, one on
    the host float32; gradient copies kept on the host are float32. Remembers every model
    and copy it saw, so a check can look at all of them while a row is measured."""

    def __init__(self):
        super().__init__("cpu", swap=True)
        self.models, self.kept, self.checks = [], [], 0

    def _move_in(self, model):
        if model not in self.models:
            self.models.append(model)
        model.double()

    def _move_out(self, model):
        model.float()

    def _to_home(self, tensor):
        copy = tensor.float().clone()
        self.kept.append(copy)
        return copy

    def check_one_resident(self):
        on_device = [m for m in self.models
                     if any(p.dtype == torch.float64 for p in m.parameters())]
        assert on_device == [self.resident], "another row's model is on the device"
        assert all(p.grad is None or p.grad.dtype == torch.float64
                   for p in self.resident.parameters())
        assert all(t.dtype == torch.float32 for t in self.kept), "a gradient copy is on it"
        self.checks += 1


def test_on_a_swapping_device_each_row_runs_alone_with_no_gradient_copy_beside_it(
        monkeypatch):
    slot = _FakeDeviceSlot()
    real_peak, real_start = bench_module.PeakMemory, bench_module.StepTimer.start

    def peak(*args, **kwargs):
        slot.check_one_resident()
        return real_peak(*args, **kwargs)

    def start(self):
        slot.check_one_resident()
        real_start(self)

    monkeypatch.setattr(bench_module, "PeakMemory", peak)
    monkeypatch.setattr(bench_module.StepTimer, "start", start)
    base = _gpt(2, 16, 32)
    batch = base.example_batch(2, 32, torch.Generator().manual_seed(0))
    rows = run_benchmark(base, ["blocks"], {n: build_strategy(n) for n in ("none", "full")},
                         batch, warmup=1, steps=2, slot=slot)
    assert slot.checks == 2 + 2 * 3  # one peak per row, then every timed or warm-up step
    assert len(slot.models) == 2 and slot.resident is None  # all back on the host
    assert all(p.dtype == torch.float32 for m in slot.models for p in m.parameters())
    assert all(r.grads_match for r in rows), format_table(rows)


def test_cpu_rows_are_the_same_with_and_without_moving_models(monkeypatch):
    base = _gpt(2, 16, 32)
    batch = base.example_batch(2, 32, torch.Generator().manual_seed(0))
    strategies = {n: build_strategy(n) for n in ("none", "full", "sqrtn")}
    stay = run_benchmark(base, ["blocks"], strategies, batch, warmup=0, steps=1)
    moved = run_benchmark(base, ["blocks"], strategies, batch, warmup=0, steps=1,
                          slot=DeviceSlot("cpu", swap=True))
    assert [r.peak_bytes for r in stay] == [r.peak_bytes for r in moved]
    assert [r.max_grad_diff for r in stay] == [r.max_grad_diff for r in moved] == [0.0] * 3
    assert stay[1].peak_bytes < stay[0].peak_bytes
    empties = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: empties.append(1))
    slot = DeviceSlot("cuda")  # the CUDA default swaps and empties the cache on each move
    assert slot.swap and slot.home == torch.device("cpu")
    assert not DeviceSlot("cpu").swap and DeviceSlot("cpu").home == torch.device("cpu")
    model = torch.nn.Linear(2, 2)
    slot.resident = model
    slot._move_out = lambda m: None
    slot.unload()
    assert empties == [1] and slot.resident is None


# --- reference rows ------------------------------------------------------------------------

def test_reference_rows_that_cannot_apply_are_skipped_with_a_note(tmp_path, capsys):
    cfg = compose_config("bench", tmp_path, [
        "model=unet_resnet18", "model.arch_kwargs.decoder_channels=[16,16,8,8,8]",
        "model.stages=[encoder.layer4,decoder.blocks]", "data.batch_size=2",
        "data.image_size=32", "strategies=[none,full]", "warmup=0", "steps=1", "device=cpu"])
    record = bench(cfg)
    assert [r["strategy"] for r in record["rows"]] == ["none", "full"]
    assert all(r["grads_match"] for r in record["rows"])
    out = capsys.readouterr().out
    assert ("note: size 32: reference torch_checkpoint_sequential skipped: "
            "torch_checkpoint_sequential needs nn.Sequential stages: 'decoder.blocks' is a "
            "ModuleList") in out
    assert "note: size 32: reference hf_gradient_checkpointing skipped" in out
    assert any("torch_checkpoint_sequential skipped" in n for n in record["notes"])


def _llama_module(layers=2):
    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    return SequenceModule(vocab_size=64, block_size=64, net=net, stages=["model.layers"])


def test_hf_reference_row_is_hfs_own_checkpointing_and_remove_undoes_it():
    module = _llama_module(3)
    strategy = HFGradientCheckpointing()
    report = strategy.apply(module.net, ["model.layers"])
    assert report.wrapped == [f"model.layers.{i}" for i in range(3)]
    assert report.segments == {"model.layers": [(0, 1), (1, 2), (2, 3)]}
    assert module.net.is_activation_checkpointing
    assert all(layer.gradient_checkpointing for layer in module.net.model.layers)
    assert module.net.model.layers[0]._gradient_checkpointing_func.keywords == {
        "use_reentrant": False}
    strategy.remove(module.net)
    assert not module.net.is_activation_checkpointing
    assert not hasattr(module.net, "_require_grads_hook")
    with pytest.raises(StageError, match="needs a Hugging Face PreTrainedModel holding "
                                         "stage 'blocks'"):
        strategy.apply(_gpt(2).net, ["blocks"])
    with pytest.raises(StageError, match="holds no layer Hugging Face checkpoints"):
        strategy.apply(module.net, ["model.embed_tokens"])


def test_hf_every_n_layers_checkpoints_every_nth_layer():
    """Hugging Face's ``every_n_layers=2``: layers 0 and 2 of 4 recomputed, 1 and 3 keep
    their activations."""
    module = _llama_module(4)
    report = HFGradientCheckpointing(every_n_layers=2).apply(module.net, ["model.layers"])
    assert report.wrapped == ["model.layers.0", "model.layers.2"]
    assert report.segments == {"model.layers": [(0, 1), (2, 3)]}
    assert [layer.gradient_checkpointing for layer in module.net.model.layers] == [
        True, False, True, False]
    with pytest.raises(ValueError, match="every_n_layers must be an integer >= 1, got 0"):
        HFGradientCheckpointing(every_n_layers=0)


@pytest.mark.slow  # 22 s on 2 cores: make test-all
def test_a_plan_meets_hfs_every_n_layers_point(tmp_path):
    """At the ``every_n_layers=2`` row: gradients as ``none``'s, a peak between ``full``'s
    and ``none``'s; the plan for that row's training-step peak peaks no higher and
    recomputes no more."""
    every = "hf_gradient_checkpointing(every_n_layers=2)"
    cfg = compose_config("bench", tmp_path, [
        *HF_LLAMA_TINY, "model.net.config.num_hidden_layers=4", "data.block_size=256",
        "strategies=[none,full,{name: hf_gradient_checkpointing, every_n_layers: 2},"
        f"{{name: budget, at: '{every}'}}]"])
    rows = {r["strategy"]: r for r in bench(cfg)["rows"]}
    assert all(r["grads_match"] for r in rows.values())
    assert rows["full"]["peak_bytes"] < rows[every]["peak_bytes"] < rows["none"]["peak_bytes"]
    plan = rows[f"budget(at={every})"]
    assert plan["peak_bytes"] <= rows[every]["peak_bytes"]
    assert plan["flops"] <= rows[every]["flops"]


def test_hf_reference_row_matches_gradients_and_saves_memory():
    base = _llama_module(4)
    batch = base.example_batch(2, 64, torch.Generator().manual_seed(0))
    rows = run_benchmark(base, ["model.layers"],
                         {"none": build_strategy("none"), "full": build_strategy("full"),
                          "hf": HFGradientCheckpointing()}, batch, warmup=0, steps=1)
    by = {r.strategy: r for r in rows}
    assert all(r.grads_match for r in rows), format_table(rows)  # dropout masks replayed
    assert by["hf"].peak_ratio < 1.0
    assert by["hf"].peak_bytes == pytest.approx(by["full"].peak_bytes, rel=0.05)


HF_LLAMA_TINY = ["model=hf_llama", "model.net.config.hidden_size=32",
                 "model.net.config.intermediate_size=64", "model.net.config.num_hidden_layers=3",
                 "model.net.config.num_attention_heads=4", "model.net.config.num_key_value_heads=2",
                 "data.batch_size=1", "data.block_size=64", "warmup=0", "steps=1", "device=cpu"]


def test_bench_hf_llama_prints_rows_beside_the_hf_reference(tmp_path, capsys):
    cfg = compose_config("bench", tmp_path, [*HF_LLAMA_TINY, "strategies=[none,full]"])
    rows = bench(cfg)["rows"]
    assert [r["strategy"] for r in rows] == ["none", "full", "hf_gradient_checkpointing"]
    assert all(r["grads_match"] for r in rows)
    assert all(r["peak_bytes"] < rows[0]["peak_bytes"] for r in rows[1:])
    out = capsys.readouterr().out
    assert "hf_gradient_checkpointing" in out and "timm_set_grad_checkpointing skipped" in out
    # one size: one table and each note once (the size's progress print repeated them)
    assert out.count("recompute FLOPs x none") == 1
    assert out.count("timm_set_grad_checkpointing skipped") == 1


# --- compiled rows -------------------------------------------------------------------------

def test_profiler_peak_equals_memtracker_on_an_eager_step():
    for strategy in ("none", "full"):
        base = _gpt(2, 32, 64)
        build_strategy(strategy).apply(base.net, ["blocks"])
        batch = base.example_batch(2, 64, torch.Generator().manual_seed(0))
        _step(base, batch, torch.device("cpu"), "32-true")  # warm-up
        base.zero_grad(set_to_none=True)
        with PeakMemory("cpu", modules=[base]) as tracked:
            _step(base, batch, torch.device("cpu"), "32-true")
        base.zero_grad(set_to_none=True)
        with ProfilerPeakMemory("cpu", modules=[base]) as profiled:
            _step(base, batch, torch.device("cpu"), "32-true")
        assert profiled.peak_bytes == pytest.approx(tracked.peak_bytes, rel=0.01), strategy
        params = sum(p.numel() * 4 for p in base.parameters())
        assert profiled.peak_bytes > 2 * params  # parameters, gradients and activations


def test_compiled_rows_are_measured_on_the_compiled_model(monkeypatch):
    calls = []
    real = bench_module.compile_row

    def compile_spy(net, backend):
        calls.append(backend)
        return real(net, backend)

    monkeypatch.setattr(bench_module, "compile_row", compile_spy)
    base = _gpt(2, 16, 32)
    batch = base.example_batch(2, 32, torch.Generator().manual_seed(0))
    rows = run_benchmark(base, ["blocks"], {"none": build_strategy("none")}, batch,
                         warmup=1, steps=1, compile_backend="aot_eager")
    assert [getattr(c, "backend", c) for c in calls] == ["aot_eager"]
    (row,) = rows
    assert row.strategy == "none (compiled, aot_eager)" and row.compiled == "aot_eager"
    assert row.peak_method == "torch.profiler" and row.peak_ratio == 1.0
    assert row.grads_match and row.max_grad_diff < 1e-5 and row.grad_rel_error < 1e-5  # eager
    assert row.peak_bytes > 2 * sum(p.numel() * 4 for p in base.parameters())
    assert row.eager_time_ratio > 0 and row.eager_peak_ratio > 0  # eager none timed with it


def test_compiled_rows_are_timed_in_the_same_rounds_as_the_eager_rows(monkeypatch):
    """One loop of rounds over every row, eager and compiled: the ratios of compiled rows to
    eager none are interleaved (a drift of the machine's load falls on both)."""
    order = []
    real_start = bench_module.StepTimer.start

    def start(self):
        order.append(id(self))
        real_start(self)

    monkeypatch.setattr(bench_module.StepTimer, "start", start)
    base = _gpt(2, 16, 32)
    batch = base.example_batch(2, 32, torch.Generator().manual_seed(0))
    rows = run_benchmark(base, ["blocks"], {n: build_strategy(n) for n in ("none", "full")},
                         batch, warmup=1, steps=2, compile_backend="aot_eager")
    rounds = [order[i:i + 3] for i in range(0, len(order), 3)]  # eager none + 2 compiled
    assert len(rounds) == 3 and all(r == rounds[0] for r in rounds) and len(set(order)) == 3
    assert [len(r.step_ms) for r in rows] == [2, 2]
    none = rows[0]
    assert none.eager_time_ratio == pytest.approx(none.median_ms / (none.median_ms /
                                                                    none.eager_time_ratio))
    assert rows[1].eager_time_ratio / none.eager_time_ratio == pytest.approx(rows[1].time_ratio)


@pytest.mark.slow  # > 5 s on 2 cores and not the only proof: make test-all
def test_compiled_rows_past_dynamos_recompile_limit_are_still_compiled(monkeypatch):
    """nn.Module.compile shares Module._call_impl's code object, whose cache holds
    recompile_limit entries (8), earlier rows' included: each row gets a code object of
    its own; a row that runs eagerly all the same is left out with a note, never timed as
    if compiled."""
    base = _gpt(2, 16, 32)
    batch = base.example_batch(2, 32, torch.Generator().manual_seed(0))
    strategies = {n: build_strategy(n) for n in ("none", "full", "sqrtn")}
    notes: list[str] = []
    with torch._dynamo.config.patch(recompile_limit=1):
        rows = run_benchmark(base, ["blocks"], strategies, batch, warmup=0, steps=1,
                             compile_backend="aot_eager", notes=notes)
    assert [r.strategy for r in rows] == [f"{n} (compiled, aot_eager)" for n in strategies]
    assert notes == []
    monkeypatch.setattr(bench_module, "compile_row",
                        lambda net, backend: net.compile(backend=backend))  # shared code
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        rows = run_benchmark(base, ["blocks"], strategies, batch, warmup=0, steps=1,
                             compile_backend="aot_eager", notes=notes)
    assert [r.strategy for r in rows] == ["none (compiled, aot_eager)"]
    assert len(notes) == 2 and all("ran eagerly" in n for n in notes)


def test_peak_by_profiler_measures_eager_rows_with_torch_profiler(tmp_path):
    overrides = ["model=gpt_tiny", "model.n_layer=2", "model.n_embd=16", "model.n_head=2",
                 "data.batch_size=1", "data.block_size=32", "strategies=[none,full]",
                 "reference_points=false", "warmup=0", "steps=1", "device=cpu"]
    record = bench(compose_config("bench", tmp_path, [*overrides, "peak_by=profiler"]))
    assert [r["peak_method"] for r in record["rows"]] == ["torch.profiler"] * 2
    assert record["peak_by"] == "profiler" and record["rows"][1]["peak_ratio"] < 1.0
    with pytest.raises(ValueError, match="peak_by must be auto or profiler"):
        bench(compose_config("bench", tmp_path, [*overrides, "peak_by=memtracker"]))


def test_bench_compiled_option_adds_rows_and_notes_rows_that_fail_to_compile(tmp_path):
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", "model.n_layer=2", "model.n_embd=16", "model.n_head=2",
        "data.batch_size=1", "data.block_size=32", "strategies=[none]",
        "reference_points=false", "warmup=0", "steps=1", "device=cpu", "compiled=true",
        "compile_backend=aot_eager", "compile_strategies=[none]"])
    record = bench(cfg)
    assert [r["strategy"] for r in record["rows"]] == ["none", "none (compiled, aot_eager)"]
    assert record["compiled"] and record["compile_backend"] == "aot_eager"
    assert record["rows"][1]["grads_match"] and record["rows"][1]["peak_ratio"] == 1.0
    assert "aot_eager,torch.profiler" in (tmp_path / "bench.csv").read_text().splitlines()[2]
    cfg = compose_config("bench", tmp_path, ["model=gpt_tiny", "compiled=true",
                                             "compile_strategies=[full]", "device=cpu"])
    with pytest.raises(ValueError, match="compile_strategies must include 'none'"):
        bench(cfg)


def test_bench_torch_compile_memory_budget_reference_row(tmp_path):
    """Plain torch.compile of the whole net under the partitioner's memory budget: budget 0
    recomputes what it can, so its peak is below none compiled; no dropout, so gradients
    match."""
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", "model.n_layer=2", "model.dropout=0.0", "data.batch_size=4",
        "data.block_size=256", "strategies=[none]", "reference_points=false", "warmup=0",
        "steps=1", "device=cpu", "compiled=true", "compile_backend=aot_eager",
        "compile_strategies=[none,{name: torch_compile_budget, memory_budget: 0.0}]"])
    record = bench(cfg)
    by = {r["strategy"]: r for r in record["rows"]}
    row = by["torch_compile_budget(memory_budget=0.0) (compiled, aot_eager)"]
    assert row["grads_match"] and row["peak_ratio"] < 1.0
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", "strategies=[none,{name: torch_compile_budget, memory_budget: 0.3}]"])
    with pytest.raises(ValueError, match="list it in compile_strategies"):
        bench(cfg)


def _partitioner_rows(tmp_path, rows: str) -> dict:
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", "model.n_layer=2", "model.dropout=0.0", "data.batch_size=4",
        "data.block_size=256", "strategies=[none,sqrtn]", "reference_points=false",
        "warmup=0", "steps=1", "device=cpu", "compiled=true", "compile_backend=aot_eager",
        f"compile_strategies=[none,sqrtn,{rows}]"])
    return {r["strategy"]: r for r in bench(cfg)["rows"]}


def test_a_compiled_row_with_a_partitioner_budget_runs_under_it(tmp_path):
    """``compile_memory_budget`` on a compiled row: the strategy and the partitioner's budget
    together, below the same strategy compiled without it (6.11 against 6.17 MiB)."""
    by = _partitioner_rows(tmp_path, "{name: sqrtn, compile_memory_budget: 0.5}")
    plain = by["sqrtn (compiled, aot_eager)"]
    row = by["sqrtn(compile_memory_budget=0.5) (compiled, aot_eager)"]
    assert row["grads_match"] and row["peak_bytes"] < plain["peak_bytes"], row
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", "strategies=[none,{name: full, compile_memory_budget: 0.5}]"])
    with pytest.raises(ValueError, match=r"full\(compile_memory_budget=0.5\): "
                                         "compile_memory_budget is the compiler's partitioner"):
        bench(cfg)
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", "compiled=true", "compile_strategies=[none,{name: full, "
        "compile_memory_budget: 2}]"])
    with pytest.raises(ValueError, match=r"memory_budget must be a number in \[0, 1\]"):
        bench(cfg)


def test_a_planned_row_keeps_its_partitioner_budget(tmp_path):
    """A budget row's plan is made per size and replaces the row's strategy object; the
    partitioner's budget goes with it."""
    by = _partitioner_rows(tmp_path, "{name: budget, at: sqrtn, compile_memory_budget: 0.5}")
    row = by["budget(at=sqrtn, compile_memory_budget=0.5) (compiled, aot_eager)"]
    assert row["grads_match"] and row["peak_bytes"] < by["sqrtn (compiled, aot_eager)"][
        "peak_bytes"], row


def test_rows_that_would_wrap_nothing_are_refused_as_training_refuses_them(tmp_path):
    # a network of lone layers: every row was none's step, printed at 1.00x without a note
    cfg = compose_config("bench", tmp_path, [
        "model=custom", "model.net._target_=tests.models.nets.LeafNet", "data.image_size=32",
        "data.batch_size=1", "strategies=[none,full,sqrtn]", "device=cpu"])
    with pytest.raises(StageError, match=r"^bench: full, sqrtn would wrap nothing: LeafNet has "
                                         r"no stages.*its modules: c1 \(Conv2d\)"):
        bench(cfg)


def test_compile_options_are_checked_inductor_settings(tmp_path):
    from remat.compiling import check_compile_options

    assert check_compile_options({"layout_optimization": False}, "inductor") == {
        "layout_optimization": False}
    assert check_compile_options(None, "aot_eager") == {}
    with pytest.raises(ValueError, match=r"compile_options.layout_optimisation: not an "
                                         r"inductor setting.*layout_optimization"):
        check_compile_options({"layout_optimisation": False}, "inductor")
    with pytest.raises(ValueError, match="compile_backend='aot_eager' takes none"):
        check_compile_options({"layout_optimization": False}, "aot_eager")
    with pytest.raises(ValueError, match="compile_options must be a mapping"):
        check_compile_options(["layout_optimization"], "inductor")
    with pytest.raises(ValueError, match=r"compile_options.max_autotune: inductor's setting "
                                         r"is a bool \(default False\), got 'maybe'"):
        check_compile_options({"max_autotune": "maybe"}, "inductor")
    with pytest.raises(ValueError, match=r"realize_reads_threshold: inductor's setting is a "
                                         r"int .*got True"):
        check_compile_options({"realize_reads_threshold": True}, "inductor")
    cfg = compose_config("bench", tmp_path, [
        "model=gpt_tiny", "compiled=true", "compile_backend=aot_eager", "device=cpu",
        "compile_options={layout_optimization: false}"])
    with pytest.raises(ValueError, match="takes none"):
        bench(cfg)


def test_compiled_training_and_rows_turn_layout_optimization_off_under_the_users_options():
    """The same default in every precision (a recomputing compiled step keeps channels-last
    weight copies with it: bf16 sqrtn above compiled none), and a user's options go on top
    of it instead of replacing it."""
    from remat.compiling import late_sums_apart, training_options

    defaults = {"layout_optimization": False, "allow_buffer_reuse": False,
                "post_grad_custom_post_pass": late_sums_apart()}
    assert training_options(None) == training_options({}) == defaults
    assert training_options({"max_autotune": True}) == {**defaults, "max_autotune": True}
    assert training_options({"layout_optimization": True}) == {
        **defaults, "layout_optimization": True}
    assert training_options({"allow_buffer_reuse": True})["allow_buffer_reuse"] is True
    from remat.compiling import options_record

    # summary.json and bench.json record the pass by name (json.dumps refused the object)
    assert json.loads(json.dumps(options_record(training_options(None)))) == {
        "layout_optimization": False, "allow_buffer_reuse": False,
        "post_grad_custom_post_pass": "remat.compiling.late_sums_apart()"}


@pytest.mark.slow  # four inductor compiles of a GPT: make test-all
def test_a_compiled_step_peaks_no_higher_than_the_same_step_eager():
    """With training's inductor settings a compiled GPT (tied head and embedding) peaks at or
    below its eager step, under ``none`` and under ``full``: with buffer reuse and the late
    addmm fused, compiled ``full`` peaked 19.6 MiB against 16.7 eager (512 tokens, 4 blocks,
    width 128, batch 2, CPU), and ``gpt_small``'s plans 1-4% above eager."""
    import copy

    from remat.compiling import RowBackend, compile_row, training_options
    from remat.measure import ProfilerPeakMemory
    from remat.models.gpt import GPT

    torch.manual_seed(0)
    base = GPT(vocab_size=65, block_size=512, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    tokens = torch.randint(0, 65, (2, 512))

    def peak(model):
        for i in range(3):
            model.zero_grad(set_to_none=True)
            with ProfilerPeakMemory("cpu", modules=[model]) if i == 2 else \
                    contextlib.nullcontext() as meter:
                logits = model(tokens)
                torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                  tokens.flatten()).backward()
                del logits
        return meter.peak_bytes

    for strategy in ("none", "full"):
        peaks = {}
        for compiled in (False, True):
            torch._dynamo.reset()
            model = copy.deepcopy(base).train()
            build_strategy(strategy).apply(model, ["blocks"])
            if compiled:
                compile_row(model, RowBackend("inductor", options=training_options(None)))
            peaks[compiled] = peak(model)
        assert peaks[True] <= peaks[False], (strategy, peaks)


def test_a_late_sum_is_split_from_its_matrix_product():
    """``addmm(c, a, b)`` with ``c`` made after ``a`` and ``b`` (a tied weight's gradient):
    the product moves up to right after its operands, the sum stays where the addmm was,
    and the graph computes the same; a bias (made before) stays fused."""
    import torch.fx

    from remat.compiling import late_sums_apart

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    p0, p1, p2, bias = (graph.placeholder(n) for n in ("p0", "p1", "p2", "bias"))
    a = graph.call_function(aten.cos.default, (p0,))
    b = graph.call_function(aten.cos.default, (p1,))
    late = graph.call_function(aten.sin.default, (p2,))
    fused = graph.call_function(aten.addmm.default, (late, a, b))
    biased = graph.call_function(aten.addmm.default, (bias, a, b))
    graph.output((fused, biased))
    inputs = [torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5), torch.randn(5)]
    expected = torch.fx.GraphModule(torch.nn.Module(), graph)(*inputs)
    late_sums_apart()(graph)
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert ops == ["aten.cos.default", "aten.cos.default", "aten.mm.default",
                   "aten.sin.default", "aten.add.Tensor", "aten.addmm.default"]
    got = torch.fx.GraphModule(torch.nn.Module(), graph)(*inputs)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert late_sums_apart().uuid() == "remat.compiling.late_sums_apart/1"


@pytest.mark.slow  # an inductor compile of forward and backward: make test-all
def test_inductor_layout_optimization_keeps_a_copy_of_each_conv_weight_unless_off():
    """What compile_options={layout_optimization: false} is for: inductor runs convolutions
    channels-last and saves a channels-last copy of each (contiguous) weight for the
    backward; with the option off (forward and backward compiles alike) it saves none."""
    from remat.compiling import RowBackend, compile_row

    def saved_weight_copies(options):
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1),
                                  torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, padding=1))
        backend = RowBackend("inductor", options=options)
        compile_row(net, backend)
        x = torch.randn(1, 3, 16, 16)
        net(x).sum().backward()
        params = {p.untyped_storage().data_ptr() for p in net.parameters()}
        shapes = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = net(x)
        out.sum().backward()
        assert backend.graphs == 1
        return [s for s in shapes if s == (64, 64, 3, 3)]

    assert saved_weight_copies({}) == [(64, 64, 3, 3)]
    assert saved_weight_copies({"layout_optimization": False}) == []
