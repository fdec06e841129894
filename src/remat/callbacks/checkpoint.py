"""``last.ckpt`` that is really the last state, written atomically, and stops on signals that
lose nothing.

Lightning's ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` only when a top-k
checkpoint is written in the same step (``save_last`` docs: "whenever a checkpoint file gets
saved"), so with a ``monitor`` it holds the best epoch, not the last one. :class:`LastCheckpoint`
fills that gap; the best checkpoint stays with ``ModelCheckpoint``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

STOP_SIGNALS = ("SIGTERM", "SIGINT")


def preemption_signal() -> signal.Signals:
    """The signal submitit sends a job before preemption or its time limit:
    ``SIG$SUBMITIT_PREEMPT_SIGNAL`` (``SIGUSR2`` by default)."""
    return signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic: the checkpoint goes to a hidden
    temporary file in the target folder, is flushed to disk (``fsync``) and then renamed over
    the target (``os.replace``). A full disk or a kill mid-write leaves the previous file
    intact and no partial one. (Lightning's own writer stages the file in the system temp
    folder and moves it, which is a copy, not a rename, when that folder is on another
    filesystem.) Remote paths (``s3://``...) use Lightning's writer.

    Raises:
        TypeError: ``storage_options`` given (as ``TorchCheckpointIO``).
        OSError: the write failed (disk full, permissions); the temporary file is removed.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint does not take storage_options")
        if type(get_filesystem(path)).__name__ != "LocalFileSystem":
            return super().save_checkpoint(checkpoint, path)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _training_done(trainer: L.Trainer, after_epoch: bool) -> bool:
    """Whether the optimizer step just taken is the run's last: ``trainer.max_steps``
    reached or, ``after_epoch`` (at an epoch's end), the last of ``trainer.max_epochs``."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    epochs = trainer.max_epochs
    return after_epoch and epochs is not None and 0 <= epochs <= trainer.current_epoch + 1


def _raise_sigterm_at_step_end(trainer: L.Trainer) -> None:
    """Make Lightning raise ``SIGTERMException`` where it does for a SIGTERM it caught: at
    the end of this batch, or of this epoch after its validation (loggers and schedulers
    updated first). Sets the flag its handler sets, without running that handler: it sends
    the signal on to the other processes it launched and broadcasts from rank 0, and the
    ranks have agreed on the stop already (:meth:`LastCheckpoint._signalled`); a rank
    receiving the forwarded signal in the middle of its own stop broke the collectives
    ("Connection closed by peer"). Without the flag (another Lightning), raises now."""
    connector = getattr(trainer, "_signal_connector", None)  # Lightning keeps it private
    if connector is None or not hasattr(connector, "received_sigterm"):
        raise SIGTERMException
    connector.received_sigterm = True


class LastCheckpoint(Checkpoint):
    """Writes ``<dirpath>/<filename>.ckpt`` (default ``last.ckpt``) with the full training
    state (weights, optimizer, scheduler, loops, callbacks such as
    :class:`~remat.callbacks.ResumeState`):

    * at the end of every training epoch: after its validation (after every
      ``ModelCheckpoint`` that saves there, as ``configs/callbacks/model_checkpoint.yaml``'s
      does, so the best record inside ``last.ckpt`` names the best file on disk), or at
      ``on_train_epoch_end`` when no validation runs then,
    * every ``every_n_train_steps`` optimizer steps if set,
    * when training ends (so its ``global_step`` is the run's last step); a stop inside an
      epoch (``trainer.max_steps``, ``max_time``, ``trainer.should_stop``) is written after
      that batch, with the epoch still open, so a resume with a higher limit trains the
      rest of that epoch (written at train end, Lightning's loop state counts the epoch as
      finished, and a resume would go on with the next one),
    * on SIGTERM or SIGINT: the signal is held until the current optimizer step is complete
      (all accumulated batches, or the epoch end), the checkpoint is written, and the run stops
      through Lightning's SIGTERM path (``SIGTERMException``, ``on_exception`` hooks, loggers
      finalised). A second signal while waiting is handed on: SIGINT raises
      ``KeyboardInterrupt``; SIGTERM goes to the handler installed before this one
      (Lightning's, which stops the run at the end of the current batch), or, with none,
      terminates the process at once.
      ``received_signal`` names the signal (``"SIGTERM"``/``"SIGINT"``). Under DDP/FSDP a
      signal reaching any one rank stops every rank after the same optimizer step (one
      small all-reduce per step); once they agreed, further signals are ignored. A signal
      after the run's last optimizer step (e.g. in the last validation) stops nothing: the
      run ends ``completed``, with its checkpoint.
    * on the scheduler's preemption signal (:func:`preemption_signal`, submitit's ``USR2``)
      when a handler for it is installed at train start: as for SIGTERM; that handler is
      kept in ``deferred`` and called once the run has stopped
      (:func:`remat.runs.hand_on_preemption`), so the job is resubmitted after its
      checkpoint is written. Under DDP/FSDP every rank calls its handler when the signal
      reached any one of them (submitit resubmits from rank 0).

    Nothing is written when a run fails with another exception: its state may be mid-step,
    and the last good ``last.ckpt`` is kept. Signal handlers are installed at train start in
    the main thread only and restored at train end. With ``SLURMEnvironment(auto_requeue)``
    Lightning's SIGUSR1 handler (HPC checkpoint and requeue) is left in place.

    Raises:
        ValueError: ``every_n_train_steps`` < 1 (when set) or an empty ``filename``.
    """

    def __init__(self, dirpath: str | Path, filename: str = "last",
                 every_n_train_steps: int | None = None) -> None:
        super().__init__()
        if not filename:
            raise ValueError("LastCheckpoint: filename must not be empty")
        if every_n_train_steps is not None and int(every_n_train_steps) < 1:
            raise ValueError(f"LastCheckpoint: every_n_train_steps must be >= 1 or null, got "
                             f"{every_n_train_steps}")
        self.dirpath = Path(dirpath)
        self.filename = filename
        self.every_n_train_steps = every_n_train_steps
        self.received_signal: str | None = None
        self.saved_step: int | None = None
        self._saved_at: tuple[int, int, str] | None = None
        self._handlers: dict[int, Any] = {}
        self._step_at_batch_start = 0
        self._trained = False  # whether this fit has run a training batch
        self._stopping = False  # every rank agreed to stop after this step
        #: the preemption signal's earlier handler (submitit's requeue), held until the
        #: checkpoint is written: ``(signal number, handler)``, set when that signal came
        self.deferred: tuple[int, Any] | None = None
        self._preemption: tuple[int, Any] | None = None

    @property
    def path(self) -> Path:
        """Where the checkpoint is written."""
        return self.dirpath / f"{self.filename}.ckpt"

    @property
    def last_model_path(self) -> str:
        """The checkpoint's path once written, else ``""`` (as ``ModelCheckpoint``)."""
        return str(self.path) if self.saved_step is not None else ""

    @property
    def state_key(self) -> str:
        # not the folder: a run resumed into another folder still finds this callback's state
        return self._generate_state_key(filename=self.filename)

    def save(self, trainer: L.Trainer, where: str) -> None:
        """Write the checkpoint now (once per step and place: ``where`` names the hook)."""
        key = (trainer.current_epoch, trainer.global_step, where)
        if self._saved_at == key or trainer.sanity_checking or trainer.fast_dev_run:
            return
        if not self._trained:
            return  # nothing trained in this fit (a resume at the end): last.ckpt stays as it is
        # the whole state (optimizer, loops, callbacks): a resume needs it; said explicitly,
        # Lightning logs a line per write otherwise ('weights_only was not set')
        trainer.save_checkpoint(self.path, weights_only=False)
        self._saved_at, self.saved_step = key, trainer.global_step
        if trainer.is_global_zero:  # every rank takes part; one line in the log
            log.info("wrote %s (epoch %d, global step %d, %s)", self.path,
                     trainer.current_epoch, trainer.global_step, where)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trained = False
        self._stopping = False
        self.deferred = self._preemption = None
        # after every ModelCheckpoint, so that a last.ckpt written in the same hook holds
        # their updated best record (a resumed run then knows the true best file)
        others = [c for c in trainer.callbacks if c is not self]
        after = max((i for i, c in enumerate(others) if isinstance(c, ModelCheckpoint)),
                    default=-1)
        trainer.callbacks[:] = [*others[:after + 1], self, *others[after + 1:]]

    # --- signals -------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in STOP_SIGNALS:
            signum = getattr(signal, name)
            self._handlers[signum] = signal.signal(signum, self._on_signal)
        preempt = preemption_signal()
        previous = signal.getsignal(preempt)
        if preempt not in self._handlers and callable(previous):
            # a scheduler's handler (submitit's requeue): it runs once the checkpoint is
            # written (remat.runs.hand_on_preemption), not at once mid-step
            self._handlers[preempt] = signal.signal(preempt, self._on_signal)
            self._preemption = (int(preempt), previous)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stopping:
            # the ranks agreed to stop at this step already; this is the signal Lightning's
            # launcher forwards to the other ranks (or a repeat): acting on it now would
            # leave this rank's collectives unmatched
            log.info("received %s while stopping: already stopping", signal.Signals(signum).name)
            return
        if self.received_signal is None:
            self.received_signal = signal.Signals(signum).name
            if self._preemption is not None and signum == self._preemption[0]:
                self.deferred = self._preemption
            log.warning("received %s: stopping after the current optimizer step, with a "
                        "checkpoint (a second SIGINT stops at once, a second SIGTERM at the end "
                        "of this batch)", self.received_signal)
            return
        previous = self._handlers.get(signum)
        self._restore_handlers()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if callable(previous):  # Lightning's: it stops the run at the end of this batch
            previous(signum, frame)
        elif previous in (None, signal.SIG_DFL):  # nothing else handles it: terminate now
            os.kill(os.getpid(), signum)

    def _restore_handlers(self) -> None:
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._handlers = {}

    def _stop(self, trainer: L.Trainer, where: str) -> None:
        """Checkpoint, then hand the stop to Lightning's SIGTERM handling: it raises
        ``SIGTERMException`` at the end of this batch/epoch, on every rank."""
        self.save(trainer, where)
        _raise_sigterm_at_step_end(trainer)

    # --- when to write -------------------------------------------------------------------
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._trained = True
        if trainer.global_step == self._step_at_batch_start:
            return  # gradients are still being accumulated: no complete step to save
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if self._signalled(trainer) and not last_batch:  # at the epoch's end: after validation
            if not _training_done(trainer, after_epoch=False):
                self._stop(trainer, "signal")
                return
            self._finish(trainer)
        if not last_batch and (trainer.should_stop or 0 < trainer.max_steps
                               <= trainer.global_step):
            # training stops inside the epoch (trainer.max_steps, max_time): write it here.
            # By on_train_end Lightning has counted the epoch as finished, and a resume
            # from that state would skip the rest of it
            self.save(trainer, "stop_mid_epoch")
            return
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0 and not last_batch:
            self.save(trainer, "every_n_train_steps")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the validation at an epoch's end: where ModelCheckpoint saves too, and the point
        # Lightning resumes from most reliably (also with trainer.max_steps)
        if trainer.sanity_checking or not trainer.training and trainer.state.fn != "fit":
            return
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._epoch_end(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._saved_at is None or self._saved_at[:2] != (trainer.current_epoch,
                                                            trainer.global_step) \
                or self._saved_at[2] not in ("epoch_end", "signal", "stop_mid_epoch"):
            self._epoch_end(trainer)  # no validation at this epoch's end

    def _finish(self, trainer: L.Trainer) -> None:
        """A stop signal after the run's last optimizer step: nothing is left to stop, so the
        run ends as it would have (``completed``), with its checkpoint."""
        if trainer.is_global_zero:
            log.warning("%s arrived after the last optimizer step (global step %d): the run "
                        "finishes normally", self.received_signal, trainer.global_step)

    def _signalled(self, trainer: L.Trainer) -> bool:
        """A stop signal reached this rank or, in a multi-rank run, any rank (one small
        all-reduce per optimizer step): every rank must checkpoint and stop together, or the
        ones that go on wait in a collective for the ones that stopped."""
        mine = self.received_signal is not None
        if trainer.world_size > 1:
            anyone = bool(trainer.strategy.reduce_boolean_decision(mine, all=False))
            if anyone:
                # was it the scheduler's preemption signal, on any rank? Then every rank
                # hands on to its scheduler handler once stopped (submitit requeues from
                # rank 0, whichever rank the signal reached). A second collective, only in
                # the step every rank agreed to stop at
                preempted = bool(trainer.strategy.reduce_boolean_decision(
                    self.deferred is not None, all=False))
                if preempted and self.deferred is None and self._preemption is not None:
                    self.deferred = self._preemption
            if anyone and not mine:
                self.received_signal = (signal.Signals(self.deferred[0]).name
                                        if self.deferred is not None else "SIGTERM")
                log.warning("another rank received a stop signal: stopping after this "
                            "optimizer step, with a checkpoint")
            self._stopping = anyone
            return anyone
        self._stopping = mine
        return mine

    def _epoch_end(self, trainer: L.Trainer) -> None:
        if self._signalled(trainer) and not _training_done(trainer, after_epoch=True):
            self._stop(trainer, "epoch_end")
            return
        if self._stopping:
            self._finish(trainer)
        self.save(trainer, "epoch_end")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handlers()
        if self.saved_step != trainer.global_step:
            self.save(trainer, "train_end")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        self._restore_handlers()
        # SIGTERMException is raised by Lightning after a complete batch: a clean state
        if isinstance(exception, SIGTERMException) and self.saved_step != trainer.global_step:
            self.save(trainer, "sigterm")
        if isinstance(exception, SIGTERMException) and self.received_signal is None:
            self.received_signal = "SIGTERM"

    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": str(self.dirpath), "filename": self.filename}
