"""Thin Lightning callbacks over :mod:`remat.measure`."""

from remat.callbacks.memory import PeakMemoryMonitor
from remat.callbacks.report import RunReport
from remat.callbacks.timing import StepTimeMonitor

__all__ = ["PeakMemoryMonitor", "RunReport", "StepTimeMonitor"]
