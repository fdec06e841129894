"""Activation checkpointing strategies for any ``nn.Module`` (no Lightning imports here).

>>> from remat.strategies import build_strategy
>>> strategy = build_strategy("sqrtn")
>>> report = strategy.apply(model, stages=["encoder.layer*"])  # doctest: +SKIP
"""

from remat.strategies.base import STRATEGY_STATE_KEY, CheckpointStrategy, StrategyReport
from remat.strategies.compiled import CompileBudget
from remat.strategies.every_k import EveryK
from remat.strategies.full import FullCheckpoint
from remat.strategies.none import NoCheckpoint
from remat.strategies.offload import OffloadCheckpoint
from remat.strategies.recompute import RecomputeError, is_recomputing
from remat.strategies.references import (
    HFGradientCheckpointing,
    MonaiUseCheckpoint,
    TorchCheckpointSequential,
    TorchCompileMemoryBudget,
)
from remat.strategies.registry import (
    COMPILED_REFERENCES,
    FIXED_POINTS,
    REFERENCES,
    STRATEGIES,
    build_strategy,
)
from remat.strategies.segmented import RecomputeStrategy
from remat.strategies.segments import balanced_segments, every_k_segments, sqrt_segments
from remat.strategies.selective import SelectiveCheckpoint
from remat.strategies.sqrtn import SqrtN
from remat.strategies.stages import StageError, resolve_stages
from remat.strategies.timm_native import TimmNative
from remat.strategies.wrapping import unwrap_all

__all__ = [
    "COMPILED_REFERENCES",
    "FIXED_POINTS",
    "REFERENCES",
    "STRATEGIES",
    "STRATEGY_STATE_KEY",
    "CheckpointStrategy",
    "CompileBudget",
    "EveryK",
    "FullCheckpoint",
    "HFGradientCheckpointing",
    "MonaiUseCheckpoint",
    "NoCheckpoint",
    "OffloadCheckpoint",
    "RecomputeError",
    "RecomputeStrategy",
    "SelectiveCheckpoint",
    "SqrtN",
    "StageError",
    "StrategyReport",
    "TimmNative",
    "TorchCheckpointSequential",
    "TorchCompileMemoryBudget",
    "balanced_segments",
    "build_strategy",
    "every_k_segments",
    "is_recomputing",
    "resolve_stages",
    "sqrt_segments",
    "unwrap_all",
]
