"""Each family of the matrix builds offline, trains one step under ``none`` and its stages
resolve to the modules the family's docstring names."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from remat.strategies import build_strategy, resolve_stages
from tests.strategies.families import FAMILIES, PATTERNS, build, output_tensors

CHAIN_TYPES = (nn.Sequential, nn.ModuleList)

# what each family's stages resolve to (the blocks a strategy would wrap)
RESOLVED = {
    "unet_resnet": ["encoder.layer1", "encoder.layer2", "encoder.layer3", "encoder.layer4"],
    "unet_timm": [f"encoder.model.stages_{i}.blocks" for i in range(4)],
    "vit": ["blocks"], "gpt": ["blocks"], "gpt_rotary": ["blocks"],
    "vit_seg": ["encoder.blocks"],
    "hf_gpt2": ["transformer.h"], "hf_llama": ["model.layers"],
    "hf_bert": ["bert.encoder.layer"],
    "resnet50": ["layer1", "layer2", "layer3", "layer4"],
    "monai_unetr": ["vit.blocks"],
    "monai_swinunetr": [f"swinViT.layers{i}.0.blocks" for i in range(1, 5)],
    "timm_efficientnet": [f"blocks.{i}" for i in range(7)],
    "timm_convnext": [f"stages_{i}.blocks" for i in range(4)],
    "smp_unetplusplus": ["encoder.layer1", "encoder.layer2", "encoder.layer3",
                         "encoder.layer4", "decoder.blocks.x_0_0", "decoder.blocks.x_0_1",
                         "decoder.blocks.x_1_1", "decoder.blocks.x_0_2",
                         "decoder.blocks.x_1_2", "decoder.blocks.x_2_2",
                         "decoder.blocks.x_0_3", "decoder.blocks.x_1_3",
                         "decoder.blocks.x_2_3", "decoder.blocks.x_3_3",
                         "decoder.blocks.x_0_4"],
    "smp_fpn": ["encoder.layer1", "encoder.layer2", "encoder.layer3", "encoder.layer4",
                "decoder.seg_blocks"],
    "smp_deeplabv3plus": ["encoder.layer1", "encoder.layer2", "encoder.layer3",
                          "encoder.layer4", "decoder.aspp", "decoder.block2"],
}


def test_every_family_is_listed_here():
    assert set(RESOLVED) == set(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_trains_one_step_under_none_and_its_stages_resolve(name):
    family = build(name)
    model = family.model
    assert model.training
    assert set(family.patterns) == set(family.stages)
    assert set(family.patterns.values()) <= set(PATTERNS)
    resolved = resolve_stages(model, family.stages)
    assert [path for path, _ in resolved] == RESOLVED[name]
    for pattern, kind in family.patterns.items():  # chains are chains, modules are not
        hits = [m for p, m in resolve_stages(model, [pattern])]
        assert all(isinstance(m, CHAIN_TYPES) == (kind != "module") for m in hits), pattern
    report = build_strategy("none").apply(model, family.stages)
    assert report.wrapped == []

    started = time.perf_counter()
    out, loss = family.step()
    loss.backward()
    elapsed = time.perf_counter() - started
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(torch.isfinite(t).all() for t in output_tensors(out) if t.is_floating_point())
    for path, stage in resolved:  # every stage is on the path: its weights got gradients
        stage_grads = [p.grad for p in stage.parameters()]
        assert stage_grads and any(g is not None and g.abs().sum() > 0
                                   for g in stage_grads), path
    assert elapsed < 3.0, f"{name}: forward+backward took {elapsed:.2f} s"  # CPU, shared


@pytest.mark.parametrize("name", FAMILIES)
def test_family_flags_say_what_the_stages_hold(name):
    family = build(name)
    modules = [m for _, stage in resolve_stages(family.model, family.stages)
               for m in stage.modules()]
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)
    assert family.batchnorm == has_bn
    drops = [m for m in modules if isinstance(m, nn.Dropout | nn.Dropout2d)
             and m.p > 0]
    rates = [getattr(m, "drop_prob", getattr(m, "attention_dropout", 0.0)) or 0.0
             for m in modules]
    attn = getattr(getattr(family.model, "config", None), "attention_dropout", 0.0) or 0.0
    assert family.dropout == bool(drops or any(r > 0 for r in rates) or attn > 0)


def test_inputs_are_seeded_and_leave_the_global_rng_alone():
    family = build("hf_llama")
    state = torch.random.get_rng_state()
    a, b, c = family.make_input(), family.make_input(), family.make_input(seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.kwargs["input_ids"], b.kwargs["input_ids"])
    assert not torch.equal(a.kwargs["input_ids"], c.kwargs["input_ids"])
    assert a.kwargs["attention_mask"][1, -3:].sum() == 0
    assert (a.kwargs["labels"][1, -3:] == -100).all()
    model, stages, make_input, loss_fn = family
    assert stages == ["model.layers"] and make_input is family.make_input


def test_hf_decoders_keep_their_config_default_cache():
    for name in ("hf_gpt2", "hf_llama"):
        family = build(name)
        assert family.model.config.use_cache is True
        out, _ = family.step()
        assert out.get("cache") is not None or out.get("past_key_values") is not None, name


def test_unknown_family_lists_the_names():
    with pytest.raises(KeyError, match="unknown family 'nope'; families: unet_resnet"):
        build("nope")
