"""The commands of ``docs/fine-tuning-lora.md``, as written there, at tiny sizes: a base
Llama trained from scratch writes ``<run>/hf_model``, and the LoRA commands load it
(``model.pretrained``), train adapters, estimate, plan and resume."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from remat.estimate import estimate
from remat.train import train
from tests.helpers import TINY, TINY_TRAINER, compose_app, compose_train, logged, run_python
from tests.test_readme import DOCS, _app_and_args, _one_line, bash_commands

PAGE = DOCS / "fine-tuning-lora.md"
# the tiny base (width 32, 2 layers, 2 query / 1 key-value heads) and tiny text runs
TINY_NET = ["model.net.config.hidden_size=32", "model.net.config.intermediate_size=64",
            "model.net.config.num_hidden_layers=2", "model.net.config.num_attention_heads=2",
            "model.net.config.num_key_value_heads=1"]
TINY_DATA = ["data.block_size=32", "data.batch_size=4", "data.train_windows=8",
             "data.val_windows=4", "model.sample_tokens=4", "model.scheduler.warmup_steps=1",
             "trainer.log_every_n_steps=1"]
# r 8 on q_proj (32 -> 32) and v_proj (32 -> 16) of 2 layers
ADAPTERS = 2 * (8 * 32 + 32 * 8 + 8 * 32 + 16 * 8)


def page_args(start: str, fill: dict[str, str]) -> tuple[str, list[str]]:
    """``(app, arguments)`` of the page's command that starts with ``start``, its
    ``<...>`` placeholders filled from ``fill`` (``start`` ends at a word)."""
    found = [c for c in map(_one_line, bash_commands(PAGE))
             if c == start or c.startswith(start + " ")]
    assert len(found) == 1, (start, found)
    command = found[0]
    for placeholder, value in fill.items():
        command = command.replace(placeholder, value)
    assert "<" not in command, command
    return _app_and_args(command)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, remat_data_dir):
    """``python train.py experiment=shakespeare_llama`` at tiny sizes: the base model."""
    run = tmp_path_factory.mktemp("base") / "run"
    _, args = page_args("python train.py experiment=shakespeare_llama", {})
    assert args == ["experiment=shakespeare_llama"]
    summary = train(compose_train(run, [*args, *TINY_NET, *TINY_DATA, *TINY_TRAINER]))
    assert summary["status"] == "completed" and summary["parameters"]["lora"] is None
    return run


def test_a_hugging_face_run_writes_its_model_for_model_pretrained(base_run):
    folder = base_run / "hf_model"
    assert (folder / "config.json").is_file()
    saved = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    state = torch.load(base_run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for name, tensor in saved.state_dict().items():
        assert torch.equal(state[f"net.{name}"], tensor), name


def test_the_lora_experiment_trains_adapters_on_the_saved_model(tmp_path, base_run):
    _, args = page_args("python train.py experiment=shakespeare_llama_lora "
                        "model.pretrained=<run>/hf_model strategy=full",
                        {"<run>": str(base_run)})
    summary = train(compose_train(tmp_path, [*args, *TINY_DATA, *TINY_TRAINER]))
    assert summary["status"] == "completed" and summary["global_step"] == 2
    assert summary["strategy_report"]["wrapped"] == [
        f"base_model.model.model.layers.{i}" for i in (0, 1)]
    params = summary["parameters"]
    assert params["trainable"] == ADAPTERS and params["lora"]["target_modules"] == [
        "q_proj", "v_proj"]
    # the base is frozen: the saved weights, unchanged; the adapters moved
    base = AutoModelForCausalLM.from_pretrained(base_run / "hf_model").state_dict()
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    prefix = "net.base_model.model."
    assert torch.equal(state[prefix + "model.embed_tokens.weight"],
                       base["model.embed_tokens.weight"])
    assert torch.equal(state[prefix + "model.layers.1.self_attn.q_proj.base_layer.weight"],
                       base["model.layers.1.self_attn.q_proj.weight"])
    assert state[prefix + "model.layers.1.self_attn.q_proj.lora_B.default.weight"].abs().max() > 0
    config = json.loads((tmp_path / "lora_adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16


def test_plus_model_lora_on_model_hf_llama(tmp_path, base_run):
    _, args = page_args("python train.py model=hf_llama", {"<folder>": str(base_run / "hf_model")})
    summary = train(compose_train(tmp_path, [*args, *TINY_DATA, *TINY_TRAINER]))
    assert summary["status"] == "completed" and summary["strategy"] == "sqrtn"
    assert summary["parameters"]["trainable"] == ADAPTERS
    assert summary["parameters"]["lora"]["dropout"] == 0.05


def test_the_estimate_of_a_lora_model(tmp_path, base_run):
    app, args = page_args("python -m remat.estimate", {"<folder>": str(base_run / "hf_model")})
    assert app == "estimate"
    est = estimate(compose_app("estimate", tmp_path, [*args, "data.block_size=32",
                                                      "device=cpu"]))
    assert est.strategy == "full" and est.size == 32
    # AdamW state of the adapters only: two fp32 moments, a 4-byte step per tensor (8)
    assert est.categories["optimizer_state"] == 2 * 4 * ADAPTERS + 4 * 8


@pytest.mark.slow  # three training processes: about 1.5 min on 2 shared cores
def test_budget_then_resume_from_the_command_line(tmp_path, base_run):
    """The budget command trains with a plan, then ``ckpt_path=`` alone resumes the run (a
    second epoch) with the losses of a run that was never stopped."""
    fill = {"<run>": str(base_run)}
    _, args = page_args("python train.py experiment=shakespeare_llama_lora "
                        "model.pretrained=<run>/hf_model strategy=budget", fill)
    tiny = [*TINY_DATA, *TINY_TRAINER, "model.scheduler=null"]
    proc = run_python(["-m", "remat.train", *args, *tiny, "trainer.max_epochs=2",
                       f"hydra.run.dir={tmp_path / 'reference'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert reference["strategy"] == "budget" and reference["global_step"] == 4
    run = tmp_path / "run"
    proc = run_python(["-m", "remat.train", *args, *tiny, f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, resume = page_args("python train.py ckpt_path=<lora run>/checkpoints/last.ckpt", {
        "<lora run>": str(run)})
    proc = run_python(["-m", "remat.train", *resume, "trainer.max_epochs=2"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 4
    assert summary["resumed_from"].endswith("last.ckpt")
    assert logged(run, "train/loss_step") == logged(tmp_path / "reference", "train/loss_step")


def test_segmentation_encoder_weights_from_a_file(tmp_path):
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(5)
    weights = timm.create_model("convnext_atto", pretrained=False).state_dict()
    save_file(weights, tmp_path / "convnext_atto.safetensors")
    _, args = page_args("python train.py model=unet_convnext", {
        "<convnext_atto.safetensors>": str(tmp_path / "convnext_atto.safetensors")})
    cfg = compose_train(tmp_path / "run", [*args, *TINY])
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["strategy"] == "sqrtn"
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt",
                       weights_only=False)["state_dict"]
    # two AdamW steps (lr 1e-3: at most about 2e-3 each) from the file's weights
    trained = state["net.encoder.model.stages_2.blocks.0.conv_dw.weight"]
    start = weights["stages.2.blocks.0.conv_dw.weight"]
    assert (trained - start).abs().max() < 0.01 < start.abs().max()
