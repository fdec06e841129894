"""Thin Lightning callbacks over :mod:`remat.measure`, the run's bookkeeping (summary,
last checkpoint, resume state) and the Hydra callbacks of the entry points.

Lightning callbacks: :class:`PeakMemoryMonitor`, :class:`StepTimeMonitor`,
:class:`RunReport` (strategy report and memory estimate at start), :class:`RunSummary`
(``summary.json``), :class:`MonitorCheck`, :class:`LastCheckpoint` (``last.ckpt`` and
signals), :class:`ResumeState` (RNG and loader position), :class:`PerImageMetrics`
(``per_image.csv`` of ``remat.eval``); the checkpoint writer plugin :class:`AtomicCheckpointIO`.
Hydra callbacks: :class:`RunDirLock`, :class:`SweepReport`.
"""

from remat.callbacks.checkpoint import AtomicCheckpointIO, LastCheckpoint
from remat.callbacks.memory import PeakMemoryMonitor
from remat.callbacks.monitor import MonitorCheck
from remat.callbacks.per_image import PerImageMetrics
from remat.callbacks.report import RunReport
from remat.callbacks.resume import ResumeState
from remat.callbacks.run_dir import RunDirInUse, RunDirLock, claim_run_dir, release_run_dir
from remat.callbacks.summary import RunSummary, failure_summary, write_json
from remat.callbacks.sweep_report import SweepReport
from remat.callbacks.timing import StepTimeMonitor

__all__ = [
    "AtomicCheckpointIO",
    "LastCheckpoint",
    "MonitorCheck",
    "PeakMemoryMonitor",
    "PerImageMetrics",
    "ResumeState",
    "RunDirInUse",
    "RunDirLock",
    "RunReport",
    "RunSummary",
    "StepTimeMonitor",
    "SweepReport",
    "claim_run_dir",
    "failure_summary",
    "release_run_dir",
    "write_json",
]
