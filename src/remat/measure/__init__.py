"""Measurement shared by callbacks, benchmarks and tests (no Lightning imports here)."""

from remat.measure.device_slot import DeviceSlot
from remat.measure.memory import (
    CATEGORIES,
    PeakMemory,
    allocation_levels,
    device_name,
    format_bytes,
)
from remat.measure.parity import TOLERANCES, GradientParity, compare_gradients, gradients_of
from remat.measure.profiler import ProfilerPeakMemory
from remat.measure.step import autocast, step_peak_memory, training_step
from remat.measure.timing import StepTimer, synchronize

__all__ = [
    "CATEGORIES",
    "TOLERANCES",
    "DeviceSlot",
    "GradientParity",
    "PeakMemory",
    "ProfilerPeakMemory",
    "StepTimer",
    "allocation_levels",
    "autocast",
    "compare_gradients",
    "device_name",
    "format_bytes",
    "gradients_of",
    "step_peak_memory",
    "synchronize",
    "training_step",
]
