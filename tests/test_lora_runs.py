"""LoRA runs end to end (``model.pretrained`` + ``+model.lora`` on ``model=hf_llama``, tiny
sizes, CPU): the estimate and a ``strategy=budget`` plan predict the measured peak with the
frozen base (gradients and optimizer state of the adapters only), the run's summary,
checkpoint and adapter folder say and hold what was trained, and a resume continues with
the same per-step losses."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peft import PeftModel

from remat.build import build_from_config
from remat.estimate import estimate
from remat.measure.trace import trace_step
from remat.planner import Planner, PlanStrategy
from remat.train import train
from tests.helpers import TINY_TRAINER, compose_config, compose_train, logged
from tests.models.test_lora import SEQ, VOCAB, tiny_llama

LORA = "+model.lora={r: 8, alpha: 16, dropout: 0.1, target_modules: [q_proj, v_proj]}"
# r x in (A) + out x r (B) per layer: q_proj 32 -> 32, v_proj 32 -> 16 (one key-value head)
ADAPTERS = 2 * (8 * 32 + 32 * 8 + 8 * 32 + 16 * 8)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A random tiny Llama written by save_pretrained (what a downloaded model folder is)."""
    folder = tmp_path_factory.mktemp("pretrained") / "tiny-llama"
    tiny_llama(seed=7).save_pretrained(folder)
    return folder


def lora_run(root, pretrained, batch_size=4, windows=16) -> list[str]:
    return ["model=hf_llama", "data=tinyshakespeare", f"data.root={root}",
            f"data.block_size={SEQ}", f"data.batch_size={batch_size}",
            f"data.train_windows={windows}", "data.val_windows=4",
            f"model.pretrained={pretrained}", LORA, "model.sample_tokens=0",
            "model.scheduler.warmup_steps=1", "trainer.log_every_n_steps=1"]


@pytest.mark.parametrize("strategy", ["none", "full"])
def test_lora_estimate_is_the_measured_peak(tmp_path, shakespeare_root, pretrained, strategy):
    cfg = compose_config("estimate", tmp_path, [
        *lora_run(shakespeare_root, pretrained)[:-3], "device=cpu", f"strategy={strategy}"])
    predicted, measured = estimate(cfg), estimate(cfg, fake=False)
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (
        predicted.categories, measured.categories)
    total = sum(p.numel() for p in tiny_llama().parameters()) + ADAPTERS
    cats = predicted.categories
    assert cats["parameters"] == 4 * total  # fp32: the frozen base and the adapters
    # AdamW: two fp32 moments and a 4-byte step per adapter tensor (8), none for the base
    assert cats["optimizer_state"] == 2 * 4 * ADAPTERS + 4 * 8
    assert cats["gradients"] <= 4 * ADAPTERS


def test_lora_plan_predicts_the_measured_peak(tmp_path, shakespeare_root, pretrained):
    """The planner on the PEFT-wrapped model: its units are the decoder layers under PEFT's
    prefix, and a plan's predicted (fake-traced) peak is the real step's peak."""
    cfg = compose_config("estimate", tmp_path, [
        *lora_run(shakespeare_root, pretrained, batch_size=16)[:-3], "device=cpu"])
    build, _, batch, size = build_from_config(cfg)
    planner = Planner(build.with_strategy, batch, size, "32-true", device="h100",
                      max_traces=2, default_stages=["model.layers"])
    # none's peak is about 2 MiB, full recompute's 1.4 MiB
    plan = planner.plan(planner.budget_for(int(0.8 * planner.none.allocator_peak))).plan
    assert plan.predicted_allocator_peak_bytes < 0.8 * planner.none.allocator_peak
    assert [u.path for u in plan.units] == ["base_model.model.model.layers"]
    _, measured = trace_step(lambda: build.with_strategy(PlanStrategy(plan)), batch, size,
                             torch.device("cpu"), "32-true", fake=False)
    assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= 0.03 * measured.peak_bytes


@pytest.mark.slow  # ~30 s: plans, then trains; the planner alone is checked above
def test_lora_budget_run_predicts_its_peak_and_keeps_the_adapters(tmp_path, shakespeare_root,
                                                                  pretrained):
    # batch 16: a peak of about 2 MiB, the full-recompute floor about 1.4 MiB
    cfg = compose_train(tmp_path, [
        *lora_run(shakespeare_root, pretrained, batch_size=16, windows=32), *TINY_TRAINER,
        "strategy=budget", "strategy.memory=1900000", "strategy.device=cpu",
        "strategy.max_traces=2", "strategy.margin=0.0"])
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["strategy"] == "budget"
    plan = summary["plan"]
    assert plan["predicted_peak_bytes"] <= 1_900_000 < plan["none_peak_bytes"]
    assert any(s["mode"] != "keep" for u in plan["units"] for s in u["segments"])
    assert plan["units"][0]["path"] == "base_model.model.model.layers"
    assert abs(plan["measured_over_predicted"] - 1) <= 0.03, plan
    params = summary["parameters"]
    assert params["trainable"] == ADAPTERS and params["lora"]["r"] == 8
    assert params["total"] == sum(p.numel() for p in tiny_llama().parameters()) + ADAPTERS
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["lora"]["trainable_parameters"] == ADAPTERS
    adapters = {k: v for k, v in ckpt["state_dict"].items() if ".lora_" in k}
    assert len(adapters) == 8 and sum(v.numel() for v in adapters.values()) == ADAPTERS
    # the frozen base is the saved model, unchanged by training
    base = tiny_llama(seed=7).state_dict()
    key = "net.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(ckpt["state_dict"][key], base["model.layers.0.self_attn.q_proj.weight"])
    # the adapter folder loads on the base model with PEFT and gives the run's logits
    folder = tmp_path / "lora_adapter"
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
    tuned = PeftModel.from_pretrained(tiny_llama(seed=7), folder).eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    from remat.models import SequenceModule

    module = SequenceModule(vocab_size=VOCAB, block_size=SEQ, pretrained=str(pretrained),
                            stages=["model.layers"], lora={
                                "r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    module.load_state_dict(ckpt["state_dict"])
    module.eval()
    torch.testing.assert_close(tuned(input_ids=tokens).logits, module(tokens))
    assert not torch.equal(module(tokens), tiny_llama(seed=7).eval()(input_ids=tokens).logits)


def test_lora_resume_gives_the_uninterrupted_losses(tmp_path, shakespeare_root, pretrained):
    """Stopped by ``trainer.max_steps=2`` inside its first epoch of 4 steps, resumed with
    the limit lifted: the same per-step losses (dropout on the adapters' input) and
    adapters as a run that was not stopped."""
    overrides = [*lora_run(shakespeare_root, pretrained), *TINY_TRAINER,
                 "trainer.max_epochs=2", "model.scheduler=null", "strategy=full"]
    train(compose_train(tmp_path / "reference", overrides))
    run_dir = tmp_path / "run"
    train(compose_train(run_dir, [*overrides, "trainer.max_steps=2"]))
    assert sorted(logged(run_dir, "train/loss_step")) == [0, 1]
    resumed = train(compose_train(run_dir, [
        *overrides, "trainer.max_steps=-1", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"]))
    assert resumed["resumed_from"].endswith("last.ckpt") and resumed["global_step"] == 8
    losses = logged(tmp_path / "reference", "train/loss_step")
    assert sorted(losses) == list(range(8)) and all(math.isfinite(v) for v in losses.values())
    assert logged(run_dir, "train/loss_step") == losses
    ref = torch.load(tmp_path / "reference" / "checkpoints" / "last.ckpt", weights_only=False)
    res = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    for key, value in ref["state_dict"].items():
        assert torch.equal(res["state_dict"][key], value), key


def test_lora_run_estimate_at_train_start_is_its_measured_peak(tmp_path, shakespeare_root,
                                                               pretrained):
    """The default callbacks: the estimate logged at train start (a meta copy of the run's
    PEFT-wrapped module, traced) against the run's own measured peak."""
    summary = train(compose_train(tmp_path, [
        *lora_run(shakespeare_root, pretrained, batch_size=16, windows=32),
        "trainer.max_epochs=1", "trainer.accelerator=cpu", "strategy=sqrtn"]))
    predicted, measured = summary["memory_estimate"]["peak_bytes"], summary["peak_memory_bytes"]
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    assert summary["parameters"]["trainable"] == ADAPTERS
