"""``model.pretrained`` (a local ``save_pretrained`` folder, offline) and ``model.lora``
(PEFT's LoRA adapters on a frozen Hugging Face causal LM): loading, errors, the stage paths
under PEFT's prefix, and adapter gradients equal to ``none``'s under every recomputing
strategy with frozen embeddings (the layers' inputs need no gradient)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from remat.models import GPT, SequenceModule
from remat.models.hf import PEFT_PREFIX, lora_stage_paths
from remat.strategies import STRATEGIES, RecomputeStrategy, build_strategy
from tests.helpers import TINY_TRAINER, compose_train
from tests.test_errors import one_line_error

RECOMPUTING = [n for n, c in STRATEGIES.items() if issubclass(c, RecomputeStrategy)]
VOCAB, SEQ = 65, 32


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        bos_token_id=None, eos_token_id=None, pad_token_id=None))


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=None,
        eos_token_id=None))


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(VOCAB, SEQ, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


# each family: the net, its stages, its LoRA targets (GPT-2's c_attn is a Conv1D)
FAMILIES = {
    "gpt": (tiny_gpt, ["blocks"], {"target_modules": ["qkv", "proj"]}),
    "hf_llama": (tiny_llama, ["model.layers"], {"target_modules": ["q_proj", "v_proj"]}),
    "hf_gpt2": (tiny_gpt2, ["transformer.h"], {"target_modules": ["c_attn"],
                                                "fan_in_fan_out": True}),
}


def lora_module(family: str, strategy: str, dropout: float = 0.1) -> SequenceModule:
    make, stages, targets = FAMILIES[family]
    # init_lora_weights=false: lora_B starts non-zero, so lora_A's gradient is not zero
    lora = {"r": 8, "alpha": 16, "dropout": dropout, "init_lora_weights": False, **targets}
    net = make()
    torch.manual_seed(1)  # the adapters' random init
    return SequenceModule(vocab_size=VOCAB, block_size=SEQ, net=net, stages=stages,
                          strategy=build_strategy(strategy), lora=lora)


def adapter_grads(module: SequenceModule, seed: int = 2) -> dict[str, torch.Tensor]:
    batch = module.example_batch(2, SEQ, torch.Generator().manual_seed(seed))
    module.train()
    torch.manual_seed(seed)  # the dropout masks
    module.training_loss(batch).backward()
    return {n: p.grad for n, p in module.named_parameters() if p.requires_grad}


def test_pretrained_folder_is_the_saved_model(tmp_path):
    saved = tiny_llama(seed=3)
    saved.save_pretrained(tmp_path / "llama")
    module = SequenceModule(vocab_size=VOCAB, block_size=SEQ, pretrained=str(tmp_path / "llama"),
                            stages=["model.layers"], strategy=build_strategy("full"))
    assert type(module.net).__name__ == "LlamaForCausalLM" and module.hf_net
    # in training mode (from_pretrained gives eval(), which Lightning would keep)
    assert all(m.training for m in module.net.modules())
    state = module.net.state_dict()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(state[name], tensor), name
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    saved.eval(), module.eval()
    torch.testing.assert_close(module(tokens), saved(input_ids=tokens).logits)


@pytest.mark.parametrize("layout", ["missing", "no_config"])
def test_pretrained_folder_errors_name_the_key(tmp_path, layout):
    folder = tmp_path / "weights"
    if layout == "no_config":
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"^model.pretrained={folder}: ") as err:
        SequenceModule(vocab_size=VOCAB, pretrained=str(folder), stages=["model.layers"])
    assert ("no such folder" if layout == "missing" else "no config.json") in str(err.value)


def test_pretrained_folder_error_is_one_line_from_the_command_line(tmp_path, capsys,
                                                                   shakespeare_root):
    err = one_line_error(capsys, compose_train(tmp_path / "run", [
        *TINY_TRAINER, "model=hf_llama", "data=tinyshakespeare", f"data.root={shakespeare_root}",
        "data.block_size=32",
        f"model.pretrained={tmp_path / 'nowhere'}"]))
    assert err.startswith(f"error: model.pretrained={tmp_path / 'nowhere'}: no such folder")
    assert len(err.splitlines()) == 1


def test_lora_freezes_the_base_and_keeps_the_configured_stages():
    module = lora_module("hf_llama", "full")
    trainable = [n for n, p in module.net.named_parameters() if p.requires_grad]
    # 2 layers x (q_proj, v_proj) x (lora_A, lora_B)
    assert len(trainable) == 8 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # r x 32 (A) + out x r (B): q_proj 32 -> 32, v_proj 32 -> 16 (one key-value head)
    assert module.trainable_parameters == 2 * (8 * 32 + 32 * 8 + 8 * 32 + 16 * 8)
    assert module.total_parameters == module.trainable_parameters + sum(
        p.numel() for p in tiny_llama().parameters())
    assert module.strategy_report.stages == [PEFT_PREFIX + "model.layers"]
    assert module.strategy_report.wrapped == [f"{PEFT_PREFIX}model.layers.{i}" for i in (0, 1)]
    assert lora_stage_paths(["model.layers*", PEFT_PREFIX + "x"]) == [
        PEFT_PREFIX + "model.layers*", PEFT_PREFIX + "x"]
    assert lora_stage_paths("auto") == "auto"


def test_lora_settings_errors_name_the_key():
    with pytest.raises(ValueError, match=r"^model.lora.rank: not a LoRA setting"):
        SequenceModule(
            vocab_size=VOCAB, net=tiny_llama(), stages=["model.layers"],
            lora={"rank": 8, "target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match=r"^model.lora.target_modules=\{'nope'\}"):
        SequenceModule(vocab_size=VOCAB, net=tiny_llama(), stages=["model.layers"],
                       lora={"r": 8, "target_modules": ["nope"]})


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("strategy", RECOMPUTING)
def test_lora_adapter_gradients_equal_none_under_recompute(family, strategy):
    expected = adapter_grads(lora_module(family, "none"))
    module = lora_module(family, strategy)
    if strategy not in ("offload",):
        assert module.strategy_report.wrapped, strategy
    # the frozen embeddings: the first layer's input needs no gradient
    embed = next(m for m in module.net.modules() if isinstance(m, torch.nn.Embedding))
    assert not embed.weight.requires_grad
    got = adapter_grads(module)
    # 2 layers x each target x (lora_A, lora_B)
    assert got.keys() == expected.keys()
    assert len(got) == 2 * len(FAMILIES[family][2]["target_modules"]) * 2
    assert embed.weight.grad is None
    for name, grad in expected.items():
        assert grad is not None and grad.abs().max() > 0, name
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
