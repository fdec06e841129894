"""``timm_native``: switch on timm's own gradient checkpointing, as a reference point.

The stages only locate timm models: each resolved stage maps to itself or to its nearest
ancestor that is a timm model with a ``set_grad_checkpointing`` method, and that method is
called once per distinct model. What is then recomputed is timm's choice, not the stages':

- a full timm model (ViT, ConvNeXt, ...) checkpoints wherever its own ``forward`` looks at
  the flag, typically every block (``timm.models._manipulate.checkpoint_seq``);
- a ``features_only`` wrapper (``FeatureListNet``, ``FeatureDictNet``, ``FeatureHookNet``,
  the ``encoder.model`` of an smp ``tu-`` encoder built from a CNN) checkpoints each of its
  top-level children as one unit, except the first, the last and in-place ones (timm 1.0
  ``timm/models/_features.py``). The report lists those children as one-block segments of
  the wrapper; a stage inside a child that timm never checkpoints gets a warning, and a
  wrapper with no child timm would checkpoint is an error, since the flag would do nothing;
- a ``FeatureGetterNet`` wrapper has no flag of its own and calls its model's
  ``forward_intermediates``; the strategy switches on the wrapped model (``<path>.model``).

What holds, and what does not (``tests/strategies/test_timm_native.py``):

- outputs equal the eager model's and gradients match within float tolerance; dropout masks
  are replayed (``torch.utils.checkpoint`` restores the RNG state by default);
- BatchNorm running statistics are NOT protected: timm's recompute runs each recomputed
  BatchNorm a second time in training mode, so its ``num_batches_tracked`` counts 2 per
  step and its running mean/variance take the momentum update twice. The segment strategies
  (``full``, ``sqrtn``, ``every_k``) guard against this; ``timm_native`` is kept as timm
  ships it, so it is a reference for time and memory, not for BatchNorm statistics;
- timm picks ``use_reentrant`` from ``timm.layers.use_reentrant_ckpt()`` (environment
  variable ``TIMM_REENTRANT_CKPT``); ``apply`` refuses to run when it is on, since remat
  always uses the non-reentrant variant;
- under ``no_grad`` nothing is recomputed (there is no backward), but in ``eval()`` with
  grad enabled (e.g. input gradients) timm still checkpoints: its forwards look at the flag,
  not at ``self.training``. This departs from the strategy contract and is kept as timm
  ships it (BatchNorm does not update statistics in eval, so only time is lost);
- ``state_dict`` keys do not change (only a boolean attribute is set). ``apply`` also puts
  forward pre-hooks on the timm model's modules until :meth:`TimmNative.verify` (or
  ``remove``), or until the first recompute, whichever comes first.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from torch import nn

from remat import _compat
from remat.strategies import wrapping
from remat.strategies.base import CheckpointStrategy, StrategyReport
from remat.strategies.stages import StageError, resolve_stages

_ALTERNATIVES = ("use strategy 'full', 'sqrtn' or 'every_k' on its block chains "
                 "(nn.Sequential / nn.ModuleList of blocks), or 'compile'")


def _feature_wrappers() -> tuple[type, ...]:
    from timm.models import FeatureDictNet, FeatureHookNet  # FeatureListNet is a DictNet

    return FeatureDictNet, FeatureHookNet


def _getter_wrapper() -> type | None:
    try:
        from timm.models._features import FeatureGetterNet
    except ImportError:  # pragma: no cover - older timm
        return None
    return FeatureGetterNet


def is_timm_checkpointable(module: nn.Module) -> bool:
    """A timm module (or a subclass of one) with a ``set_grad_checkpointing`` method."""
    return callable(getattr(module, "set_grad_checkpointing", None)) and any(
        cls.__module__.split(".")[0] == "timm" for cls in type(module).__mro__)


def feature_wrapper_checkpointed(wrapper: nn.Module) -> list[int]:
    """Indices of the children a timm ``features_only`` wrapper checkpoints when its flag
    is on: all but the first, the last and in-place ones (timm 1.0, ``_features.py``)."""
    children = list(wrapper.children())
    return [i for i, child in enumerate(children)
            if 0 < i < len(children) - 1 and getattr(child, "inplace", False) is not True]


def _parent(path: str) -> str | None:
    if not path:
        return None
    return path.rpartition(".")[0]


def _describe(path: str) -> str:
    return f"'{path}'" if path else "the model itself"


class _RecomputeProbe:
    """Forward pre-hooks on every module of one timm model that note whether any of them
    ran inside a backward pass, i.e. was recomputed (pre-hooks, since a recompute may stop
    early, before forward hooks run). The hooks remove themselves at the first recompute."""

    def __init__(self, target: nn.Module):
        self.recomputed = False
        self._handles = [m.register_forward_pre_hook(self._hook) for m in target.modules()]

    def _hook(self, module: nn.Module, args: tuple) -> None:
        if _compat.in_backward():
            self.recomputed = True
            self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class TimmNative(CheckpointStrategy):
    """Call timm's ``set_grad_checkpointing(True)`` on the timm models holding the stages.

    A reference point for comparisons: timm decides what is recomputed (see the module
    docstring for what that means for full models and ``features_only`` wrappers, and for
    BatchNorm statistics, which timm's checkpointing updates twice).

    The report's ``wrapped`` lists the dotted paths of the timm models switched on (``''``
    is the model itself); ``segments`` lists, for ``features_only`` wrappers, the children
    timm checkpoints, as one-block ranges.
    """

    name = "timm_native"

    def _locate(self, model: nn.Module, stages: Iterable[str]
                ) -> tuple[list[str], dict[str, nn.Module], dict[str, list[str]]]:
        resolved = resolve_stages(model, stages)
        named = dict(model.named_modules())
        getter = _getter_wrapper()
        targets: dict[str, nn.Module] = {}
        members: dict[str, list[str]] = {}
        for path, module in resolved:
            if getter is not None and isinstance(module, getter):
                path, module = f"{path}.model", module.model
            found = path
            while found is not None and not is_timm_checkpointable(named[found]):
                found = _parent(found)
            if found is None:
                chain = []
                probe: str | None = path
                while probe is not None:
                    chain.append(f"{_describe(probe)} ({type(named[probe]).__name__})")
                    probe = _parent(probe)
                raise StageError(
                    f"strategy 'timm_native' switches on timm's own checkpointing, but stage "
                    f"'{path}' is a {type(module).__name__} with no timm model with "
                    f"set_grad_checkpointing at or above it (checked: {', '.join(chain)}); "
                    f"{_ALTERNATIVES}"
                )
            targets.setdefault(found, named[found])
            members.setdefault(found, []).append(path)
        return [p for p, _ in resolved], targets, members

    def _segments(self, targets: dict[str, nn.Module], members: dict[str, list[str]]
                  ) -> dict[str, list[tuple[int, int]]]:
        segments: dict[str, list[tuple[int, int]]] = {}
        for path, target in targets.items():
            if not isinstance(target, _feature_wrappers()):
                continue
            names = [name for name, _ in target.named_children()]
            kept = feature_wrapper_checkpointed(target)
            if not kept:
                raise ValueError(
                    f"timm's {type(target).__name__} at {_describe(path)} never checkpoints its "
                    f"first and last children nor in-place ones, and its children "
                    f"({', '.join(names)}) leave nothing else: set_grad_checkpointing(True) "
                    f"would change nothing; {_ALTERNATIVES}"
                )
            prefix = f"{path}." if path else ""
            for stage in members[path]:
                if stage == path or not stage.startswith(prefix):
                    continue
                child = stage[len(prefix):].split(".")[0]
                if names.index(child) not in kept:
                    warnings.warn(
                        f"timm_native: stage '{stage}' lies in '{prefix}{child}', which timm's "
                        f"{type(target).__name__} never checkpoints (it skips its first and "
                        f"last children and in-place ones); nothing there is recomputed. To "
                        f"recompute it, {_ALTERNATIVES}",
                        stacklevel=3,
                    )
            segments[path] = [(i, i + 1) for i in kept]
        return segments

    def apply(self, model: nn.Module, stages: Iterable[str]) -> StrategyReport:
        """Switch on timm's checkpointing for the timm models holding ``stages``.

        Removes remat's own wrapping (segments, compiled stages) and switches off timm
        checkpointing that an earlier ``timm_native`` switched on, so applying twice equals
        applying once.

        Raises:
            StageError: a stage matches nothing, or lies in no timm model with
                ``set_grad_checkpointing`` (the message names the stage, its type and the
                strategies that work instead).
            ValueError: timm's ``set_grad_checkpointing`` refuses (some models assert that
                checkpointing is not supported), would change nothing (a features wrapper
                with nothing to checkpoint), or timm is set to reentrant checkpointing.
        """
        from timm.layers import use_reentrant_ckpt

        paths, targets, members = self._locate(model, stages)
        if use_reentrant_ckpt():
            raise ValueError(
                "timm is set to reentrant checkpointing (TIMM_REENTRANT_CKPT or "
                "timm.layers.set_reentrant_ckpt(True)); remat always uses "
                "use_reentrant=False. Call timm.layers.set_reentrant_ckpt(False) first"
            )
        segments = self._segments(targets, members)
        wrapping.unwrap_all(model)
        for path, target in targets.items():
            try:
                target.set_grad_checkpointing(True)
            except (AssertionError, NotImplementedError, RuntimeError, TypeError) as err:
                wrapping.unwrap_all(model)
                raise ValueError(
                    f"timm's {type(target).__name__} at {_describe(path)} does not support "
                    f"gradient checkpointing (set_grad_checkpointing(True) raised "
                    f"{type(err).__name__}: {err}); {_ALTERNATIVES}"
                ) from err
            wrapping.install(target, wrapping.Wrap(self, path, state=_RecomputeProbe(target)))
        return StrategyReport(strategy=self.name, stages=paths, wrapped=list(targets),
                              segments=segments)

    def undo(self, module: nn.Module, wrap: wrapping.Wrap) -> None:
        """Call ``set_grad_checkpointing(False)`` on a timm model ``apply`` switched on."""
        module.set_grad_checkpointing(False)
        if wrap.state is not None:
            wrap.state.close()
        wrapping.uninstall(module)

    def verify(self, model: nn.Module) -> None:
        """Call after one training step (forward and backward): each timm model switched on
        must have recomputed something in that backward, i.e. the code path actually used
        honours timm's flag. Removes the probe hooks ``apply`` installed.

        Raises:
            ValueError: a timm model recomputed nothing (the path used ignores the flag).
        """
        silent = []
        for path, module, wrap in wrapping.wraps_of(model):
            probe = wrap.state if isinstance(wrap.owner, TimmNative) else None
            if probe is None:
                continue
            probe.close()
            wrap.state = None
            if not probe.recomputed:
                silent.append(f"{_describe(path)} ({type(module).__name__})")
        if silent:
            raise ValueError(
                f"timm_native switched on set_grad_checkpointing(True) for {', '.join(silent)}, "
                "but the training step recomputed nothing inside it: the code path used does "
                "not look at timm's flag (e.g. a parent calls its blocks directly), or nothing "
                f"in it needs gradients; {_ALTERNATIVES}"
            )
