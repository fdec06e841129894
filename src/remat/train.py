"""Training entry point: ``python train.py ...`` or ``python -m remat.train ...``.

``train(cfg)`` is a plain function (the tests call it with a composed config); ``main`` is
the thin Hydra wrapper around it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import traceback
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from remat.callbacks import PeakMemoryMonitor, RunReport, StepTimeMonitor
from remat.config import check_top_level, config_dir
from remat.measure import device_name
from remat.models.checks import check_checkpoint_fits, check_model_fits_data, read_checkpoint

log = logging.getLogger(__name__)


def _instantiate_group(group: DictConfig | None, kind: str) -> list[Any]:
    """Instantiate every ``_target_`` entry of a callbacks/logger group (a dict of configs)."""
    if not group:
        return []
    if not isinstance(group, DictConfig):
        raise TypeError(f"{kind} config must be a mapping of name -> config, got {type(group)}")
    return [instantiate(conf) for _, conf in group.items()
            if isinstance(conf, DictConfig) and "_target_" in conf]


def _to_number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu()
        value = value.item() if value.numel() == 1 else None
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    return None


def _safe_get(node: Any, key: str) -> Any:
    """``node.get(key)``, or None when the value cannot be resolved (e.g. a failing
    interpolation such as ``${remat.batch_for:...}``), so a failed run still gets a summary."""
    try:
        return node.get(key) if node is not None else None
    except Exception:  # omegaconf raises several types for a failing interpolation/resolver
        return None


def _choice(group: str) -> str | None:
    """The config group option chosen (``model=gpt_tiny`` -> ``gpt_tiny``), if under Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get(group)
    except ValueError:  # no Hydra app around this call
        return None


def _strategy_choice(cfg: DictConfig) -> str | None:
    """The strategy named on the command line / in the defaults, for runs that failed early."""
    choice = _choice("strategy")
    if choice is not None:
        return choice
    strategy = _safe_get(cfg, "strategy")
    target = _safe_get(strategy, "_target_") if strategy else None
    return target.rsplit(".", 1)[-1] if isinstance(target, str) else None


def _error_text(err: BaseException) -> str:
    """One-line-first error text for ``summary.json``; a failing interpolation gives its key
    and the resolver's own error (``data.batch_size: ValueError: ...``), not omegaconf's
    wrapper."""
    text = "".join(traceback.format_exception_only(err)).strip()
    if isinstance(err, InterpolationResolutionError):
        msg = str(getattr(err, "msg", "") or "")
        match = re.match(r"(\w+) raised while resolving interpolation: (.*)", msg, re.S)
        if match:
            key = getattr(err, "full_key", None)
            cause = f"{match.group(1)}: {match.group(2)}"
            text = f"{key}: {cause}" if key else cause
    return text


class MonitorCheck(L.Callback):
    """Raise after the first validation (the sanity check included) when a checkpoint
    callback's ``monitor`` key was not logged, instead of Lightning's error after an epoch.

    Raises:
        ValueError: names ``monitor`` and lists the logged ``val/`` keys.
    """

    def __init__(self) -> None:
        self.done = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.done:
            return
        self.done = True
        logged = set(trainer.callback_metrics)
        for cb in trainer.checkpoint_callbacks:
            key = getattr(cb, "monitor", None)
            # only validation keys exist this early (train/... appear after an epoch)
            if key and key.startswith("val/") and key not in logged:
                available = sorted(k for k in logged if k.startswith("val/"))
                raise ValueError(
                    f"monitor={key} is not among the metrics this model logs in validation; "
                    f"available val/ keys: {', '.join(available) or 'none'} (set monitor= and "
                    "monitor_mode= to one of them, e.g. monitor=val/loss monitor_mode=min)")


def build_summary(cfg: DictConfig, trainer: L.Trainer | None, model: Any,
                  status: str, error: str | None = None) -> dict[str, Any]:
    """The content of ``summary.json``: what ran, what it reached, what it cost.

    Memory in bytes (``peak_memory_bytes``, ``peak_memory_reserved_bytes`` on CUDA,
    ``peak_memory_per_epoch_bytes``, ``memory_estimate`` from :class:`RunReport`), time in
    milliseconds (``median_step_ms``), throughput per second of training batches
    (``samples_per_s``, ``pixels_per_s`` or ``tokens_per_s``: counted in the timed batches,
    per median step time).
    Keys whose config value cannot be resolved (a failing interpolation) are None.
    """
    data = _safe_get(cfg, "data")
    summary: dict[str, Any] = {
        "status": status,
        "task_name": _safe_get(cfg, "task_name"),
        "strategy": getattr(getattr(model, "strategy_report", None), "strategy", None)
        or _strategy_choice(cfg),
        "precision": str(_safe_get(cfg, "precision")),
        "accumulate_grad_batches": _safe_get(cfg, "accumulate_grad_batches"),
        "batch_size": _safe_get(data, "batch_size"),
        "image_size": _safe_get(data, "image_size"),
        "block_size": _safe_get(data, "block_size"),
        "seed": _safe_get(cfg, "seed"),
        "torch_version": torch.__version__,
        "lightning_version": L.__version__,
    }
    if error:
        summary["error"] = error
    report = getattr(model, "strategy_report", None)
    summary["strategy_report"] = report.to_dict() if report is not None else None
    if trainer is None:
        return summary
    memory = next((c for c in trainer.callbacks if isinstance(c, PeakMemoryMonitor)), None)
    timing = next((c for c in trainer.callbacks if isinstance(c, StepTimeMonitor)), None)
    report_cb = next((c for c in trainer.callbacks if isinstance(c, RunReport)), None)
    metrics = {k: _to_number(v) for k, v in trainer.callback_metrics.items()}
    ckpt = trainer.checkpoint_callback
    summary.update({
        "device": device_name(model.device) if model is not None else None,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "metrics": {k: v for k, v in sorted(metrics.items()) if v is not None},
        "peak_memory_bytes": memory.peak_bytes if memory else None,
        "peak_memory_reserved_bytes": getattr(memory, "reserved_bytes", None),
        "peak_memory_per_epoch_bytes": getattr(memory, "epoch_peaks", None),
        "memory_estimate": getattr(report_cb, "estimate", None),
        "memory_estimate_note": getattr(report_cb, "estimate_note", None),
        "peak_memory_note": memory.skipped_reason if memory else "no PeakMemoryMonitor callback",
        "median_step_ms": timing.median_ms if timing else None,
        **(timing.throughput() if timing else {"samples_per_s": None}),
        "timed_steps": len(timing.timer.times_ms) if timing and timing.timer else 0,
        "best_model_path": getattr(ckpt, "best_model_path", None) or None,
        "best_model_score": _to_number(getattr(ckpt, "best_model_score", None)),
        "monitor": getattr(ckpt, "monitor", None),
        "last_model_path": getattr(ckpt, "last_model_path", None) or None,
    })
    return summary


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train the configured model; return (and write) the run summary.

    Writes into ``cfg.paths.output_dir``: ``config.yaml`` (resolved), CSV logs,
    ``checkpoints/last.ckpt`` and the best checkpoint by ``cfg.monitor``, ``summary.json``.
    A run that raises still writes ``summary.json`` with ``status: failed`` and the error.

    Raises:
        ValueError: bad top-level keys (``seed``, ``precision``, ``accumulate_grad_batches``),
            a model that does not fit the data (kinds, ``num_classes``, ``in_channels``), a
            ``ckpt_path`` of another model, a ``monitor`` key not logged in validation (after
            the first validation), or any error of the data, model or strategy configs.
    """
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = model = None
    try:
        check_top_level(cfg)
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)
        L.seed_everything(cfg.seed, workers=True)
        datamodule = instantiate(cfg.data)
        strategy = instantiate(cfg.strategy)
        model = instantiate(cfg.model, strategy=strategy)
        check_model_fits_data(model, datamodule, _choice("model"), _choice("data"))
        ckpt_path = cfg.get("ckpt_path")
        if ckpt_path and str(ckpt_path) not in ("last", "best", "hpc", "registry"):
            check_checkpoint_fits(model, read_checkpoint(ckpt_path), ckpt_path)
        callbacks = [*_instantiate_group(cfg.get("callbacks"), "callbacks"), MonitorCheck()]
        trainer = instantiate(cfg.trainer, callbacks=callbacks,
                              logger=_instantiate_group(cfg.get("logger"), "logger") or False)
        trainer.fit(model=model, datamodule=datamodule, ckpt_path=ckpt_path)
    except BaseException as err:
        summary = build_summary(cfg, trainer, model, "failed", _error_text(err))
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        raise
    summary = build_summary(cfg, trainer, model, "completed")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("summary written to %s", out / "summary.json")
    return summary


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Hydra app; returns the monitored metric's best value (for sweepers)."""
    summary = train(cfg)
    return summary.get("best_model_score")


if __name__ == "__main__":
    main()
