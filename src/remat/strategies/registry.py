"""Name -> strategy class, and :func:`build_strategy`, the Python twin of the Hydra group;
the fixed points a plan is compared against and the benchmark's reference rows."""

from __future__ import annotations

from typing import Any

from remat.strategies.base import CheckpointStrategy
from remat.strategies.compiled import CompileBudget
from remat.strategies.every_k import EveryK
from remat.strategies.full import FullCheckpoint
from remat.strategies.none import NoCheckpoint
from remat.strategies.offload import OffloadCheckpoint
from remat.strategies.references import (
    HFGradientCheckpointing,
    MonaiUseCheckpoint,
    TorchCheckpointSequential,
    TorchCompileMemoryBudget,
)
from remat.strategies.selective import SelectiveCheckpoint
from remat.strategies.sqrtn import SqrtN
from remat.strategies.timm_native import TimmNative

STRATEGIES: dict[str, type[CheckpointStrategy]] = {
    cls.name: cls for cls in (NoCheckpoint, FullCheckpoint, SqrtN, EveryK, SelectiveCheckpoint,
                              OffloadCheckpoint, CompileBudget, TimmNative)
}

#: The fixed strategies a plan is compared against (``remat.plan``'s frontier, the
#: planner's reference plans): ``(label, registry name, constructor arguments)``.
FIXED_POINTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("none", "none", {}), ("full", "full", {}), ("sqrtn", "sqrtn", {}),
    ("every_k k=2", "every_k", {"k": 2}), ("every_k k=4", "every_k", {"k": 4}),
    ("selective matmul", "selective", {"policy": "matmul"}))

#: Reference rows from outside remat that ``remat.bench`` measures beside the strategies
#: where they apply to the stages (``reference_points=true``): row label -> class, in row
#: order. Not in :data:`STRATEGIES`: they have no training config.
REFERENCES: dict[str, type[CheckpointStrategy]] = {
    TorchCheckpointSequential.name: TorchCheckpointSequential,
    "timm_set_grad_checkpointing": TimmNative,
    HFGradientCheckpointing.name: HFGradientCheckpointing,
    MonaiUseCheckpoint.name: MonaiUseCheckpoint,
}

#: Reference rows for ``remat.bench``'s ``compile_strategies`` only (compiled rows):
#: name -> class, built with the entry's arguments (``{name: torch_compile_budget,
#: memory_budget: 0.3}``).
COMPILED_REFERENCES: dict[str, type[CheckpointStrategy]] = {
    TorchCompileMemoryBudget.name: TorchCompileMemoryBudget,
}


def build_strategy(name: str, **overrides: Any) -> CheckpointStrategy:
    """Build a strategy by registry name, as ``configs/strategy/<name>.yaml`` does.

    Args:
        name: one of :data:`STRATEGIES` (``none``, ``full``, ``sqrtn``, ``every_k``,
            ``selective``, ``offload``, ...).
        **overrides: constructor arguments, e.g. ``k=4`` for ``every_k``.

    Raises:
        ValueError: unknown name (the message lists the valid ones) or bad arguments.
    """
    try:
        cls = STRATEGIES[name]
    except KeyError:
        valid = ", ".join(sorted(STRATEGIES))
        raise ValueError(f"unknown strategy '{name}'; valid strategies: {valid}") from None
    try:
        return cls(**overrides)
    except TypeError as err:
        raise ValueError(f"strategy '{name}' does not take {sorted(overrides)}: {err}") from err
