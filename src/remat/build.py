"""Model building from a composed config, shared by every entry point that builds a model
without a Trainer (``remat.estimate``, ``remat.plan``, a ``strategy=budget`` training run's
planner, the GPU check scripts).

:func:`build_from_config` checks the run's sizes and precision once, imports the
``_target_`` of the ``strategy`` and ``model`` groups (so forked trace workers do not), and
returns a :class:`ModelBuilder` that instantiates the model for one training step: the
scheduler is dropped (its ``${trainer...}`` interpolations need no trainer) and a sequence
model's positions cover the sequence. Errors name the config key or group, not the entry
point that asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from remat import run_shape
from remat.errors import user_error
from remat.models.checks import check_lora_supported

#: The largest element count a tensor may have (torch indexes elements with int64).
INT64_MAX = 2**63 - 1


def check_sizes(batch_size: Any, size: Any, size_key: str, channels: int = 1
                ) -> tuple[int, int | tuple[int, int]]:
    """Validate ``data.batch_size`` and the size key; the input tensor must fit int64.

    Args:
        batch_size, size: the config values; ``size`` is an image side (px), an image size
            ``[h, w]`` (px; see :func:`remat.run_shape.normalize_size`) or a sequence length
            (tokens), named by ``size_key`` (e.g. ``data.image_size``).
        channels: input channels (images: ``h * w`` pixels each).

    Returns:
        ``(batch_size, size)``, a ``[h, w]`` size as a tuple (a square one as an int).

    Raises:
        ValueError: not an integer >= 1 (or a pair of them for image sizes), or the input's
            element count overflows int64; the message names the key.
    """
    batch_size = run_shape.normalize_size(batch_size, "data.batch_size")
    size = run_shape.normalize_size(size, size_key)
    numel = batch_size * channels * run_shape.size_elements(size)
    if numel > INT64_MAX:
        raise ValueError(f"{size_key}={size} with data.batch_size={batch_size} gives an input "
                         f"of {numel:.3e} elements, more than int64 can index "
                         f"({INT64_MAX:.3e}); use a smaller {size_key}")
    return batch_size, size


@dataclass
class ModelBuilder:
    """Builds the configured model for one training step (no Trainer, no scheduler).

    Calling it instantiates ``strategy`` (the ``strategy`` group) and the model with it;
    :meth:`with_strategy` builds the model with a given strategy object instead (the
    planner's traces, the fixed points of ``remat.plan``).

    Attributes:
        strategy: the ``strategy`` config node.
        model: the ``model`` config node, scheduler dropped (and ``block_size`` raised to
            the sequence length where it was shorter).
    """

    strategy: DictConfig
    model: DictConfig

    def __call__(self) -> nn.Module:
        """The model with the configured strategy.

        Raises:
            ValueError: the ``strategy`` or ``model`` group fails to build (naming the group
                and its ``_target_``).
        """
        try:
            strategy = instantiate(self.strategy)
        except InstantiationException as err:
            shown = user_error(err)  # a module that cannot be imported, an argument the
            if shown is not None and shown is not err:  # strategy does not take: one line
                raise shown from err
            raise ValueError(f"config group 'strategy' failed to build "
                             f"({self.strategy.get('_target_')}): {err}") from err
        return self.with_strategy(strategy)

    def with_strategy(self, strategy: Any, stages: Any = None) -> nn.Module:
        """The model with ``strategy`` (a strategy object) on ``stages`` (default: the
        config's ``model.stages``).

        Raises:
            ImportError: a ``_target_`` in it cannot be imported (naming its key and the fix,
                :func:`remat.errors.unimportable_target`).
            remat.strategies.StageError: the stages cannot be wrapped (as the model raises
                it: naming ``model.stages``).
            ValueError: the ``model`` group fails to build (naming its ``_target_``).
        """
        try:
            if stages is not None:
                return instantiate(self.model, strategy=strategy, stages=list(stages))
            return instantiate(self.model, strategy=strategy)
        except InstantiationException as err:
            # model.net._target_ that cannot be imported, stages that cannot be wrapped
            # (names model.stages), a constructor's own error naming its key: one line
            shown = user_error(err)
            if shown is not None and shown is not err:
                raise shown from err
            raise ValueError(f"config group 'model' failed to build "
                             f"({self.model.get('_target_')}): {err}") from err


def build_from_config(cfg: DictConfig) -> tuple[ModelBuilder, str, int, int | tuple[int, int]]:
    """Check the config and return ``(build, size_key, batch_size, size)``: ``build()``
    instantiates ``cfg.strategy`` and ``cfg.model`` (scheduler dropped: one step), and
    ``build.with_strategy(strategy, stages=None)`` the model with a given strategy object
    (and other ``model.stages``); see :class:`ModelBuilder`.

    Raises:
        ValueError: no size key, bad sizes (naming the key), a 3D network on 2D images or a
            2D one on volumes (:func:`remat.run_shape.check_spatial_dims`), a precision
            that cannot be traced, or a group whose ``_target_`` cannot be imported (naming
            the group).
    """
    size_key = run_shape.size_key_of(cfg.data, cfg.model)
    if size_key is None:
        raise ValueError("no input size: set data.image_size or data.patch_size "
                         "(image models, px) or data.block_size (sequence models, tokens)")
    run_shape.check_spatial_dims(cfg.model, cfg.data)
    check_lora_supported(cfg.model)
    size = OmegaConf.select(cfg, size_key)
    channels = int(cfg.model.get("in_channels", 1) or 1)
    batch_size, size = check_sizes(cfg.data.get("batch_size"), size, size_key, channels)
    if str(cfg.precision) not in run_shape.TRACED_PRECISIONS:
        raise ValueError(f"precision={str(cfg.precision)!r} cannot be traced; use "
                         f"{', '.join(run_shape.TRACED_PRECISIONS)}")
    model_cfg = cfg.model.copy()
    with open_dict(model_cfg):
        model_cfg.scheduler = None  # one step; its ${trainer...} interpolations need no trainer
        if "block_size" in model_cfg and isinstance(size, int) and size > int(
                model_cfg.block_size):
            model_cfg.block_size = size  # positions must cover the sequence

    for group, node in (("strategy", cfg.strategy), ("model", model_cfg)):
        try:  # import here, once: the traces run in forked children, which would re-import
            get_class(str(node._target_))
        except Exception as err:
            raise ValueError(f"config group '{group}' failed to build: _target_ "
                             f"{node.get('_target_')!r} cannot be imported ({err})") from err
    return ModelBuilder(cfg.strategy, model_cfg), size_key, batch_size, size
