"""Measurement shared by callbacks, benchmarks and tests (no Lightning imports here)."""

from remat.measure.memory import PeakMemory, device_name, format_bytes
from remat.measure.timing import StepTimer, synchronize

__all__ = ["PeakMemory", "StepTimer", "device_name", "format_bytes", "synchronize"]
