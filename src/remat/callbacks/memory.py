"""Lightning adapter over :class:`remat.measure.PeakMemory`."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch

from remat.measure import PeakMemory, ProfilerPeakMemory, format_bytes

log = logging.getLogger(__name__)


def _strategy_of(pl_module: L.LightningModule) -> dict[str, Any]:
    """The strategy's name, its plan's one-line-per-unit summary (None without one) and
    whether the network ran compiled (``compile=true``)."""
    strategy = getattr(pl_module, "strategy", None)
    plan = getattr(strategy, "plan", None)
    return {"strategy": getattr(strategy, "name", None),
            "plan": plan.summary() if hasattr(plan, "summary") else None,
            "compiled": bool(getattr(pl_module, "compiled", False))}


def over_budget(pl_module: L.LightningModule, peak_bytes: int) -> str | None:
    """What to tell when a planned run (``strategy=budget`` or ``plan``) measured a peak
    above its budget (the plan did not hold on this run, e.g. compiled code keeping more
    than the eager step the planner traced), logged as a warning; else ``None``."""
    plan = getattr(getattr(pl_module, "strategy", None), "plan", None)
    budget = getattr(plan, "budget_bytes", None)
    if not budget or peak_bytes <= budget:
        return None
    predicted = getattr(plan, "predicted_allocator_peak_bytes", None)
    for_compiled = bool(getattr(plan, "compiled", False))
    hint = ""
    if getattr(pl_module, "compiled", False):
        hint = ("; the network is compiled: try compile=false, or a lower strategy.memory"
                if for_compiled else
                "; the network is compiled and the plan was made for an eager step (it "
                "does not count the dropout masks compiled segments keep): plan with "
                "compile=true (strategy=budget ... compile=true, or python -m remat.plan "
                "... compile=true)")
    note = (f"measured peak {format_bytes(peak_bytes)} is above the budget "
            f"{format_bytes(budget)} the plan was made for (predicted "
            f"{format_bytes(predicted)}): this run needs more than planned" + hint)
    log.warning(note)
    return note


class PeakMemoryMonitor(L.Callback):
    """Measures the peak memory of the training batches of this process's first
    ``track_steps`` optimizer steps, and of each epoch where that is cheap.

    With ``accumulate_grad_batches=k`` an optimizer step spans k batches: tracking goes on
    until ``track_steps`` optimizer steps have completed (at most ``track_steps * k``
    batches), so the measured steps include optimizer steps, with the optimizer state
    allocated, whatever k is. A resumed run measures its own first steps (nothing is taken
    from the checkpoint but the per-epoch history). :meth:`measured` says which batches and
    optimizer steps were measured.

    Each tracked batch (forward, backward and, when due, the optimizer step) runs inside
    its own :class:`~remat.measure.PeakMemory`; the maximum is kept. On CPU the tracker is
    exact but slows the tracked batches, so :class:`StepTimeMonitor` skips them.

    Logged (bytes): ``mem/step_peak_bytes`` per tracked batch, ``mem/peak_bytes`` (their
    maximum) once tracking ends, ``mem/epoch_peak_bytes`` per epoch. The epoch peak is the
    allocator's peak over the whole epoch on CUDA; on CPU only the tracked batches are
    measured, so it is their maximum within that epoch (absent for epochs without one).
    Under DDP/FSDP ``peak_bytes`` is the highest rank's at the end of training (gathered
    from every rank), with each rank's in ``rank_peaks_bytes``.
    Only totals are kept: Lightning runs forward and backward inside
    ``optimizer.step(closure)``, so MemTracker would file activations under optimizer state
    (the per-category split is given by :mod:`remat.estimate`). Compiled code on CPU (a
    network compiled as a whole by training's ``compile=true``, or the ``compile``
    strategy's stages) is measured from ``torch.profiler`` memory events
    (:class:`~remat.measure.ProfilerPeakMemory`: the allocator's peak, kernel temporaries
    included), since MemTracker's dispatch mode would make dynamo run it eagerly;
    ``peak_method`` says which measure was taken. A planned run whose measured peak is
    above its budget logs a warning when tracking ends, kept as ``note``.

    Raises:
        ValueError: ``track_steps < 0``.
    """

    def __init__(self, track_steps: int = 2) -> None:
        if track_steps < 0:
            raise ValueError(f"PeakMemoryMonitor: track_steps must be >= 0, got {track_steps}")
        self.track_steps = track_steps
        self.peak_bytes: int | None = None
        self.rank_peaks_bytes: list[int | None] | None = None  # DDP/FSDP: each rank's
        self.reserved_bytes: int | None = None
        self.step_peaks: list[int] = []
        self.epoch_peaks: list[int | None] = []
        self.batches: list[dict[str, int | bool]] = []
        self.steps_done = 0
        self.note: str | None = None  # a planned run above its budget (summary.json)
        # what measured the peak: "allocator" (CUDA's, or torch.profiler's memory events on
        # CPU for compiled code) or "tensors" (MemTracker on CPU)
        self.peak_method: str | None = None
        self.history: list[dict[str, Any]] = []
        self.measured_under: dict[str, Any] | None = None  # strategy and plan measured
        self._current: PeakMemory | ProfilerPeakMemory | None = None
        self._epoch_peak: int | None = None
        self._step_before = 0

    def is_tracking(self) -> bool:
        """Whether the current (or next) training batch is one this monitor measures."""
        return self._current is not None or self.steps_done < self.track_steps

    def measured(self) -> dict[str, Any]:
        """Which batches were measured: ``batches`` (count), ``optimizer_steps`` (the
        global steps completed by them), ``first``/``last`` (``[epoch, batch_idx]``),
        ``batch_peaks_bytes`` (each batch's peak, in order), ``method`` (``allocator`` or
        ``tensors``: what measured them); ``previous_runs`` holds what earlier runs of a
        resumed training measured (``peak_bytes``, ``optimizer_steps``, ``peak_method``,
        and the ``strategy``, ``plan`` (:meth:`~remat.planner.Plan.summary`, or None) and
        ``compiled`` those steps ran under: a resume may change each)."""
        steps = [int(b["global_step"]) for b in self.batches if b["optimizer_step"]]
        return {
            "batches": len(self.batches),
            "optimizer_steps": steps,
            "first": [self.batches[0]["epoch"], self.batches[0]["batch_idx"]]
            if self.batches else None,
            "last": [self.batches[-1]["epoch"], self.batches[-1]["batch_idx"]]
            if self.batches else None,
            "batch_peaks_bytes": list(self.step_peaks),
            "method": self.peak_method,
            "previous_runs": list(self.history),
        }

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_peak = None
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._step_before = trainer.global_step
        if not self.is_tracking():
            return
        strategy = getattr(pl_module, "strategy", None)
        if self.measured_under is None:
            self.measured_under = _strategy_of(pl_module)
        cuda = pl_module.device.type == "cuda"
        # on CPU MemTracker's dispatch mode would make dynamo run the compiled network (or
        # the compile strategy's stages) eagerly: the allocator's events instead
        profiler = not cuda and (getattr(pl_module, "compiled", False)
                                 or not getattr(strategy, "measurable_on_cpu", True))
        self.peak_method = "allocator" if cuda or profiler else "tensors"
        self._current = (ProfilerPeakMemory(pl_module.device, modules=[pl_module],
                                            optimizers=trainer.optimizers) if profiler
                         else PeakMemory(pl_module.device, modules=[pl_module],
                                         optimizers=trainer.optimizers, split=False))
        self._current.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":  # peak since the last reset (epoch or step)
            allocated = int(torch.cuda.max_memory_allocated(pl_module.device))
            self._epoch_peak = max(self._epoch_peak or 0, allocated)
        if self._current is None:
            return
        self._current.__exit__(None, None, None)
        peak, self._current = self._current, None
        stepped = trainer.global_step != self._step_before
        self.steps_done += int(stepped)
        self.batches.append({"epoch": trainer.current_epoch, "batch_idx": batch_idx,
                             "global_step": trainer.global_step, "optimizer_step": stepped})
        self.step_peaks.append(int(peak.peak_bytes))
        self._epoch_peak = max(self._epoch_peak or 0, int(peak.peak_bytes))
        if peak.reserved_bytes is not None:
            self.reserved_bytes = max(self.reserved_bytes or 0, peak.reserved_bytes)
        if self.peak_bytes is None or peak.peak_bytes > self.peak_bytes:
            self.peak_bytes = peak.peak_bytes
        pl_module.log("mem/step_peak_bytes", float(peak.peak_bytes), on_step=True,
                      on_epoch=False, batch_size=1)
        if self.steps_done == self.track_steps and stepped:
            pl_module.log("mem/peak_bytes", float(self.peak_bytes), on_step=True,
                          on_epoch=False, batch_size=1)
            self.note = over_budget(pl_module, int(self.peak_bytes))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_peaks.append(self._epoch_peak)
        if self._epoch_peak is not None:
            pl_module.log("mem/epoch_peak_bytes", float(self._epoch_peak), on_step=False,
                          on_epoch=True, batch_size=1)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._gather_ranks()

    def _gather_ranks(self) -> None:
        """Under DDP/FSDP (every rank calls this: a collective), the run's peak becomes the
        highest rank's, and ``rank_peaks_bytes`` holds each rank's (rank order); a rank
        without a measured batch gives None."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, self.peak_bytes)
        self.rank_peaks_bytes = [None if p is None else int(p) for p in every]
        known = [p for p in self.rank_peaks_bytes if p is not None]
        if known:
            self.peak_bytes = max(known)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        if self._current is not None:
            self._current.__exit__(type(exception), exception, None)
            self._current = None

    def state_dict(self) -> dict[str, Any]:
        runs = list(self.history)
        if self.batches:
            runs.append({"peak_bytes": self.peak_bytes,
                         "optimizer_steps": self.measured()["optimizer_steps"],
                         **(self.measured_under or {}),
                         **({"peak_method": self.peak_method} if self.peak_method else {})})
        return {"epoch_peaks": list(self.epoch_peaks), "history": runs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a resumed run measures its own steps; only the record of earlier runs is kept
        self.epoch_peaks = list(state_dict.get("epoch_peaks", []))
        self.history = list(state_dict.get("history", []))
