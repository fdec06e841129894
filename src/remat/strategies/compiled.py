"""``compile``: the compiler decides what to save, under an activation memory budget.

Each stage runs through ``torch.compile``. AOTAutograd traces forward and backward as one
joint graph and its min-cut partitioner chooses which intermediate values the forward keeps
for the backward and which the backward recomputes. ``torch._functorch.config.
activation_memory_budget`` steers that choice (torch 2.4+, ``torch/_functorch/config.py``):
1.0 keeps what the default, runtime-optimised partitioner keeps; 0.0 keeps about what
checkpointing the whole compiled region would keep (its inputs); values between solve a
0-1 knapsack for the least recompute that fits the budget.

How the budget is put in force. The setting is global and read only when a graph is
partitioned, i.e. inside the compile that dynamo starts lazily at the first call (and again
at every recompile, e.g. on a new input shape). The strategy therefore compiles with a small
backend of its own that patches the budget (``torch._functorch.config.patch``) around the
real backend (``aot_eager``, ``inductor``, ...): the budget holds exactly while a stage's
graph is partitioned, whenever that happens, and nowhere else. Dynamo also refuses to reuse
a graph compiled by another backend object, so a stage never picks up a graph partitioned
under another strategy's budget (with the plain string backend it would: dynamo guards on
the module's structure, not its identity, and a second, identical model would silently reuse
the first one's graph and budget).

How a stage is compiled. ``nn.Module.compile()`` compiles the shared ``Module._call_impl``
code, and dynamo keeps its cache per code object with a limit of 8 entries
(``torch._dynamo.config.recompile_limit``): the ninth differently-shaped stage of a process
would silently run eager. Each stage here gets its own copy of a tiny trampoline code object
instead, so each has its own cache. The stage's ``forward`` is replaced on the instance (as
the segment strategies do), so parameters, buffers and ``state_dict`` keys do not change,
hooks on the stage itself run eagerly around the compiled call, and ``copy.deepcopy``
gives a model whose stages compile again for the copy at their first call.

Guarantees (checked in ``tests/strategies/test_compile.py``):

- outputs and gradients equal those of the eager module within float tolerance, not
  bitwise: compiled kernels may fuse and reorder floating-point operations;
- BatchNorm running statistics and ``num_batches_tracked`` are updated once per forward.
  Functionalisation turns the in-place buffer update into a graph output that is copied
  back after the forward; the partitioner recomputes only the values the backward needs,
  never that write;
- dropout and other random ops: a mask is drawn once, in the forward, and the backward
  uses that same mask. This needs a workaround: in torch <= 2.14 a budget below 1.0 lets
  the partitioner recompute random ops in the backward, where they draw new numbers, so
  gradients come out silently wrong (pytorch/pytorch#190758, #190717; fixes proposed in
  #190759 and #191684). Before partitioning, the strategy marks every op that draws random
  numbers ``CheckpointPolicy.MUST_SAVE`` (the tag selective checkpointing uses), so the
  partitioner keeps its output and recomputes the rest as the budget asks; a budget of 0.0
  becomes 1e-6 for such graphs, since torch's shortcut for exactly 0 ignores the tags.
  Whether the masks equal eager's depends on the backend: ``aot_eager`` runs the same ATen
  ops on the same generator and reproduces eager's masks under the same seed; ``inductor``
  draws random numbers with its own kernels, so its masks differ from eager's (same
  distribution) unless ``torch._inductor.config.fallback_random = True`` is set for the
  forward and the backward, which makes inductor call the ATen ops and gives eager's masks;
- dynamo does not compile while a ``TorchDispatchMode`` is active (e.g. ``MemTracker``,
  the CPU peak-memory tracker): such a forward runs eager, and :meth:`CompileBudget.verify`
  reports it;
- under ``eval()`` or ``torch.no_grad()`` a stage runs its eager ``forward``: nothing is
  compiled or recompiled for inference, and outputs equal the eager module's exactly.
"""

from __future__ import annotations

import math
import numbers
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from remat import _compat
from remat.strategies import wrapping
from remat.strategies.base import CheckpointStrategy, StrategyReport
from remat.strategies.recompute import ChainPlan, draws_random_numbers
from remat.strategies.stages import StageError, child_path


def _check_budget(budget: Any) -> float:
    if (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
            or not math.isfinite(budget) or not 0.0 <= budget <= 1.0):
        raise ValueError(
            f"budget must be a number in [0, 1] (fraction of the activations the default "
            f"partitioner saves: 1.0 = all of them, 0.0 = recompute as much as possible), "
            f"got {budget!r}"
        )
    return float(budget)


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    """An ATen op call of the graph that draws random numbers
    (:func:`remat.strategies.recompute.draws_random_numbers`)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, _compat.OpOverload)
            and draws_random_numbers(target, node.args, node.kwargs))


_TINY_BUDGET = 1e-6  # stands for 0.0 where random ops must be kept (see _BudgetBackend)


def mark_random_ops_saved(graph_module: torch.fx.GraphModule) -> list[str]:
    """Tag each op that draws random numbers (and has no checkpoint tag yet)
    ``CheckpointPolicy.MUST_SAVE``, so the partitioner keeps its output instead of
    recomputing it; returns the ops found, tagged or not."""
    found = []
    for gm in graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if _draws_random_numbers(node):
                found.append(str(node.target))
                node.meta.setdefault("recompute", CheckpointPolicy.MUST_SAVE)
    return found


class _BudgetBackend:
    """A ``torch.compile`` backend: run ``compiler`` with the activation budget patched in.

    It also installs a pass on the joint forward+backward graph, run just before it is
    partitioned (``torch._functorch.config.joint_custom_pass``; a pass already set there
    runs first), that keeps random ops out of the recompute (module docstring: dropout).
    """

    def __init__(self, compiler: Callable, budget: float, kwargs: dict[str, Any],
                 label: str):
        self.compiler = compiler
        self.budget = budget
        self.kwargs = kwargs
        self.label = label
        #: graphs compiled through this backend so far
        self.graphs = 0
        #: random ops whose outputs the last partition had to keep
        self.random_ops: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        config = _compat.functorch_config()
        previous = config.joint_custom_pass

        def keep_random_ops(joint: torch.fx.GraphModule, joint_inputs: Any):
            if callable(previous):
                joint = previous(joint, joint_inputs)
            if config.activation_memory_budget < 1.0:
                self.random_ops = mark_random_ops_saved(joint)
                if self.random_ops and config.activation_memory_budget == 0.0:
                    config.activation_memory_budget = _TINY_BUDGET  # undone by the patch
            return joint

        self.graphs += 1
        with config.patch(activation_memory_budget=self.budget,
                          joint_custom_pass=keep_random_ops):
            return self.compiler(gm, example_inputs, **self.kwargs)


def trampoline(forward: Callable) -> Callable:
    """A function that runs ``forward`` (a module's own forward), with a code object of its
    own (dynamo keeps its compile cache on the code object)."""

    def run(*args, **kwargs):
        return forward(*args, **kwargs)

    code = run.__code__.replace()
    return types.FunctionType(code, run.__globals__, run.__name__, run.__defaults__,
                              run.__closure__)


def dynamo_break_messages() -> dict[str, int]:
    """Dynamo's graph-break messages so far in this process -> how often each was met."""
    return _compat.dynamo_break_counts()


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


class _CompiledStage:
    """Per-stage runtime state (kept in the stage's wrap): its compiled function, built at
    the first training call, whether a call ran under a dispatch mode, and the graph breaks
    dynamo met compiling it (``reasons``, first lines of dynamo's messages)."""

    def __init__(self) -> None:
        self.backend: _BudgetBackend | None = None
        self.under_dispatch_mode = False  # a call saw a TorchDispatchMode (dynamo skips)
        self.first_graphs: int | None = None  # graphs compiled by the first call
        self.reasons: list[str] = []
        self._owner: weakref.ref | None = None
        self._fn: Callable | None = None

    def compiled_for(self, strategy: CompileBudget, module: nn.Module, path: str,
                     forward: Callable) -> Callable:
        # After copy.copy the state may point at the original module.
        if self._fn is None or self._owner is None or self._owner() is not module:
            self.backend = strategy.make_backend(path)
            self._fn = strategy.compile_module(forward, self.backend)
            self._owner = weakref.ref(module)
        return self._fn


def is_compiled_stage(module: nn.Module) -> bool:
    """Whether ``module`` is a stage compiled by :class:`CompileBudget`."""
    wrap = module.__dict__.get(wrapping.WRAP_ATTR)
    return wrap is not None and isinstance(wrap.owner, CompileBudget)


class CompileBudget(CheckpointStrategy):
    """Compile each stage with ``torch.compile`` under an activation memory budget.

    The compiler's min-cut partitioner decides what to save and what to recompute; the
    budget bounds what it may save (see the module docstring for the mechanism and the
    guarantees that hold).

    Args:
        budget: ``torch._functorch.config.activation_memory_budget`` while the stages are
            partitioned, in [0, 1]: 1.0 saves what the default partitioner saves, 0.0
            recomputes as much as possible.
        backend: ``torch.compile`` backend, a registered name (``inductor``, ``aot_eager``,
            ...) or a backend callable. It must partition with AOTAutograd's min-cut
            partitioner for the budget to matter (``inductor`` and ``aot_eager`` do;
            ``eager`` and ``aot_eager_default_partitioner`` ignore it).
        mode: ``torch.compile`` mode (``default``, ``reduce-overhead``, ``max-autotune``,
            ...), inductor only; ``None`` for the default.
        dynamic: ``torch.compile``'s ``dynamic`` (``None``: dynamic shapes after a
            recompile on a new shape).

    Raises:
        ValueError: ``budget`` not a number in [0, 1], an unknown backend, or a mode that
            the backend does not take.
    """

    name = "compile"
    traceable = False          # remat.estimate cannot trace compiled code under FakeTensorMode
    measurable_on_cpu = False  # dynamo does not compile under MemTracker (a dispatch mode)

    def __init__(self, budget: float = 0.5, backend: str | Callable = "inductor",
                 mode: str | None = None, dynamic: bool | None = None):
        self.budget = _check_budget(budget)
        self.backend = backend
        self.mode = mode
        self.dynamic = dynamic
        self._compiler, self._compiler_kwargs = self._resolve_backend()

    def _resolve_backend(self) -> tuple[Callable, dict[str, Any]]:
        try:
            compiler = _compat.lookup_backend(self.backend)
        except Exception as err:  # torch raises its own InvalidBackend
            raise ValueError(
                f"unknown torch.compile backend {self.backend!r}; registered backends: "
                f"{', '.join(_compat.list_backends())}"
            ) from err
        kwargs: dict[str, Any] = {}
        if self.mode not in (None, "default"):
            if self.backend != "inductor":
                raise ValueError(f"mode={self.mode!r} needs backend='inductor', got "
                                 f"backend={self.backend!r}")
            modes = _compat.inductor_mode_options()
            if self.mode not in modes:
                raise ValueError(f"unknown torch.compile mode {self.mode!r}; valid modes: "
                                 f"{', '.join(modes)}")
            # what torch.compile(mode=...) hands inductor, as config patches
            kwargs["config_patches"] = dict(_compat.inductor_mode_options(self.mode, self.dynamic))
        return compiler, kwargs

    def make_backend(self, label: str) -> _BudgetBackend:
        """A fresh backend for one stage (``label``: the stage's path, for debugging)."""
        return _BudgetBackend(self._compiler, self.budget, self._compiler_kwargs, label)

    def compile_module(self, forward: Callable, backend: Callable) -> Callable:
        """The compiled function that runs ``forward`` (a module's own) through ``backend``;
        compilation itself happens at its first call."""
        return torch.compile(trampoline(forward), backend=backend, dynamic=self.dynamic)

    def wrap_stage(self, path: str, module: nn.Module, report: StrategyReport) -> None:
        """Compile the stage in place (any module; each member of an ``nn.ModuleList`` or
        ``nn.ModuleDict``, which have no forward of their own). Compilation is lazy: each
        stage compiles at its first training call with grad enabled."""
        self._report = report
        targets = ([(child_path(path, name), m) for name, m in (
            module.items() if isinstance(module, nn.ModuleDict) else enumerate(module))]
            if isinstance(module, nn.ModuleList | nn.ModuleDict) else [(path, module)])
        # the members of a list are one stage for the bypass check (a parent may skip some)
        group = ChainPlan(path, [(0, len(targets))]) if len(targets) > 1 else None
        for target_path, target, indices in wrapping.distinct_members(targets):
            wrapping.install(target, wrapping.Wrap(self, target_path, self.run, chain=group,
                                                   index=indices[0]))
            report.wrapped.append(target_path)

    def run(self, module: nn.Module, wrap: wrapping.Wrap, forward: Callable,
            args: tuple, kwargs: dict) -> Any:
        """Runner of a compiled stage: its compiled function in training with grad. Inside
        an outer ``torch.compile(model)`` the stage is part of the outer graph (that
        compile's settings decide), so it runs its own forward there."""
        if torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        if wrap.state is None:
            wrap.state = _CompiledStage()
        wrap.calls += 1
        if _compat.any_torch_dispatch_mode_on_stack():
            wrap.state.under_dispatch_mode = True
        stage = wrap.state
        fn = stage.compiled_for(self, module, wrap.path, forward)
        if stage.first_graphs is not None:
            return fn(*args, **kwargs)
        before = dynamo_break_messages()
        out = fn(*args, **kwargs)
        stage.first_graphs = stage.backend.graphs if stage.backend is not None else 0
        after = dynamo_break_messages()
        stage.reasons = [_first_line(m) for m, n in after.items() if n > before.get(m, 0)]
        return out

    def _report_graph_breaks(self, model: nn.Module) -> None:
        """Put the stages dynamo split into several graphs into the strategy report and
        warn once, naming each with its graph count and dynamo's reasons."""
        broken = {}
        for _, _, wrap in wrapping.wraps_of(model):
            stage = wrap.state
            if (isinstance(wrap.owner, CompileBudget) and isinstance(stage, _CompiledStage)
                    and (stage.first_graphs or 0) > 1):
                broken[wrap.path] = {"graphs": stage.first_graphs,
                                     "breaks": stage.first_graphs - 1,
                                     "reasons": stage.reasons}
        report = getattr(self, "_report", None)
        if report is not None:
            report.graph_breaks = broken
        if broken and not getattr(self, "_warned_breaks", False):
            self._warned_breaks = True
            parts = [f"'{path}': {b['graphs']} graphs"
                     + (f" ({'; '.join(b['reasons'])})" if b["reasons"] else "")
                     for path, b in broken.items()]
            warnings.warn(
                f"strategy 'compile': torch.compile split {len(broken)} stage(s) at graph "
                f"breaks, so the activation memory budget {self.budget} holds for each "
                f"fragment on its own and nothing is saved across a break: {', '.join(parts)}."
                " Remove the break (see the reason) or list the fragments' modules as stages",
                stacklevel=2)

    def verify(self, model: nn.Module) -> None:
        """Call after one training forward: every compiled stage must have run through its
        compiled path, and dynamo must have compiled a graph for it (it may otherwise fall
        back to eager silently, e.g. when a recompile limit is hit).

        Raises:
            StageError: a stage was bypassed (its parent calls its children directly) or
                ran eager.
        """
        bypassed, eager, under_mode = [], [], False
        for _, _, wrap in wrapping.wraps_of(model):
            if not isinstance(wrap.owner, CompileBudget):
                continue
            stage = wrap.state
            if wrap.calls == 0 and not wrap.traced:
                bypassed.append(wrap.path)
            elif wrap.calls and (stage is None or stage.backend is None
                                 or stage.backend.graphs == 0):
                eager.append(wrap.path)
                under_mode = under_mode or (stage is not None and stage.under_dispatch_mode)
        if bypassed:
            raise StageError(
                f"strategy 'compile' compiled {', '.join(bypassed)}, but the training forward "
                "never called it: its parent runs the children itself, so nothing is compiled "
                f"there. List the children as stages instead, e.g. '{bypassed[0]}.*'"
            )
        self._report_graph_breaks(model)
        if eager:
            why = ("a TorchDispatchMode was active around the forward (e.g. MemTracker, which "
                   "CPU memory measurement uses), and dynamo does not compile under one"
                   if under_mode else "see the torch._dynamo warnings, or TORCH_LOGS=+dynamo")
            raise StageError(
                f"strategy 'compile': torch.compile produced no graph for {', '.join(eager)}, "
                f"which ran eager: {why}"
            )
