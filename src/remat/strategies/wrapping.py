"""The one wrapping mechanism every strategy uses: install, remove, verify.

A strategy changes how a module runs by *installing a wrap* on it: a :class:`Wrap` record
kept in the module's ``__dict__`` and, for strategies that change the forward, an instance
``forward`` (a :class:`_Forward` object) that hands training calls to the strategy's runner:

    runner(module, wrap, forward, args, kwargs) -> output

where ``forward`` is the module's own forward (its class ``forward``, or an instance forward
some other library installed before us) and ``args``/``kwargs`` are the call's real
arguments. Under ``eval()`` or ``torch.no_grad()`` the wrap calls ``forward`` directly, so a
strategy does nothing there. Nothing else about the module changes: parameters, buffers,
``state_dict`` keys, module paths and hooks stay as they are (the module's own hooks run
around the wrap, its children's hooks inside it).

A wrap without a runner only records that a strategy changed a module in some other way (a
timm or Hugging Face checkpointing flag), and how to undo it.

:func:`unwrap_all` asks each wrap's owner (the strategy that installed it) to undo its own
work, so this module never imports a specific strategy. Every strategy's ``apply`` starts
with it: strategies replace each other, never nest.

A wrapped model pickles and deep-copies (``torch.save(model)``, Lightning's ``ddp_spawn``):
the forward object and the record hold only the module, the strategy object and plain data.

Bypassed stages. A parent that loops over a chain's children itself, or calls a block's
class ``forward`` directly, goes around the wrap, so nothing is recomputed there. The model
given to ``apply`` gets a forward hook that warns once, after its first training forward,
naming every wrapped unit that was not called; :func:`verify` raises instead.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat import _compat
from remat.strategies.stages import StageError

WRAP_ATTR = "_remat_wrap"   # the Wrap record of a wrapped module
ROOT_ATTR = "_remat_root"   # the Root record of the model a strategy was applied to

_comptime = _compat.comptime()  # runs a function while dynamo traces, without a graph break



@dataclass(eq=False)
class Wrap:
    """What a strategy did to one module.

    Attributes:
        owner: the strategy that installed the wrap; ``owner.undo(module, wrap)`` reverts it.
        path: dotted path of the module in the model the strategy was applied to.
        runner: called for training calls with grad (see the module docstring), or ``None``
            for a wrap that changes no forward.
        chain: for a member of a chain (Sequential/ModuleList/ModuleDict stage), the
            :class:`~remat.strategies.recompute.ChainPlan` of its chain; else ``None``.
        index: position of the member in its chain (its first, for a module the chain holds
            several times).
        indices: every position of the member in its chain, when the chain holds the same
            module several times (a layer shared as ALBERT's is); else empty.
        calls: training calls with grad that ran through the wrap (eager ones).
        traced: the wrap was traced by ``torch.compile`` (calls are not counted there).
        state: per-unit runtime state of the owner (rebuilt after pickling).
        previous: the instance ``forward`` the module had before the wrap, or ``None``.
    """

    owner: Any
    path: str
    runner: Callable[..., Any] | None = None
    chain: Any = None
    index: int = 0
    indices: tuple[int, ...] = ()
    calls: int = 0
    traced: bool = False
    state: Any = None
    previous: Callable[..., Any] | None = field(default=None, repr=False)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["state"] = None  # runtime caches (module references, compiled code)
        return state


class _Forward:
    """The instance ``forward`` of a wrapped module: hands training calls to the runner."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        wrap: Wrap = getattr(module, WRAP_ATTR)
        forward = (wrap.previous if wrap.previous is not None
                   else functools.partial(type(module).forward, module))
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            mark_traced(wrap)
        return wrap.runner(module, wrap, forward, args, kwargs)

    def __getstate__(self) -> nn.Module:
        return self.module

    def __setstate__(self, module: nn.Module) -> None:
        self.module = module


def _note_traced(ctx: Any) -> None:
    """Run by dynamo at trace time (``comptime``): set ``traced`` on the real ``wrap`` object
    of the frame being traced. Best effort: an API change only loses the note."""
    wrap = _compat.traced_local(ctx, "wrap")
    if wrap is not None:
        wrap.traced = True


def mark_traced(wrap: Wrap) -> None:
    """Record, while ``torch.compile`` traces a wrapped call, that ``wrap`` is on the traced
    path: runs once per trace (not per step) and adds no graph break or guard."""
    _comptime(_note_traced)


def distinct_members(members: list[tuple[str, nn.Module]]
                     ) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    """The distinct modules of a chain's ``(name, member)`` list, each once, with its first
    name and every position it holds (a chain may hold one module several times: ALBERT's
    and universal transformers' shared layer, ``nn.Sequential(*[block] * n)``)."""
    seen: dict[int, list[Any]] = {}
    for index, (name, member) in enumerate(members):
        seen.setdefault(id(member), [name, member, []])[2].append(index)
    return [(name, member, tuple(indices)) for name, member, indices in seen.values()]


def install(module: nn.Module, wrap: Wrap) -> Wrap:
    """Install ``wrap`` on ``module`` (and its instance forward if ``wrap.runner`` is set).

    Raises:
        StageError: ``module`` already carries a wrap (the same module listed twice, e.g. a
            block shared by two chains), or a forward-changing wrap is put on a TorchScript
            module.
    """
    if wrap.runner is not None and isinstance(module, torch.jit.ScriptModule):
        raise StageError(
            f"module '{wrap.path}' is a TorchScript module (torch.jit.script/trace): its "
            "forward cannot be wrapped. Wrap the eager module (script after training, or "
            "script only modules inside a stage's blocks), or leave it out of model.stages")
    existing = module.__dict__.get(WRAP_ATTR)
    if existing is not None:
        raise StageError(
            f"module '{wrap.path}' ({type(module).__name__}) is already wrapped as "
            f"'{existing.path}' by strategy '{existing.owner.name}': a module shared by two "
            "stages can be wrapped once; list it in one stage only")
    if wrap.runner is not None:
        wrap.previous = module.__dict__.get("forward")
        object.__setattr__(module, "forward", _Forward(module))
    object.__setattr__(module, WRAP_ATTR, wrap)
    return wrap


def uninstall(module: nn.Module) -> bool:
    """Remove the wrap of one module (restoring any instance forward it replaced); returns
    whether there was one. Does not call the owner: use :func:`unwrap_all` for that."""
    wrap = module.__dict__.pop(WRAP_ATTR, None)
    if wrap is None:
        return False
    if isinstance(module.__dict__.get("forward"), _Forward):
        del module.__dict__["forward"]
        if wrap.previous is not None:
            object.__setattr__(module, "forward", wrap.previous)
    return True


def wraps_of(model: nn.Module) -> Iterator[tuple[str, nn.Module, Wrap]]:
    """``(name in model, module, wrap)`` for every wrapped module of ``model``."""
    for name, module in model.named_modules():
        wrap = module.__dict__.get(WRAP_ATTR)
        if wrap is not None:
            yield name, module, wrap


def unwrap_all(model: nn.Module) -> int:
    """Undo every strategy's work on ``model``: each wrap's owner reverts its own module
    (``owner.undo(module, wrap)``) and the bypass hook goes. Returns how many modules were
    restored."""
    restored = 0
    for _, module, wrap in list(wraps_of(model)):
        wrap.owner.undo(module, wrap)
        uninstall(module)  # in case the owner's undo left the record
        restored += 1
    disarm(model)
    return restored


# --- bypass detection ------------------------------------------------------------------


@dataclass(eq=False)
class Root:
    """Bookkeeping on the model a strategy was applied to (the bypass check)."""

    strategy: str
    checked: bool = False


def never_called(model: nn.Module) -> list[str]:
    """Paths of wrapped units that no eager training call reached and no ``torch.compile``
    trace went through: single modules, and chains none of whose members ran."""
    units: dict[str, bool] = {}
    for _, _, wrap in wraps_of(model):
        if wrap.runner is None:
            continue
        key = wrap.chain.path if wrap.chain is not None else wrap.path
        units[key] = units.get(key, False) or wrap.calls > 0 or wrap.traced
    return [path for path, used in units.items() if not used]


def _bypass_message(strategy: str, unused: list[str]) -> str:
    return (f"strategy '{strategy}' wrapped {', '.join(unused)}, but the training forward never "
            "called it: its parent runs the children (or their code) itself, so nothing is "
            f"recomputed there. List the modules that are called as stages instead, e.g. "
            f"'{unused[0]}.*'")


def _after_root_forward(model: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of the model a strategy was applied to: ends every open chain segment
    and, after the first training forward, warns about bypassed units."""
    if torch.compiler.is_compiling():
        return
    root: Root | None = model.__dict__.get(ROOT_ATTR)
    if root is None:
        return
    for _, _, wrap in wraps_of(model):
        if wrap.chain is not None:
            wrap.chain.close()
    if root.checked or not (model.training and torch.is_grad_enabled()):
        return
    root.checked = True
    unused = never_called(model)
    if unused:
        warnings.warn(_bypass_message(root.strategy, unused), stacklevel=2)


def arm(model: nn.Module, strategy: str) -> None:
    """Put the bypass check on ``model`` (after ``install``; idempotent)."""
    disarm(model)
    if not any(w.runner is not None for _, _, w in wraps_of(model)):
        return
    object.__setattr__(model, ROOT_ATTR, Root(strategy))
    model.register_forward_hook(_after_root_forward)


def disarm(model: nn.Module) -> None:
    """Remove the bypass check of :func:`arm` from ``model``."""
    model.__dict__.pop(ROOT_ATTR, None)
    _compat.remove_forward_hook(model, _after_root_forward)


def verify(model: nn.Module, strategy: str) -> None:
    """Raise unless every wrapped unit of ``model`` was on the code path of the training
    forwards run so far (eager calls counted, ``torch.compile`` traces noted).

    Raises:
        StageError: a unit was bypassed; the message names it and the fix.
    """
    unused = never_called(model)
    if unused:
        raise StageError(_bypass_message(strategy, unused))
