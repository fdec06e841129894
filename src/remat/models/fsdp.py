"""``trainer=fsdp``: Lightning's ``ModelParallelStrategy`` (FSDP2) sharding remat's modules.

Lightning's ``ModelParallelStrategy`` runs FSDP2 (``torch.distributed.fsdp.fully_shard``)
and leaves where to shard to the LightningModule's ``configure_model`` hook;
:meth:`remat.models.base.StrategyModule.configure_model` shards there with
:func:`remat.sharding.shard`, after the checkpointing strategy wrapped the network (the order
that keeps both working). :class:`FSDP2Strategy` adds two things to it:

- a 1-D data-parallel mesh over every rank of every node (``ModelParallelStrategy``'s
  ``auto`` sizes put only the nodes on the data-parallel axis and the GPUs of a node on the
  tensor-parallel one, which remat does not use);
- sharded checkpoints written atomically: the shards go to a hidden folder beside
  ``last.ckpt`` that replaces the previous folder only once every rank has written, so a
  run killed while saving keeps its previous checkpoint; one killed between the swap's two
  renames is put right by :func:`recover_swapped_checkpoints` when the run starts again.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

log = logging.getLogger(__name__)


def _swap_names(path: Path) -> tuple[Path, Path]:
    """The staging and previous-copy folders of the sharded checkpoint ``path``."""
    return path.with_name(f".{path.name}.writing"), path.with_name(f".{path.name}.old")


def recover_swapped_checkpoints(folder: str | Path) -> list[Path]:
    """Finish a sharded-checkpoint swap a kill interrupted, in ``folder``.

    :meth:`FSDP2Strategy.save_checkpoint` renames ``last.ckpt`` to ``.last.ckpt.old``, then
    the fully written ``.last.ckpt.writing`` to ``last.ckpt``; a run killed between the two
    renames has no ``last.ckpt``. The newer copy (``.writing``, complete once the old one was
    moved aside) is renamed to the checkpoint's name, else the previous one (``.old``); a
    stale ``.old`` beside its checkpoint is removed.

    Returns:
        the checkpoint paths restored (each logged).
    """
    folder = Path(folder)
    restored: list[Path] = []
    if not folder.is_dir():
        return restored
    for old in sorted(folder.glob(".*.old")):
        path = folder / old.name[1:-len(".old")]
        staging, _ = _swap_names(path)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            continue
        source = staging if staging.is_dir() else old
        source.rename(path)
        log.warning("%s was missing (a run stopped while swapping in a sharded checkpoint): "
                    "restored it from %s", path, source.name)
        shutil.rmtree(old, ignore_errors=True)
        restored.append(path)
    return restored


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 data parallelism over all ranks for remat's LightningModules.

    Args:
        reshard_after_forward: free each unit's gathered parameters after its forward and
            gather them again in backward (True: ZeRO-3, ``FULL_SHARD``), or keep them until
            backward (False: ZeRO-2, ``SHARD_GRAD_OP``; more memory, fewer all-gathers).
        save_distributed_checkpoint: True writes ``last.ckpt`` as a folder with one shard per
            rank (torch.distributed.checkpoint; loads on any number of ranks under this
            strategy); False gathers full weights and optimizer state on rank 0 into one
            file (loads anywhere, also on one process without FSDP).
        process_group_backend: ``gloo`` (CPU) or ``nccl``; ``None`` picks by device.
        **kwargs: passed on to ``ModelParallelStrategy`` (e.g. ``timeout``).

    Raises:
        ValueError: ``reshard_after_forward`` or ``save_distributed_checkpoint`` is not a
            bool (names the ``trainer.strategy`` key).
    """

    def __init__(self, reshard_after_forward: bool = True,
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, **kwargs: Any) -> None:
        for key, value in (("reshard_after_forward", reshard_after_forward),
                           ("save_distributed_checkpoint", save_distributed_checkpoint)):
            if not isinstance(value, bool):
                raise ValueError(f"trainer.strategy.{key}: expected true or false, got "
                                 f"{value!r}")
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, **kwargs)
        self.reshard_after_forward = bool(reshard_after_forward)

    def setup_environment(self) -> None:
        # every rank on the data-parallel axis, none on the tensor-parallel one
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``filepath``: one file through the trainer's checkpoint
        I/O (rank 0), or, sharded, a folder swapped in only after every rank wrote its shard.
        """
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        staging, old = _swap_names(path)
        if self.global_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        self.barrier("remat_ckpt_staging")
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier("remat_ckpt_written")
        if self.global_rank == 0:
            shutil.rmtree(old, ignore_errors=True)
            if path.is_dir():
                path.rename(old)
            elif path.exists():
                path.unlink()
            staging.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier("remat_ckpt_swapped")
