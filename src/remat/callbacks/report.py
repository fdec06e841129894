"""What a run is about to cost, logged once at train start: strategy report and estimate."""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict
from typing import Any

import lightning as L
import torch

from remat.measure import format_bytes

log = logging.getLogger(__name__)


def _batch_shape(trainer: L.Trainer) -> tuple[int, int] | None:
    dm = trainer.datamodule
    batch = getattr(dm, "batch_size", None)
    size = getattr(dm, "image_size", None) or getattr(dm, "block_size", None)
    if isinstance(size, list | tuple):
        size = size[0]
    return (batch, size) if isinstance(batch, int) and isinstance(size, int) else None


class RunReport(L.Callback):
    """At train start: logs the strategy report (which modules are wrapped, how the chains
    are cut) and, with ``estimate=True``, the peak memory of one training step predicted by
    :mod:`remat.estimate` (FakeTensorMode + MemTracker, no allocation; a few seconds).

    The model is rebuilt from its class and saved hyperparameters with a copy of its
    strategy and optimizer factory; models that cannot be rebuilt that way (a ready ``net``
    passed in) or strategies that cannot be traced (``compile``) get a note instead of a
    number. Kept for ``summary.json``: ``strategy_report`` (dict), ``estimate`` (dict of
    :class:`remat.estimate.Estimate` fields, bytes) or ``estimate_note``.
    """

    def __init__(self, estimate: bool = True) -> None:
        self.do_estimate = estimate
        self.strategy_report: dict[str, Any] | None = None
        self.estimate: dict[str, Any] | None = None
        self.estimate_note: str | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        report = getattr(pl_module, "strategy_report", None)
        if report is not None:
            self.strategy_report = report.to_dict()
            log.info("strategy report: %s", self.strategy_report)
        if not self.do_estimate or not trainer.is_global_zero:
            return
        self.estimate, self.estimate_note = self._estimate(trainer, pl_module)
        if self.estimate:
            log.info("estimated peak of one training step on %s: %s (%s)",
                     self.estimate["device"], format_bytes(self.estimate["peak_bytes"]),
                     ", ".join(f"{k} {format_bytes(v)}"
                               for k, v in self.estimate["categories"].items()))
            for logger in trainer.loggers:  # self.log is not allowed in on_train_start
                logger.log_metrics({"mem/estimate_bytes": float(self.estimate["peak_bytes"])},
                                   step=trainer.global_step)
        else:
            log.info("no memory estimate: %s", self.estimate_note)

    def _estimate(self, trainer: L.Trainer, pl_module: L.LightningModule
                  ) -> tuple[dict[str, Any] | None, str | None]:
        from remat.estimate import Estimate, NotTraceable, trace_step
        from remat.strategies import CompileBudget

        shape = _batch_shape(trainer)
        if shape is None:
            return None, "the datamodule has no integer batch_size and image_size/block_size"
        if isinstance(pl_module.strategy, CompileBudget):
            return None, "strategy compile cannot be traced under FakeTensorMode"
        cls, hparams = type(pl_module), dict(pl_module.hparams)
        strategy = copy.deepcopy(pl_module.strategy)
        optimizer = getattr(pl_module, "optimizer_factory", None)

        net_type = type(getattr(pl_module, "net", None))

        def build() -> torch.nn.Module:
            try:
                module = cls(**hparams, strategy=copy.deepcopy(strategy), optimizer=optimizer)
            except Exception as err:  # noqa: BLE001 - reported as a note, never raised
                raise TypeError(f"{cls.__name__} cannot be rebuilt from its hyperparameters "
                                f"({type(err).__name__}: {err})") from err
            if type(getattr(module, "net", None)) is not net_type:  # e.g. a ready net passed in
                raise TypeError(f"{cls.__name__} cannot be rebuilt from its hyperparameters "
                                f"(got a {type(module.net).__name__}, the run has a "
                                f"{net_type.__name__})")
            return module

        precision = str(trainer.precision)
        try:
            name, peak = trace_step(build, shape[0], shape[1], pl_module.device,
                                    precision if precision in ("bf16-mixed", "16-mixed")
                                    else "32-true")
        except (NotTraceable, RuntimeError, TypeError, ValueError) as err:
            return None, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        key = "data.image_size" if getattr(trainer.datamodule, "image_size", None) else (
            "data.block_size")
        est = Estimate(strategy=name, precision=precision, device=pl_module.device.type,
                       batch_size=shape[0], size=shape[1], size_key=key,
                       peak_bytes=int(peak.peak_bytes), categories=peak.categories,
                       seconds=0.0)
        return asdict(est), None
