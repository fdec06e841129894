"""``timm_native`` (timm's own checkpointing) and ``sqrtn`` on a timm ``tu-`` encoder.

Recompute is counted with forward PRE-hooks: a recompute may stop early, before forward
hooks run, and a block that runs twice in one training step was recomputed.
"""

import copy

import pytest
import segmentation_models_pytorch as smp
import timm
import torch
from torch import nn

from remat.strategies import build_strategy
from remat.strategies.stages import StageError
from remat.strategies.timm_native import TimmNative, feature_wrapper_checkpointed
from tests.strategies.common import assert_same_function, count_calls, train_step

# tu-convnext_atto's encoder (a timm FeatureListNet): children stem_0, stem_1, stages_0..3;
# each stage holds an nn.Sequential chain of ConvNeXt blocks (2, 2, 6, 2 blocks).
CONVNEXT_CHAINS = ["encoder.model.stages_*.blocks"]


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                             patch_size=8, depth=4, num_classes=0, proj_drop_rate=0.1,
                             drop_path_rate=0.2)  # dropout masks must be replayed


@pytest.fixture(scope="module")
def convnext_unet():
    torch.manual_seed(0)
    return smp.Unet("tu-convnext_atto", encoder_weights=None, classes=1,
                    decoder_channels=(32, 16, 16, 8, 8))








def test_vit_blocks_recomputed_outputs_and_gradients_match(vit):
    model = copy.deepcopy(vit)
    x = torch.randn(2, 3, 32, 32)
    ref = train_step(copy.deepcopy(vit), x)
    keys = list(model.state_dict())
    report = TimmNative().apply(model, ["blocks"])
    assert report.strategy == "timm_native"
    assert report.stages == ["blocks"] and report.wrapped == [""]  # the model itself
    assert model.grad_checkpointing and list(model.state_dict()) == keys
    blocks = list(model.blocks)
    counts, handles = count_calls(blocks)
    got = train_step(model, x)
    assert [counts[id(b)] for b in blocks] == [2] * len(blocks)  # forward + recompute
    TimmNative().verify(model)
    assert_same_function(got, ref, exact_output=True)
    for key in counts:
        counts[key] = 0
    with torch.no_grad():
        model.train()(x)
    assert [counts[id(b)] for b in blocks] == [1] * len(blocks)  # no_grad: no recompute
    model.eval()
    model(x).sum().backward()  # timm checkpoints in eval() too when grad is on
    assert [counts[id(b)] for b in blocks] == [3] * len(blocks)
    for h in handles:
        h.remove()


def test_apply_twice_equals_once_and_remove_switches_off(vit):
    model = copy.deepcopy(vit)
    strategy = TimmNative()
    build_strategy("full").apply(model, ["blocks"])
    assert strategy.apply(model, ["blocks"]) == strategy.apply(model, ["blocks"])
    assert "forward" not in vars(model.blocks)  # the segment patch was replaced
    counts, handles = count_calls(list(model.blocks))
    train_step(model, torch.randn(1, 3, 32, 32))
    assert set(counts.values()) == {2}  # recomputed once, not twice
    strategy.remove(model)
    assert model.grad_checkpointing is False
    assert not any(vars(m).get("_remat_timm_native") for m in model.modules())
    for key in counts:
        counts[key] = 0
    train_step(model, torch.randn(1, 3, 32, 32))
    assert set(counts.values()) == {1}
    for h in handles:
        h.remove()


def test_flag_ignored_on_the_path_used_fails_verify(vit):
    class Bypass(nn.Module):  # runs the ViT's blocks itself: timm's forward never runs
        def __init__(self):
            super().__init__()
            self.vit = copy.deepcopy(vit)

        def forward(self, x):
            x = self.vit.patch_embed(x)
            for block in self.vit.blocks:
                x = block(x)
            return x

    model = Bypass()
    strategy = TimmNative()
    assert strategy.apply(model, ["vit.blocks"]).wrapped == ["vit"]
    train_step(model, torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match=r"'vit' \(VisionTransformer\).*recomputed nothing"):
        strategy.verify(model)


def test_features_getter_wrapper_switches_on_its_model():
    torch.manual_seed(0)

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = timm.create_model("vit_tiny_patch16_224", pretrained=False,
                                         img_size=32, patch_size=8, depth=3,
                                         features_only=True, out_indices=(1, 2))

        def forward(self, x):
            return torch.stack([f.mean() for f in self.enc(x)]).sum()

    model = Holder()
    assert type(model.enc).__name__ == "FeatureGetterNet"
    report = TimmNative().apply(model, ["enc"])
    assert report.wrapped == ["enc.model"]
    blocks = list(model.enc.model.blocks)
    counts, handles = count_calls(blocks)
    model.train()
    model(torch.randn(1, 3, 32, 32)).backward()
    assert [counts[id(b)] for b in blocks] == [2] * len(blocks)
    TimmNative().verify(model)
    for h in handles:
        h.remove()


def test_tu_convnext_encoder_checkpoints_all_but_first_and_last_children(convnext_unet):
    """timm's FeatureListNet checkpoints its children except the first, the last and in-place
    ones: stem_1 and stages_0..2 are recomputed, stages_3 is not (and gets a warning)."""
    model = copy.deepcopy(convnext_unet)
    x = torch.randn(2, 3, 64, 64)
    ref = train_step(copy.deepcopy(convnext_unet), x)
    with pytest.warns(UserWarning, match=r"'encoder\.model\.stages_3\.blocks' lies in "
                                         r"'encoder\.model\.stages_3'.*never checkpoints"):
        report = TimmNative().apply(model, CONVNEXT_CHAINS)
    enc = model.encoder.model
    assert type(enc).__name__ == "FeatureListNet"
    assert report.wrapped == ["encoder.model"]
    assert report.segments == {"encoder.model": [(1, 2), (2, 3), (3, 4), (4, 5)]}
    blocks = {f"stages_{i}": list(enc[f"stages_{i}"].blocks) for i in range(4)}
    counts, handles = count_calls([b for chain in blocks.values() for b in chain])
    got = train_step(model, x)
    seen = {name: [counts[id(b)] for b in chain] for name, chain in blocks.items()}
    assert seen == {"stages_0": [2, 2], "stages_1": [2, 2], "stages_2": [2] * 6,
                    "stages_3": [1, 1]}
    TimmNative().verify(model)
    assert_same_function(got, ref, exact_output=True)
    for h in handles:
        h.remove()


def test_sqrtn_on_tu_convnext_block_chains_recomputes_every_block(convnext_unet):
    model = copy.deepcopy(convnext_unet)
    x = torch.randn(2, 3, 64, 64)
    reference = copy.deepcopy(convnext_unet)
    build_strategy("none").apply(reference, CONVNEXT_CHAINS)
    ref = train_step(reference, x)
    strategy = build_strategy("sqrtn")
    report = strategy.apply(model, CONVNEXT_CHAINS)
    assert report.segments == {
        "encoder.model.stages_0.blocks": [(0, 1), (1, 2)],
        "encoder.model.stages_1.blocks": [(0, 1), (1, 2)],
        "encoder.model.stages_2.blocks": [(0, 2), (2, 4), (4, 6)],
        "encoder.model.stages_3.blocks": [(0, 1), (1, 2)],
    }
    blocks = [b for i in range(4) for b in model.encoder.model[f"stages_{i}"].blocks]
    counts, handles = count_calls(blocks, inner=True)
    got = train_step(model, x)
    assert [counts[id(b)] for b in blocks] == [2] * 12
    strategy.verify(model)
    assert_same_function(got, ref, exact_output=True)
    for h in handles:
        h.remove()


def test_batchnorm_stats_double_updated_by_timm_but_not_by_sqrtn():
    """Documented pitfall: timm's checkpointing re-runs BatchNorm in training mode during
    recompute. tu-resnet18's FeatureListNet recomputes bn1 and layer1..layer3."""
    torch.manual_seed(0)
    unet = smp.Unet("tu-resnet18", encoder_weights=None, classes=1,
                    decoder_channels=(16, 16, 8, 8, 8))
    x = torch.randn(2, 3, 64, 64)
    ref = train_step(copy.deepcopy(unet), x)
    timm_model = copy.deepcopy(unet)
    report = TimmNative().apply(timm_model, ["encoder.model"])
    children = [name for name, _ in timm_model.encoder.model.named_children()]
    assert [children[i] for i in feature_wrapper_checkpointed(timm_model.encoder.model)] == [
        "bn1", "maxpool", "layer1", "layer2", "layer3"]  # act1 is in-place, layer4 last
    assert report.segments["encoder.model"] == [(1, 2), (3, 4), (4, 5), (5, 6), (6, 7)]
    got = train_step(timm_model, x)
    assert_same_function(got, ref, exact_output=True)  # outputs and gradients still match
    tracked = {k: int(v) for k, v in got[2].items() if k.endswith("num_batches_tracked")}
    assert tracked["encoder.model.bn1.num_batches_tracked"] == 2
    assert tracked["encoder.model.layer1.0.bn1.num_batches_tracked"] == 2
    assert tracked["encoder.model.layer4.0.bn1.num_batches_tracked"] == 1  # not recomputed
    assert not torch.allclose(got[2]["encoder.model.layer1.0.bn1.running_mean"],
                              ref[2]["encoder.model.layer1.0.bn1.running_mean"])
    segmented = copy.deepcopy(unet)
    build_strategy("sqrtn").apply(segmented, ["encoder.model.layer*"])
    got = train_step(segmented, x)
    assert_same_function(got, ref, exact_output=True)
    for key, value in ref[2].items():
        assert torch.equal(got[2][key], value), key


def test_stage_outside_any_timm_model_names_stage_type_and_alternatives():
    unet = smp.Unet("resnet18", encoder_weights=None, classes=1,
                    decoder_channels=(16, 16, 8, 8, 8))
    with pytest.raises(StageError, match=r"stage 'encoder\.layer1' is a Sequential.*"
                                         r"ResNetEncoder.*'full', 'sqrtn'"):
        TimmNative().apply(unet, ["encoder.layer1"])


def test_timm_model_without_checkpointing_support_is_a_clear_error():
    model = timm.create_model("dla46_c", pretrained=False, num_classes=0)
    with pytest.raises(ValueError, match=r"DLA at the model itself does not support gradient "
                                         r"checkpointing.*AssertionError"):
        TimmNative().apply(model, ["level2"])
    assert not any(vars(m).get("_remat_timm_native") for m in model.modules())


def test_features_wrapper_with_nothing_to_checkpoint_is_an_error():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = timm.create_model("regnetx_002", pretrained=False, features_only=True,
                                         out_indices=(0,))  # only its stem is left

    model = Holder()
    with pytest.raises(ValueError, match=r"FeatureListNet at 'enc' never checkpoints .*"
                                         r"would change nothing"):
        TimmNative().apply(model, ["enc"])


def test_reentrant_timm_checkpointing_is_refused(vit):
    from timm.layers import set_reentrant_ckpt

    set_reentrant_ckpt(True)
    try:
        with pytest.raises(ValueError, match="use_reentrant=False"):
            TimmNative().apply(copy.deepcopy(vit), ["blocks"])
    finally:
        set_reentrant_ckpt(False)


@pytest.mark.parametrize("strategy", ["full", "sqrtn"])
def test_the_models_own_checkpointing_is_switched_off(strategy, caplog):
    """timm's own checkpointing left on under a remat strategy: its recompute ran BatchNorm a
    second time (running_var off by 3.67 in a trial's efficientnet_b0) and remat's stage
    wrappers never ran (timm calls the blocks itself). Applying a recomputing strategy
    switches it off with a warning; the model then trains as plain ``none`` does."""
    from tests.strategies.common import sgd_steps

    def effnet():
        torch.manual_seed(0)
        return timm.create_model("efficientnet_b0", pretrained=False, drop_path_rate=0.2,
                                 num_classes=4)

    x = torch.randn(2, 3, 32, 32)
    ref = sgd_steps(effnet(), x, seed=1)
    model = effnet()
    model.set_grad_checkpointing(True)
    with caplog.at_level("WARNING", logger="remat.strategies.base"):
        report = build_strategy(strategy).apply(model, ["blocks.*"])
    assert model.grad_checkpointing is False
    assert f"strategy '{strategy}' switched off the model's own gradient checkpointing in " \
        "the model itself" in caplog.text
    got = sgd_steps(model, x, seed=1)
    assert len(report.wrapped) == 16  # the blocks of the 7 stages
    assert torch.equal(got[0], ref[0])
    for key, value in ref[2].items():  # BatchNorm statistics: updated once per forward
        assert torch.equal(got[2][key], value), key
    for key, grad in ref[1].items():
        torch.testing.assert_close(got[1][key], grad, rtol=1e-5, atol=1e-6, msg=key)


def test_a_subclass_of_a_timm_model_has_its_own_checkpointing_switched_off_too():
    """A user's subclass of a timm model (defined outside timm) kept timm's checkpointing
    on: BatchNorm statistics off by 0.18 and a warning blaming the stages."""
    from timm.models.resnet import BasicBlock, ResNet

    class Mine(ResNet):
        pass

    torch.manual_seed(0)
    model = Mine(block=BasicBlock, layers=[1, 1, 1, 1], num_classes=4)
    model.set_grad_checkpointing(True)
    build_strategy("sqrtn").apply(model, ["layer1", "layer2", "layer3", "layer4"])
    assert model.grad_checkpointing is False
