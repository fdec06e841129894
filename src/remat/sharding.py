"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) over a
network a checkpointing strategy has already wrapped.

Order: the strategy first, then sharding. :func:`shard` makes each *checkpointed segment*
one FSDP unit (``fully_shard([block_i, ..., block_j])``), each block outside a segment its
own unit, and the network the root unit. A segment must be one unit because its blocks are
recomputed together: in backward, FSDP gathers a unit's parameters when the gradient reaches
the unit's output, which for a segment of several blocks is the last block's output; the
recompute then runs every block of the segment, so all their parameters must have been
gathered by then. Sharded the other way round (one unit per block, then a segment strategy,
as a hand-written ``configure_model`` might do) the first forward raises
:class:`~remat.strategies.StageError` naming the segment
(:func:`remat.strategies.recompute.check_fsdp_segment`).

Nothing here imports Lightning: :meth:`remat.models.base.StrategyModule.configure_model`
calls :func:`shard` under Lightning's ``ModelParallelStrategy``
(:class:`remat.models.fsdp.FSDP2Strategy`), and plain PyTorch users call it themselves after
``strategy.apply``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from remat.strategies import StageError, StrategyReport
from remat.strategies.segmented import CHAIN_TYPES, chain_members


@dataclass
class ShardReport:
    """What :func:`shard` did.

    Attributes:
        units: one list of module paths per FSDP unit below the root, in model order (a
            checkpointed segment of several blocks is one unit of several paths).
        world_size: ranks the parameters are sharded over.
        reshard_after_forward: parameters are freed after each unit's forward (ZeRO-3,
            ``FULL_SHARD``) rather than kept gathered until backward (ZeRO-2,
            ``SHARD_GRAD_OP``).
    """

    units: list[list[str]] = field(default_factory=list)
    world_size: int = 1
    reshard_after_forward: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"units": [list(u) for u in self.units], "world_size": self.world_size,
                "reshard_after_forward": self.reshard_after_forward}


def _module(net: nn.Module, path: str) -> nn.Module:
    return net.get_submodule(path) if path else net


def shard_units(net: nn.Module, report: StrategyReport,
                stages: Sequence[str] = ()) -> list[list[str]]:
    """The FSDP units below the root for ``net`` wrapped as ``report`` says.

    Each stage that is a chain contributes one unit per checkpointed segment
    (``report.segments``) and one per block outside any segment (``none``, or blocks a plan
    keeps); a stage that is one module is one unit. ``stages`` (the model's own
    ``model.stages``, globs allowed) are added where the report has no stage at or around
    them, so a strategy that wrapped nothing there still gets one unit per block.

    Returns:
        Lists of dotted module paths, one list per unit, in model order.
    """
    from remat.strategies.stages import resolve_stages

    paths = list(report.stages)
    if stages:
        for path, _ in resolve_stages(net, list(stages)):
            if not any(path == p or path.startswith(p + ".") or p.startswith(path + ".")
                       for p in paths):
                paths.append(path)
    units: list[list[str]] = []
    for stage in paths:
        module = _module(net, stage)
        if not isinstance(module, CHAIN_TYPES):
            units.append([stage])
            continue
        names = [f"{stage}.{name}" if stage else name for name, _ in chain_members(module)]
        cursor = 0
        for start, end in sorted(report.segments.get(stage, [])):
            units.extend([n] for n in names[cursor:start])
            units.append(names[start:end])
            cursor = end
        units.extend([n] for n in names[cursor:])
    return units


def is_sharded(net: nn.Module) -> bool:
    """``net`` or one of its modules is already an FSDP2 unit."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in net.modules())


def shard(net: nn.Module, mesh: Any, report: StrategyReport, *,
          reshard_after_forward: bool = True, mp_policy: Any = None,
          stages: Sequence[str] = ()) -> ShardReport:
    """Shard ``net`` with FSDP2 over the 1-D ``mesh``: one unit per checkpointed segment and
    per block of each stage chain, then the root (module docstring for the order).

    Call it after ``strategy.apply(net, stages)``, with that call's report.

    Args:
        net: the network, wrapped by a strategy (or by ``none``).
        mesh: a 1-D ``torch.distributed.device_mesh.DeviceMesh`` over the data-parallel
            ranks.
        report: what the strategy did (:class:`~remat.strategies.StrategyReport`).
        reshard_after_forward: ``fully_shard``'s argument (True: ZeRO-3; False: ZeRO-2).
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` or ``None`` (parameters and gradients
            stay in their dtype; Lightning's ``bf16-mixed`` autocasts the compute).
        stages: the model's own stages (:func:`shard_units`).

    Raises:
        StageError: ``net`` is already sharded (shard once, after the strategy), or
            ``mesh`` is not 1-D.
    """
    from torch.distributed.fsdp import fully_shard

    if is_sharded(net):
        raise StageError(f"{type(net).__name__} is already sharded by FSDP (fully_shard): "
                         "apply the strategy first, then shard once with remat.sharding.shard")
    if mesh.ndim != 1:
        raise StageError(f"remat.sharding.shard needs a 1-D device mesh of the data-parallel "
                         f"ranks, got {mesh.ndim} dimensions {tuple(mesh.mesh_dim_names or ())}")
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    units = shard_units(net, report, stages)
    for unit in units:
        modules = [_module(net, p) for p in unit]
        if not any(p.requires_grad for m in modules for p in m.parameters()):
            continue  # no trainable parameter (a frozen or parameter-free block): the root's
        fully_shard(modules if len(modules) > 1 else modules[0], **kwargs)
    fully_shard(net, **kwargs)
    return ShardReport(units=units, world_size=mesh.size(),
                       reshard_after_forward=reshard_after_forward)
