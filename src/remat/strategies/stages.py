"""Stage resolution: turn dotted paths with globs into the modules a strategy wraps."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

#: ``model.stages=auto``: the units :func:`discover_units` finds
AUTO = "auto"
#: the stage path of the network itself (``model.stages=[""]``; torch's ``named_modules``
#: name for the root): a network that is one ``nn.Sequential`` of blocks is that chain
ROOT = ""


def child_path(stage: str, name: str | int) -> str:
    """The dotted path of member ``name`` of the stage at ``stage`` (the root's: ``name``)."""
    return f"{stage}.{name}" if stage else str(name)


class StageError(ValueError):
    """A stage path matched nothing, or matched a module the strategy cannot wrap."""


def path_matches(pattern: str, name: str) -> bool:
    """Whether stage ``pattern`` (dotted, ``fnmatch`` globs per component) names module path
    ``name``; per component, so ``encoder.layer*`` does not reach ``encoder.layer1.0``."""
    p_parts, n_parts = pattern.split("."), name.split(".")
    return len(p_parts) == len(n_parts) and all(
        fnmatchcase(n, p) for p, n in zip(p_parts, n_parts, strict=True)
    )


def as_stage_list(stages: Any) -> list[str]:
    """``stages`` as a list of paths: a bare string is one path; ``None`` is no stage.

    Raises:
        StageError: ``stages`` is neither a string nor an iterable of strings.
    """
    if stages is None:
        return []
    if isinstance(stages, str):
        return [stages]
    try:
        return list(stages)
    except TypeError:
        raise StageError(f"stages must be a dotted module path or a list of them (e.g. "
                         f"[encoder.layer1, encoder.layer2]), got {stages!r}") from None


def resolve_stages(model: nn.Module, stages: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """Resolve stage patterns against ``model.named_modules()``.

    Args:
        model: any module.
        stages: dotted module paths; each component may hold ``fnmatch`` globs
            (``encoder.layer*``, ``blocks``, ``encoder.model.stages_?``).

    Returns:
        ``(path, module)`` pairs in model order, without duplicates.

    Raises:
        StageError: a pattern matches no module (the message lists close names), or one
            matched stage lies inside another (nested checkpointing would recompute twice).
    """
    stages = as_stage_list(stages)
    named = dict(model.named_modules())
    named.pop("", None)
    order = {name: i for i, name in enumerate(named)}
    if ROOT in stages:  # the network itself (a network that is one nn.Sequential)
        if len(stages) > 1:
            raise StageError(f"stage {ROOT!r} is the whole network, which holds every other "
                             f"stage ({', '.join(s for s in stages if s != ROOT)}); list one "
                             "or the other")
        return [(ROOT, model)]
    found: dict[str, nn.Module] = {}
    for pattern in stages:
        if not isinstance(pattern, str) or not pattern:
            raise StageError(f"stage paths must be non-empty strings, got {pattern!r}")
        hits = [name for name in named if path_matches(pattern, name)]
        if not hits:
            close = difflib.get_close_matches(pattern, list(named), n=5, cutoff=0.5)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            top = sorted({name.split(".")[0] for name in named})
            raise StageError(
                f"stage '{pattern}' matches no module of {type(model).__name__}{hint}. "
                f"Top-level modules: {', '.join(top)}"
            )
        for name in hits:
            found[name] = named[name]
    names = sorted(found, key=order.__getitem__)
    for outer in names:
        for inner in names:
            if inner != outer and inner.startswith(outer + "."):
                raise StageError(
                    f"stage '{inner}' lies inside stage '{outer}'; list one or the other"
                )
    return [(name, found[name]) for name in names]


def discover_units(model: nn.Module) -> list[str]:
    """The dotted paths of the units of a network nobody listed stages for
    (``model.stages=auto``, and the planner's candidates): every outermost chain
    (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict`` with members) and every outermost
    module with children that holds no chain and lies in none (an encoder block, a decoder,
    a head of several layers), but for one that shares a module with a unit found before
    it. Leaf layers (a lone ``nn.Conv2d``) are no unit: checkpointing
    one saves nothing. A chain of one member that is a layer counts as that layer (MONAI's
    ``Convolution(conv_only=True)``, an ``nn.Sequential`` holding one convolution): else
    every residual block of MONAI's DynUNet and SwinUNETR, whose convolutions are such
    chains, split into lone convolutions with its norms and activations in no unit, and
    checkpointing them saved nothing. A chain of one member that is not a layer is looked
    into as its member is (SwinUNETR's stages ``swinViT.layers1`` ... are ModuleLists of one
    ``BasicLayer``: its Swin blocks are the chain, its patch merging a unit).

    Returns:
        Paths in model order; empty when the network has neither (a single layer, or a
        ``Sequential`` of leaf layers only, whose members the caller may list by hand).
    """
    from remat.strategies.segmented import CHAIN_TYPES

    def is_layer(module: nn.Module) -> bool:
        children = list(module.children())
        return not children or (isinstance(module, CHAIN_TYPES) and len(children) == 1
                                and is_layer(children[0]))

    def is_chain(module: nn.Module) -> bool:
        # one member is no chain to cut: its member is looked into instead (SwinUNETR's
        # swinViT.layers1 is a ModuleList of one BasicLayer, whose blocks are the chain)
        return isinstance(module, CHAIN_TYPES) and len(module) > 1

    def has_chain(module: nn.Module) -> bool:
        return any(is_chain(m) for m in module.modules())

    found: list[str] = []
    taken: set[int] = set()  # the modules inside the units found so far
    for name, module in model.named_modules():
        if not name or any(name.startswith(t + ".") for t in found):
            continue
        inside = {id(m) for m in module.modules()}
        if inside & taken:
            # it calls modules of units found already (DynUNet's skip_layers: the same
            # blocks as input_block ... upsamples, nested): no unit of its own
            continue
        if is_chain(module) or (not is_layer(module) and not has_chain(module)):
            found.append(name)
            taken |= inside
    return found


def auto_stages(net: nn.Module) -> list[str]:
    """The stages ``model.stages=auto`` (``strategy.apply(net, "auto")``) gives: a network
    that is itself an ``nn.Sequential`` of several blocks is the chain (:data:`ROOT`: the
    chains inside its blocks would recompute lone layers; a Sequential of six conv blocks:
    ``full`` 1.43x ``none``'s peak on the inner chains, ``sqrtn`` 1.00x), any other network
    the units :func:`discover_units` finds."""
    if isinstance(net, nn.Sequential) and len(net) > 1:
        return [ROOT]
    return discover_units(net)


def stage_setting(stages: Any) -> list[str] | str:
    """A ``model.stages`` value as given: :data:`AUTO`, or a list of paths (see
    :func:`as_stage_list`)."""
    if isinstance(stages, str) and stages == AUTO:
        return AUTO
    return as_stage_list(stages)


def module_listing(model: nn.Module, limit: int = 12) -> str:
    """The first ``limit`` top-level and second-level module paths of ``model`` that have
    children, with their classes (else its top-level layers), for messages that ask the user
    to pick stages."""
    rows = [f"{name} ({type(module).__name__})" for name, module in model.named_modules()
            if name and name.count(".") <= 1 and len(list(module.children()))]
    if not rows:  # only layers (a network of lone convolutions): those can be listed
        rows = [f"{name} ({type(module).__name__})" for name, module in model.named_children()]
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return ", ".join(rows[:limit]) + more if rows else "(none: it holds no module)"


def nothing_to_wrap(who: str, net: nn.Module, why: str, suggest_auto: bool = True
                    ) -> StageError:
    """The error for strategies that would wrap nothing in ``net``: ``who`` (e.g.
    ``strategy=sqrtn``) and ``why`` (``model.stages is empty``), the modules to pick from and,
    with ``suggest_auto``, ``model.stages=auto``."""
    return StageError(
        f"{who} would wrap nothing: {why}, so this run would checkpoint no activations. List "
        f"the modules of {type(net).__name__} to recompute, e.g. model.stages=[<path>, ...] "
        "(globs allowed)" + (", or model.stages=auto" if suggest_auto else "")
        + f"; its modules: {module_listing(net)}")


def listed_stages(stages: Any) -> list[str]:
    """The stage paths a ``model.stages`` value lists: none for :data:`AUTO` (the units are
    found on the built network, see :func:`discover_units`), else :func:`as_stage_list`."""
    setting = stage_setting(stages)
    return [] if setting == AUTO else setting
