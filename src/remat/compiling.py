"""Compiling a (wrapped) network in place with ``torch.compile``: training's
``compile=true`` and the bench's compiled rows.

The network is compiled after its strategy wrapped it (and after FSDP sharded it), in place
(``nn.Module.compile``'s way: parameter names, so checkpoints and gradient comparisons, do
not change), with a backend object per network that counts the graphs it compiled.

Under ``torch.compile`` every recomputed segment is one checkpointed region for
AOTAutograd's partitioner, and ops that draw random numbers keep their outputs
(:func:`remat.strategies.recompute.compiled_region_contexts`), so a compiled plan computes
the eager plan's function and keeps what it keeps eager, or less (inductor fuses and frees
what eager autograd keeps).
One inductor setting works against that: its layout optimisation runs convolutions
channels-last and, for a network whose fp32 weights are not channels-last, saves a
channels-last copy of each convolution weight for the backward, which eager does not keep
(U-Net-R18, 256 px, batch 2, CPU: compiled ``none`` 217.3 MiB with it, 185.0 without, eager
200.4). Under ``bf16-mixed`` compiled ``none`` is lower with it than without (165.2 and
173.2 MiB, eager 184.5), but a compiled step that recomputes is not: U-Net-R18 128 px batch 2,
bf16-mixed, ``sqrtn`` 250.0 MiB with it, 208.2 without (eager 208.2), above compiled
``none`` (229.5) with it; a budget plan for 226 MiB measured 238.0 with it. So
:func:`training_options` turns it off in every precision, and a user's ``compile_options``
go on top of that (``{layout_optimization: true}`` turns it back on).

Two more made a compiled plan peak above the same plan eager (``gpt_small``, 1024 tokens,
batch 2, fp32, CPU: ``full`` 150.7 MiB compiled, 138.0 eager), both now off by default:
inductor's buffer reuse keeps a dead buffer for a later one of the same size, judged
against its own estimate of the graph's peak, which leaves out what a kernel allocates
inside itself, so a recomputed block's MLP buffers (3 x 8 MiB) stayed alive through the
next attention backward (``allow_buffer_reuse=False``); and its fusion of ``mm(a, b) + c``
into an ``addmm`` that waits for a late ``c`` (a tied weight's gradient) held ``a`` and ``b``
through the whole backward (:func:`late_sums_apart`). With both off, compiled ``full`` peaks at
138.0 MiB, ``sqrtn`` 225.1 (eager 225.1), compiled ``none`` 573.5 (eager 573.7).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from remat import _compat
from remat.strategies.compiled import trampoline

#: The backend training's ``compile=true`` uses.
TRAINING_BACKEND = "inductor"


class RowBackend:
    """The ``torch.compile`` backend of one compiled network (a bench row, or training's
    ``compile=true``): the registered backend
    ``backend`` (``inductor``, ``aot_eager``, ...), under the partitioner's
    ``activation_memory_budget`` when one is given, with inductor's config ``options``
    (what ``torch.compile(options=...)`` takes; inductor only, checked by
    :func:`check_compile_options`), counting the graphs it compiles.

    One object per network: dynamo checks a cache entry against the backend it was compiled
    with, so a network never reuses another's graphs, and ``graphs`` says whether it was
    compiled at all (dynamo may run a frame eagerly with only a warning, e.g. past its
    recompile limit; see :func:`compile_row`).
    """

    def __init__(self, backend: str, memory_budget: float | None = None,
                 options: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self.memory_budget = memory_budget
        self.options = dict(options or {})
        self.inner = (_compat.inductor_backend(self.options) if self.options
                      else _compat.lookup_backend(backend))
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1
        if self.memory_budget is None:
            return self.inner(gm, example_inputs)
        with _compat.functorch_config().patch(activation_memory_budget=self.memory_budget):
            return self.inner(gm, example_inputs)


def check_compile_options(options: Any, backend: str, key: str = "compile_options"
                          ) -> dict[str, Any]:
    """``options`` as a plain dict of inductor config settings (``torch.compile(options=
    ...)``'s keys, e.g. ``{layout_optimization: false}``), checked.

    Raises:
        ValueError: not a mapping, a backend other than ``inductor`` with options, or a key
            inductor's config does not have (names ``<key>.<name>`` and close names).
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(f"{key} must be a mapping of inductor settings, e.g. "
                         f"{{layout_optimization: false}}; got {options!r}")
    options = dict(options)
    if options and backend != "inductor":
        raise ValueError(f"{key} are inductor settings; compile_backend={backend!r} takes "
                         "none (use compile_backend=inductor or drop them)")
    known = _compat.inductor_config_values()
    for name, value in options.items():
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=3)
            hint = f"; close: {', '.join(close)}" if close else ""
            raise ValueError(f"{key}.{name}: not an inductor setting "
                             f"(torch._inductor.config){hint}")
        kind = type(known[name])  # a bool, int or str setting takes only that kind
        if kind in (bool, int, str) and type(value) is not kind:
            raise ValueError(f"{key}.{name}: inductor's setting is a {kind.__name__} "
                             f"(default {known[name]!r}), got {value!r}")
    return options


def compile_row(net: torch.nn.Module, backend: Callable) -> None:
    """``net.compile(backend=backend)`` (in place: parameter names, so the gradient
    comparison, stay) with a code object of the row's own. ``nn.Module.compile`` compiles
    ``Module._call_impl``, one code object shared by every module, and dynamo keeps at most
    ``torch._dynamo.config.recompile_limit`` (8) cache entries per code object, counting
    those of earlier rows (and of models already gone): past them a row would run eagerly,
    with only a warning. A trampoline per row (:func:`remat.strategies.compiled.
    trampoline`, as the ``compile`` strategy's stages have) gives each row a cache of its
    own."""
    _compat.set_compiled_call_impl(
        net, torch.compile(trampoline(_compat.call_impl(net)), backend=backend))


#: Inductor settings every compiled network starts from (module docstring), beside the
#: graph pass :func:`late_sums_apart`; a user's ``compile_options`` are applied over them and
#: may set them back.
DEFAULT_OPTIONS: dict[str, Any] = {"layout_optimization": False, "allow_buffer_reuse": False}


@functools.lru_cache(1)
def late_sums_apart() -> Any:
    """Inductor's post-grad FX pass (``post_grad_custom_post_pass``) that splits an
    ``addmm(c, a, b)`` whose summand ``c`` is made after both matrices into ``mm(a, b)``,
    placed right after the later of ``a`` and ``b``, and ``add(mm, c)`` where the ``addmm``
    was. Inductor fuses ``mm(a, b) + c`` into one ``addmm``, which waits for ``c``: a tied
    weight's gradient (a GPT's head and token embedding) then held the logits' gradient and
    the last norm's output through the whole backward (2 MiB each on ``gpt_small``, 1024
    tokens, batch 2), where eager frees them at the head. An ``addmm`` whose ``c`` comes
    first (a bias) is left fused. Applied by :func:`training_options`."""
    base = _compat.custom_graph_pass_base()
    aten = torch.ops.aten

    class LateSumsApart(base):  # type: ignore[misc, valid-type]
        def __call__(self, graph: torch.fx.Graph) -> None:
            nodes = list(graph.nodes)
            order = {node: i for i, node in enumerate(nodes)}
            last_input = max((i for i, node in enumerate(nodes) if node.op == "placeholder"),
                             default=-1)
            for node in nodes:
                if node.target is not aten.addmm.default or node.kwargs:
                    continue  # a scaled addmm (beta, alpha) is not a fused sum
                summand, a, b = node.args
                if not all(isinstance(x, torch.fx.Node) for x in (summand, a, b)):
                    continue
                ready = max(order[a], order[b], last_input)
                if order[summand] <= ready:
                    continue
                with graph.inserting_after(nodes[ready]):
                    product = graph.call_function(aten.mm.default, (a, b))
                with graph.inserting_before(node):
                    total = graph.call_function(aten.add.Tensor, (product, summand))
                if "val" in a.meta and "val" in b.meta and "val" in summand.meta:
                    product.meta["val"] = aten.mm.default(a.meta["val"], b.meta["val"])
                    total.meta["val"] = aten.add.Tensor(product.meta["val"],
                                                        summand.meta["val"])
                node.replace_all_uses_with(total)
                graph.erase_node(node)

        def uuid(self) -> str:
            return "remat.compiling.late_sums_apart/1"

        def __repr__(self) -> str:
            return "remat.compiling.late_sums_apart()"

    return LateSumsApart()


def check_partitioner_budget(value: Any, key: str) -> float | None:
    """``value`` as torch's partitioner budget (``torch._functorch.config.
    activation_memory_budget``: 1.0 saves what the default min-cut partitioner saves, 0.0
    recomputes all it can), or None for none given.

    Raises:
        ValueError: not a number in [0, 1]; names ``key``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"{key} must be a number in [0, 1] (torch's partitioner "
                         f"activation_memory_budget; null for its default), got {value!r}")
    return float(value)


def refuse_random_ops_recomputed(net: torch.nn.Module, budget: float | None, key: str) -> None:
    """Refuse a partitioner budget below 1 on a network that draws random numbers: the
    partitioner may then recompute dropout in the backward with other masks, so the
    gradients are not the forward's (pytorch/pytorch#190758; measured on a ViT with
    drop-path 0.1: relative gradient error 1.9-2.6). remat's own recompute segments keep
    their masks (:func:`remat.strategies.recompute.compiled_region_contexts`); the
    partitioner's choices outside them do not.

    Raises:
        ValueError: names ``key`` and the modules.
    """
    if budget is None or budget >= 1:
        return
    found = random_modules(net)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ValueError(f"{key}={budget:g} with modules that draw random numbers ({shown}): "
                         "torch's partitioner may recompute them in the backward with other "
                         "numbers, so gradients would be wrong (pytorch/pytorch#190758); set "
                         "their probability to 0 (model.dropout=0.0 for remat's GPT, "
                         "model.net.drop_path_rate=0.0 for its ViT, or your net's own keys), or "
                         f"leave {key} at null and let the strategy's plan recompute")


def options_record(options: Mapping[str, Any]) -> dict[str, Any]:
    """Inductor ``options`` as JSON-ready data, for ``summary.json`` and ``bench.json``:
    numbers, strings, booleans and ``None`` as they are, anything else (a graph pass) by
    its ``repr``."""
    return {k: v if v is None or isinstance(v, bool | int | float | str) else repr(v)
            for k, v in options.items()}


def training_options(options: Any) -> dict[str, Any]:
    """Inductor settings for training's ``compile=true`` and the bench's inductor rows:
    :data:`DEFAULT_OPTIONS` (``layout_optimization=False`` and ``allow_buffer_reuse=False``,
    in every precision: module docstring) and the graph pass :func:`late_sums_apart` as
    ``post_grad_custom_post_pass``, updated with ``options`` (checked by
    :func:`check_compile_options`, key ``compile_options``; ``None``: none).

    Raises:
        ValueError: as :func:`check_compile_options`.
    """
    given = check_compile_options(options, TRAINING_BACKEND)
    if TRAINING_BACKEND != "inductor":
        return given
    return {**DEFAULT_OPTIONS, "post_grad_custom_post_pass": late_sums_apart(), **given}


_DROPOUT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
            torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


#: float attributes attention modules pass as their kernel's dropout probability (remat's
#: GPT ``dropout``; Hugging Face ``attention_dropout``, ``attn_pdrop``, ``dropout_p``)
ATTENTION_DROPOUT_NAMES = ("dropout", "dropout_p", "attention_dropout", "attn_dropout",
                           "attn_pdrop")


def random_modules(net: torch.nn.Module) -> list[str]:
    """Paths of the modules of ``net`` that draw random numbers in training: dropout
    (``torch.nn`` dropout modules with ``p > 0``), stochastic depth (``DropPath``, timm's
    and look-alikes, with ``drop_prob > 0``), and attention modules whose dropout
    probability is a float attribute (:data:`ATTENTION_DROPOUT_NAMES` > 0, the
    ``dropout_p`` of their SDPA call). Other functional dropout inside a forward is not
    seen."""
    found = []
    for name, module in net.named_modules():
        if isinstance(module, _DROPOUT):
            p = getattr(module, "p", None)
        elif "droppath" in type(module).__name__.lower():
            p = getattr(module, "drop_prob", None)
        else:
            p = next((v for v in (getattr(module, n, None) for n in ATTENTION_DROPOUT_NAMES)
                      if isinstance(v, float) and v > 0), None)
        if isinstance(p, int | float) and not isinstance(p, bool) and p > 0:
            found.append(name or type(module).__name__)
    return found


def warn_random_ops_kept(net: torch.nn.Module, recomputes: bool,
                         log: Any) -> list[str]:
    """Log, for a network about to be compiled by ``compile=true`` under a strategy that
    recomputes, that its dropout / stochastic-depth modules keep their masks in the
    recomputed regions (for gradients equal to eager's: module docstring of
    :mod:`remat.strategies.recompute`), one byte per element dropped, so the compiled step
    peaks above the same strategy eager (``gpt_small``, 512 tokens, batch 2, dropout 0.1,
    CPU: compiled ``full`` 185.4 MiB, eager 143.4 MiB). The run's estimate and a
    ``strategy=budget`` plan made with ``compile=true`` count them
    (:func:`remat.strategies.recompute.trace_as_compiled`). Returns the modules named."""
    found = random_modules(net) if recomputes else []
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        log.warning("compile=true: %s draw random numbers in training; compiled, each "
                    "recomputed segment keeps their masks until its backward (recomputed, "
                    "they would draw other numbers): the step peaks above the same strategy "
                    "eager. The estimate and strategy=budget count them (dropout called as a "
                    "function too); a plan made without compile=true does not", shown)
    return found
