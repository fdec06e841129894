"""What Lightning does not restore on resume: the global RNG, and the train loader's shuffle
order and position inside the epoch.

Lightning restores weights, optimizer, schedulers and loop counters from a checkpoint, and a
train loader's position only when the loader implements ``state_dict``/``load_state_dict``
(e.g. torchdata's ``StatefulDataLoader``), and then only for a checkpoint taken inside an
epoch. A plain ``DataLoader`` with ``shuffle=True`` restarts its generator, so the first
epoch after a resume replays epoch 0's order, and the global RNG (dropout masks, random
crops drawn in the main process) starts from the seed again. :class:`ResumeState` keeps both in
the checkpoint (its callback state) and puts them back.

Under DDP/FSDP Lightning replaces a train loader's sampler by a ``DistributedSampler`` of its
own, which would drop the resume wrapper: :class:`ResumeState` shards the epoch over the
ranks itself (:class:`_ShardedResumableSampler`, the order Lightning's sampler gives), so a
resume inside an epoch skips exactly the batches each rank trained.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from remat.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gathered(state: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's ``state`` (a collective: Lightning builds the checkpoint on all ranks),
    or None on one process."""
    _, world = _rank_and_world()
    if world == 1:
        return None
    every: list[Any] = [None] * world
    torch.distributed.all_gather_object(every, state)
    return every


class _ResumePoint:
    """Where a train sampler's pass starts: the loader generator's state at the epoch's start
    (recorded each pass), and the states a resume left to put back (``start``: between
    epochs, with the global RNG; ``resume``: inside an epoch, with the indices to skip)."""

    def _init_resume_point(self, generator: torch.Generator | None) -> None:
        self.generator = generator
        self.epoch_start: torch.Tensor | None = None
        self.resume: tuple[torch.Tensor | None, int] | None = None
        self.start: tuple[torch.Tensor | None, dict[str, Any] | None] | None = None

    def begin_pass(self) -> int:
        """The start of a pass: put back the states a resume left (the loader generator,
        and the global RNG for a resume between epochs), record the generator's state as
        the epoch's start, and return how many of this pass's indices were trained before
        the checkpoint (0 but once after a resume inside an epoch)."""
        skip = 0
        if self.start is not None:  # first pass after a resume between epochs
            (state, rng), self.start = self.start, None
            if state is not None and self.generator is not None:
                self.generator.set_state(state)
            if rng is not None:
                set_rng_state(rng)
        if self.resume is not None:
            (state, skip), self.resume = self.resume, None
            if state is not None and self.generator is not None:
                self.generator.set_state(state)
        generator = self.generator
        self.epoch_start = generator.get_state() if generator is not None else None
        return skip


class _ResumableSampler(_ResumePoint, Sampler):
    """Wraps the sampler inside a train loader's ``BatchSampler``: at the start of each pass
    it records the loader generator's state (before the epoch permutation is drawn from it)
    or, once after a resume, sets that state back and leaves out the indices of the batches
    already trained. ``len`` is the full length, as Lightning expects of a resumed loader."""

    def __init__(self, inner: Any, generator: torch.Generator | None) -> None:
        self.inner = inner
        self._init_resume_point(generator)

    def __iter__(self) -> Iterator[int]:
        skip = self.begin_pass()
        return itertools.islice(iter(self.inner), skip, None)

    def __len__(self) -> int:
        return len(self.inner)

    #: one process sees the whole epoch
    num_replicas, rank = 1, 0


class _Length:
    """A stand-in dataset of ``n`` positions, for :class:`DistributedSampler` to permute."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class _ShardedResumableSampler(_ResumePoint, DistributedSampler):
    """One rank's share of a train loader's epoch, resumable: the order Lightning's own
    distributed sampler gives the loader (torch's ``DistributedSampler``: a permutation
    seeded by ``seed + epoch``, padded to a multiple of the ranks by repeating its start, or
    cut with ``drop_last``, every ``num_replicas``-th index from ``rank``), with the resume
    steps of :class:`_ResumableSampler`.

    ``by_dataset``: the permutation is of the dataset's indices (Lightning's rule for a
    ``RandomSampler`` or ``SequentialSampler``, whose own order is then unused); otherwise
    of the positions of ``inner``'s indices, drawn anew each pass (a sampler choosing an
    epoch's windows, :class:`remat.data.text.WindowSampler`), as Lightning's
    ``DistributedSamplerWrapper`` does. ``len`` is this rank's full share.
    """

    def __init__(self, inner: Any, generator: torch.Generator | None, dataset: Any, *,
                 by_dataset: bool, num_replicas: int, rank: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> None:
        super().__init__(dataset if by_dataset else _Length(len(inner)),
                         num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.inner = inner
        self.by_dataset = by_dataset
        self._init_resume_point(generator)

    def __iter__(self) -> Iterator[int]:
        skip = self.begin_pass()
        order = None if self.by_dataset else list(self.inner)
        positions = super().__iter__()
        if order is not None:
            positions = (order[p] for p in positions)
        return itertools.islice(positions, skip, None)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if not self.by_dataset and callable(getattr(self.inner, "set_epoch", None)):
            self.inner.set_epoch(epoch)


# DataLoader arguments a rebuilt loader takes from the one it replaces (every other one)
_LOADER_OWN = {"self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler",
               "drop_last"}


def _with_sampler(loader: DataLoader, sampler: Sampler) -> DataLoader | None:
    """``loader`` made again with ``sampler`` (its batch size, ``drop_last`` and every other
    setting kept), or None for a loader this cannot remake faithfully (a ``DataLoader``
    subclass, a custom batch sampler)."""
    batches = loader.batch_sampler
    if type(loader) is not DataLoader or type(batches) is not BatchSampler:
        return None
    kwargs = {name: getattr(loader, name)
              for name in inspect.signature(DataLoader.__init__).parameters
              if name not in _LOADER_OWN and hasattr(loader, name)}
    return DataLoader(loader.dataset, batch_size=batches.batch_size, sampler=sampler,
                      drop_last=batches.drop_last, **kwargs)


def _lightning_shards(trainer: L.Trainer | None, loader: DataLoader) -> bool:
    """Whether Lightning would put its own ``DistributedSampler`` into this train loader
    (``Trainer(use_distributed_sampler=True)``, the default, under a distributed strategy)."""
    if trainer is None or trainer.distributed_sampler_kwargs is None:
        return False
    if isinstance(loader.dataset, IterableDataset):
        return False
    # the Trainer keeps its use_distributed_sampler argument nowhere public
    connector = getattr(trainer, "_accelerator_connector", None)
    return bool(getattr(connector, "use_distributed_sampler", True))


class ResumeState(L.Callback):
    """Saves the global RNG and the train loader's state with every checkpoint and restores
    them on resume, so an interrupted and resumed run sees the same batches in the same order
    and draws the same random numbers as an uninterrupted run with the same seed.

    Loader state: inside an epoch, the state of the loader's ``generator`` (the one its
    ``RandomSampler`` draws the epoch permutation from) when the epoch's pass began, and how
    many batches of the epoch were trained (Lightning's batch progress); at an epoch's end,
    the generator's state for the next epoch. On resume the generator is set back and the
    batches already trained are skipped as sampler indices (no sample is loaded). The global
    RNG is restored at the point the checkpoint was taken: before the next epoch's iterator
    is created (checkpoint between epochs), or when training starts, after that iterator
    exists and before the first batch is fetched (checkpoint inside an epoch); Lightning runs
    the sanity check with an isolated RNG.

    Under DDP/FSDP (a strategy for which Lightning would put a ``DistributedSampler`` into
    the train loader) the loader is made again with :class:`_ShardedResumableSampler`
    instead, which gives every rank the share Lightning's sampler would (same seed,
    shuffle, padding) and skips, on resume, the indices that rank trained (the checkpoint
    keeps every rank's count); a loader with its own plain ``DistributedSampler`` keeps that
    sampler's settings. Resumed on another number of ranks, each skips an even share of
    what all ranks trained (the order then differs anyway, and a warning says so).

    A resumed run also sets aside the rows an earlier run logged at the checkpoint's global
    step or later (:meth:`remat.loggers.CSVLogger.set_aside_steps_from`): after a kill
    without a checkpoint (SIGKILL, out of memory) they are steps this run trains again.

    Exact for remat's train loaders with any ``data.num_workers``: each sample's random
    draws start from a seed drawn with the epoch's order (:mod:`remat.data.seeding`). A
    loader of one's own gets its order and position back, and with workers not the RNG
    inside them (persistent workers carry theirs on from the epoch's start). Needs a datamodule
    (``trainer.fit(datamodule=...)``) whose train loader has a ``BatchSampler``: its
    ``train_dataloader`` is wrapped for the fit and unwrapped after.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None
        self._rng: dict[str, Any] | None = None
        self._trainer: L.Trainer | None = None
        self._sampler: _ResumableSampler | None = None
        self._original = None
        self._batch_size: int | None = None

    # --- wrapping the datamodule's train_dataloader ----------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        dm = trainer.datamodule
        if stage != "fit" or dm is None or self._original is not None:
            return
        original = dm.train_dataloader
        # Lightning warns that a loader without state_dict cannot resume mid-epoch; this
        # callback restores its position itself (and says so when it resumes)
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended "
                                "before the epoch ended", category=PossibleUserWarning)

        @functools.wraps(original)
        def train_dataloader() -> Any:
            return self._prepare(original())

        self._original = original
        dm.train_dataloader = train_dataloader

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._original is not None and trainer.datamodule is not None:
            trainer.datamodule.__dict__.pop("train_dataloader", None)
        self._original = None

    def _prepare(self, loader: Any) -> Any:
        """Called with a new train loader, before Lightning creates its iterator; returns
        the loader to train with (made again with a sharding sampler under DDP/FSDP)."""
        pending, self._pending = self._pending, None
        generator = getattr(loader, "generator", None)
        batch_sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(loader, DataLoader) or not hasattr(batch_sampler, "sampler"):
            self._sampler = None
            if pending and pending.get("batches"):
                rank_zero_warn("ResumeState: the train loader has no BatchSampler; the "
                               "resumed epoch starts over instead of skipping the "
                               f"{pending['batches']} batches already trained")
            return loader
        inner = batch_sampler.sampler
        if not isinstance(inner, _ResumableSampler | _ShardedResumableSampler):
            own = getattr(inner, "generator", None)  # RandomSampler(generator=...)
            own = own if isinstance(own, torch.Generator) else generator
            sharded = self._sharded(loader, inner, own)
            if sharded is not None:
                loader, inner = sharded
            else:
                inner = batch_sampler.sampler = _ResumableSampler(inner, own)
        self._sampler = inner
        self._batch_size = loader.batch_sampler.batch_size
        try:
            self._num_batches: int | None = len(loader.batch_sampler)
        except TypeError:  # a sampler without a length
            self._num_batches = None
        if pending is not None:
            self._apply(pending)
        return loader

    def _sharded(self, loader: DataLoader, inner: Any, generator: torch.Generator | None
                 ) -> tuple[DataLoader, _ShardedResumableSampler] | None:
        """Under DDP/FSDP: ``loader`` made again with a :class:`_ShardedResumableSampler`
        in place of the ``DistributedSampler`` Lightning would put there (same ranks, seed
        and shuffle), or taking over the loader's own plain ``DistributedSampler``; None
        for a loader of one process (or one Lightning leaves alone)."""
        if type(inner) is DistributedSampler:  # the user's: its settings, its order
            sampler = _ShardedResumableSampler(
                inner, generator, inner.dataset, by_dataset=True,
                num_replicas=inner.num_replicas, rank=inner.rank, seed=inner.seed,
                shuffle=inner.shuffle, drop_last=inner.drop_last)
            sampler.set_epoch(inner.epoch)
        elif isinstance(inner, DistributedSampler) or not _lightning_shards(self._trainer,
                                                                            loader):
            return None
        else:
            trainer = self._trainer
            sampler = _ShardedResumableSampler(
                inner, generator, loader.dataset,
                by_dataset=isinstance(inner, RandomSampler | SequentialSampler),
                # Lightning's choices (lightning.pytorch's _get_distributed_sampler)
                shuffle=not trainer.overfit_batches,
                seed=int(os.getenv("PL_GLOBAL_SEED", 0)), **trainer.distributed_sampler_kwargs)
        rebuilt = _with_sampler(loader, sampler)
        if rebuilt is None:
            rank_zero_warn(f"ResumeState: cannot remake the train loader "
                           f"({type(loader).__name__} with {type(loader.batch_sampler).__name__}"
                           ") with a resumable distributed sampler: a resume inside an epoch "
                           "will not skip the batches already trained")
            return None
        return rebuilt, sampler

    def _apply(self, pending: dict[str, Any], iterated: bool = False) -> None:
        """Put the prepared sampler where the checkpointed run's loader was. Called from
        :meth:`_prepare`, or from :meth:`load_state_dict` when the loader was made before the
        checkpoint was read (``iterated``: Lightning's ``ModelParallelStrategy`` restores
        after setup, and a scheduler asking ``estimated_stepping_batches`` makes the loader
        and its first iterator there)."""
        inner, batch_size = self._sampler, self._batch_size
        self._warn_if_reshaped(pending, batch_size)
        if pending.get("batches"):
            samples = self._samples_to_skip(pending)
            inner.resume = (pending.get("generator"), samples)
            log.info("resume: skipping the %d batches (%d samples) of this epoch trained "
                     "before the checkpoint", pending["batches"], samples)
            return
        # between epochs: what the uninterrupted run does next is create the next epoch's
        # iterator, which may draw its base seed from the global RNG (a loader without a
        # generator): restore both before Lightning does that
        if pending.get("generator") is not None and inner.generator is not None:
            inner.generator.set_state(pending["generator"])
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None
        # the iterator Lightning makes before training starts and never reads draws from
        # these states after this restore, unless it was made before it (iterated)
        self._between_epochs = not iterated
        self._close_restored_epoch()

    def _samples_to_skip(self, pending: dict[str, Any]) -> int:
        """This rank's indices of the resumed epoch that the checkpointed run trained,
        whatever the batch size is now: the rank's own count when the ranks are the same,
        else an even share of all ranks' (the epoch's first positions, as ranks take turns
        through the permutation; another world size also makes another permutation)."""
        sampler = self._sampler
        per_rank = pending.get("samples_per_rank")
        if per_rank and len(per_rank) == sampler.num_replicas:
            return int(per_rank[sampler.rank])
        if per_rank:
            total = sum(per_rank)
        else:  # a checkpoint of one process (or of a loader that was not sharded)
            total = pending.get("samples", pending["batches"] * (self._batch_size or 0))
        return int(total) // sampler.num_replicas

    _num_batches: int | None = None

    def _close_restored_epoch(self) -> None:
        """After an epoch-end checkpoint, make Lightning's restored loop count that epoch's
        batches as this loader's: resumed with another batch size, it compared the old
        count with the new loader's length and trained on in the finished epoch (batch 4 ->
        2 after an 8-batch epoch: 8 more batches of that epoch). The counters move by the
        same amount, so Lightning still sees a restart after the epoch's last batch."""
        trainer, n = self._trainer, self._num_batches
        if trainer is None or n is None:
            return
        limit = getattr(trainer, "limit_train_batches", 1.0)  # Lightning's rule: an int
        if isinstance(limit, int) and not isinstance(limit, bool):  # caps the count, a
            n = min(n, limit)                                        # fraction scales it
        elif isinstance(limit, float) and limit < 1.0:
            n = int(n * limit)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.completed
        if not progress.is_last_batch or done in (0, n):
            return
        delta = n - done
        for counts in (progress.current, progress.total):
            counts.ready += delta
            counts.started += delta
            counts.processed += delta
            counts.completed += delta
        log.info("resume: the checkpoint's epoch ended after %d batches of the old size; "
                 "counted as the %d of this loader", done, n)

    _between_epochs = False

    def _warn_if_reshaped(self, pending: dict[str, Any], batch_size: int) -> None:
        """Warn when the resumed run's batch, accumulation or epoch length differ from the
        checkpointed run's: training goes on, but is no longer the uninterrupted run."""
        trainer = self._trainer
        now = {"data.batch_size": batch_size,
               "accumulate_grad_batches": getattr(trainer, "accumulate_grad_batches", None),
               "samples per epoch": self._epoch_samples(),
               "ranks": getattr(trainer, "world_size", None)}
        then = {"data.batch_size": pending.get("batch_size"),
                "accumulate_grad_batches": pending.get("accumulate_grad_batches"),
                "samples per epoch": pending.get("epoch_samples"),
                "ranks": pending.get("world_size")}
        changed = [f"{k} {then[k]} -> {now[k]}" for k in now
                   if then[k] is not None and now[k] is not None and then[k] != now[k]]
        if changed:
            rank_zero_warn(
                "resuming with another run shape than the checkpoint was trained with ("
                + ", ".join(changed) + "): training goes on from the checkpoint, but the "
                "losses will not be those of an uninterrupted run. Inside an epoch the "
                "samples already trained are skipped, while Lightning still counts the "
                "epoch's trained batches at the old size, so with another batch size the "
                "rest of this epoch is cut short or runs long; resume from an epoch-end "
                "checkpoint to change it")

    def _epoch_samples(self) -> int | None:
        sampler = self._sampler
        try:
            if isinstance(sampler, _ShardedResumableSampler):  # all ranks' share, unpadded
                return len(sampler.dataset)
            return len(sampler.inner) if sampler is not None else None
        except TypeError:  # a sampler without a length
            return None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path is not None:
            # a run killed after its last checkpoint had logged steps this run trains again
            for logger in trainer.loggers:
                set_aside = getattr(logger, "set_aside_steps_from", None)
                moved = set_aside(trainer.global_step) if set_aside is not None else None
                if moved:
                    log.info("resuming at global step %d: %d rows an earlier run logged at "
                             "that step or later (trained again now) moved to "
                             "metrics.replayed.csv", trainer.global_step, moved)
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None
        if self._between_epochs and self._sampler is not None:
            # Resuming from a checkpoint taken after an epoch's last batch but before the
            # epoch ended (e.g. at its validation), Lightning makes an iterator here that it
            # never reads, then another for the next epoch: the states as they are now,
            # after the first iterator was made, are the ones the next pass must start from
            self._between_epochs = False
            generator = self._sampler.generator
            self._sampler.start = (generator.get_state() if generator is not None else None,
                                   rng_state())

    # --- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rng": rng_state()}
        loader = self._loader_state()
        if loader is not None:
            state["loader"] = loader
        # every rank's RNG (dropout masks differ by rank) and place in its share of the epoch
        samples = loader.get("samples") if loader is not None else None
        ranks = _gathered({"rng": state["rng"], "samples": samples})
        if ranks is not None:
            state["rng_per_rank"] = [r["rng"] for r in ranks]
            if samples is not None and isinstance(self._sampler, _ShardedResumableSampler):
                loader["samples_per_rank"] = [int(r["samples"]) for r in ranks]
        return state

    def _loader_state(self) -> dict[str, Any] | None:
        """Where the train loader is: the generator state to start the next pass from and
        how many batches of the open epoch were trained (``samples``: indices of this rank)."""
        trainer, sampler = self._trainer, self._sampler
        if trainer is None or sampler is None:
            return None
        progress = trainer.fit_loop.epoch_loop.batch_progress
        served = int(progress.current.ready)
        shape = {"batch_size": self._batch_size, "epoch_samples": self._epoch_samples(),
                 "accumulate_grad_batches": trainer.accumulate_grad_batches,
                 "world_size": trainer.world_size}
        if progress.is_last_batch or served >= trainer.num_training_batches or served == 0:
            # between epochs: the next epoch's pass starts from the generator as it is now
            generator = sampler.generator
            return {"generator": generator.get_state() if generator is not None else None,
                    "batches": 0, **shape}
        loader = {"generator": sampler.epoch_start, "batches": served, **shape}
        if self._batch_size:
            loader["samples"] = served * self._batch_size
        return loader

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rng = state_dict.get("rng")
        self._pending = state_dict.get("loader")
        ranks = state_dict.get("rng_per_rank")
        if ranks:
            rank, world = _rank_and_world()
            if world == len(ranks):
                self._rng = ranks[rank]
            else:
                rank_zero_warn(f"the checkpoint holds the RNG of {len(ranks)} ranks, this run "
                               f"has {world}: every rank starts from rank 0's RNG, so random "
                               "draws (dropout masks) differ from an uninterrupted run")
        if self._sampler is not None and self._pending is not None:  # loader made already
            pending, self._pending = self._pending, None
            self._apply(pending, iterated=True)
