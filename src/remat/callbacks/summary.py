"""``summary.json``: what a run was, how it ended, what it reached and what it cost.

Written by :class:`RunSummary` (``running`` at train start, ``completed`` at fit end,
``interrupted`` on SIGTERM/SIGINT, ``failed`` with the error otherwise); a run that fails
before the Trainer exists gets the same file from :func:`failure_summary` (called by
:func:`remat.train.train`). Every write is atomic (temporary file, then rename), so a full
disk leaves the previous summary, never an empty one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from remat.compiling import options_record
from remat.measure import device_name
from remat.run_shape import plain, shape_of

log = logging.getLogger(__name__)


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically (a temporary file in the same
    folder, fsync, ``os.replace``).

    Raises:
        OSError: the write failed; ``path`` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, default=str)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def error_text(err: BaseException) -> str:
    """One-line-first text of an error for ``summary.json``. A failing config interpolation
    is reported as ``<key>: <resolver's error>`` (e.g. ``data.batch_size: ValueError: ...``):
    omegaconf raises its own error while handling the resolver's, which is found in the
    exception chain (``__cause__``/``__context__``), and names the key in ``full_key``."""
    text = "".join(traceback.format_exception_only(err)).strip()
    if isinstance(err, OmegaConfBaseException):
        cause, seen = err, set()
        while isinstance(cause, OmegaConfBaseException) and id(cause) not in seen:
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        key = getattr(err, "full_key", None)
        if cause is not None and not isinstance(cause, OmegaConfBaseException):
            inner = "".join(traceback.format_exception_only(cause)).strip()
            text = f"{key}: {inner}" if key else inner
    return text


def status_of(err: BaseException) -> str:
    """``interrupted`` for SIGTERM/SIGINT (Lightning's ``SIGTERMException``,
    ``KeyboardInterrupt``), else ``failed``."""
    return "interrupted" if isinstance(err, SIGTERMException | KeyboardInterrupt) else "failed"


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu()
        value = value.item() if value.numel() == 1 else None
    if isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(float(value)):
        return float(value)
    return None


def _safe(node: Any, key: str) -> Any:
    try:
        return plain(node.get(key)) if node is not None else None
    except Exception:  # noqa: BLE001 - a failing interpolation: the value is unknown
        return None


def _choice(group: str) -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get(group)
    except ValueError:  # no Hydra app around this call
        return None


def _shape_fields(shape: Any) -> dict[str, Any]:
    size = shape.to_dict()["size"]
    fields = {"batch_size": shape.batch_size, "size_key": shape.size_key, "size": size,
              "image_size": None, "block_size": None}
    if shape.kind == "image":
        fields["image_size"] = size
    elif shape.kind == "sequence":
        fields["block_size"] = size
    return fields


def read_summary(path: str | Path) -> dict[str, Any] | None:
    """The ``summary.json`` at ``path`` as a dict, or None when it is missing or unreadable
    (a run being resumed, or a folder a new run would write over)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def failure_summary(cfg: DictConfig, err: BaseException) -> dict[str, Any]:
    """The summary of a run that failed before its Trainer ran, from the config alone
    (values whose interpolation fails are None)."""
    strategy = _choice("strategy")
    if strategy is None:
        target = (_safe(cfg, "strategy") or {}).get("_target_")
        strategy = target.rsplit(".", 1)[-1] if isinstance(target, str) else None
    try:
        shape = shape_of(cfg.get("data"), cfg.get("model"))
    except Exception:  # noqa: BLE001 - the shape is only reported here
        shape = shape_of(None)
    summary = {
        "status": status_of(err), "task_name": _safe(cfg, "task_name"), "strategy": strategy,
        "precision": str(_safe(cfg, "precision")),
        "accumulate_grad_batches": _safe(cfg, "accumulate_grad_batches"),
        **_shape_fields(shape), "seed": _safe(cfg, "seed"),
        "torch_version": torch.__version__, "lightning_version": L.__version__,
        "error": error_text(err), "strategy_report": None,
    }
    if summary["status"] == "interrupted":  # as a run stopped while training says it
        summary["signal"] = "SIGINT" if isinstance(err, KeyboardInterrupt) else "SIGTERM"
        summary["error"] = f"stopped by {summary['signal']}"
    return summary


def parameters_of(pl_module: Any) -> dict[str, Any] | None:
    """``{"trainable": n, "total": n}`` parameter elements of the module (tied tensors once),
    plus ``"lora"``: its LoRA settings (``model.lora``) when it trains adapters on a frozen
    network (``pl_module.lora``), else ``None``."""
    if pl_module is None:
        return None
    params = {id(p): p for p in pl_module.parameters()}.values()
    return {"trainable": sum(p.numel() for p in params if p.requires_grad),
            "total": sum(p.numel() for p in params),
            "lora": plain(getattr(pl_module, "lora", None))}


def _plan_of(pl_module: Any, memory: Any) -> dict[str, Any] | None:
    """The plan the run trains with (``strategy=budget`` or ``strategy=plan``; resumed, the
    plan saved in the checkpoint where it was reused), with ``origin`` and this process's
    measured peak beside the predicted one; None for other strategies."""
    plan = getattr(getattr(pl_module, "strategy", None), "plan", None)
    if plan is None or not hasattr(plan, "to_dict"):
        return None
    out = plan.to_dict()
    # planned at start, replayed from a file, or taken from the checkpoint resumed
    out["origin"] = getattr(pl_module.strategy, "origin", None)
    out["measured_peak_bytes"] = getattr(memory, "peak_bytes", None)
    # on CUDA the run measures the allocator (batch and kernel buffers included), on the
    # CPU the tensors (MemTracker), or the allocator's events for compiled code
    # (torch.profiler): each beside the prediction of the same thing
    method = getattr(memory, "peak_method", None)
    allocator = (method == "allocator" if method is not None
                 else getattr(memory, "reserved_bytes", None) is not None)
    out["measured_peak_kind"] = "allocator" if allocator else "tensors"
    predicted = out.get("predicted_allocator_peak_bytes" if allocator
                        else "predicted_peak_bytes")
    measured = out["measured_peak_bytes"]
    out["measured_over_predicted"] = (measured / predicted if predicted and measured
                                      else None)
    return out


def compiled_of(pl_module: Any) -> dict[str, Any] | None:
    """``{"backend", "options", "memory_budget", "graphs"}`` of a network compiled by
    ``compile=true`` (:meth:`remat.models.base.StrategyModule.compile_net`;
    ``memory_budget``: ``compile_memory_budget``, or None), else ``None``."""
    backend = getattr(pl_module, "compile_backend", None)
    if backend is None:
        return None
    return {"backend": backend.backend, "options": options_record(backend.options),
            "memory_budget": backend.memory_budget, "graphs": int(backend.graphs)}


class RunSummary(L.Callback):
    """Writes ``path`` (``summary.json``): ``running`` at train start, ``completed`` at fit
    end, ``interrupted`` (with ``signal``) or ``failed`` (with ``error``) on an exception.

    Keys: ``status``, ``task_name``, ``strategy``, ``precision``,
    ``accumulate_grad_batches``, ``batch_size``, ``size_key`` and ``size`` (px, ``[h, w]`` px
    or tokens; also as ``image_size`` or ``block_size``), ``seed``, ``resumed_from``,
    ``global_step``, ``epochs``, ``metrics`` (last logged values), memory in bytes
    (``peak_memory_bytes``, ``peak_memory_reserved_bytes`` on CUDA,
    ``peak_memory_per_epoch_bytes``, ``peak_memory_measured``: which batches and optimizer
    steps of this process were measured, ``memory_estimate``), ``plan`` (the plan of
    ``strategy=budget``/``plan`` with ``predicted_peak_bytes`` and ``measured_peak_bytes``
    side by side), ``median_step_ms`` (ms),
    throughput per second (``samples_per_s``, ``pixels_per_s`` or ``tokens_per_s``),
    checkpoint paths (``best_model_path``, ``last_model_path``), ``device``,
    ``torch_version``, ``lightning_version``. Values the other callbacks did not provide
    are None.
    """

    def __init__(self, path: str | Path, task_name: str | None = None, seed: int | None = None,
                 resumed_from: str | None = None) -> None:
        self.path = Path(path)
        self.task_name = task_name
        self.seed = seed
        self.resumed_from = resumed_from
        self.summary: dict[str, Any] | None = None
        self._earlier: dict[str, Any] | None = None  # the folder's summary before a resume
        self._trained = True  # whether this fit ran a training batch (reset in setup)

    def build(self, trainer: L.Trainer, pl_module: L.LightningModule | None, status: str,
              exception: BaseException | None = None) -> dict[str, Any]:
        """The summary dict for the trainer's current state."""
        from remat.callbacks.checkpoint import LastCheckpoint
        from remat.callbacks.memory import PeakMemoryMonitor
        from remat.callbacks.report import RunReport
        from remat.callbacks.timing import StepTimeMonitor

        def find(kind: type) -> Any:
            return next((c for c in trainer.callbacks if isinstance(c, kind)), None)

        memory, timing = find(PeakMemoryMonitor), find(StepTimeMonitor)
        report, last = find(RunReport), find(LastCheckpoint)
        best = next((c for c in trainer.checkpoint_callbacks if getattr(c, "monitor", None)),
                    None)
        report_obj = getattr(pl_module, "strategy_report", None)
        shape = shape_of(trainer.datamodule, getattr(pl_module, "hparams", None))
        metrics = {k: _number(v) for k, v in trainer.callback_metrics.items()}
        summary: dict[str, Any] = {
            "status": status,
            "task_name": self.task_name,
            "strategy": getattr(report_obj, "strategy", None),
            "precision": str(trainer.precision),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            **_shape_fields(shape),
            "seed": self.seed,
            "resumed_from": self.resumed_from,
            "torch_version": torch.__version__,
            "lightning_version": L.__version__,
        }
        if exception is not None:
            summary["error"] = error_text(exception)
        if status == "interrupted":
            summary["signal"] = getattr(last, "received_signal", None) or (
                "SIGINT" if isinstance(exception, KeyboardInterrupt) else "SIGTERM")
            # both signals stop through Lightning's SIGTERM path: say which one it was
            summary["error"] = f"stopped by {summary['signal']}"
        summary.update({
            "strategy_report": report_obj.to_dict() if report_obj is not None else None,
            # FSDP2 units and ranks under trainer=fsdp
            "sharding": (pl_module.shard_report.to_dict()
                         if getattr(pl_module, "shard_report", None) is not None else None),
            "device": device_name(pl_module.device) if pl_module is not None else None,
            # compile=true: backend, inductor options, graphs compiled (0: it ran eagerly)
            "compiled": compiled_of(pl_module),
            # a LoRA run: its adapters' elements, of the frozen network's and theirs
            "parameters": parameters_of(pl_module),
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "metrics": {k: v for k, v in sorted(metrics.items()) if v is not None},
            # the highest rank's under DDP/FSDP, each rank's beside it
            "peak_memory_bytes": getattr(memory, "peak_bytes", None),
            "peak_memory_per_rank_bytes": getattr(memory, "rank_peaks_bytes", None),
            "peak_memory_reserved_bytes": getattr(memory, "reserved_bytes", None),
            "peak_memory_per_epoch_bytes": getattr(memory, "epoch_peaks", None),
            "peak_memory_measured": memory.measured() if memory else None,
            "peak_memory_note": memory.note if memory
            else "no PeakMemoryMonitor callback",
            "plan": _plan_of(pl_module, memory),
            "memory_estimate": getattr(report, "estimate", None),
            "memory_estimate_note": getattr(report, "estimate_note", None),
            "median_step_ms": timing.median_ms if timing else None,
            **(timing.throughput() if timing else {"samples_per_s": None}),
            "timed_steps": len(timing.timer.times_ms) if timing and timing.timer else 0,
            "best_model_path": getattr(best, "best_model_path", None) or None,
            "best_model_score": _number(getattr(best, "best_model_score", None)),
            "monitor": getattr(best, "monitor", None),
            "last_model_path": getattr(last, "last_model_path", None) or None,
        })
        if isinstance(exception, SIGTERMException) and last is not None:
            summary["last_model_path"] = str(last.path)  # LastCheckpoint writes it on SIGTERM
        return summary

    def write(self, trainer: L.Trainer, pl_module: L.LightningModule | None, status: str,
              exception: BaseException | None = None) -> dict[str, Any]:
        """Build and write the summary (rank 0 only); never raises for a failed build: the
        file then holds the status and the build error."""
        try:
            summary = self.build(trainer, pl_module, status, exception)
        except Exception as err:  # noqa: BLE001 - the summary of a failing run must exist
            log.exception("summary could not be built")
            summary = {"status": status, "task_name": self.task_name,
                       "error": error_text(exception) if exception else None,
                       "summary_error": error_text(err)}
        self.summary = summary
        if trainer.is_global_zero:
            write_json(self.path, summary)
        return summary

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before anything is written: a resumed run's folder may hold its finished summary
        # (Lightning skips on_train_start when the checkpoint is at the end of training)
        self._earlier = read_summary(self.path) if self.resumed_from else None
        self._trained = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.resumed_from:  # the file ckpt_path=last named; None where it found none
            found = getattr(trainer, "ckpt_path", None)
            self.resumed_from = str(found) if found else None
        self.write(trainer, pl_module, "running")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._trained = True

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        earlier = self._earlier
        if not self._trained and earlier and earlier.get("status") == "completed":
            # resumed from a checkpoint that had already reached the end of training: this
            # fit measured and logged nothing, so the run's own summary stays as it was
            log.warning("nothing to train: %s is already at the end of training (global step "
                        "%d); %s kept as the run wrote it. Raise trainer.max_epochs or "
                        "trainer.max_steps to train on", self.resumed_from,
                        trainer.global_step, self.path)
            self.summary = earlier
            if trainer.is_global_zero:
                write_json(self.path, earlier)
            return
        self.write(trainer, pl_module, "completed")
        if trainer.is_global_zero:  # the other ranks build it but do not write it
            log.info("summary written to %s", self.path)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        self.write(trainer, pl_module, status_of(exception), exception)
