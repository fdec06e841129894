"""Kernel temporaries: memory an operator allocates and frees inside its own call.

A tensor-level trace (``MemTracker``, real or fake) sees the tensors an operator returns,
not the buffers its kernel allocates and frees before returning. On this CPU those are
large: oneDNN reorders a convolution's input and weight into its blocked layout (a copy the
size of the input), ``convolution_backward`` does the same for the gradient, and
``native_batch_norm_backward`` makes a gradient-sized buffer. On a U-Net-R34 at 512 px,
batch 2, the allocator's peak is 4.6% above the tensor-level peak because of them, and a
plan that recomputes a whole decoder in backward 8.5% above.

:func:`record_signatures` lists the operators of a (fake) training step with what they were
called with (shapes, strides, dtypes and the other arguments); :func:`measure_temporaries`
runs each for real (stand-in inputs of the same layout) under ``torch.profiler`` memory
events, and keeps the highest the allocator went above what was allocated before the call
and its outputs. The trace then adds, after each operator, that operator's temporaries to
the memory held at that moment (:class:`KernelTemporaries`, read by
:class:`remat.measure.PeakMemory`): the peak the allocator reaches, not only the tensors'.

Measured on the device present only (the CPU here; the CUDA path reads the caching
allocator's peak instead of profiler events).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from remat._compat import TorchDispatchMode, tree_flatten, tree_map

# Operators whose arguments and outputs together are smaller than this are not measured: a
# kernel's own buffers are at most a few times what it reads and writes. At 1 MiB a MONAI
# UNet at 128 px, batch 2 (a 21.9 MiB step) was predicted 3.4% below its allocator peak,
# its many small calls' buffers unseen; at 256 KiB, 1.1% above.
MIN_BYTES = 1 << 18


@dataclass(frozen=True)
class TensorSpec:
    """What a real stand-in for a traced tensor needs: shape, strides, dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def make(self, device: torch.device) -> torch.Tensor:
        """A real tensor with this layout: floats 0.5 (a kernel's buffers do not depend on
        the values; no denormals), zeros otherwise (valid indices and masks)."""
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True)
                         if n > 0) if all(self.shape) else 0
        if self.dtype.is_floating_point or self.dtype.is_complex:
            base = torch.full((max(extent, 1),), 0.5, dtype=self.dtype, device=device)
        else:
            base = torch.zeros(max(extent, 1), dtype=self.dtype, device=device)
        return base.as_strided(self.shape, self.stride)


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, torch.device):
        return "device"  # the device is the one measured on
    return value


def _nbytes(values: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))


def signature(func: Any, args: tuple, kwargs: dict) -> tuple:
    """A hashable key of an operator call: its name, and its arguments with each tensor
    replaced by its shape, strides and dtype (:class:`TensorSpec`; the arguments may be
    specs already)."""
    flat, _ = tree_flatten((args, kwargs))
    return (str(func), tuple(_hashable(_spec(v)) for v in flat))


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


@dataclass
class Call:
    """One recorded operator call: the operator (or its name, ``aten.mm.default``) and its
    arguments as specs."""

    func: Any
    args: tuple
    kwargs: dict


class _SignatureRecorder(TorchDispatchMode):
    def __init__(self, min_bytes: int) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.calls: dict[tuple, Call] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # prim: metadata; profiler: record_function's ranges (a script object, no kernel)
        if func.namespace in ("prim", "profiler") or func.is_view:
            return out
        flat = tree_flatten((args, kwargs, out))[0]
        if _nbytes(flat) >= self.min_bytes:
            key = signature(func, args, kwargs)
            if key not in self.calls:
                self.calls[key] = Call(func, tree_map(_spec, args), tree_map(_spec, kwargs))
        return out


def record_signatures(work: Callable[[], Any], min_bytes: int = MIN_BYTES
                      ) -> tuple[Any, dict[tuple, Call]]:
    """Run ``work()`` (a fake training step) and return its result and every distinct
    operator call that reads and writes at least ``min_bytes`` in all (views excluded)."""
    recorder = _SignatureRecorder(min_bytes)
    with recorder:
        result = work()
    return result, recorder.calls


def _real(value: Any, device: torch.device) -> Any:
    if isinstance(value, TensorSpec):
        return value.make(device)
    if value == "device":
        return device
    return value


def _stand_in(call: Call, device: torch.device) -> tuple[tuple, dict]:
    return (tree_map(lambda v: _real(v, device), call.args),
            tree_map(lambda v: _real(v, device), call.kwargs))


def _measure_cuda(calls: list[Call], device: torch.device, repeats: int) -> list[int]:
    found = []
    for call in calls:
        best = 0
        for _ in range(repeats):
            try:
                args, kwargs = _stand_in(call, device)
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                out = call.func(*args, **kwargs)
                torch.cuda.synchronize(device)
                after = torch.cuda.memory_allocated(device)
                best = max(best, torch.cuda.max_memory_allocated(device) - max(before, after))
                del out, args, kwargs
            except Exception:  # noqa: BLE001 - stand-in values an op refuses: no figure
                break
        found.append(int(best))
    return found


def _measure_cpu(calls: list[Call], repeats: int) -> list[int]:
    """One ``torch.profiler`` session (the CPU allocator has no peak counter); each call
    runs inside a ``record_function`` range, and its temporaries are the highest running
    total of the allocator's events inside the range less the total before it and less
    the call's outputs (freed after the range)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device = torch.device("cpu")
    outputs: dict[str, int] = {}
    # kineto logs "gpuGetDeviceCount failed" as an ERROR on a machine without a GPU; quiet
    # it unless the user chose a level
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, call in enumerate(calls):
            for r in range(repeats):
                try:
                    args, kwargs = _stand_in(call, device)
                    with record_function(f"remat_kernel_{i}_{r}"):
                        out = call.func(*args, **kwargs)
                    outputs[f"remat_kernel_{i}_{r}"] = _output_bytes(out, args, kwargs)
                    del out, args, kwargs
                except Exception:  # noqa: BLE001 - stand-in values an op refuses: no figure
                    break
    from remat.measure.memory import allocation_levels

    events = prof.profiler.kineto_results.events()
    times, levels = allocation_levels(prof, "cpu")
    found = [0] * len(calls)
    for e in events:
        name = e.name()
        if name not in outputs:
            continue
        lo = bisect.bisect_left(times, e.start_ns())
        hi = bisect.bisect_right(times, e.start_ns() + e.duration_ns())
        if hi <= lo:
            continue
        before = levels[lo - 1] if lo > 0 else 0
        extra = max(levels[lo:hi]) - before - outputs[name]
        i = int(name.split("_")[2])
        found[i] = max(found[i], int(extra))
    return found


def measure_temporaries(calls: Iterable[Call], device: torch.device | str = "cpu",
                        repeats: int = 1) -> dict[tuple, int]:
    """Run each recorded call for real on ``device`` (stand-in inputs of the recorded
    shapes, strides and dtypes), ``repeats`` times, and return ``signature -> bytes`` of
    the highest its kernel allocated beyond its outputs (only calls with temporaries are
    listed). A call that fails on stand-in inputs is left out (counted as none). One run
    is enough on this CPU: two gave the same 107 figures for a U-Net-R34 step (three the
    same 137 for a U-Net-R18 at 256 px).

    On the CPU the allocator's running total comes from ``torch.profiler`` memory events
    inside the call; on CUDA from the caching allocator's peak counter.
    """
    device = torch.device(device)
    calls = [Call(_operator(c.func), c.args, c.kwargs) if isinstance(c.func, str) else c
             for c in calls]
    with torch.no_grad():
        found = (_measure_cuda(calls, device, repeats) if device.type == "cuda"
                 else _measure_cpu(calls, repeats))
    return {signature(c.func, c.args, c.kwargs): n
            for c, n in zip(calls, found, strict=True) if n > 0}


def _output_bytes(out: Any, args: Any, kwargs: Any) -> int:
    """Bytes of the new storages ``out`` holds (not those of its arguments: in-place ops
    and views return their input)."""
    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs:
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass
class KernelTemporaries:
    """``signature -> bytes`` of measured kernel temporaries, looked up per operator call
    (see :func:`measure_temporaries`). ``device``: where they were measured."""

    table: dict[tuple, int] = field(default_factory=dict)
    device: str = "cpu"

    def __post_init__(self) -> None:
        self._names = {key[0] for key in self.table}

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> int:
        if str(func) not in self._names:  # most operators: no signature to build
            return 0
        return self.table.get(signature(func, args, kwargs or {}), 0)

    def __bool__(self) -> bool:
        return bool(self.table)


def measured_temporaries(calls: Iterable[Call], device: torch.device) -> KernelTemporaries:
    """:func:`measure_temporaries` of ``calls`` on ``device``, as the lookup table a trace
    adds to each operator call (the planner's and ``remat.estimate``'s)."""
    return KernelTemporaries(measure_temporaries(calls, device), device=device.type)


def signatures_fn(build: Callable[[], torch.nn.Module], batch_size: int, size: Any,
                  precision: str, device: torch.device | str = "cpu",
                  min_bytes: int = MIN_BYTES) -> Callable[[], list[Call]]:
    """The work of listing a model's operator calls, to run in a forked child
    (:func:`remat.measure.trace.in_children`): two fake training steps of ``build()``
    (forward, loss, backward, optimizer step; ``build`` without checkpointing: a recompute
    runs the forward's operators again, so a plan calls nothing new) give the distinct
    operator calls (:func:`record_signatures`), returned picklable (operators by name).
    Measure them with :func:`measure_temporaries` in a process that may run kernels on
    several threads (not a forked child: OpenMP's thread pool does not survive a fork).
    """
    from remat.measure.trace import built_fn, optimizer_of, optimizer_steps

    device = torch.device(device)

    def steps(model: torch.nn.Module) -> list[Call]:
        model.train()
        optimizer = optimizer_of(model)
        calls = record_signatures(lambda: optimizer_steps(
            model, optimizer, batch_size, size, device, precision), min_bytes)[1]
        return [Call(str(c.func), c.args, c.kwargs) for c in calls.values()]

    return built_fn(build, steps, device, fake=True)


def _operator(name: str) -> Any:
    """``aten.convolution_backward.default`` -> the operator overload."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)
