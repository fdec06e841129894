"""What Lightning does not restore on resume: the global RNG, and the train loader's shuffle
order and position inside the epoch.

Lightning restores weights, optimizer, schedulers and loop counters from a checkpoint, and a
train loader's position only when the loader implements ``state_dict``/``load_state_dict``
(e.g. torchdata's ``StatefulDataLoader``), and then only for a checkpoint taken inside an
epoch. A plain ``DataLoader`` with ``shuffle=True`` restarts its generator, so the first
epoch after a resume replays epoch 0's order, and the global RNG (dropout masks, random
crops drawn in the main process) starts from the seed again. :class:`ResumeState` keeps both in
the checkpoint (its callback state) and puts them back.
"""

from __future__ import annotations

import functools
import itertools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, Sampler

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


class _ResumableSampler(Sampler):
    """Wraps the sampler inside a train loader's ``BatchSampler``: at the start of each pass
    it records the loader generator's state (before the epoch permutation is drawn from it)
    or, once after a resume, sets that state back and leaves out the indices of the batches
    already trained. ``len`` is the full length, as Lightning expects of a resumed loader."""

    def __init__(self, inner: Any, generator: torch.Generator | None) -> None:
        self.inner = inner
        self.generator = generator
        self.epoch_start: torch.Tensor | None = None
        self.resume: tuple[torch.Tensor | None, int] | None = None
        self.start: tuple[torch.Tensor | None, dict[str, Any] | None] | None = None

    def __iter__(self) -> Iterator[int]:
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
        self.epoch_start = self.generator.get_state() if self.generator is not None else None
        return itertools.islice(iter(self.inner), skip, None)

    def __len__(self) -> int:
        return len(self.inner)


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

    Exact for loaders without workers (``data.num_workers=0``). With workers, the order and
    position are restored, but not the RNG inside persistent workers, nor (for a resume
    inside an epoch) the worker seeds of that epoch. Needs a datamodule
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
            loader = original()
            self._prepare(loader)
            return loader

        self._original = original
        dm.train_dataloader = train_dataloader

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._original is not None and trainer.datamodule is not None:
            trainer.datamodule.__dict__.pop("train_dataloader", None)
        self._original = None

    def _prepare(self, loader: Any) -> None:
        """Called with a new train loader, before Lightning creates its iterator."""
        pending, self._pending = self._pending, None
        generator = getattr(loader, "generator", None)
        batch_sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(loader, DataLoader) or not hasattr(batch_sampler, "sampler"):
            self._sampler = None
            if pending and pending.get("batches"):
                rank_zero_warn("ResumeState: the train loader has no BatchSampler; the "
                               "resumed epoch starts over instead of skipping the "
                               f"{pending['batches']} batches already trained")
            return
        inner = batch_sampler.sampler
        if not isinstance(inner, _ResumableSampler):
            own = getattr(inner, "generator", None)  # RandomSampler(generator=...)
            inner = batch_sampler.sampler = _ResumableSampler(
                inner, own if isinstance(own, torch.Generator) else generator)
        self._sampler = inner
        self._batch_size = batch_sampler.batch_size
        try:
            self._num_batches: int | None = len(batch_sampler)
        except TypeError:  # a sampler without a length
            self._num_batches = None
        if pending is not None:
            self._apply(pending)

    def _apply(self, pending: dict[str, Any]) -> None:
        """Put the prepared sampler where the checkpointed run's loader was. Called from
        :meth:`_prepare`, or from :meth:`load_state_dict` when the loader was made before the
        checkpoint was read (Lightning's ``ModelParallelStrategy`` restores after setup,
        and a scheduler asking ``estimated_stepping_batches`` makes the loader there)."""
        inner, batch_size = self._sampler, self._batch_size
        self._warn_if_reshaped(pending, batch_size)
        if pending.get("batches"):
            # the samples the checkpointed run trained, whatever the batch size is now
            samples = pending.get("samples", pending["batches"] * batch_size)
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
        self._between_epochs = True
        self._close_restored_epoch()

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
            return len(sampler.inner) if sampler is not None else None
        except TypeError:  # a sampler without a length
            return None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
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
        ranks = _gathered(state["rng"])
        if ranks is not None:  # every rank's RNG (dropout masks differ by rank)
            state["rng_per_rank"] = ranks
        trainer, sampler = self._trainer, self._sampler
        if trainer is None or sampler is None:
            return state
        progress = trainer.fit_loop.epoch_loop.batch_progress
        served = int(progress.current.ready)
        shape = {"batch_size": self._batch_size, "epoch_samples": self._epoch_samples(),
                 "accumulate_grad_batches": trainer.accumulate_grad_batches,
                 "world_size": trainer.world_size}
        if progress.is_last_batch or served >= trainer.num_training_batches or served == 0:
            # between epochs: the next epoch's pass starts from the generator as it is now
            generator = sampler.generator
            state["loader"] = {"generator": generator.get_state() if generator is not None
                               else None, "batches": 0, **shape}
        else:
            state["loader"] = {"generator": sampler.epoch_start, "batches": served, **shape}
            if self._batch_size:
                state["loader"]["samples"] = served * self._batch_size
        return state

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
            self._apply(pending)
