"""``model=hf_llama``: a Hugging Face ``LlamaForCausalLM`` from a small config as the
``SequenceModule``'s ready net, wrapped at ``model.layers``, trained on tiny Shakespeare."""

from __future__ import annotations

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from remat.models import SequenceModule
from remat.models.gpt import GPT
from remat.models.sequence import sample_tokens
from remat.strategies import build_strategy
from remat.train import train
from tests.helpers import TINY_TRAINER, compose_train


def _llama(vocab=65, layers=2):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None))


def test_sequence_module_trains_a_ready_hf_causal_lm():
    net = _llama()
    ref = LlamaForCausalLM(net.config)
    ref.load_state_dict(net.state_dict())
    module = SequenceModule(vocab_size=65, block_size=16, net=net, stages=["model.layers"],
                            strategy=build_strategy("full"))
    assert module.net is net and module.hf_net
    assert "net" not in module.hparams
    assert module.strategy_report.wrapped == ["model.layers.0", "model.layers.1"]
    batch = module.example_batch(2, 16, torch.Generator().manual_seed(0))
    assert batch["tokens"].shape == (2, 17) and batch["tokens"].max() < 65
    loss = module.training_loss(batch)
    logits = ref(input_ids=batch["tokens"][:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch["tokens"][:, 1:].flatten())
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_hf_net_vocabulary_must_match_the_model_key():
    with pytest.raises(ValueError, match=r"model.net.config.vocab_size=64 but "
                                         r"model.vocab_size=65"):
        SequenceModule(vocab_size=65, net=_llama(vocab=64), stages=["model.layers"])


def test_a_misspelled_hf_config_setting_is_named():
    """``LlamaConfig`` keeps any keyword: ``num_hiden_layers=2`` built the default layers
    without a word (an estimate of 16.8 MiB where 2 layers give 8.7)."""
    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=65, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=2, num_hiden_layers=2))
    with pytest.raises(ValueError, match=r"model.net.config.num_hiden_layers: LlamaConfig has "
                                         r"no setting 'num_hiden_layers'.*did you mean "
                                         r"model.net.config.num_hidden_layers\?"):
        SequenceModule(vocab_size=65, net=net, stages=["model.layers"])
    SequenceModule(vocab_size=65, net=_llama(), stages=["model.layers"])  # right keys build


def test_another_architectures_settings_are_named(caplog):
    """The ``hf_llama`` preset with GPT-2 as the target: ``GPT2Config`` keeps Llama's
    ``intermediate_size`` and ``rms_norm_eps`` and GPT-2 never reads them (its MLP is 4x the
    width, 128 here, not the 48 asked for), so the run names them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    net = GPT2LMHeadModel(GPT2Config(vocab_size=65, n_positions=16, hidden_size=32,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=48, rms_norm_eps=1e-6))
    assert net.transformer.h[0].mlp.c_fc.nf == 128  # what GPT-2 built: 48 was not read
    with caplog.at_level("WARNING", logger="remat.models.hf"):
        SequenceModule(vocab_size=65, net=net, stages=["transformer.h"])
    [line] = [r.getMessage() for r in caplog.records if r.name == "remat.models.hf"]
    assert line.startswith("model.net.config: GPT2Config has no setting 'intermediate_size', "
                           "'rms_norm_eps': GPT2LMHeadModel ignores")
    assert "~model.net.config.intermediate_size ~model.net.config.rms_norm_eps" in line
    caplog.clear()
    with caplog.at_level("WARNING", logger="remat.models.hf"):
        SequenceModule(vocab_size=65, net=_llama(), stages=["model.layers"])
    assert not [r for r in caplog.records if r.name == "remat.models.hf"]
    # a misspelling of a name GPT-2 maps onto its own keys is refused like any other
    net = GPT2LMHeadModel(GPT2Config(vocab_size=65, n_positions=16, hidden_size=32,
                                     n_layer=1, num_attention_heads=2, num_hiden_layers=2))
    with pytest.raises(ValueError, match=r"num_hiden_layers: GPT2Config has no setting.*did "
                                         r"you mean model.net.config.num_hidden_layers\?"):
        SequenceModule(vocab_size=65, net=net, stages=["transformer.h"])


def test_one_sampling_loop_for_gpt_and_hf_nets():
    torch.manual_seed(0)
    gpt = GPT(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16).eval()
    prompt = torch.tensor([[1, 2, 3]])
    ours = sample_tokens(gpt, prompt, 12, 8, 0.9, 5, torch.Generator().manual_seed(3))
    theirs = gpt.generate(prompt, 12, 0.9, 5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours, theirs)  # the GPT models' samples do not change
    module = SequenceModule(vocab_size=65, block_size=8, net=_llama(), stages=["model.layers"],
                            sample_tokens=10, sample_prompt="ab")
    chars = [chr(ord("a") + i) for i in range(65)]
    text = module.sample(lambda s: torch.tensor([chars.index(c) for c in s]),
                         lambda ids: "".join(chars[i] for i in ids))
    assert len(text) == 12 and text.startswith("ab")
    assert module.net.training  # restored after sampling
    with pytest.raises(ValueError, match="temperature > 0"):
        sample_tokens(gpt, prompt, 1, 8, temperature=0.0)


def test_tiny_llama_trains_on_shakespeare_from_the_command_line_config(tmp_path,
                                                                      shakespeare_root):
    cfg = compose_train(tmp_path, [
        "model=hf_llama", "data=tinyshakespeare", f"data.root={shakespeare_root}",
        "strategy=full", "monitor=val/loss", "monitor_mode=min",
        "data.block_size=32", "data.batch_size=8", "data.train_windows=64",
        "data.val_windows=16", "model.net.config.hidden_size=32",
        "model.net.config.intermediate_size=64", "model.net.config.num_hidden_layers=2",
        "model.net.config.num_attention_heads=2", "model.net.config.num_key_value_heads=1",
        "model.optimizer.lr=0.01", "model.scheduler.warmup_steps=1", "model.sample_tokens=20",
        "trainer.log_every_n_steps=1", *TINY_TRAINER])
    assert cfg.model.net.config.vocab_size == 65
    assert cfg.model.net.config.max_position_embeddings == 32
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["global_step"] == 8
    report = summary["strategy_report"]
    assert report["strategy"] == "full" and report["stages"] == ["model.layers"]
    assert report["wrapped"] == ["model.layers.0", "model.layers.1"]
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    losses = [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-2:]) < sum(losses[:2])  # it learns: about ln(65) = 4.17 at first
    metrics = summary["metrics"]
    assert metrics["val/bpc"] == pytest.approx(metrics["val/loss"] / math.log(2), rel=1e-5)
    assert metrics["val/loss"] < math.log(65)
    sample = (tmp_path / "samples" / "epoch_000.txt").read_text()
    assert len(sample) == 21 and set(sample) <= set((shakespeare_root / "input.txt").read_text())
