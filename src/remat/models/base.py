"""What every remat LightningModule shares: its network wrapped by a checkpointing strategy."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning as L
from torch import nn

from remat.errors import setup_error
from remat.strategies import (
    STRATEGY_STATE_KEY,
    CheckpointStrategy,
    NoCheckpoint,
    StageError,
    StrategyReport,
)
from remat.strategies.stages import (
    AUTO,
    ROOT,
    auto_stages,
    nothing_to_wrap,
    stage_setting,
)
from remat.strategies.wrapping import never_called

log = logging.getLogger(__name__)

class StrategyModule(L.LightningModule):
    """Base LightningModule: ``self.net`` with ``strategy`` applied to ``stages``.

    Subclasses build ``net`` and call :meth:`wrap_net`. After the first training batch the
    strategy verifies that what it wrapped was on the code path actually used. Every
    checkpoint keeps the strategy's record (:meth:`on_save_checkpoint`).
    """

    net: nn.Module

    def wrap_net(self, net: nn.Module, stages: Sequence[str] | str,
                 strategy: CheckpointStrategy | None) -> None:
        """Keep ``net`` and apply ``strategy`` (default ``none``) to its ``stages``.

        ``stages`` is a list of dotted paths (globs allowed); one path given as a bare string
        is one stage; ``""`` is the network itself; ``"auto"`` is the network itself when it
        is an ``nn.Sequential`` of several blocks, else the units
        :func:`remat.strategies.stages.discover_units` finds (outermost chains and modules
        with children), for a network nobody listed
        stages for. A strategy that names its own units (a plan) ignores ``stages``.

        Raises:
            remat.strategies.StageError: a stage matches no module (close names listed),
                ``stages`` is not a path or list of paths, or a strategy other than ``none``
                would wrap nothing (empty ``stages``, or ``auto`` on a network without units:
                the message lists the network's modules to pick from); the message names the
                ``model.stages`` config key.
        """
        self.net = net
        self.strategy = strategy if strategy is not None else NoCheckpoint()
        own_units = getattr(self.strategy, "names_own_units", False)
        try:
            setting = stage_setting(stages)
        except StageError as err:
            raise StageError(f"model.stages: {err}") from err
        stages = auto_stages(net) if setting == AUTO else setting
        if setting == AUTO:
            log.info("model.stages=auto: %s", ", ".join(
                "the network itself (an nn.Sequential)" if s == ROOT else s for s in stages)
                or "no unit found")
        self.stage_paths: list[str] = list(stages)  # FSDP units follow them too
        if not stages and self.strategy.name != "none" and not own_units:
            why = ("model.stages=auto found no unit in it (no chain and no module with "
                   "children)" if setting == AUTO else "model.stages is empty")
            raise nothing_to_wrap(f"strategy={self.strategy.name}", net, why,
                                  suggest_auto=setting != AUTO)
        try:
            self.strategy_report: StrategyReport = self.strategy.apply(self.net, stages)
        except StageError as err:
            if own_units:
                raise  # a plan names its units (and its file) itself; model.stages is unused
            raise StageError(f"model.stages={stages}: {err}") from err
        report = self.strategy_report
        if report.strategy == "none":
            log.info("strategy none: every activation is kept (nothing recomputed)")
        else:
            log.info("strategy %s wrapped %d modules in %s%s", report.strategy,
                     len(report.wrapped), ", ".join(report.stages),
                     f": segments {report.segments}" if report.segments else "")

    def compile_net(self, options: dict[str, Any] | None = None,
                    memory_budget: float | None = None) -> None:
        """Have ``self.net`` compiled with ``torch.compile`` (inductor, with its config
        ``options``, under the partitioner's ``activation_memory_budget`` ``memory_budget``
        when given) when training starts (:meth:`configure_model`: after the strategy
        wrapped it and FSDP sharded it), in place: parameter names and checkpoints are
        those of the eager network. Training's ``compile=true`` (and
        ``compile_memory_budget``).

        Raises:
            ValueError: ``memory_budget`` outside [0, 1], or below 1 on a network with
                dropout or drop-path (:func:`remat.compiling.refuse_random_ops_recomputed`).
        """
        from remat.compiling import check_partitioner_budget, refuse_random_ops_recomputed

        memory_budget = check_partitioner_budget(memory_budget, "compile_memory_budget")
        refuse_random_ops_recomputed(self.net, memory_budget, "compile_memory_budget")
        self.compile_memory_budget = memory_budget
        self.compile_options: dict[str, Any] | None = dict(options or {})

    @property
    def compiled(self) -> bool:
        """Whether ``self.net`` runs compiled (:meth:`compile_net`, once training started)."""
        return getattr(self, "compile_backend", None) is not None

    def _compile(self) -> None:
        options = getattr(self, "compile_options", None)
        if options is None or self.compiled:
            return
        from remat.compiling import (
            TRAINING_BACKEND,
            RowBackend,
            compile_row,
            warn_random_ops_kept,
        )

        found = warn_random_ops_kept(self.net, bool(getattr(self.strategy, "recomputes",
                                                            False)), log)
        plan = getattr(self.strategy, "plan", None)
        if found and plan is not None and not getattr(plan, "compiled", True):
            log.warning("compile=true with %s: that plan was made for an eager step "
                        "(compiled: false), so its predicted peak leaves out those masks; "
                        "plan for this run with python -m remat.plan ... compile=true",
                        getattr(self.strategy, "origin", "a plan file"))
        budget = getattr(self, "compile_memory_budget", None)
        self.compile_backend = RowBackend(TRAINING_BACKEND, memory_budget=budget,
                                          options=options)
        compile_row(self.net, self.compile_backend)
        log.info("torch.compile(%s) of the network, in place%s%s", TRAINING_BACKEND,
                 f", inductor options {options}" if options else "",
                 f", partitioner activation_memory_budget {budget:g}" if budget is not None
                 else "")

    def configure_model(self) -> None:
        """Shard ``self.net`` with FSDP2 when the trainer runs Lightning's
        ``ModelParallelStrategy`` (``trainer=fsdp``), after the strategy wrapped it:
        one FSDP unit per checkpointed segment and per block of each stage, then the network
        (:func:`remat.sharding.shard`). Under any other trainer strategy, nothing. Then,
        after :meth:`compile_net`, compile the network. Called by Lightning once per
        ``fit``/``validate``/``test``; sharding and compiling happen once.

        Raises:
            remat.strategies.StageError: the checkpointing strategy says it cannot be
                sharded (``shardable`` false), or the trainer's mesh has a tensor-parallel
                axis.
        """
        from lightning.pytorch.strategies import ModelParallelStrategy

        from remat.sharding import is_sharded, shard

        trainer_strategy = self._trainer.strategy if self._trainer is not None else None
        if not isinstance(trainer_strategy, ModelParallelStrategy) or is_sharded(self.net):
            self._compile()
            return
        if not getattr(self.strategy, "shardable", True):
            raise StageError(
                f"trainer=fsdp cannot shard a network under strategy={self.strategy.name} "
                f"({type(self.strategy).__name__}); use trainer=ddp with this strategy, or "
                "another strategy with trainer=fsdp")
        mesh = self.device_mesh
        names = mesh.mesh_dim_names or ()
        if mesh.ndim > 1:
            tp = mesh["tensor_parallel"].size() if "tensor_parallel" in names else 0
            if tp != 1:
                raise StageError(
                    f"trainer.strategy: remat shards over data-parallel ranks only, but the "
                    f"device mesh {dict(zip(names, mesh.shape, strict=False))} has a tensor-"
                    "parallel axis; use trainer=fsdp (remat.models.fsdp.FSDP2Strategy) or set "
                    "tensor_parallel_size=1")
            mesh = mesh["data_parallel"]
        self._same_units_on_every_rank(mesh)
        name = type(self.net).__name__  # before fully_shard renames the class FSDP<name>
        self.shard_report = shard(
            self.net, mesh, self.strategy_report,
            reshard_after_forward=getattr(trainer_strategy, "reshard_after_forward", True),
            stages=self.stage_paths)
        log.info("FSDP2 sharded %s over %d ranks: %d units below the root", name,
                 mesh.size(), len(self.shard_report.units))
        self._compile()

    def _same_units_on_every_rank(self, mesh: Any) -> None:
        """Raise, instead of hanging in a collective, when the ranks wrapped the network
        differently (e.g. a budget planned with measured times on each rank)."""
        import torch.distributed as dist

        from remat.sharding import shard_units

        mine = shard_units(self.net, self.strategy_report, self.stage_paths)
        every: list[Any] = [None] * mesh.size()
        dist.all_gather_object(every, mine, group=mesh.get_group())
        if any(units != mine for units in every):
            raise StageError(
                "trainer=fsdp: the ranks wrapped the network differently (FSDP units per "
                f"rank: {every}); every rank must apply the same strategy and plan. With "
                "strategy=budget strategy.calibrate=true plan once (python -m remat.plan) "
                "and replay it with strategy=plan strategy.path=plan.json")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the strategy's record (a plan, with what it was planned for) in every
        checkpoint, under :data:`STRATEGY_STATE_KEY`: a run resumed with ``strategy=budget``
        trains on with that plan instead of planning again (:func:`remat.planner.run.plan_for_run`),
        one resumed with ``strategy=plan`` instead of reading ``strategy.path`` again
        (:func:`remat.planner.run.resumed_replay`)."""
        state = self.strategy.state_for_checkpoint()
        if state is not None:
            checkpoint[STRATEGY_STATE_KEY] = state

    def on_fit_start(self) -> None:
        self.strategy.preflight(self.net)  # e.g. SyncBatchNorm inside a recomputed unit

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not getattr(self, "_strategy_verified", False):
            try:
                self.strategy.verify(self.net)  # the wrapped stages are on the path used
            except StageError as err:
                unused = never_called(self.net)
                listed = ",".join(f"{path}.*" if path else "*" for path in unused)
                raise setup_error(StageError(
                    f"{err} (train.py: model.stages=[{listed}], or name the modules the "
                    "forward calls)")) from err
            self._strategy_verified = True
