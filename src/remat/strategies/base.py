"""The strategy contract: ``apply(model, stages) -> StrategyReport`` and ``remove(model)``."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from remat import _compat
from remat.strategies import wrapping
from remat.strategies.stages import AUTO, auto_stages, resolve_stages

#: Key of a Lightning checkpoint under which the strategy's own record is kept
#: (:meth:`CheckpointStrategy.state_for_checkpoint`: a plan and what it was planned for),
#: as plain data.
STRATEGY_STATE_KEY = "remat_strategy"

log = logging.getLogger(__name__)


def own_checkpointing_off(model: nn.Module) -> list[str]:
    """Switch off a model's own gradient checkpointing wherever it is on: Hugging Face
    models (``is_gradient_checkpointing``; ``gradient_checkpointing_disable()``), timm
    modules (``grad_checkpointing``; ``set_grad_checkpointing(False)``, or the flag of a
    timm stage) and MONAI blocks (``use_checkpoint``, e.g. SwinUNETR's Swin blocks).
    Returns the paths switched off (``""``: the model itself), outermost first."""
    switched: list[str] = []
    for path, module in model.named_modules():
        # a user's subclass of a timm or MONAI model counts as theirs
        libraries = {cls.__module__.split(".")[0] for cls in type(module).__mro__}
        if getattr(module, "is_gradient_checkpointing", False) is True and callable(
                getattr(module, "gradient_checkpointing_disable", None)):
            module.gradient_checkpointing_disable()
        elif getattr(module, "grad_checkpointing", False) is True and "timm" in libraries:
            setter = getattr(module, "set_grad_checkpointing", None)
            if callable(setter):
                setter(False)
            else:
                module.grad_checkpointing = False
        elif getattr(module, "use_checkpoint", False) is True and "monai" in libraries:
            module.use_checkpoint = False
        else:
            continue
        if not any(path.startswith(f"{outer}.") for outer in switched):
            switched.append(path)  # outermost only: a MONAI layer and its blocks are one
    return [f"'{path}'" if path else "the model itself" for path in switched]


@dataclass
class StrategyReport:
    """What a strategy did to a model.

    Attributes:
        strategy: registry name of the strategy (``none``, ``full``, ``sqrtn``, ...).
        stages: resolved dotted paths of the stages it was asked to act on.
        wrapped: dotted paths of the modules (blocks, or whole stages) whose activations are
            now recomputed.
        segments: stage path -> half-open block ranges, one per checkpointed segment; a stage
            that is one module (not a chain) is one segment ``[(0, 1)]``.
        kept_boundaries: number of segment inputs kept in the forward pass (one per segment).
        graph_breaks: for ``compile``, stage path -> ``{"graphs": n, "breaks": n - 1,
            "reasons": [...]}`` for each stage ``torch.compile`` split into several graphs
            at its first training call (its memory budget then holds per fragment);
            filled after the first training step.
    """

    strategy: str
    stages: list[str] = field(default_factory=list)
    wrapped: list[str] = field(default_factory=list)
    segments: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    graph_breaks: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def kept_boundaries(self) -> int:
        return sum(len(v) for v in self.segments.values())

    def to_dict(self) -> dict:
        """JSON-ready form (tuples become lists)."""
        out = asdict(self)
        out["segments"] = {k: [list(s) for s in v] for k, v in self.segments.items()}
        out["kept_boundaries"] = self.kept_boundaries
        return out


class CheckpointStrategy:
    """Base class of every activation checkpointing strategy.

    A strategy acts on any ``nn.Module`` in place, through the one wrapping mechanism of
    :mod:`remat.strategies.wrapping`: the wrapped model computes the same function (outputs,
    gradients, norm running statistics, dropout masks) and keeps the same ``state_dict``
    keys and module paths; only peak memory and step time change. Under ``eval()`` or
    ``torch.no_grad()`` a strategy does nothing.

    Subclasses implement :meth:`wrap_stage` (what to do with one resolved stage) and, if
    they change a module other than through a wrapped forward, :meth:`undo`.

    Capabilities, for generic callers (estimate, callbacks, bench) instead of type tests:

    Attributes:
        recomputes: activations are dropped in the forward and recomputed in backward.
        traceable: a training step can be traced under ``FakeTensorMode`` (``remat.estimate``
            predicts its peak memory exactly).
        measurable_on_cpu: ``MemTracker`` (a ``TorchDispatchMode``) sees the strategy's real
            behaviour; ``False`` where the work happens in compiled code that dynamo skips
            under a dispatch mode.
        shardable: the wrapped network can then be sharded with FSDP2
            (:func:`remat.sharding.shard`, ``trainer=fsdp``) and computes the same function.
    """

    name: str = "base"
    recomputes: bool = False
    traceable: bool = True
    measurable_on_cpu: bool = True
    shardable: bool = True

    def apply(self, model: nn.Module, stages: Iterable[str]) -> StrategyReport:
        """Wrap the stages of ``model`` (dotted paths with globs, or ``"auto"``: the units
        :func:`~remat.strategies.stages.auto_stages` finds, as ``model.stages=auto``) in
        place.

        Removes whatever remat wrapping the model carries first, so applying twice is the
        same as applying once, and applying over another strategy replaces it.

        Raises:
            StageError: a stage matches nothing (close names listed), one lies inside
                another, or the strategy cannot wrap it (the message says why and what to do).
        """
        if isinstance(stages, str) and stages == AUTO:
            stages = auto_stages(model)
        resolved = resolve_stages(model, stages)
        for path, module in resolved:
            self.check_stage(path, module)
        if self.recomputes:
            switched = own_checkpointing_off(model)
            if switched:
                norms = any(isinstance(m, _compat.NormBase)
                            and m.track_running_stats for m in model.modules())
                log.warning("strategy '%s' switched off the model's own gradient "
                            "checkpointing in %s: the strategy decides what is recomputed "
                            "(with both on, remat's estimates and plans do not hold%s)",
                            self.name, ", ".join(switched[:3]) + (
                                f" and {len(switched) - 3} more" if len(switched) > 3
                                else ""),
                            ", and the model's own recompute updates the running statistics "
                            "of its norms a second time" if norms else "")
        wrapping.unwrap_all(model)
        report = StrategyReport(strategy=self.name, stages=[p for p, _ in resolved])
        try:
            for path, module in resolved:
                self.wrap_stage(path, module, report)
        except BaseException:
            wrapping.unwrap_all(model)
            raise
        wrapping.arm(model, self.name)
        return report

    def check_stage(self, path: str, module: nn.Module) -> None:
        """Raise :class:`~remat.strategies.StageError` if this strategy cannot act on the
        stage; called for every stage before anything is changed. Default: accept."""

    def wrap_stage(self, path: str, module: nn.Module, report: StrategyReport) -> None:
        """Act on one resolved stage (install wraps, fill ``report``). Default: nothing."""

    def undo(self, module: nn.Module, wrap: wrapping.Wrap) -> None:
        """Revert what this strategy did to one wrapped module (asked by
        :func:`~remat.strategies.wrapping.unwrap_all`). Default: remove the wrap."""
        wrapping.uninstall(module)

    def remove(self, model: nn.Module) -> None:
        """Restore the original behaviour of every module of ``model`` remat wrapped."""
        wrapping.unwrap_all(model)

    def preflight(self, model: nn.Module) -> None:
        """Check, before training starts (after the trainer has set the model up, e.g.
        converted BatchNorm to SyncBatchNorm), what the wrapping cannot do; raise a clear
        error naming the module. Default: nothing to check."""

    def state_for_checkpoint(self) -> dict | None:
        """Plain data (dicts, lists, strings, numbers) a training run keeps in every
        checkpoint it writes, so that a resumed run can make the same decisions (a plan's
        units and what it was planned for); ``None``: nothing to keep (the default)."""
        return None

    def verify(self, model: nn.Module) -> None:
        """Check, after one training forward, that the wrapping is on the code path used.

        Raises:
            StageError: a wrapped unit was never called (its parent bypasses it).
        """
        wrapping.verify(model, self.name)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"
