"""The FakeTensor estimate agrees with the real MemTracker peak, and says when it cannot."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from remat.estimate import NotTraceable, estimate
from remat.train import train
from tests.helpers import TINY_TRAINER, compose_app, compose_config

TRACEABLE = ["strategy=none", "strategy=full", "strategy=sqrtn", "strategy=every_k",
             "strategy=selective", "strategy=selective strategy.policy=attention",
             "strategy=offload", "strategy=offload strategy.segments=sqrtn"]
GPT = ["model=gpt_tiny", "device=cpu"]
# plain SGD (no optimizer state), so the peak is set by activations, not by Adam's moments
UNET = ["model=unet_resnet18", "device=cpu", "data.batch_size=2",
        "model.arch_kwargs.decoder_channels=[32,16,16,8,8]",
        "model.optimizer._target_=torch.optim.SGD"]


def _pair(tmp_path, overrides):
    cfg = compose_config("estimate", tmp_path, overrides)
    predicted = estimate(cfg)
    measured = estimate(cfg, fake=False)
    return predicted, measured


def _within(predicted, measured, rel=0.10):
    return abs(predicted.peak_bytes - measured.peak_bytes) <= rel * measured.peak_bytes


@pytest.mark.parametrize("strategy,size", [
    *[(s, 64) for s in TRACEABLE],
    # the longer context for two strategies here, for all of them in test-all
    *[(s, 128) if s in ("strategy=full", "strategy=sqrtn")
      else pytest.param(s, 128, marks=pytest.mark.slow) for s in TRACEABLE]])
def test_gpt_estimate_within_10_percent_of_measured(tmp_path, strategy, size):
    predicted, measured = _pair(tmp_path, [*GPT, *strategy.split(), "data.batch_size=2",
                                           f"+data.block_size={size}"])
    assert predicted.fake and not measured.fake
    assert predicted.size == size and predicted.size_key == "data.block_size"
    assert _within(predicted, measured), (predicted.categories, measured.categories)
    # the split is real: parameters are the model's parameter bytes, optimizer state Adam's
    assert predicted.categories["parameters"] == measured.categories["parameters"] > 0


@pytest.mark.parametrize("size", [64, 128])
@pytest.mark.parametrize("strategy", ["strategy=sqrtn"])
def test_unet_estimate_within_10_percent_of_measured(tmp_path, strategy, size):
    predicted, measured = _pair(tmp_path, [*UNET, strategy, f"data.image_size={size}"])
    assert _within(predicted, measured), (predicted.categories, measured.categories)


@pytest.mark.slow
@pytest.mark.parametrize("size", [64, 96])
@pytest.mark.parametrize("strategy", TRACEABLE)
def test_unet_estimate_every_strategy(tmp_path, strategy, size):
    predicted, measured = _pair(tmp_path, [*UNET, *strategy.split(), f"data.image_size={size}"])
    assert _within(predicted, measured), (predicted.categories, measured.categories)


def test_estimate_splits_the_peak_by_category_and_is_fast(tmp_path):
    cfg = compose_config("estimate", tmp_path, [*UNET, "data.image_size=1024",
                                                "data.batch_size=4"])
    start = time.perf_counter()
    est = estimate(cfg)
    assert time.perf_counter() - start < 60
    params = est.categories["parameters"]
    # a ResNet-18 U-Net at 1024 px, batch 4: activations dwarf the weights
    assert est.categories["activations"] > 20 * params
    assert sum(v for k, v in est.categories.items() if k != "total") == est.peak_bytes


def test_sqrtn_estimate_is_below_none(tmp_path):
    none = estimate(compose_config("estimate", tmp_path, [*GPT, "+data.block_size=256"]))
    sqrtn = estimate(compose_config("estimate", tmp_path, [*GPT, "+data.block_size=256",
                                                           "strategy=sqrtn"]))
    assert sqrtn.categories["activations"] < 0.7 * none.categories["activations"]


def test_compile_is_not_estimated(tmp_path):
    with pytest.raises(NotTraceable, match="strategy 'compile' cannot be estimated"):
        estimate(compose_config("estimate", tmp_path, [*GPT, "strategy=compile"]))


def test_a_budget_is_sent_to_the_planner(tmp_path):
    """strategy=budget failed inside the model's build with the strategy's own
    RuntimeError, wrapped as the model group's failure; it names remat.plan now."""
    with pytest.raises(ValueError, match=r"^estimate: strategy=budget \(strategy.memory="
                                         r"50MiB\) is a request for a plan.*python -m "
                                         r"remat.plan.*strategy=plan strategy.path="):
        estimate(compose_config("estimate", tmp_path, [*GPT, "strategy=budget",
                                                       "strategy.memory=50MiB"]))


def test_a_plan_file_for_another_size_is_refused_as_training_refuses_it(tmp_path):
    """strategy=plan with a plan made for another size was estimated at this one without a
    word, where train.py refuses it; the estimator refuses it the same way."""
    from remat.planner.plan import Plan, UnitPlan

    path = Plan(units=[UnitPlan("blocks", "chain", [(0, 2, "recompute")])], batch_size=2,
                size=96, precision="32-true").save(tmp_path / "plan.json")
    cfg = compose_config("estimate", tmp_path, ["model=gpt_tiny", "device=cpu",
                                                "data.batch_size=2", "+data.block_size=64",
                                                "strategy=plan", f"strategy.path={path}"])
    with pytest.raises(ValueError, match=re.escape(
            f"strategy.path='{path}': the plan was made for data.block_size=96, this run has "
            "data.block_size=64")):
        estimate(cfg)


def test_size_overflowing_int64_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"data.image_size=10000000000 .*int64"):
        estimate(compose_config("estimate", tmp_path, [*UNET, f"data.image_size={10**10}"]))


def test_config_that_fails_to_build_names_the_group(tmp_path):
    # the model's and the strategy's own errors name their keys (they came inside Hydra's
    # three lines)
    with pytest.raises(ValueError, match=r"^model.arch / model.encoder_name: Wrong encoder "
                                         r"name `resnet_nope`"):
        estimate(compose_config("estimate", tmp_path, [*UNET, "model.encoder_name=resnet_nope"]))
    with pytest.raises(ValueError, match=r"^strategy.k must be an int >= 1, got 0 \(every_k"):
        estimate(compose_config("estimate", tmp_path, [*GPT, "strategy=every_k",
                                                       "strategy.k=0"]))


def test_cuda_without_a_driver_is_refused_with_the_reason(tmp_path):
    if torch.cuda.is_available():
        pytest.fail("this check is for CPU-only machines; on a GPU machine device=cuda works")
    with pytest.raises(ValueError, match="device=cuda.*fake CUDA tensors"):
        estimate(compose_config("estimate", tmp_path, [*GPT, "device=cuda"]))


def test_entry_point_prints_the_table(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "remat.estimate", *GPT, "+data.block_size=64",
                         "strategy=sqrtn", f"hydra.run.dir={tmp_path / 'a'}"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "predicted peak of one training step: strategy sqrtn" in ok.stdout
    assert "activations" in ok.stdout and (tmp_path / "a" / "estimate.json").is_file()
    record = json.loads((tmp_path / "a" / "estimate.json").read_text())
    assert record["config"]["strategy"]["_target_"] == "remat.strategies.SqrtN"
    assert record["config"]["data"]["block_size"] == 64
    # no .hydra/ folder: `remat.report outputs/` must not list the estimate as a missing job
    assert not (tmp_path / "a" / ".hydra").exists()


@pytest.mark.slow  # a second remat.estimate start, 8 s: make test-all
def test_entry_point_refuses_compile(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "remat.estimate", *GPT, "strategy=compile",
                          f"hydra.run.dir={tmp_path / 'b'}"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "cannot be estimated" in bad.stderr


@pytest.mark.slow  # > 5 s on 2 cores and not the only proof: make test-all
def test_timm_vit_segmenter_is_estimated(tmp_path):
    # timm's init calls data-dependent ops (trunc_normal_ -> .item()) that FakeTensorMode
    # refuses; the model is then built on the meta device and turned into fake tensors
    predicted, measured = _pair(tmp_path, ["model=vit_seg_tiny", "device=cpu",
                                           "data.image_size=32", "data.batch_size=1"])
    assert predicted.categories["parameters"] == measured.categories["parameters"] > 20e6
    assert _within(predicted, measured), (predicted.categories, measured.categories)


@pytest.mark.slow  # ~30 s: the real SwinUNETR step is the reference
def test_a_model_whose_init_reads_item_on_meta_is_built_once_for_real(tmp_path):
    # MONAI's SwinUNETR calls .item() on a linspace in __init__: neither FakeTensorMode nor
    # the meta device can answer it, so the estimate builds it on the CPU once and traces
    # a meta copy; the prediction still equals the real run's peak
    predicted, measured = _pair(tmp_path, ["model=monai_swinunetr", "device=cpu",
                                           "data.image_size=64", "data.batch_size=1",
                                           "strategy=full"])
    assert predicted.categories["parameters"] == measured.categories["parameters"] > 1e6
    assert _within(predicted, measured, rel=0.01), (predicted.categories,
                                                    measured.categories)


@pytest.mark.slow
def test_timm_convnext_unet_is_estimated(tmp_path):
    predicted, measured = _pair(tmp_path, ["model=unet_convnext", "device=cpu",
                                           "data.image_size=64", "data.batch_size=1"])
    assert predicted.categories["parameters"] == measured.categories["parameters"] > 0
    assert _within(predicted, measured), (predicted.categories, measured.categories)


def test_patch_size_datasets_use_the_patch_as_input(tmp_path):
    base = [*UNET, "data=isbi2012", "data.batch_size=2"]
    predicted, measured = _pair(tmp_path, [*base, "data.patch_size=[64,128]"])
    assert predicted.size_key == "data.patch_size" and predicted.size == (64, 128)
    assert _within(predicted, measured), (predicted.categories, measured.categories)
    square = estimate(compose_config("estimate", tmp_path, [*base, "data.patch_size=128"]))
    assert square.size == 128
    # a 64 x 128 crop holds half the pixels of a 128 x 128 one (activations dominate the peak)
    assert 0.4 < predicted.categories["activations"] / square.categories["activations"] < 0.6
    with pytest.raises(ValueError, match=r"data.patch_size must be an integer >= 1 or \[h, w\]"):
        estimate(compose_config("estimate", tmp_path, [*base, "data.patch_size=[32,0]"]))


def test_estimate_outputs_go_under_outputs_estimate(tmp_path):
    cfg = compose_app("estimate", tmp_path)
    assert str(cfg.hydra.run.dir).startswith("outputs/estimate/"), cfg.hydra.run.dir
    assert cfg.hydra.output_subdir is None


TRAIN_RUNS = {
    # GPT: after the first step the Adam state and (Lightning zeroes them after the forward)
    # the last step's gradients are alive during the forward; a one-step trace missed both
    "gpt": ["experiment=shakespeare_gpt", "data.block_size=32", "data.batch_size=4",
            "trainer.gradient_clip_val=null"],
    "gpt_bf16": ["experiment=shakespeare_gpt", "data.block_size=32", "data.batch_size=4",
                 "strategy=selective", "precision=bf16-mixed"],
    # a ready `net` (not in the hyperparameters) and a timm encoder
    "vit": ["experiment=vit_seg_highres", "data.image_size=32", "data.batch_size=1",
            "strategy=sqrtn"],
    # random crops: data.patch_size is the input size
    "isbi": ["experiment=isbi2012_unet", "data.patch_size=32", "data.batch_size=2",
             "model.arch_kwargs={decoder_channels:[32,16,16,8,8]}"],
}


@pytest.mark.parametrize("run", [
    "gpt", "gpt_bf16", "isbi",
    # the timm ViT's fake build is tested in test_timm_vit_segmenter_is_estimated
    pytest.param("vit", marks=pytest.mark.slow)])
def test_estimate_at_train_start_is_within_10_percent_of_measured(tmp_path, run, request):
    roots = {"gpt": "shakespeare_root", "gpt_bf16": "shakespeare_root", "vit": "kvasir_root",
             "isbi": "isbi_root"}
    root = request.getfixturevalue(roots[run])
    cfg = compose_app("train", tmp_path, [
        *TRAIN_RUNS[run], f"data.root={root}", *TINY_TRAINER, "trainer.max_steps=2",
        "+trainer.limit_val_batches=0", "callbacks.model_checkpoint=null",
        "callbacks.run_report.estimate=true"])
    summary = train(cfg)
    est, measured = summary["memory_estimate"], summary["peak_memory_bytes"]
    assert est is not None, summary["memory_estimate_note"]
    assert measured > 0 and abs(est["peak_bytes"] - measured) <= 0.10 * measured, (
        est, measured)
    if run == "isbi":
        assert est["size_key"] == "data.patch_size" and est["size"] == 32


def test_in_process_trace_leaves_the_callers_random_state_alone(monkeypatch):
    """Where the trace cannot fork (CUDA initialised, no os.fork) it runs in the training
    process, whose seed must survive it."""
    import os

    from remat.measure.trace import trace_step
    from remat.models import SequenceModule

    monkeypatch.delattr(os, "fork")
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    name, peak = trace_step(lambda: SequenceModule(vocab_size=32, block_size=16, n_layer=1,
                                                   n_head=2, n_embd=16),
                            2, 16, torch.device("cpu"), "32-true")
    assert name == "none" and peak.peak_bytes > 0
    assert torch.equal(torch.random.get_rng_state(), state)
