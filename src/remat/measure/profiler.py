"""Peak memory from ``torch.profiler`` memory events: what the allocator saw, compiled
kernels included (MemTracker, a ``TorchDispatchMode``, makes dynamo run eagerly)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from remat.measure.memory import allocation_levels


class ProfilerPeakMemory:
    """Peak memory of the work inside the block from ``torch.profiler`` memory events, in
    bytes: the highest running sum of the allocations and frees it records on ``device``
    (``profile_memory=True``; every allocation through the device's allocator, so compiled
    kernels too), plus what was held at the start: the parameters, buffers and gradients of
    ``modules`` and the state of ``optimizers`` (a gradient freed inside the block, by
    ``zero_grad``, counts until it is freed). On an eager step this equals MemTracker's
    peak to within rounding (``tests/test_bench.py``).

    Reads the profiler's allocation events in time order (``experimental_event_tree()``,
    each with its block's address and signed size; torch's public ``events()`` folds
    allocations into the ops that made them and loses the order). A free counts only when
    its block was allocated inside this block of work: the profiler also reports frees of
    blocks allocated during an *earlier* profiling session of the process (a model's
    gradients from the last measured step, freed by ``zero_grad``), which put the running
    sum that much too low (a 2-block GPT: 869,704 B instead of 987,976 B on every
    measurement after the first).

    After the block: ``peak_bytes`` (int), ``reserved_bytes`` (``None``).
    """

    def __init__(self, device: torch.device | str, modules: Iterable[torch.nn.Module] = (),
                 optimizers: Iterable[torch.optim.Optimizer] = ()):
        self.device = torch.device(device)
        self.modules = list(modules)
        self.optimizers = list(optimizers)
        self.peak_bytes: int | None = None
        self.reserved_bytes: int | None = None
        self._prof = None
        self._held: dict[int, int] = {}

    def _held_now(self) -> dict[int, int]:
        """Storage address -> bytes of the modules' parameters, buffers and gradients and
        the optimizers' state on the device."""
        tensors = [t for m in self.modules for p in (*m.parameters(), *m.buffers())
                   for t in (p, p.grad) if t is not None]
        tensors += [v for opt in self.optimizers for state in opt.state.values()
                    for v in state.values() if isinstance(v, torch.Tensor)]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if t.device.type == self.device.type and t.untyped_storage().nbytes()}

    def __enter__(self) -> ProfilerPeakMemory:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._held = self._held_now()
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(*exc)
        _, levels = allocation_levels(self._prof, self.device.type, self._held)
        self.peak_bytes = int(sum(self._held.values()) + max([0, *levels]))
        self._prof = None
