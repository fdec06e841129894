"""Where the Hydra config tree lives, and checks of the top-level ablation keys."""

from __future__ import annotations

import difflib
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from remat.run_shape import PRECISIONS, check_precision

log = logging.getLogger(__name__)

__all__ = ["PRECISIONS", "check_top_level", "config_dir", "per_step_batch", "run_id"]


def config_dir() -> Path:
    """The Hydra config tree: ``$REMAT_CONFIG_DIR`` if set, else the one shipped inside the
    package (``remat/configs/``, so a non-editable ``pip install`` finds it too).

    Raises:
        FileNotFoundError: the folder holds no ``train.yaml`` (a wrong ``REMAT_CONFIG_DIR``,
            or an install that left the package data out).
    """
    env = os.environ.get("REMAT_CONFIG_DIR")
    path = Path(env) if env else Path(__file__).resolve().parent / "configs"
    if not (path / "train.yaml").is_file():
        raise FileNotFoundError(
            f"remat config tree not found at {path} (expected train.yaml there); "
            + ("REMAT_CONFIG_DIR points elsewhere" if env else
               "reinstall remat (pip install remat, or pip install -e . from its repository)")
        )
    return path


def check_top_level(cfg: DictConfig) -> None:
    """Validate ``seed``, ``precision``, ``accumulate_grad_batches``, ``monitor_mode``,
    ``trainer.max_epochs`` / ``max_steps``, ``compile`` and ``compile_options`` before
    anything is built.

    Raises:
        ValueError: ``seed`` not an integer (or null); ``monitor_mode`` not min or max;
            ``trainer.max_epochs`` / ``max_steps`` not an integer >= -1 (-1: no limit, as
            Lightning reads it), or 0 (no training at all); ``trainer.precision`` or
            ``trainer.accumulate_grad_batches`` set apart from the top-level key; a
            ``trainer`` key ``lightning.Trainer`` does not take; precision not one of
            :data:`PRECISIONS`; ``accumulate_grad_batches`` not an int >= 1;
            ``16-mixed`` asked for without a CUDA device; ``compile`` not a boolean, or
            true with ``strategy=compile`` (which compiles its stages itself); bad
            ``compile_options`` (:func:`remat.compiling.check_compile_options`).
    """
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer (or null for a random seed), got {seed!r}")
    mode = cfg.get("monitor_mode", "max")
    if mode not in ("min", "max"):
        raise ValueError(f"monitor_mode must be min or max (the best checkpoint's direction), "
                         f"got {mode!r}")
    for key in ("max_epochs", "max_steps"):
        value = cfg.get("trainer", {}).get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < -1):
            raise ValueError(f"trainer.{key} must be an integer >= -1 (-1: no limit), got "
                             f"{value!r}")
        if value == 0:  # Lightning stops before the first batch and calls the run complete
            raise ValueError(f"trainer.{key}=0 trains nothing: give a positive number, or -1 "
                             "for no limit")
    accelerator = str(cfg.get("trainer", {}).get("accelerator", "auto"))
    check_precision(cfg.get("precision"), accelerator)
    for key, example in (("precision", " | ".join(PRECISIONS)),
                         ("accumulate_grad_batches", "batches per optimizer step")):
        own = cfg.get("trainer", {}).get(key)
        if own is not None and str(own) != str(cfg.get(key)):
            # Lightning would train with trainer.<key> while the estimate, the plan and the
            # report read the top-level key
            raise ValueError(f"trainer.{key}={own!r} differs from {key}={cfg.get(key)!r}: "
                             f"set the top-level key, {key}=<{example}> (trainer.{key} "
                             "follows it)")
    _check_trainer_keys(cfg.get("trainer"))
    acc = cfg.get("accumulate_grad_batches")
    if isinstance(acc, bool) or not isinstance(acc, int) or acc < 1:
        raise ValueError(
            f"accumulate_grad_batches must be an integer >= 1 (batches per optimizer step), "
            f"got {acc!r}"
        )
    from remat.compiling import check_partitioner_budget

    check_partitioner_budget(cfg.get("compile_memory_budget"), "compile_memory_budget")
    compiled = cfg.get("compile", False)
    if not isinstance(compiled, bool):
        raise ValueError(f"compile must be true or false (torch.compile the network after "
                         f"the strategy), got {compiled!r}")
    if compiled:
        from remat.compiling import training_options

        if str(cfg.get("strategy", {}).get("_target_", "")).endswith(".CompileBudget"):
            raise ValueError("compile=true with strategy=compile: that strategy compiles its "
                             "stages itself under strategy.budget; use one or the other")
        options = cfg.get("compile_options")
        training_options(OmegaConf.to_container(options) if isinstance(options, DictConfig)
                         else options)
    else:
        for key in ("compile_options", "compile_memory_budget"):
            if cfg.get(key) is not None:
                log.warning("%s is ignored: compile=false (set compile=true to compile the "
                            "network with it)", key)


def _check_trainer_keys(trainer: Any) -> None:
    """Refuse a ``trainer.<key>`` that ``lightning.Trainer`` does not take (Hydra's
    instantiate error named only ``trainer``), with the closest names it does take."""
    if not isinstance(trainer, DictConfig) or trainer.get("_target_") not in (
            "lightning.Trainer", "lightning.pytorch.Trainer"):
        return
    import inspect

    import lightning

    taken = set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"}
    unknown = sorted(str(k) for k in trainer.keys() if not str(k).startswith("_")
                     and str(k) not in taken)
    if unknown:
        near = {k: difflib.get_close_matches(k, sorted(taken), n=2) for k in unknown}
        hints = "; ".join(f"trainer.{k}" + (f" (did you mean {', '.join(v)}?)" if v else "")
                          for k, v in near.items())
        raise ValueError(f"{hints}: not an argument of lightning.Trainer (see "
                         "https://lightning.ai/docs/pytorch/stable/common/trainer.html)")


def per_step_batch(effective: int, accumulation: int) -> int:
    """``data.batch_size`` for an effective batch of ``effective`` samples per optimizer step
    with ``accumulation`` batches per step (the ``remat.batch_for`` resolver of
    ``configs/sweep/ablation.yaml``).

    Raises:
        ValueError: ``effective`` not divisible by ``accumulation`` (names both keys).
    """
    effective, accumulation = int(effective), int(accumulation)
    if accumulation < 1 or effective % accumulation:
        raise ValueError(f"effective_batch_size={effective} is not divisible by "
                         f"accumulate_grad_batches={accumulation}; pick values whose product "
                         "with data.batch_size is the effective batch")
    return effective // accumulation


def run_id() -> str:
    """A short id that makes a run folder unique: ``$SLURM_JOB_ID`` (with
    ``_$SLURM_ARRAY_TASK_ID`` for array jobs) under SLURM, else 6 random hex digits. The
    ``remat.run_id`` resolver of ``configs/hydra/default.yaml`` caches it, so one config
    gets one id."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"{os.environ.get('SLURM_ARRAY_JOB_ID', job)}_{task}" if task else job
    return secrets.token_hex(3)


def best_saved_at_validation(monitor: Any) -> bool | None:
    """``ModelCheckpoint(save_on_train_epoch_end=...)`` for ``configs/callbacks/
    model_checkpoint.yaml``: ``False`` (save the best checkpoint at the validation end,
    before ``last.ckpt`` is written there, so the best record inside ``last.ckpt`` is
    current) unless ``monitor`` is a training metric (``train/...``), which exists only at
    the train epoch end; then ``None`` (Lightning decides)."""
    return None if str(monitor).startswith("train/") else False


def msd_info(root: Any, key: str) -> Any:
    """``num_classes`` (1 = binary), ``class_names`` or ``in_channels`` of the MSD task at
    ``root`` from its ``dataset.json`` (the ``remat.msd`` resolver of
    ``configs/data/msd.yaml``, so the model config follows the task); defaults (binary,
    ``[background, foreground]``, 1 channel) while ``root`` is unset or holds no readable
    ``dataset.json`` (the datamodule then names the problem)."""
    from remat.data.msd import dataset_info

    return dataset_info(root, str(key))


def color_classes(colors: Any, default: Any) -> Any:
    """``data.num_classes`` of ``data=folder`` (the ``remat.color_classes`` resolver): the
    number of classes ``data.colors`` lists (a list in class order or ``{name: colour}``),
    so ``mask_encoding=colors`` needs no second key; ``default`` without colours."""
    if colors is None or isinstance(colors, str):
        return default
    try:
        return len(colors)
    except TypeError:  # not a list or mapping: the datamodule names the problem
        return default


if not OmegaConf.has_resolver("remat.color_classes"):
    OmegaConf.register_new_resolver("remat.color_classes", color_classes)
if not OmegaConf.has_resolver("remat.msd"):
    OmegaConf.register_new_resolver("remat.msd", msd_info)
if not OmegaConf.has_resolver("remat.best_saved_at_validation"):
    OmegaConf.register_new_resolver("remat.best_saved_at_validation", best_saved_at_validation)
if not OmegaConf.has_resolver("remat.batch_for"):
    OmegaConf.register_new_resolver("remat.batch_for", per_step_batch)
if not OmegaConf.has_resolver("remat.run_id"):
    OmegaConf.register_new_resolver("remat.run_id", run_id, use_cache=True)
