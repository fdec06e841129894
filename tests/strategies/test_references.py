"""The benchmark's reference rows and the planner's fixed points come from the registry."""

from remat.strategies import (
    COMPILED_REFERENCES,
    FIXED_POINTS,
    REFERENCES,
    STRATEGIES,
    HFGradientCheckpointing,
    TimmNative,
    TorchCheckpointSequential,
    TorchCompileMemoryBudget,
)


def test_fixed_points_and_reference_rows_come_from_the_registry():
    assert {name for _, name, _ in FIXED_POINTS} <= set(STRATEGIES)
    assert list(REFERENCES) == ["torch_checkpoint_sequential", "timm_set_grad_checkpointing",
                                "hf_gradient_checkpointing"]
    assert list(REFERENCES.values()) == [TorchCheckpointSequential, TimmNative,
                                         HFGradientCheckpointing]
    assert COMPILED_REFERENCES == {"torch_compile_budget": TorchCompileMemoryBudget}
    # reference rows have no training config: their labels are not registry names
    assert not set(REFERENCES) & set(STRATEGIES)
    assert not set(COMPILED_REFERENCES) & set(STRATEGIES)
