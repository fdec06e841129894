"""A plan (which unit runs how) and the strategy that applies one: ``strategy=plan``.

A plan lists units (dotted paths into the network) and, per unit, segments
``(start, end, mode)`` over its blocks with ``mode`` one of ``keep`` (nothing changes),
``recompute`` (the segment is one checkpointed region, as ``full``/``sqrtn`` segments are),
``selective`` (the block is checkpointed with the ``selective`` matmul preset) or
``offload`` (a ``recompute`` segment whose kept inputs wait in host memory, as the
``offload`` strategy's ``segments=full`` moves them; planned for GPUs only). It also
records what it was made for (network fingerprint, batch, size, precision, device, budget)
and what was predicted (peak bytes, recompute time and FLOPs), so a saved ``plan.json`` is
replayed only on the run it fits.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from remat.strategies import wrapping
from remat.strategies.base import StrategyReport
from remat.strategies.full import FullCheckpoint
from remat.strategies.offload import OffloadCheckpoint
from remat.strategies.recompute import ChainPlan, refuse_sync_batchnorm
from remat.strategies.segmented import RecomputeStrategy, chain_members
from remat.strategies.selective import SelectiveCheckpoint
from remat.strategies.stages import StageError, resolve_stages

PLAN_VERSION = 1
#: Version of :meth:`PlanStrategy.state_for_checkpoint`'s record.
SAVED_STATE_VERSION = 1


class PlanMismatch(ValueError):
    """A replayed plan was made for another network (its parameters differ) or run shape
    (batch size, input size, precision, accumulation, world size) than the run's; the
    message names ``strategy.path`` and, for a run shape, the key and both values.
    ``python train.py`` reports it in one line (exit code 1)."""


@dataclass
class UnitPlan:
    """One unit of a plan: ``path``, ``kind`` (``chain`` | ``module``) and its segments
    ``[(start, end, mode), ...]`` partitioning its blocks (a module is one block)."""

    path: str
    kind: str
    segments: list[tuple[int, int, str]]

    @property
    def changed(self) -> bool:
        return any(mode != "keep" for _, _, mode in self.segments)


@dataclass
class Plan:
    """A checkpointing plan and what it was made for and predicts.

    Attributes:
        units: the units, each with its segments and modes.
        model: class name of the network; ``fingerprint``: hash of its parameter names and
            shapes (:func:`remat.planner.profile.fingerprint`).
        batch_size, size, precision, accumulate_grad_batches: the run shape planned for.
        world_size: FSDP2 ranks planned for (1: not sharded); the peaks are one rank's.
        device: name of the device planned for; ``budget_bytes``: the budget.
        predicted_peak_bytes: traced (FakeTensorMode + MemTracker) peak of a training step
            with this plan (tensors: what training's peak-memory monitor measures);
            ``predicted_allocator_peak_bytes``: that peak with the batch and, where
            measured, the kernel temporaries (what the allocator reaches; the budget holds
            it plus ``margin_bytes``, kept free for what is not measured).
        none_peak_bytes: the same trace without checkpointing.
        recompute_flops: FLOPs the plan adds to a step (traced, exact); ``step_flops``: a
            step's FLOPs without checkpointing.
        predicted_overhead: modelled step time over ``none``'s (roofline, >= 1).
        objective: what the search minimised (``time`` or ``flops``).
        device_figures: the figures the time model used (FLOP/s, bytes/s, their source: the
            datasheet, or this CPU's calibration and what it was measured on).
        compiled: planned for the step ``compile=true`` runs (its traces held the dropout
            masks compiled recomputed regions keep); False in plan files from before.
    """

    units: list[UnitPlan]
    model: str = ""
    fingerprint: str = ""
    batch_size: int = 0
    size: Any = None
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    world_size: int = 1
    device: str = ""
    budget_bytes: int = 0
    predicted_peak_bytes: int = 0
    predicted_allocator_peak_bytes: int = 0
    margin_bytes: int = 0
    none_peak_bytes: int = 0
    recompute_flops: int = 0
    step_flops: int = 0
    predicted_overhead: float = 1.0
    objective: str = "time"
    compiled: bool = False
    device_figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    version: int = PLAN_VERSION

    def to_dict(self) -> dict:
        """JSON-ready form (``plan.json``; ``summary.json``'s ``plan``)."""
        out = asdict(self)
        out["units"] = [{"path": u.path, "kind": u.kind,
                         "segments": [{"start": s, "end": e, "mode": m}
                                      for s, e, m in u.segments]} for u in self.units]
        if isinstance(self.size, tuple):
            out["size"] = list(self.size)
        return out

    @classmethod
    def from_dict(cls, data: dict, source: str = "plan") -> Plan:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: not a plan, another version, or a malformed unit (names ``source``).
        """
        if not isinstance(data, dict) or "units" not in data:
            raise ValueError(f"{source}: not a remat plan (no 'units'); write one with "
                             "python -m remat.plan")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"{source}: plan version {data.get('version')!r}, this remat "
                             f"reads version {PLAN_VERSION}; plan again with python -m "
                             "remat.plan")
        try:
            units = [UnitPlan(str(u["path"]), str(u["kind"]),
                              [(int(s["start"]), int(s["end"]), str(s["mode"]))
                               for s in u["segments"]]) for u in data["units"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: malformed unit in 'units' ({err!r}); expected "
                             "{path, kind, segments: [{start, end, mode}]}") from err
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__
                  and k != "units"}
        size = fields.get("size")
        if isinstance(size, list):
            fields["size"] = tuple(size)
        return cls(units=units, **fields)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a ``plan.json``.

        Raises:
            FileNotFoundError: no such file (names it).
            ValueError: not JSON or not a plan (names the file).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"strategy.path={str(path)!r}: no such plan file; write "
                                    "one with python -m remat.plan ... (it saves plan.json)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"strategy.path={str(path)!r}: not JSON ({err})") from err
        return cls.from_dict(data, f"strategy.path={str(path)!r}")

    def summary(self) -> str:
        """One line per changed unit, e.g. ``decoder.blocks: keep 0, recompute 1-4`` (a
        network that is itself the chain: ``(the network): ...``)."""
        from remat.planner.search import Option, describe

        lines = [f"{u.path or '(the network)'}: {describe(Option(0, 0, 0.0, 0, u.segments))}"
                 for u in self.units if u.changed]
        return "\n".join(lines) if lines else "(keep everything)"


def _resolves(model: nn.Module, path: str) -> bool:
    try:
        resolve_stages(model, [path])
    except StageError:
        return False
    return True


class PlanStrategy(RecomputeStrategy):
    """Apply a :class:`Plan`: ``recompute`` segments become checkpointed regions,
    ``selective`` blocks use the ``selective`` matmul preset, ``offload`` segments are
    checkpointed regions whose inputs are moved to host memory (pinned, on CUDA; on a CPU
    they already are there and nothing moves), ``keep`` blocks are left alone.

    The plan names its own units, so ``model.stages`` is not used. Everything the other
    recomputing strategies guarantee holds (same function, BatchNorm statistics updated
    once, dropout masks kept, ``torch.compile`` composes), because each segment is run by
    the same mechanism (:mod:`remat.strategies.recompute`).

    Every training checkpoint keeps the plan (:meth:`state_for_checkpoint`), so a run
    resumed with ``strategy=budget`` trains on with it instead of planning again, and one
    resumed with ``strategy=plan`` with it instead of the file at ``strategy.path``.

    Args:
        plan: a :class:`Plan`, its dict form, or ``None`` with ``path``.
        path: a ``plan.json`` to read (``strategy=plan strategy.path=plan.json``).
        origin: where the plan comes from, for messages and ``summary.json`` (default
            ``strategy.path=...``, or ``plan``).
        request: what a budget asked for when this plan was made
            (:meth:`~remat.planner.BudgetStrategy.request`); ``None`` for a replayed file.
        resumed: the plan was read from the checkpoint being resumed (a plan for another
            network then means the checkpoint does not fit the model either).
        host: where ``offload`` segments put their inputs: ``cpu``, or ``meta`` in the
            planner's fake traces made on a CPU for a GPU
            (:class:`~remat.strategies.offload.HostOffload`).

    Raises:
        FileNotFoundError, ValueError: the plan file is missing or not a plan.
    """

    name = "plan"
    names_own_units = True  # model.stages is not used: errors name the plan, not the stages

    def __init__(self, plan: Plan | dict | None = None, path: str | None = None,
                 origin: str | None = None, request: dict | None = None,
                 resumed: bool = False, host: str = "cpu") -> None:
        if plan is None and path is None:
            raise ValueError("strategy plan: give strategy.path=<plan.json> (written by "
                             "python -m remat.plan) or a plan")
        if plan is None:
            plan = Plan.load(path)
        elif isinstance(plan, dict):
            plan = Plan.from_dict(plan)
        self.plan = plan
        self.path = str(path) if path is not None else None
        self.origin = origin or (f"strategy.path={self.path!r}" if self.path else "plan")
        self.request = dict(request) if request is not None else None
        self.resumed = bool(resumed)
        self._full = FullCheckpoint()
        self._selective = SelectiveCheckpoint("matmul")
        self._offload = OffloadCheckpoint(pin_memory=True, segments="full")
        self._offload._host = host

    @property
    def offloads(self) -> bool:
        """Whether any segment of the plan is ``offload``."""
        return any(mode == "offload" for u in self.plan.units for _, _, mode in u.segments)

    def apply(self, model: nn.Module, stages: Any = ()) -> StrategyReport:
        """Wrap ``model`` (the network) as the plan says; ``stages`` is ignored.

        Raises:
            PlanMismatch: the plan was made for another network (fingerprint differs).
            StageError: a unit path matches nothing, or its segments do not fit it.
        """
        from remat.planner.profile import fingerprint

        where = self.origin
        if self.plan.fingerprint and fingerprint(model) != self.plan.fingerprint:
            todo = ("the checkpoint was trained with that network: resume it with the model "
                    "config it was trained with" if self.resumed
                    else "plan again for this model with python -m remat.plan")
            raise PlanMismatch(f"{where}: this plan was made for another network ("
                               f"{self.plan.model or 'unknown'}, parameters differ); {todo}")
        units = [u for u in self.plan.units if u.changed]
        try:
            resolved = dict(resolve_stages(model, [u.path for u in units])) if units else {}
        except StageError as err:
            raise StageError(f"{where}: {err}; plan again for this model") from err
        wrapping.unwrap_all(model)
        # every unit of the plan, kept ones too: FSDP shards each (remat.sharding)
        # a plan a budget made says so (its request): logs, summary.json and a sweep's
        # report tell it from a replayed plan file
        report = StrategyReport(strategy="budget" if self.request else self.name, stages=[
            u.path for u in self.plan.units
            if u.changed or _resolves(model, u.path)])
        try:
            for unit in units:
                self._wrap_unit(unit, resolved[unit.path], report, where)
        except BaseException:
            wrapping.unwrap_all(model)
            raise
        wrapping.arm(model, self.name)
        return report

    def state_for_checkpoint(self) -> dict:
        """What every training checkpoint keeps (plain data, read with
        ``torch.load(weights_only=True)``): ``plan`` (:meth:`Plan.to_dict`), ``request``
        (the budget's request, or ``None`` for a replayed plan), ``origin`` and ``version``."""
        return {"version": SAVED_STATE_VERSION, "plan": self.plan.to_dict(),
                "request": self.request, "origin": self.origin}

    def _wrap_unit(self, unit: UnitPlan, module: nn.Module, report: StrategyReport,
                   where: str) -> None:
        owners = {"recompute": self._full, "selective": self._selective,
                  "offload": self._offload}
        if unit.kind == "module":
            if len(unit.segments) != 1 or unit.segments[0][:2] != (0, 1):
                raise StageError(f"{where}: unit {unit.path} is one module; expected one "
                                 "segment [0, 1)")
            if unit.segments[0][2] not in owners:
                raise StageError(f"{where}: unit {unit.path}: unknown mode "
                                 f"{unit.segments[0][2]!r} (keep, recompute, selective, "
                                 "offload)")
            owner = owners[unit.segments[0][2]]
            wrapping.install(module, wrapping.Wrap(owner, unit.path, owner.run))
            report.segments[unit.path] = [(0, 1)]
            report.wrapped.append(unit.path)
            return
        members = chain_members(module)
        bounds = [(s, e) for s, e, _ in unit.segments]
        if not bounds or bounds[0][0] != 0 or bounds[-1][1] != len(members) or any(
                a[1] != b[0] for a, b in zip(bounds, bounds[1:], strict=False)):
            raise StageError(f"{where}: segments {bounds} of unit {unit.path} do not "
                             f"partition its {len(members)} blocks; plan again")
        plan = ChainPlan(unit.path, bounds)
        done = []
        for start, end, mode in unit.segments:
            if mode == "keep":
                continue
            if mode not in owners:
                raise StageError(f"{where}: unit {unit.path}: unknown mode {mode!r} (keep, "
                                 "recompute, selective, offload)")
            owner = owners[mode]
            for index in range(start, end):
                name, member = members[index]
                wrapping.install(member, wrapping.Wrap(owner, f"{unit.path}.{name}",
                                                       owner.run, chain=plan, index=index))
                report.wrapped.append(f"{unit.path}.{name}")
            done.append((start, end))
        report.segments[unit.path] = done

    def preflight(self, model: nn.Module) -> None:
        """Refuse a recomputed unit holding a SyncBatchNorm (as the other strategies do).

        Raises:
            StageError: names the SyncBatchNorm module.
        """
        for _, module, wrap in wrapping.wraps_of(model):
            if wrap.owner in (self._full, self._selective, self._offload):
                refuse_sync_batchnorm(module, wrap.path)
