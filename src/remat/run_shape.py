"""The shape of a run, resolved in one place: which size key applies, precision and device.

Every entry point (train, bench, estimate, eval) and the callbacks ask this module:

* **size key**: a sequence model (its config has ``block_size``) reads ``data.block_size``
  (tokens; falling back to ``model.block_size``); an image model reads ``data.image_size``
  (px; resized sets), else ``data.patch_size`` (px; random training crops of large tiles).
  An image size is an int (square side) or ``[h, w]``; a square ``[s, s]`` is the int ``s``.
  A volume size (3D models, ``data=msd``) is ``[d, h, w]`` (voxels), kept as a triple.
* **precision**: one of :data:`PRECISIONS`; ``16-mixed`` needs CUDA.
* **device**: ``auto`` is ``cuda`` where a CUDA driver is present, else ``cpu``.

No Lightning imports; values come from an OmegaConf config or from a datamodule's attributes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")
# precisions whose autocast the memory tracer and the benchmark reproduce
TRACED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
IMAGE_KEYS = ("image_size", "patch_size")
SEQUENCE_KEY = "block_size"

Size = int | tuple[int, int] | tuple[int, int, int]


def plain(value: Any) -> Any:
    """An OmegaConf container as plain Python (lists, dicts); anything else unchanged."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_size(value: Any, key: str) -> Size:
    """An image side or ``[h, w]`` (px), a volume size ``[d, h, w]`` (voxels), or a sequence
    length (tokens), checked.

    Args:
        value: the config value (int, list/tuple/ListConfig of two or three ints).
        key: its config key, e.g. ``data.image_size``; ``[h, w]`` and ``[d, h, w]`` are
            accepted for image keys.

    Returns:
        an int, ``(h, w)`` for a non-square image size (a square pair gives its side), or
        ``(d, h, w)`` for a volume (always a triple, so a cube stays 3D).

    Raises:
        ValueError: not an integer >= 1 (or, for image keys, a pair of them); names ``key``.
    """
    value = plain(value)
    image = key.rsplit(".", 1)[-1] in IMAGE_KEYS
    if image and isinstance(value, Sequence) and not isinstance(value, str):
        pair = tuple(value)
        if len(pair) == 2 and all(_is_int(v) and v >= 1 for v in pair):
            return pair[0] if pair[0] == pair[1] else (int(pair[0]), int(pair[1]))
        if len(pair) == 3 and all(_is_int(v) and v >= 1 for v in pair):
            return (int(pair[0]), int(pair[1]), int(pair[2]))
    elif _is_int(value) and value >= 1:
        return int(value)
    expected = "an integer >= 1" + (" or [h, w] (px) or [d, h, w] (voxels)" if image else "")
    raise ValueError(f"{key} must be {expected}, got {value!r}")


def size_elements(size: Size) -> int:
    """Pixels of an image size (``s * s`` or ``h * w``), voxels of a volume (``d * h * w``);
    a sequence length as it is."""
    return math.prod(size) if isinstance(size, tuple) else size


@dataclass(frozen=True)
class RunShape:
    """What one training batch looks like: ``batch_size`` samples of ``size`` (px side,
    ``(h, w)`` px, or tokens), read from ``size_key`` (``data.image_size``,
    ``data.patch_size``, ``data.block_size`` or ``model.block_size``). Fields are None when
    the config or datamodule does not say (e.g. a failed interpolation)."""

    batch_size: int | None
    size: Size | None
    size_key: str | None

    @property
    def kind(self) -> str | None:
        """``"sequence"`` (tokens), ``"image"`` (pixels), or None."""
        if self.size_key is None:
            return None
        return "sequence" if self.size_key.endswith(SEQUENCE_KEY) else "image"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``batch_size``, ``size`` (int or ``[h, w]``), ``size_key``."""
        size = list(self.size) if isinstance(self.size, tuple) else self.size
        return {"batch_size": self.batch_size, "size": size, "size_key": self.size_key}


def _get(node: Any, key: str) -> Any:
    """``node[key]`` for configs, mappings and objects; None when absent or when resolving
    it raises (a failing interpolation such as ``${remat.batch_for:...}``)."""
    if node is None:
        return None
    try:
        if isinstance(node, DictConfig | Mapping):
            return node.get(key)
        return getattr(node, key, None)
    except Exception:  # noqa: BLE001 - omegaconf raises several types for a failing resolver
        return None


def is_sequence_model(model_cfg: Any) -> bool:
    """Whether a model config (or module hparams) describes a sequence model: it has
    ``block_size``."""
    try:
        return model_cfg is not None and "block_size" in model_cfg
    except TypeError:
        return False


def size_key_of(data: Any, model_cfg: Any = None) -> str | None:
    """The size key that applies (``data.block_size``, ``model.block_size``,
    ``data.image_size`` or ``data.patch_size``), or None when none is set.

    ``data`` is the data config or a datamodule; ``model_cfg`` (optional) the model config,
    whose ``block_size`` makes it a sequence model."""
    if is_sequence_model(model_cfg) or (model_cfg is None and _get(data, SEQUENCE_KEY)
                                        is not None):
        if _get(data, SEQUENCE_KEY) is not None:
            return f"data.{SEQUENCE_KEY}"
        return f"model.{SEQUENCE_KEY}" if model_cfg is not None else None
    for key in IMAGE_KEYS:
        if _get(data, key) is not None:
            return f"data.{key}"
    return None


def shape_of(data: Any, model_cfg: Any = None, strict: bool = False) -> RunShape:
    """The :class:`RunShape` of a data config or datamodule (plus the model config, for the
    ``model.block_size`` fallback and the sequence/image decision).

    Args:
        strict: raise on a bad value instead of recording None (entry points that need the
            number use ``strict=True``; summaries of failed runs use the default).

    Raises:
        ValueError: with ``strict``, a missing size or a size or batch size that is not an
            integer >= 1 (or ``[h, w]`` for image keys); the message names the key.
    """
    key = size_key_of(data, model_cfg)
    raw = None
    if key is not None:
        node = model_cfg if key.startswith("model.") else data
        raw = _get(node, key.split(".", 1)[1])
    batch = _get(data, "batch_size")
    try:
        size = normalize_size(raw, key) if key is not None else None
        batch = normalize_size(batch, "data.batch_size") if batch is not None else None
    except ValueError:
        if strict:
            raise
        size = raw if _is_int(raw) else None
        batch = batch if _is_int(batch) else None
    if strict and key is None:
        raise ValueError("no input size: set data.image_size or data.patch_size (image models, "
                         "px) or data.block_size (sequence models, tokens)")
    if strict and batch is None:
        raise ValueError("data.batch_size must be an integer >= 1, got None")
    return RunShape(batch, size, key)


def _spatial_dims_of_model(model: Any) -> int | None:
    """2 or 3: the spatial dimensions a segmentation model (config or module) takes, its
    ``spatial_dims`` (default 2); None for sequence models and models that do not say."""
    if model is None or is_sequence_model(model):
        return None
    # keys present, not resolved: data=msd's num_classes reads data.root's dataset.json
    is_config = isinstance(model, DictConfig | Mapping)
    if not any((k in model) if is_config else hasattr(model, k)
               for k in ("spatial_dims", "num_classes")):
        return None  # not a segmentation model
    dims = _get(model, "spatial_dims")
    if dims is None:
        return 2
    return dims if dims in (2, 3) else None  # another value: SegmentationModule names it


def _spatial_dims_of_data(data: Any) -> tuple[int, str, Any] | None:
    """``(dims, size_key, size)`` of an image/volume data config or datamodule: 3 for a
    ``[d, h, w]`` size (volumes), 2 for a side or ``[h, w]`` (images); None for sequence
    data or a size that is unset or not valid (its own check names it)."""
    shape = shape_of(data)
    if shape.kind != "image" or shape.size is None:
        return None
    size = shape.size
    dims = 3 if isinstance(size, tuple) and len(size) == 3 else 2
    return dims, shape.size_key, list(size) if isinstance(size, tuple) else size


def _named(group: str, name: str | None, node: Any) -> str:
    """``model=unet_resnet18`` (given, or Hydra's choice for a config node), else
    ``model (SegmentationModule)``."""
    if not name and isinstance(node, DictConfig):
        try:
            from hydra.core.hydra_config import HydraConfig

            name = HydraConfig.get().runtime.choices.get(group)
        except ValueError:  # no Hydra app around this call
            name = None
    if name:
        return f"{group}={name}"
    target = _get(node, "_target_")
    return f"{group} ({str(target).rsplit('.', 1)[-1] if target else type(node).__name__})"


def check_spatial_dims(model: Any, data: Any, model_name: str | None = None,
                       data_name: str | None = None) -> None:
    """Refuse a 3D network (``model.spatial_dims=3``) on 2D images, or a 2D one on volumes
    (a ``[d, h, w]`` ``data.patch_size``), before any data is read or a model is built; both
    failed mid-step with torch's convolution error.

    Args:
        model, data: the ``model`` and ``data`` config nodes, or the module and datamodule.
        model_name, data_name: the config choices (``monai_unet3d``, ``synthetic_seg``).

    Raises:
        ValueError: names ``model=``, ``model.spatial_dims``, ``data=`` and its size key and
            says which data or model fits.
    """
    model_dims, served = _spatial_dims_of_model(model), _spatial_dims_of_data(data)
    if model_dims is None or served is None or model_dims == served[0]:
        return
    dims, key, size = served
    m, d = _named("model", model_name, model), _named("data", data_name, data)
    if model_dims == 3 and key == "data.patch_size" and isinstance(size, int):
        # one side: as 2D data has it, but also a volume data config given a cube's side
        raise ValueError(
            f"{m} is a 3D network (model.spatial_dims=3) but {key}={size} is one side (2D "
            f"patches); volumes (data=msd, data=volumes) take {key}=[d, h, w] voxels, e.g. "
            f"'{key}=[{size},{size},{size}]'")
    if model_dims == 3:
        raise ValueError(
            f"{m} is a 3D network (model.spatial_dims=3) but {d} serves 2D images "
            f"({key}={size}); a 3D network needs volumes [d, h, w]: use data=msd or "
            f"data=volumes (with data.root), or a 2D model (e.g. model=unet_resnet18)")
    raise ValueError(
        f"{m} is a 2D network (model.spatial_dims=2) but {d} serves 3D volumes "
        f"({key}={size}); use a 3D model for volumes (e.g. model=monai_unet3d, or "
        f"model.spatial_dims=3 with a 3D model.net), or 2D image data (e.g. data=folder)")


def check_precision(precision: Any, accelerator: str = "auto",
                    allowed: Sequence[str] = PRECISIONS, who: str = "precision") -> str:
    """``precision`` as a string, checked against ``allowed``.

    Raises:
        ValueError: not one of ``allowed``; ``16-mixed`` without a CUDA device (or with
            ``accelerator=cpu``); the message names ``who`` (e.g. ``precision``).
    """
    value = "32-true" if str(precision) == "32" else str(precision)
    if value not in allowed:
        raise ValueError(f"{who}={value!r} is not supported; use one of: {', '.join(allowed)}")
    if value == "16-mixed" and (str(accelerator) == "cpu" or not torch.cuda.is_available()):
        raise ValueError(f"{who}=16-mixed needs a CUDA device (float16 autocast with a gradient "
                         "scaler); on CPU use precision=bf16-mixed")
    return value


def resolve_device(device: Any = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when a CUDA driver is present, else ``cpu``; others as given.

    Raises:
        ValueError: an unknown device string, or a CUDA device asked for on a machine without
            CUDA.
    """
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device={name!r} is not a torch device (auto, cpu, cuda, cuda:1, "
                         f"...): {err}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name}: no CUDA driver on this machine; use device=cpu or auto")
    return dev


@dataclass(frozen=True)
class Sharding:
    """How a run shards its network: ``world_size`` FSDP2 ranks, whether each unit's
    parameters are freed after its forward (ZeRO-3) or kept (ZeRO-2), and whether FSDP2
    runs at all (``fsdp``: also over one rank, where each unit is still gathered while it
    runs; by default whenever ``world_size > 1``)."""

    world_size: int = 1
    reshard_after_forward: bool = True
    fsdp: bool | None = None

    def __post_init__(self) -> None:
        if self.fsdp is None:  # a frozen dataclass: set once, here
            object.__setattr__(self, "fsdp", self.world_size > 1)


def trains_sharded(cfg: Any, remat_only: bool = False) -> bool:
    """``cfg.trainer.strategy`` is Lightning's ``ModelParallelStrategy`` (FSDP2), or, with
    ``remat_only``, remat's subclass of it (``trainer=fsdp``)."""
    strategy = _get(_get(cfg, "trainer"), "strategy")
    target = (str(_get(strategy, "_target_") or "")
              if isinstance(strategy, Mapping | DictConfig) else "")
    names = ("FSDP2Strategy",) if remat_only else ("FSDP2Strategy", "ModelParallelStrategy")
    return target.endswith(names)


def sharding_of(cfg: Any) -> Sharding:
    """The sharding of a composed config.

    ``remat.estimate`` and ``remat.plan`` read their top-level ``world_size`` (set: FSDP2
    over that many ranks, one included) and ``reshard_after_forward``; a training config
    (``world_size`` unset) shards when ``trainer.strategy`` is remat's ``FSDP2Strategy``
    (``trainer=fsdp``), over ``trainer.devices x trainer.num_nodes`` ranks, one included.

    Raises:
        ValueError: ``world_size`` is not a positive integer, or ``trainer=fsdp`` with
            ``trainer.devices`` that is not a number of processes (names the key).
    """
    if _get(cfg, "world_size") is not None:
        world = normalize_size(_get(cfg, "world_size"), "world_size")
        if not isinstance(world, int):
            raise ValueError(f"world_size: expected a positive integer (ranks), got "
                             f"{_get(cfg, 'world_size')!r}")
        return Sharding(world, _flag(_get(cfg, "reshard_after_forward"),
                                     "reshard_after_forward"), fsdp=True)
    trainer = _get(cfg, "trainer")
    strategy = _get(trainer, "strategy") if trainer is not None else None
    if not trains_sharded(cfg, remat_only=True):
        return Sharding()
    devices, nodes = _get(trainer, "devices"), _get(trainer, "num_nodes")
    nodes = 1 if nodes is None else nodes
    if not _is_int(devices) or not _is_int(nodes) or int(devices) < 1 or int(nodes) < 1:
        raise ValueError(f"trainer=fsdp: trainer.devices={devices!r} and trainer.num_nodes="
                         f"{nodes!r} must be numbers of processes per node and of nodes, so "
                         "the memory of one rank can be planned")
    return Sharding(int(devices) * int(nodes),
                    _flag(_get(strategy, "reshard_after_forward"),
                          "trainer.strategy.reshard_after_forward"), fsdp=True)


def _flag(value: Any, key: str) -> bool:
    """A bool config value (``None``: the default, True).

    Raises:
        ValueError: anything else (names ``key``).
    """
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    return value
