"""Checks shared by the LightningModules and entry points: batch layout, model/data fit,
checkpoint fit and resumed LR schedules."""

from __future__ import annotations

import inspect
import logging
import math
import pickle
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from remat.run_shape import check_spatial_dims

log = logging.getLogger(__name__)

# hyper-parameters whose disagreement makes a checkpoint unusable for a config
MODEL_KEYS = ("arch", "encoder_name", "in_channels", "num_classes", "vocab_size", "block_size",
              "n_layer", "n_head", "n_embd")
_IMAGE_DATA_HINT = "data=synthetic_seg or kvasir_seg"
_TEXT_DATA_HINT = "data=tinyshakespeare or enwik8"


def require_keys(batch: Mapping, keys: Iterable[str], module: str) -> None:
    """Raise a clear error when a batch lacks the keys a module reads.

    Raises:
        KeyError: e.g. a GPT model fed by an image datamodule; names both sides.
    """
    missing = [k for k in keys if not isinstance(batch, Mapping) or k not in batch]
    if missing:
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise KeyError(
            f"{module} needs batches with keys {sorted(keys)} but the datamodule gives {got}; "
            "pick a data config that matches the model ("
            + (f"sequence models: {_TEXT_DATA_HINT})" if "tokens" in keys
               else f"segmentation models: {_IMAGE_DATA_HINT})")
        )


def extend_restored_schedule(trainer: L.Trainer, configured_t_max: Any) -> None:
    """Resuming with a larger ``trainer.max_epochs`` (the README's "train further"), make an
    epoch-based cosine schedule restored from the checkpoint the configured one.

    The checkpoint's ``CosineAnnealingLR`` keeps its ``T_max`` (the first run's epochs):
    past it, torch's cosine climbs back to the base rate and down again every ``T_max``
    epochs (a 1-epoch run resumed to 5 epochs trained at 0.001, 0, 0.001, 0, 0.001; to 2
    epochs, its second epoch at 0). Where the configured ``T_max`` (``model.scheduler.T_max``,
    ``${trainer.max_epochs}`` by default) is larger, it takes its place, and each group's
    rate is set to that cosine's at the current epoch, as if the run had been started with
    it (Loshchilov and Hutter 2017, arXiv 1608.03983, eq. 5 without restarts); logged.
    Where the run goes past a ``T_max`` nobody asked to extend, a warning says so.
    """
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        t_max = getattr(scheduler, "T_max", None)
        if t_max is None or config.interval != "epoch" or not trainer.max_epochs:
            continue
        wanted = configured_t_max if isinstance(configured_t_max, int) else None
        if trainer.ckpt_path and wanted is not None and wanted > t_max \
                and isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR):
            epoch, eta_min = scheduler.last_epoch, scheduler.eta_min
            scheduler.T_max = wanted
            rates = [eta_min + (base - eta_min) * (1 + math.cos(math.pi * min(epoch, wanted)
                                                                / wanted)) / 2
                     for base in scheduler.base_lrs]
            before = [group["lr"] for group in scheduler.optimizer.param_groups]
            for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
                group["lr"] = rate
            log.info("the LR schedule restored from the checkpoint ended after T_max=%d "
                     "epochs; model.scheduler.T_max=%d extends it: epoch %d trains at lr %.3g "
                     "(was %.3g), the %d-epoch cosine's", t_max, wanted, epoch, rates[0],
                     before[0], wanted)
            continue
        if t_max < trainer.max_epochs:
            rank_zero_warn(
                f"the LR schedule's T_max={t_max} epochs is below trainer.max_epochs="
                f"{trainer.max_epochs}: torch's cosine rises again after epoch {t_max} "
                f"(every {t_max} epochs it goes back to the base rate and down); set "
                "model.scheduler.T_max to the epochs the schedule should span"
            )


def _has_attribute(cls: type, obj: Any, name: str) -> bool:
    """Whether ``obj`` exposes ``name``, without evaluating a property (a text datamodule's
    ``vocab_size`` is only known after ``setup``)."""
    return hasattr(cls, name) or name in getattr(obj, "__dict__", {})


def _kind(obj: Any) -> str | None:
    """``"sequence"`` (token ids, ``vocab_size``), ``"segmentation"`` (``num_classes``)."""
    hparams = getattr(obj, "hparams", None)
    names = set(hparams) if isinstance(obj, L.LightningModule) and hparams is not None \
        else {n for n in ("vocab_size", "num_classes") if _has_attribute(type(obj), obj, n)}
    if "vocab_size" in names:
        return "sequence"
    if "num_classes" in names:
        return "segmentation"
    return None


def check_model_fits_data(model: L.LightningModule, datamodule: Any,
                          model_name: str | None = None, data_name: str | None = None) -> None:
    """Raise before training when the model cannot read the datamodule's batches.

    Checks the kinds (segmentation model with ``num_classes`` vs sequence model with
    ``vocab_size``; datamodules expose the same attribute), a 2D network on volumes or a 3D
    one on images (:func:`remat.run_shape.check_spatial_dims`), ``model.num_classes`` against the
    datamodule's ``num_classes`` (1 = binary) and ``model.in_channels`` against the
    datamodule's ``in_channels`` when it has one (every segmentation datamodule: 3, or 1 for
    ``data.image_mode=grey``).
    ``model_name``/``data_name`` are the config choices (``gpt_tiny``, ``dubai_aerial``).

    Raises:
        ValueError: a mismatch, naming the ``model.`` key, the ``data.`` key that sets the
            datamodule's side (``data.image_mode`` for channels) and what would fit.
    """
    model_kind, data_kind = _kind(model), _kind(datamodule)
    m = f"model={model_name}" if model_name else f"model ({type(model).__name__})"
    d = f"data={data_name}" if data_name else f"data ({type(datamodule).__name__})"
    if model_kind and data_kind and model_kind != data_kind:
        hint = _TEXT_DATA_HINT if model_kind == "sequence" else _IMAGE_DATA_HINT
        raise ValueError(
            f"model and data kinds do not match: {m} is a {model_kind} model but {d} gives "
            f"{data_kind} batches; pick {hint} for this model, or a {data_kind} model "
            f"(model={'gpt_tiny' if data_kind == 'sequence' else 'unet_resnet18'})")
    if model_kind != "segmentation" or data_kind != "segmentation":
        return
    check_spatial_dims(model, datamodule, model_name, data_name)  # before channels: 2D vs 3D
    ours, theirs = model.hparams.get("num_classes"), getattr(datamodule, "num_classes", None)
    if isinstance(ours, int) and isinstance(theirs, int) and ours != theirs:
        raise ValueError(
            f"model.num_classes={ours} but {d} serves {theirs} classes (1 = binary); set "
            f"model.num_classes={theirs} (or pick data that matches {m})")
    ours, theirs = model.hparams.get("in_channels"), getattr(datamodule, "in_channels", None)
    if isinstance(ours, int) and isinstance(theirs, int) and ours != theirs:
        raise ValueError(f"model.in_channels={ours} but {d} serves {theirs} image channels"
                         f"{_channels_hint(datamodule, ours)}")
    check_patch_fits_strides(getattr(model, "net", None), getattr(datamodule, "patch_size", None))


def total_stride(strides: Any, dims: int) -> list[int] | None:
    """Per spatial dimension, the product of a network's ``strides`` (MONAI ``DynUNet``:
    ``[1, 2, 2, 2, 2]`` or one ``[d, h, w]`` per level; MONAI ``UNet``: ``(2, 2, 2, 2)``);
    None for anything else."""
    total = [1] * dims
    try:
        for stride in strides:
            per_dim = [int(stride)] * dims if isinstance(stride, int) else [int(v) for v in stride]
            if len(per_dim) != dims:
                return None
            total = [t * v for t, v in zip(total, per_dim, strict=True)]
    except (TypeError, ValueError):
        return None
    return total


def check_patch_fits_strides(net: Any, patch: Any) -> None:
    """Refuse training patches whose sides a strided network cannot halve down and back up
    (MONAI's DynUNet and UNet concatenate skips of mismatched sizes: torch's "Sizes of
    tensors must match" in the sanity validation, ``data.patch_size=[24,24,24]`` on a 5-level
    DynUNet).

    Raises:
        ValueError: names ``data.patch_size``, the network's total stride
            (``model.net.strides``) and the nearest sides that fit.
    """
    strides = getattr(net, "strides", None)
    if strides is None or patch is None or isinstance(strides, int | str):
        return
    sides = [int(patch)] if isinstance(patch, int) else [int(v) for v in patch]
    total = total_stride(strides, len(sides))
    if total is None or not any(side % step for side, step in zip(sides, total, strict=True)):
        return
    fit = [-(-side // step) * step for side, step in zip(sides, total, strict=True)]
    raise ValueError(
        f"data.patch_size={sides}: {type(net).__name__} downsamples each side by {total} "
        f"(model.net.strides), so every side must be a multiple of it; e.g. "
        f"data.patch_size={fit}")


def _channels_hint(datamodule: Any, wanted: int) -> str:
    """How to make the data's channels fit ``model.in_channels=wanted``: the
    ``data.image_mode`` that serves that many, or the model key to change."""
    served = getattr(datamodule, "in_channels", None)
    mode = getattr(datamodule, "image_mode", None)
    if mode is None:
        return f" (it has no data.image_mode); set model.in_channels={served}"
    modes = {1: "grey", 3: "rgb (or grey_rgb for grey data)"}
    other = (f" or data.image_mode={modes[wanted]}" if wanted in modes
             else f" (data.image_mode serves 1 or 3 channels, not {wanted})")
    return f" (data.image_mode={mode}); set model.in_channels={served}{other}"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """``path`` is a sharded checkpoint folder (torch.distributed.checkpoint, written by
    ``trainer=fsdp`` with ``save_distributed_checkpoint: true``)."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def _read_sharded(path: Path, ckpt_path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint's ``meta.pt`` (everything but weights and optimizer state),
    with ``state_dict`` as ``meta`` tensors of the saved full shapes (from the shards'
    ``.metadata``; nothing is loaded)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = path / "meta.pt"
    try:
        ckpt = torch.load(meta, map_location="cpu", weights_only=True) if meta.is_file() else {}
        entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:  # corrupt shards or metadata
        raise ValueError(f"ckpt_path={ckpt_path} could not be read as a sharded checkpoint: "
                         f"{err}") from err
    prefix = "state_dict."
    ckpt["state_dict"] = {
        key[len(prefix):]: torch.empty(tuple(entry.size), dtype=entry.properties.dtype,
                                       device="meta")
        for key, entry in entries.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    return ckpt


def sharded_weights(ckpt_path: str | Path) -> dict[str, torch.Tensor]:
    """The full model ``state_dict`` of a sharded checkpoint folder, gathered on this one
    process (torch.distributed.checkpoint's ``dcp_to_torch_save`` into a temporary file).

    Raises:
        ValueError: the shards could not be read (names ``ckpt_path``).
    """
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "full.pt"
        try:
            dcp_to_torch_save(str(ckpt_path), str(file))
            return torch.load(file, map_location="cpu", weights_only=True)["state_dict"]
        except Exception as err:  # corrupt or partial shards
            raise ValueError(f"ckpt_path={ckpt_path}: the shards could not be gathered: "
                             f"{err}") from err


def check_sharded_resume(ckpt_path: str | Path | None, sharded_trainer: bool) -> None:
    """Refuse a sharded checkpoint for a run that does not shard, saying what to do.

    Raises:
        ValueError: names ``ckpt_path`` and the two ways to resume it.
    """
    if ckpt_path is None or sharded_trainer or not is_sharded_checkpoint(ckpt_path):
        return
    raise ValueError(
        f"ckpt_path={ckpt_path} is a sharded checkpoint (one shard per rank, written by "
        "trainer=fsdp with save_distributed_checkpoint: true), and this run does not shard. "
        "Resume it with trainer=fsdp on any number of processes (trainer.devices=1 for one; "
        "the shards are redistributed), or save full checkpoints "
        "(trainer.strategy.save_distributed_checkpoint=false), which any trainer resumes")


def restore_datamodule_state(datamodule: Any, ckpt: dict[str, Any]) -> None:
    """Give ``datamodule`` what its class kept in the checkpoint (Lightning saves a
    datamodule's ``state_dict`` under its class name), as a resumed fit does: for eval and
    predict, which load the weights themselves (a folder dataset: how ``data.normalize=auto``
    normalised the training images)."""
    datamodule.load_state_dict(ckpt.get(type(datamodule).__qualname__) or {})


def read_checkpoint(ckpt_path: str | Path) -> dict[str, Any]:
    """Read a Lightning checkpoint (on CPU) with ``torch.load(weights_only=True)`` and check
    it is one.

    ``weights_only=True`` unpickles only tensors and plain containers, so a checkpoint cannot
    run code when it is read; remat's checkpoints hold nothing else (hyper-parameters are
    plain dicts, lists and scalars).

    A sharded checkpoint folder (``trainer=fsdp``) is read from its ``meta.pt`` and shard
    metadata: ``state_dict`` then holds ``meta`` tensors of the saved shapes.

    Raises:
        FileNotFoundError: ``ckpt_path`` does not exist.
        ValueError: the file is not a torch file, holds objects ``weights_only`` refuses (the
            message keeps torch's note of which), or has no ``state_dict`` entry.
    """
    path = Path(ckpt_path)
    if is_sharded_checkpoint(path):
        return _read_sharded(path, ckpt_path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.ckpt"))
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path} is a folder, not a checkpoint file (expected a Lightning "
            "checkpoint such as <run dir>/checkpoints/last.ckpt)"
            + (f"; it holds {', '.join(inside[:5])}" if inside else ""))
    if not path.is_file():
        # a run killed while writing its first last.ckpt has others beside it (the epoch's)
        others = sorted(p.name for p in path.parent.glob("*.ckpt")) if path.parent.is_dir() \
            else []
        beside = (f"; {path.parent} holds {', '.join(others[:5])}" if others else "")
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such file (expected a Lightning "
                                f"checkpoint such as <run dir>/checkpoints/last.ckpt){beside}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for a corrupt/foreign file
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
            raise ValueError(f"ckpt_path={ckpt_path} is not a checkpoint: torch.save writes a "
                             "zip archive and this file is none (a text file, a download's "
                             "error page, or a copy cut short?)") from err
        if isinstance(err, pickle.UnpicklingError):  # a global weights_only does not allow
            raise ValueError(f"ckpt_path={ckpt_path} holds objects that torch.load("
                             f"weights_only=True) refuses to unpickle: {err}") from err
        raise ValueError(f"ckpt_path={ckpt_path} could not be read as a torch checkpoint "
                         f"({type(err).__name__}: {err})") from err
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"ckpt_path={ckpt_path} is not a Lightning checkpoint (no "
                         "'state_dict' entry)")
    return ckpt


def check_checkpoint_fits(model: torch.nn.Module, ckpt: Mapping[str, Any],
                          ckpt_path: str | Path) -> None:
    """Raise one clear error when a checkpoint's hyper-parameters (:data:`MODEL_KEYS`) or
    ``state_dict`` keys/shapes differ from ``model``'s (first 5 of each listed).

    Raises:
        ValueError: names ``ckpt_path`` and the differing ``model.`` keys or tensor shapes.
    """
    hparams = ckpt.get("hyper_parameters") or {}
    ours = getattr(model, "hparams", {})
    differ = [f"{k}: checkpoint {hparams[k]!r}, config {ours[k]!r}" for k in MODEL_KEYS
              if k in hparams and k in ours and hparams[k] != ours[k]]
    if differ:
        raise ValueError(f"ckpt_path={ckpt_path} was trained with another model than the "
                         f"config asks for (model.{'; model.'.join(differ)})")
    state, theirs = model.state_dict(), ckpt["state_dict"]
    missing = sorted(set(state) - set(theirs))
    unexpected = sorted(set(theirs) - set(state))
    shapes = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(state[k].shape)}"
              for k, v in theirs.items()
              if k in state and hasattr(v, "shape") and v.shape != state[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(
            f"ckpt_path={ckpt_path} does not fit the configured model: "
            f"{len(missing)} missing keys {missing[:5]}, {len(unexpected)} unexpected keys "
            f"{unexpected[:5]}, {len(shapes)} shape mismatches {shapes[:5]}")


def check_monitor(cfg: Any, model: Any) -> None:
    """Refuse, before Lightning starts, a ``monitor`` the model does not log in validation
    (``monitor=val/dice`` on a multi-class model, which logs ``val/miou``): it failed after
    the sanity check with a traceback. Models without ``validation_keys()``, ``train/``
    keys and per-class ``val/iou_<name>`` keys (named from the data at setup) are left to
    :class:`remat.callbacks.MonitorCheck`.

    Raises:
        ValueError: names ``monitor``, the keys the model logs and the key to use.
    """
    keys = getattr(model, "validation_keys", None)
    monitor = str(cfg.get("monitor") or "")
    if not callable(keys) or not monitor.startswith("val/") or monitor.startswith("val/iou_"):
        return
    logged = list(keys())
    if monitor in logged:
        return
    best = next((k for k in ("val/miou", "val/dice") if k in logged), "val/loss")
    raise ValueError(
        f"monitor={monitor} is not among the metrics this model logs in validation "
        f"({', '.join(logged)}); set monitor={best} monitor_mode="
        f"{'min' if best == 'val/loss' else 'max'}")


def check_optimizer_settings(model: Any) -> None:
    """Build the model's optimizer once over a stand-in parameter, before Lightning starts:
    a bad setting (``model.optimizer.lr=abc``, ``lr=-1``) failed inside Lightning's
    ``configure_optimizers`` with the optimizer's own traceback.

    Raises:
        ValueError: names ``model.optimizer`` and the optimizer's message.
    """
    factory = getattr(model, "optimizer_factory", None)
    if not callable(factory):
        return
    try:
        factory(params=[torch.nn.Parameter(torch.zeros(1))])
    except (TypeError, ValueError) as err:
        raise ValueError(f"model.optimizer: {type(err).__name__}: {err}") from err
    except Exception:  # noqa: BLE001 - e.g. an optimizer that wants CUDA tensors: its own
        return  # check, with the real parameters, in configure_optimizers


def check_lora_supported(model_cfg: Any) -> None:
    """Refuse ``model.lora`` for a model class that does not train LoRA adapters (its
    ``__init__`` takes no ``lora``), before it is built.

    Raises:
        ValueError: naming ``model.lora``, the class and where LoRA is supported.
    """
    if not isinstance(model_cfg, Mapping) or model_cfg.get("lora") is None:
        return
    from hydra.utils import get_class

    target = get_class(str(model_cfg.get("_target_")))
    if "lora" not in inspect.signature(target.__init__).parameters:
        raise ValueError(f"model.lora: {target.__name__} (model._target_="
                         f"{model_cfg.get('_target_')}) does not train LoRA adapters; LoRA "
                         "is for the sequence models (model=hf_llama, gpt_*): see "
                         "docs/fine-tuning-lora.md")
