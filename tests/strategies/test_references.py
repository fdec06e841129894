"""The benchmark's reference rows and the planner's fixed points come from the registry."""

from remat.strategies import (
    COMPILED_REFERENCES,
    FIXED_POINTS,
    REFERENCES,
    STRATEGIES,
    HFGradientCheckpointing,
    MonaiUseCheckpoint,
    TimmNative,
    TorchCheckpointSequential,
    TorchCompileMemoryBudget,
)


def test_fixed_points_and_reference_rows_come_from_the_registry():
    assert {name for _, name, _ in FIXED_POINTS} <= set(STRATEGIES)
    assert list(REFERENCES) == ["torch_checkpoint_sequential", "timm_set_grad_checkpointing",
                                "hf_gradient_checkpointing", "monai_use_checkpoint"]
    assert list(REFERENCES.values()) == [TorchCheckpointSequential, TimmNative,
                                         HFGradientCheckpointing, MonaiUseCheckpoint]
    assert COMPILED_REFERENCES == {"torch_compile_budget": TorchCompileMemoryBudget}
    # reference rows have no training config: their labels are not registry names
    assert not set(REFERENCES) & set(STRATEGIES)
    assert not set(COMPILED_REFERENCES) & set(STRATEGIES)


def test_monai_use_checkpoint_switches_monai_swin_blocks_on_and_off():
    import pytest
    import torch
    from monai.networks.nets.swin_unetr import SwinTransformerBlock

    from remat.models.monai_nets import SwinUNETR3D
    from remat.strategies import StageError, unwrap_all

    net = SwinUNETR3D(1, 2, feature_size=12)
    blocks = [m for m in net.modules() if isinstance(m, SwinTransformerBlock)]
    report = MonaiUseCheckpoint().apply(net, ["swinViT.layers1.0.blocks",
                                              "swinViT.layers2.0.blocks"])
    assert report.wrapped == ["swinViT.layers1.0.blocks.0", "swinViT.layers1.0.blocks.1",
                              "swinViT.layers2.0.blocks.0", "swinViT.layers2.0.blocks.1"]
    assert [b.use_checkpoint for b in blocks] == [True] * 4 + [False] * 4
    unwrap_all(net)
    assert not any(b.use_checkpoint for b in blocks)
    with pytest.raises(StageError, match="MONAI Swin transformer blocks"):
        MonaiUseCheckpoint().apply(net, ["encoder1"])
    with pytest.raises(StageError):
        MonaiUseCheckpoint().apply(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0"])
