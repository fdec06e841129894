"""What every remat LightningModule shares: its network wrapped by a checkpointing strategy."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from remat.strategies import (
    CheckpointStrategy,
    NoCheckpoint,
    StageError,
    StrategyReport,
)
from remat.strategies.stages import as_stage_list

log = logging.getLogger(__name__)


class StrategyModule(L.LightningModule):
    """Base LightningModule: ``self.net`` with ``strategy`` applied to ``stages``.

    Subclasses build ``net`` and call :meth:`wrap_net`. After the first training batch the
    strategy verifies that what it wrapped was on the code path actually used.
    """

    net: nn.Module

    def wrap_net(self, net: nn.Module, stages: Sequence[str],
                 strategy: CheckpointStrategy | None) -> None:
        """Keep ``net`` and apply ``strategy`` (default ``none``) to its ``stages``.

        ``stages`` is a list of dotted paths (globs allowed); one path given as a bare string
        is one stage. Warns (``UserWarning``) when ``stages`` is empty under a strategy other
        than ``none``: nothing is wrapped, so the run measures no checkpointing.

        Raises:
            remat.strategies.StageError: a stage matches no module (close names listed), or
                ``stages`` is not a path or list of paths; the message names the
                ``model.stages`` config key.
        """
        self.net = net
        self.strategy = strategy if strategy is not None else NoCheckpoint()
        try:
            stages = as_stage_list(stages)
        except StageError as err:
            raise StageError(f"model.stages: {err}") from err
        if not stages and self.strategy.name != "none":
            rank_zero_warn(f"model.stages is empty: strategy {type(self.strategy).__name__} "
                           "wraps nothing, so this run checkpoints no activations; list the "
                           "stages to wrap (e.g. model.stages=[encoder.layer*])")
        try:
            self.strategy_report: StrategyReport = self.strategy.apply(self.net, stages)
        except StageError as err:
            if getattr(self.strategy, "names_own_units", False):
                raise  # a plan names its units (and its file) itself; model.stages is unused
            raise StageError(f"model.stages={stages}: {err}") from err
        log.info("strategy %s wrapped %d modules in %s: %s", self.strategy_report.strategy,
                 len(self.strategy_report.wrapped), ", ".join(self.strategy_report.stages),
                 self.strategy_report.segments)

    def on_fit_start(self) -> None:
        self.strategy.preflight(self.net)  # e.g. SyncBatchNorm inside a recomputed unit

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not getattr(self, "_strategy_verified", False):
            self.strategy.verify(self.net)  # the wrapped stages are on the path used
            self._strategy_verified = True
