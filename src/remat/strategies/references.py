"""Reference rows from outside remat, measured by ``remat.bench`` beside the strategies.

torch's ``checkpoint_sequential`` (:class:`TorchCheckpointSequential`), Hugging Face's own
activation checkpointing (:class:`HFGradientCheckpointing`), MONAI's own
``use_checkpoint=True`` of its Swin transformer blocks (:class:`MonaiUseCheckpoint`) and
plain ``torch.compile`` under the partitioner's activation memory budget
(:class:`TorchCompileMemoryBudget`, compiled rows only). They are listed, with timm's
``set_grad_checkpointing`` (:class:`remat.strategies.TimmNative`), in
:data:`remat.strategies.REFERENCES` and :data:`remat.strategies.COMPILED_REFERENCES`.
No Lightning here.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from remat.strategies import wrapping
from remat.strategies.base import CheckpointStrategy, StrategyReport
from remat.strategies.segments import sqrt_segments
from remat.strategies.stages import StageError, child_path, resolve_stages


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (False when transformers was
    never imported: then no module can be one)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


class TorchCompileMemoryBudget(CheckpointStrategy):
    """Reference row: plain ``torch.compile`` of the whole network with the partitioner's
    activation memory budget (``torch._functorch.config.activation_memory_budget``: 1.0
    saves what the default partitioner saves, 0.0 recomputes as much as it can). It wraps
    nothing; the bench compiles the net with a :class:`remat.benchmarking.RowBackend` that
    partitions under the budget. Only for ``compile_strategies`` (eager, it is ``none``).
    Below 1.0 the partitioner may recompute dropout in backward with other masks
    (pytorch/pytorch#190758),
    so its gradients can differ from ``none``'s; the row's ``grads match`` column shows it.

    Raises:
        ValueError: a budget outside [0, 1].
    """

    name = "torch_compile_budget"

    def __init__(self, memory_budget: float = 0.5) -> None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int | float) or not (
                0.0 <= float(memory_budget) <= 1.0):
            raise ValueError(f"bench: torch_compile_budget memory_budget must be a number in "
                             f"[0, 1], got {memory_budget!r}")
        self.activation_memory_budget = float(memory_budget)


class TorchCheckpointSequential(CheckpointStrategy):
    """Reference point from outside remat: ``torch.utils.checkpoint.checkpoint_sequential``
    with ceil(sqrt(N)) segments on each ``nn.Sequential`` stage (non-reentrant).

    Plain torch, so its recompute updates BatchNorm running statistics a second time; the
    benchmark compares gradients only.
    """

    name = "torch_checkpoint_sequential"

    def check_stage(self, path: str, module: torch.nn.Module) -> None:
        if not isinstance(module, torch.nn.Sequential):
            raise StageError(f"{self.name} needs nn.Sequential stages: '{path}' is a "
                             f"{type(module).__name__}")

    def wrap_stage(self, path: str, module: torch.nn.Module, report: StrategyReport) -> None:
        wrapping.install(module, wrapping.Wrap(self, path, self.run))
        report.segments[path] = sqrt_segments(len(module))
        report.wrapped.extend(child_path(path, i) for i in range(len(module)))

    def run(self, module: torch.nn.Sequential, wrap: wrapping.Wrap, forward, args: tuple,
            kwargs: dict):
        """``checkpoint_sequential`` over the chain's blocks (its one input)."""
        wrap.calls += 1
        return checkpoint_sequential(list(module), max(1, len(sqrt_segments(len(module)))),
                                     *args, use_reentrant=False)


class HFGradientCheckpointing(CheckpointStrategy):
    """Reference point from outside remat: Hugging Face's own activation checkpointing,
    ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
    False})`` (``activation_checkpointing_enable``, its non-deprecated name in transformers
    5, when present), called on the outermost ``transformers.PreTrainedModel`` that holds
    each stage.

    What is recomputed is HF's choice: every ``GradientCheckpointingLayer`` of that model
    (each decoder/encoder layer its own checkpoint, ``torch.utils.checkpoint`` without
    reentrance; the layer turns ``use_cache`` off while it checkpoints). The report lists
    those layers. ``remove`` calls ``gradient_checkpointing_disable()``
    (``activation_checkpointing_disable``) and removes the input-embedding hook that
    enabling added.

    Args:
        every_n_layers: Hugging Face's ``every_n_layers`` (transformers 5.x releases that
            have it, huggingface/transformers#48200): only layers ``0, n, 2n, ...`` of the
            model's ``GradientCheckpointingLayer`` s are checkpointed, the others keep their
            activations. 1 (every layer) is what every release does.

    Raises:
        ValueError: ``every_n_layers`` not an integer >= 1.
        StageError: no ``PreTrainedModel`` holds a stage, or the model does not support
            gradient checkpointing, or the stage holds none of its checkpointed layers, or
            ``every_n_layers`` > 1 with a transformers release that does not take it.
    """

    name = "hf_gradient_checkpointing"

    def __init__(self, every_n_layers: int = 1) -> None:
        if (isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int)
                or every_n_layers < 1):
            raise ValueError(f"{self.name}: every_n_layers must be an integer >= 1, got "
                             f"{every_n_layers!r}")
        self.every_n_layers = every_n_layers

    def apply(self, model: torch.nn.Module, stages: Iterable[str]) -> StrategyReport:
        resolved = resolve_stages(model, stages)
        report = StrategyReport(strategy=self.name, stages=[p for p, _ in resolved])
        owners: dict[int, tuple[str, torch.nn.Module]] = {}
        for path, stage in resolved:
            owner = _outermost_hf_model(model, path)
            if owner is None:
                raise StageError(f"{self.name} needs a Hugging Face PreTrainedModel holding "
                                 f"stage '{path}'; {type(model).__name__} has none there")
            prefix, hf_model = owner
            if not getattr(hf_model, "supports_gradient_checkpointing", False):
                raise StageError(f"{self.name}: {type(hf_model).__name__} (holding stage "
                                 f"'{path}') does not support gradient checkpointing")
            if not any(_is_hf_checkpoint_layer(m) for m in stage.modules()):
                raise StageError(f"{self.name}: stage '{path}' holds no layer Hugging Face "
                                 "checkpoints (GradientCheckpointingLayer); list the layer "
                                 "chain, e.g. model.layers or transformer.h")
            owners[id(hf_model)] = (prefix, hf_model)
        every = {"every_n_layers": self.every_n_layers} if self.every_n_layers > 1 else {}
        for _, hf_model in owners.values():
            enable = getattr(hf_model, "activation_checkpointing_enable", None) or \
                hf_model.gradient_checkpointing_enable
            if every and "every_n_layers" not in inspect.signature(enable).parameters:
                import transformers

                raise StageError(f"{self.name}: every_n_layers={self.every_n_layers} needs a "
                                 "transformers release that takes it (huggingface/"
                                 f"transformers#48200); this one is {transformers.__version__}")
        wrapping.unwrap_all(model)  # replaces any strategy applied before, as every one does
        for prefix, hf_model in owners.values():
            wrapping.install(hf_model, wrapping.Wrap(self, prefix))  # undone by undo()
            kwargs = {"use_reentrant": False}
            if hasattr(hf_model, "activation_checkpointing_enable"):
                hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs,
                                                         **every)
            else:  # transformers 4.35 - 4.x
                hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            for name, child in hf_model.named_modules():
                if _is_hf_checkpoint_layer(child) and child.gradient_checkpointing:
                    report.wrapped.append(".".join(p for p in (prefix, name) if p))
        for path, stage in resolved:
            blocks = [i for i, child in enumerate(stage.children())
                      if _is_hf_checkpoint_layer(child) and child.gradient_checkpointing]
            if blocks:
                report.segments[path] = [(i, i + 1) for i in blocks]
        return report

    def undo(self, module: torch.nn.Module, wrap: wrapping.Wrap) -> None:
        """Switch Hugging Face's checkpointing off again on the model ``apply`` switched on
        (asked by :func:`remat.strategies.unwrap_all`, so any later strategy replaces it)."""
        if hasattr(type(module), "activation_checkpointing_disable"):
            module.activation_checkpointing_disable()
        else:  # transformers 4.35 - 4.x
            module.gradient_checkpointing_disable()
        if hasattr(module, "_require_grads_hook"):
            module.disable_input_require_grads()
        wrapping.uninstall(module)


class MonaiUseCheckpoint(CheckpointStrategy):
    """Reference point from outside remat: MONAI's own activation checkpointing of its Swin
    transformer (``SwinUNETR(use_checkpoint=True)``), switched on in place on the same net:
    every ``monai.networks.nets.swin_unetr.SwinTransformerBlock`` inside the stages gets
    ``use_checkpoint = True``, and then (MONAI 1.3-1.6) runs its attention half and its MLP
    half each under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. What is
    recomputed is MONAI's choice; the report lists the blocks. ``undo`` sets the flag back.

    Raises:
        StageError: the stages hold no MONAI Swin transformer block.
    """

    name = "monai_use_checkpoint"

    def apply(self, model: torch.nn.Module, stages: Iterable[str]) -> StrategyReport:
        resolved = resolve_stages(model, stages)
        report = StrategyReport(strategy=self.name, stages=[p for p, _ in resolved])
        blocks = [(f"{path}.{name}" if name else path, module)
                  for path, stage in resolved for name, module in stage.named_modules()
                  if _is_monai_swin_block(module)]
        if not blocks:
            raise StageError(f"{self.name} needs MONAI Swin transformer blocks "
                             "(monai.networks.nets.swin_unetr.SwinTransformerBlock) in the "
                             f"stages {[p for p, _ in resolved]}; "
                             f"{type(model).__name__} has none there")
        wrapping.unwrap_all(model)  # replaces any strategy applied before, as every one does
        for path, block in blocks:
            wrapping.install(block, wrapping.Wrap(self, path))  # undone by undo()
            block.use_checkpoint = True
            report.wrapped.append(path)
        return report

    def undo(self, module: torch.nn.Module, wrap: wrapping.Wrap) -> None:
        """MONAI's checkpointing off again on a block ``apply`` switched on."""
        module.use_checkpoint = False
        wrapping.uninstall(module)


def _is_monai_swin_block(module: torch.nn.Module) -> bool:
    swin = sys.modules.get("monai.networks.nets.swin_unetr")
    return swin is not None and isinstance(module, swin.SwinTransformerBlock)


def _is_hf_checkpoint_layer(module: torch.nn.Module) -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module, GradientCheckpointingLayer)


def _outermost_hf_model(model: torch.nn.Module, path: str
                        ) -> tuple[str, torch.nn.Module] | None:
    """``(prefix, module)`` of the outermost ``PreTrainedModel`` on the way from ``model`` to
    ``path`` (the model itself, prefix ``""``, when it is one), or ``None``."""
    parts = path.split(".")
    for depth in range(len(parts) + 1):
        prefix = ".".join(parts[:depth])
        module = model.get_submodule(prefix) if prefix else model
        if is_hf_model(module):
            return prefix, module
    return None

