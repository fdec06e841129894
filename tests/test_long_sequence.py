"""Long-sequence recipes end to end through ``train(cfg)``: shakespeare_gpt (vocabulary saved in
the checkpoint, resumed, samples written) and vit_seg_highres, both tiny."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from remat.train import train
from tests.helpers import TINY_TRAINER, compose_train

# 2 training steps of batch 8 (windows of 33 chars), 2 val batches, a 2-block width-32 model
TINY_GPT = ["data.block_size=32", "data.batch_size=8", "data.train_windows=16",
            "data.val_windows=16", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
            "model.sample_tokens=40", "model.scheduler.warmup_steps=1", *TINY_TRAINER]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, shakespeare_root) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("shakespeare")
    cfg = compose_train(out, ["experiment=shakespeare_gpt", f"data.root={shakespeare_root}",
                              "strategy=selective", "model.pos_embedding=rotary", *TINY_GPT])
    return out, train(cfg)


def test_shakespeare_recipe_pins_its_keys(tmp_path):
    cfg = compose_train(tmp_path, ["experiment=shakespeare_gpt"])
    assert cfg.model.vocab_size == cfg.data.vocab_size == 65
    assert cfg.model.block_size == cfg.data.block_size
    assert cfg.monitor == "val/loss" and cfg.monitor_mode == "min"
    assert cfg.trainer.gradient_clip_val == 1.0
    assert cfg.model.scheduler._target_ == "remat.models.sequence.warmup_cosine"


def test_tiny_shakespeare_run_trains_logs_bpc_and_writes_a_sample(first_run,
                                                                   shakespeare_root):
    out, summary = first_run
    assert summary["status"] == "completed" and summary["global_step"] == 2
    assert summary["monitor"] == "val/loss"
    metrics = summary["metrics"]
    assert metrics["val/bpc"] == pytest.approx(metrics["val/loss"] / math.log(2), rel=1e-5)
    assert 3.0 < metrics["val/loss"] < 4.5  # about ln(65) = 4.17 after 2 steps
    sample = (out / "samples" / "epoch_000.txt").read_text()
    assert len(sample) == 41 and sample[0] == "\n"  # prompt + 40 sampled characters
    assert set(sample) <= set((shakespeare_root / "input.txt").read_text())
    rows = list(csv.DictReader((out / "csv" / "metrics.csv").open()))
    assert any(r.get("val/bpc") for r in rows)


def test_checkpoint_holds_the_vocabulary(first_run, shakespeare_root):
    out, summary = first_run
    ckpt = torch.load(summary["last_model_path"], map_location="cpu", weights_only=False)
    text = (shakespeare_root / "input.txt").read_text(encoding="utf-8")
    assert ckpt["CharTextDataModule"]["vocab"] == "".join(sorted(set(text)))
    assert ckpt["hyper_parameters"]["pos_embedding"] == "rotary"
    assert not any("pos_emb" in k for k in ckpt["state_dict"])
    # warm-up (1 step) then cosine to 10 % of lr 0.002 at the last of the 2 steps
    scheduler = ckpt["lr_schedulers"][0]
    assert scheduler["last_epoch"] == 2
    assert scheduler["_last_lr"][0] == pytest.approx(0.0002)


def test_resume_keeps_the_saved_ids_on_a_smaller_corpus(first_run, tmp_path):
    out, summary = first_run
    (tmp_path / "input.txt").write_text("To be, or not to be: that is the question.\n" * 30)
    resumed = train(compose_train(tmp_path / "run", [
        "experiment=shakespeare_gpt", f"data.root={tmp_path}", "strategy=selective",
        "model.pos_embedding=rotary", *TINY_GPT, "trainer.max_epochs=2", "data.val_windows=2",
        f"ckpt_path={summary['last_model_path']}"]))
    assert resumed["status"] == "completed" and resumed["global_step"] == 4
    ckpt = torch.load(resumed["last_model_path"], map_location="cpu", weights_only=False)
    assert len(ckpt["CharTextDataModule"]["vocab"]) == 65


def test_resume_with_a_character_missing_from_the_saved_vocabulary_fails(first_run, tmp_path):
    _, summary = first_run
    (tmp_path / "input.txt").write_text("50% of #hashtags are noise\n" * 40)
    cfg = compose_train(tmp_path / "run", ["experiment=shakespeare_gpt", f"data.root={tmp_path}",
                                           "model.pos_embedding=rotary", *TINY_GPT,
                                           "trainer.max_epochs=2",
                                           f"ckpt_path={summary['last_model_path']}"])
    with pytest.raises(ValueError, match=r"input.txt has 4 character\(s\) missing from the "
                                         r"vocabulary saved in the checkpoint: '#' \(U\+0023\), "
                                         r"'%' \(U\+0025\), '0' \(U\+0030\), '5' \(U\+0035\)"):
        train(cfg)


def test_model_vocab_size_mismatch_is_a_clear_error(shakespeare_root, tmp_path):
    cfg = compose_train(tmp_path, ["experiment=shakespeare_gpt", f"data.root={shakespeare_root}",
                                   *TINY_GPT, "model.vocab_size=80"])
    with pytest.raises(ValueError, match=r"model.vocab_size=80 but the datamodule "
                                         r"\(CharTextDataModule\) has 65 tokens"):
        train(cfg)


def test_tiny_vit_seg_highres_run_on_kvasir(tmp_path, kvasir_root):
    cfg = compose_train(tmp_path, [
        "experiment=vit_seg_highres", f"data.root={kvasir_root}", "data.image_size=64",
        "data.limit_train=4", "data.limit_val=2", "data.batch_size=2", "model.net.depth=2",
        "model.net.embed_dim=32", "model.net.num_heads=2",
        "model.net.decoder_channels=[16,8,8,8]", "strategy=sqrtn", *TINY_TRAINER])
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["global_step"] == 2
    assert summary["strategy_report"]["segments"] == {"encoder.blocks": [[0, 1], [1, 2]]}
    assert 0.0 <= summary["metrics"]["val/dice"] <= 1.0


@pytest.mark.parametrize("model,layers,width,pos", [("gpt_tiny", 4, 64, "learned"),
                                                    ("gpt_small", 16, 256, "learned"),
                                                    ("gpt_medium", 24, 512, "rotary")])
def test_gpt_configs_follow_the_data_vocabulary_and_block_size(tmp_path, model, layers, width,
                                                               pos):
    cfg = compose_train(tmp_path, ["data=enwik8", f"model={model}", "data.block_size=96"])
    assert (cfg.model.vocab_size, cfg.model.block_size) == (256, 96)
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.pos_embedding) == (layers, width, pos)
    text = compose_train(tmp_path, ["data=tinyshakespeare", f"model={model}"])
    assert (text.model.vocab_size, text.model.block_size) == (65, 256)
