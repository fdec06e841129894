"""What a run is about to cost, logged once at train start: strategy report and estimate."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import lightning as L
import torch

from remat.measure import format_bytes
from remat.run_shape import TRACED_PRECISIONS, check_precision, shape_of

log = logging.getLogger(__name__)


class RunReport(L.Callback):
    """At train start: logs the strategy report (which modules are wrapped, how the chains
    are cut) and, with ``estimate=True``, the peak memory of one training step predicted by
    :mod:`remat.estimate` (FakeTensorMode + MemTracker, no allocation; a few seconds).

    The estimate traces a structural copy of the run's own module (``meta`` tensors turned
    into fake ones: same network, also a ready ``net``, strategy wrappers, optimizer factory,
    vocabulary) at the datamodule's batch size and input size (the size key of
    :func:`remat.run_shape.shape_of`), with the run's precision and
    ``accumulate_grad_batches``, over two optimizer steps (the second has the optimizer
    state allocated, see :func:`remat.measure.trace.trace_step`). Strategies that cannot be
    traced (``compile``) get a note instead of a number. Not modelled: gradient clipping's
    temporaries (per-parameter norms, small).
    Kept for ``summary.json``: ``strategy_report`` (dict), ``estimate`` (dict of
    :class:`remat.measure.trace.Estimate` fields, bytes) or ``estimate_note``.
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
            # the parts are what is alive at that moment (at an optimizer-step peak the
            # activations are gone: "activations 4 B" read as a wrong estimate); the peak
            # counts tensors, as the memory monitor measures them, not the allocator's blocks
            alive = {k: v for k, v in self.estimate["categories"].items()
                     if k != "total" and v}
            parts = {k: v for k, v in alive.items() if v >= 2**20}
            listed = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
            if len(parts) < len(alive):  # a small model (LoRA adapters): nothing of 1 MiB
                listed += ("; each other part below 1 MiB" if parts
                           else "each part below 1 MiB")
            log.info("estimated peak of one training step on %s: %s of tensors (alive at "
                     "that moment: %s)", self.estimate["device"],
                     format_bytes(self.estimate["peak_bytes"]), listed)
            for logger in trainer.loggers:  # self.log is not allowed in on_train_start
                logger.log_metrics({"mem/estimate_bytes": float(self.estimate["peak_bytes"])},
                                   step=trainer.global_step)
        else:
            log.info("no memory estimate: %s", self.estimate_note)

    def _estimate(self, trainer: L.Trainer, pl_module: L.LightningModule
                  ) -> tuple[dict[str, Any] | None, str | None]:
        from remat.measure.trace import Estimate, materialize, meta_clone, trace_step
        from remat.strategies.recompute import trace_as_compiled

        shape = shape_of(trainer.datamodule, getattr(pl_module, "hparams", None))
        if shape.batch_size is None or shape.size is None:
            return None, ("the datamodule has no integer batch_size and image_size, "
                          "patch_size or block_size")
        if not getattr(pl_module.strategy, "traceable", True):
            return None, (f"strategy {pl_module.strategy.name} cannot be traced under "
                          "FakeTensorMode")
        if getattr(pl_module, "shard_report", None) is not None:
            world = pl_module.shard_report.world_size
            return None, (f"the network is sharded by FSDP2 over {world} ranks; one rank's "
                          f"peak is predicted by python -m remat.estimate ... world_size={world}"
                          " (same model, data and strategy keys)")
        # The run's own module, copied with meta tensors: same network (also a ready `net`
        # that is not in the hyperparameters), strategy wrappers, vocabulary, tied weights.
        try:
            skeleton = meta_clone(pl_module, drop=(trainer,))
        except Exception as err:  # noqa: BLE001 - reported as a note, never raised
            return None, (f"{type(pl_module).__name__} could not be copied for the estimate "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:300]})")
        skeleton.scheduler_factory = None  # one step; the scheduler needs the trainer

        # compile=true: set by compile_net before the network is compiled
        compiled = getattr(pl_module, "compile_options", None) is not None

        def build() -> torch.nn.Module:
            # compile=true: recomputed regions hold what compiled ones keep of dropout's draws
            trace_as_compiled(compiled)
            return materialize(skeleton, pl_module.device)

        try:
            precision = check_precision(trainer.precision, pl_module.device.type,
                                        TRACED_PRECISIONS)
        except ValueError:
            return None, f"precision {trainer.precision} is not traced by the estimator"
        accumulate = int(trainer.accumulate_grad_batches)
        try:
            name, peak = trace_step(build, shape.batch_size, shape.size, pl_module.device,
                                    precision, accumulate_grad_batches=accumulate)
        except Exception as err:  # noqa: BLE001 - reported as a note, never raised
            return None, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        finally:  # traced in this process where CUDA is up: no flag left set
            trace_as_compiled(False)
        est = Estimate(strategy=name, precision=precision, device=pl_module.device.type,
                       batch_size=shape.batch_size, size=shape.size, size_key=shape.size_key,
                       accumulate_grad_batches=accumulate,
                       peak_bytes=int(peak.peak_bytes), categories=peak.categories,
                       seconds=0.0)
        return asdict(est), None
