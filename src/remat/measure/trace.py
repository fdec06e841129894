"""Peak memory of training steps traced without allocating: the model, its optimizer state
and the batch as fake tensors (torch's ``FakeTensorMode``) under ``MemTracker``.

Used by ``python -m remat.estimate`` and by the estimate logged at training start
(:class:`remat.callbacks.RunReport`). Models are duck-typed: ``configure_optimizers()``,
``example_batch(batch_size, size)``, ``training_loss(batch)`` and ``strategy_report``
(as :class:`remat.models.base.StrategyModule` provides). No Lightning imports here.
"""

from __future__ import annotations

import copy
import functools
import gc
import logging
import os
import pickle
import selectors
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat import _compat
from remat._compat import FakeTensorMode, is_fake
from remat.measure.memory import PeakMemory
from remat.measure.step import autocast, lightning_micro_steps

_compat.preload_mem_tracker()  # imported before forking


@dataclass
class Estimate:
    """Predicted (or, with ``fake=False``, measured) peak of one training step.

    ``peak_bytes`` and ``categories`` (``parameters``, ``buffers``, ``gradients``,
    ``optimizer_state``, ``activations``, ``temporaries``, ``other``, ``total``) in bytes,
    ``seconds`` wall time of the trace, ``device`` the device type estimated for, ``note``
    what the number means there, ``accumulate_grad_batches`` the batches per optimizer step
    traced, ``world_size`` the FSDP2 ranks (the peak is rank 0's) and ``fsdp`` whether the
    step was sharded at all (also over one rank).
    ``allocator_peak_bytes``: the allocator's peak, with each operator's kernel temporaries
    (measured on this CPU) and the batch, where asked for (``kernel_temporaries=true``),
    else ``None``.
    """

    strategy: str
    precision: str
    device: str
    batch_size: int
    size: int | tuple[int, int]
    size_key: str
    peak_bytes: int
    categories: dict[str, int]
    seconds: float
    fake: bool = True
    note: str = ""
    accumulate_grad_batches: int = 1
    world_size: int = 1
    allocator_peak_bytes: int | None = None
    fsdp: bool = False
    torch_version: str = field(default_factory=lambda: torch.__version__)


def optimizer_of(module: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of ``module.configure_optimizers()`` (a LightningModule's hook): the
    first of a list, or the ``optimizer`` entry of Lightning's dict form; the scheduler, if
    any, is left out (a trace or check runs a step or two)."""
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    if isinstance(configured, list | tuple):
        configured = configured[0]
    return configured


def _data_dependent(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is FakeTensorMode refusing a
    data-dependent op (e.g. timm's ``trunc_normal_`` init calling ``.item()``)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if "DataDependentOutput" in type(err).__name__ or "DataDependentOutput" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _swap_refused(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is ``nn.Module._apply`` failing
    to swap a fake parameter (``.to()`` of a module built under FakeTensorMode swaps the
    tensors, and refuses one with a weak reference): PEFT's LoRA layers move their adapters
    to the base layer's device and dtype that way while they are built."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if "Couldn't swap" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def meta_clone(module: nn.Module, drop: tuple[Any, ...] = ()) -> nn.Module:
    """A structural copy of ``module`` (wrappers, strategy, tied weights kept) whose
    parameters and buffers are on the ``meta`` device, so copying allocates nothing.

    ``drop``: objects referenced by the module that must not be copied (e.g. its Lightning
    trainer); the copy refers to ``None`` instead. Turn the copy into fake tensors with
    :func:`materialize` inside ``FakeTensorMode``.
    """
    memo: dict[int, Any] = {id(obj): None for obj in drop}
    for tensor in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (nn.Parameter(meta, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else meta)
    return copy.deepcopy(module, memo)


def materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """Replace every parameter and buffer of ``module`` (e.g. ``meta`` ones) in place by an
    uninitialised tensor of the same shape and dtype on ``device``; inside
    ``FakeTensorMode`` these are fake tensors. Shared (tied) tensors stay shared.
    Returns ``module``."""
    done: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for table in (_compat.parameter_table(mod), _compat.buffer_table(mod)):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in done:
                    new = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    done[id(tensor)] = (nn.Parameter(new, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, nn.Parameter) else new)
                table[name] = done[id(tensor)]
    return module


def sized_batch(model: nn.Module, batch_size: int, size: int | tuple[int, ...],
                device: torch.device) -> dict[str, torch.Tensor]:
    """``model.example_batch(batch_size, size)`` on ``device``; an ``(h, w)`` size (px)
    crops a square batch of side ``max(h, w)`` to ``[..., h, w]`` (image ``[B, C, h, w]``,
    mask ``[B, h, w]``); an int is a square side (px) or a sequence length (tokens); a
    ``(d, h, w)`` volume size (voxels) goes to the model as it is (3D segmentation)."""
    if isinstance(size, int) or len(size) == 3:
        batch = model.example_batch(batch_size, size)
    else:
        h, w = size
        batch = {k: v[..., :h, :w].contiguous() if v.ndim >= 3 else v
                 for k, v in model.example_batch(batch_size, max(h, w)).items()}
    return {k: v.to(device) for k, v in batch.items()}


def optimizer_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batch_size: int,
                    size: Any, device: torch.device, precision: str, steps: int = 2,
                    seed: int | None = None) -> None:
    """``steps`` training steps of ``model`` in Lightning's order (forward and loss under
    autocast, ``zero_grad`` after the forward, backward, optimizer step), each on a new
    example batch (seeded ``seed + step`` when ``seed`` is given); nothing measured."""
    for step in range(steps):
        if seed is not None:
            torch.manual_seed(seed + step)
        batch = sized_batch(model, batch_size, size, device)
        with autocast(device, precision):
            loss = model.training_loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        del loss, batch


def _micro_peak(model: nn.Module, batch: dict[str, torch.Tensor],
                optimizer: torch.optim.Optimizer, device: torch.device, precision: str,
                zero_grad: bool, step: bool, loss_scale: float,
                temporaries: Any = None) -> PeakMemory:
    """Peak of one training batch in Lightning's automatic-optimization order: forward and
    loss (scaled by ``loss_scale``), ``zero_grad`` if asked (after the forward, as
    Lightning's ``Closure``), backward, optimizer step if asked; MemTracker over all of it."""
    with PeakMemory(device, modules=[model], optimizers=[optimizer],
                    tracker="memtracker", temporaries=temporaries) as peak:
        with autocast(device, precision):
            loss = model.training_loss(batch)
            if loss_scale != 1.0:
                loss = loss * loss_scale
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step:
            optimizer.step()
        del loss
    # the batch is made before the tracker starts (the tensor-level peak, as training's
    # PeakMemoryMonitor measures it, leaves it out); the allocator holds it throughout
    peak.allocator_peak_bytes += sum({_compat.storage_id(t): t.untyped_storage().nbytes()
                                      for t in batch.values()
                                      if isinstance(t, torch.Tensor)}.values())
    return peak


def _step_flops(model: nn.Module, batch: dict[str, torch.Tensor],
                optimizer: torch.optim.Optimizer, precision: str, device: torch.device) -> int:
    """FLOPs of forward, loss and backward of one batch (recompute included), counted by
    ``FlopCounterMode``; the gradients it makes are dropped again. A pass of its own: under
    ``FlopCounterMode`` MemTracker's peak of the same batch comes out different."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        with autocast(device, precision):
            loss = model.training_loss(batch)
        loss.backward()
    optimizer.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def step_fn(build: Callable[[], nn.Module], batch_size: int, size: int | tuple[int, int],
            device: torch.device, precision: str, fake: bool = True,
            accumulate_grad_batches: int = 1, count_flops: bool = False,
            world_size: int = 1, rank: int = 0, reshard_after_forward: bool = True,
            temporaries: Any = None, fsdp: bool | None = None
            ) -> Callable[[], tuple[str, Any]]:
    """The work of :func:`trace_step`, to run in a child: build the model (``build()``, with
    strategy applied) and measure two optimizer steps; the largest peak of their batches is
    returned.

    With ``accumulate_grad_batches=k`` each optimizer step is k batches in Lightning's order
    (:func:`~remat.measure.step.lightning_micro_steps`: the first zeroes the gradients, the
    others add to them while they stay allocated, the last steps the optimizer; the loss is
    divided by k), each batch measured on its own.

    Why two: the first step allocates the optimizer state at its end (after backward has
    freed the activations), while every later step runs forward and backward with that
    state, and (Lightning's order: ``zero_grad`` after the forward) the previous step's
    gradients, already allocated. Which of the two is higher depends on the model (the
    tiny GPT of ``experiment=shakespeare_gpt``: the second, by 37%). Training's
    :class:`~remat.callbacks.PeakMemoryMonitor` measures the batches of the first two
    optimizer steps as well.

    Under ``fake=True`` everything (parameters, optimizer state, batch) is a fake tensor on
    ``device``; with ``fake=False`` the same steps run for real (the reference the estimate
    is tested against). A model whose construction calls data-dependent ops (timm's
    ``trunc_normal_`` init: ``aten._local_scalar_dense``), which FakeTensorMode refuses, is
    built on the ``meta`` device instead and turned into fake tensors by :func:`materialize`
    (same shapes and dtypes; values do not matter to a fake trace); one whose construction
    cannot run on ``meta`` either (MONAI's SwinUNETR reads ``.item()`` of a ``linspace``)
    is built for real on the CPU once and traced as a meta copy.
    ``size`` is a side (px), a sequence length (tokens) or an ``(h, w)`` image size.
    With ``count_flops=True`` the first batch also runs under
    ``torch.utils.flop_counter.FlopCounterMode``; its FLOPs (forward, backward and any
    recompute, optimizer excluded) are set as ``step_flops`` on the returned peak.

    With ``world_size > 1`` (or ``fsdp=True``: FSDP2 on one rank, as ``trainer=fsdp
    trainer.devices=1`` runs) the step is ``rank``'s under FSDP2 (``trainer=fsdp``): the
    network is sharded over ``world_size`` ranks with :func:`remat.sharding.shard` on a
    fake process group (``torch.testing._internal.distributed.fake_pg``: collectives do
    nothing, tensors keep their shapes), so the trace holds that rank's parameter, gradient
    and optimizer-state shards and each FSDP unit's gathered parameters while it runs;
    ``batch_size`` is the per-rank batch. Needs a process without a process group (the
    forked child of :func:`trace_step` is one unless its parent had one).
    ``temporaries`` (:class:`remat.measure.kernels.KernelTemporaries`, measured on the
    device) adds each operator's kernel temporaries: the returned peak's
    ``allocator_peak_bytes`` is then the highest of the batches' peaks with them.
    Returns ``(strategy name, PeakMemory)``.
    """
    if world_size > 1 if fsdp is None else fsdp:
        build = _sharded_build(build, world_size, rank, reshard_after_forward, device)

    def run_seeded(model: nn.Module) -> tuple[str, Any]:
        model.train()
        optimizer = optimizer_of(model)
        peaks = []
        scale = 1.0 / accumulate_grad_batches
        flops = None
        for _ in range(2):
            for zero_grad, step in lightning_micro_steps(accumulate_grad_batches):
                batch = sized_batch(model, batch_size, size, device)
                if count_flops and flops is None:
                    flops = _step_flops(model, batch, optimizer, precision, device)
                peaks.append(_micro_peak(model, batch, optimizer, device, precision,
                                         zero_grad, step, scale, temporaries))
                del batch
        peak = max(peaks, key=lambda p: p.peak_bytes)
        peak.step_flops = flops
        peak.allocator_peak_bytes = max(p.allocator_peak_bytes for p in peaks)
        for p in peaks:
            p.modules, p.optimizers = [], []  # keep no fake tensor alive past the mode
        return model.strategy_report.strategy, peak

    return built_fn(build, run_seeded, device, fake)


def _sharded_build(build: Callable[[], nn.Module], world_size: int, rank: int,
                   reshard_after_forward: bool, device: torch.device
                   ) -> Callable[[], nn.Module]:
    """``build`` followed by FSDP2 sharding of its ``net`` on a fake process group of
    ``world_size`` ranks, seen from ``rank`` (see :func:`step_fn`).

    Raises:
        RuntimeError: this process already has a process group.
    """
    def sharded() -> nn.Module:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from remat.sharding import shard

        if dist.is_initialized():
            raise RuntimeError(
                "a per-rank (world_size > 1) trace needs a process without a process group; "
                "run it before torch.distributed is initialised, e.g. python -m "
                "remat.estimate world_size=...")
        dist.init_process_group("fake", store=_compat.fake_process_group_store(), rank=rank,
                                world_size=world_size)
        model = build()
        with _compat.unset_fake_temporarily():  # the mesh holds a real tensor of rank ids
            mesh = init_device_mesh(device_type=device.type, mesh_shape=(world_size,))
        shard(model.net, mesh, model.strategy_report,
              reshard_after_forward=reshard_after_forward,
              stages=getattr(model, "stage_paths", ()))
        return model  # the fake group lives until the (child) process ends

    return sharded


def trace_step(build: Callable[[], nn.Module], batch_size: int, size: int | tuple[int, int],
               device: torch.device, precision: str, fake: bool = True,
               accumulate_grad_batches: int = 1, count_flops: bool = False,
               world_size: int = 1, rank: int = 0, reshard_after_forward: bool = True,
               temporaries: Any = None, fsdp: bool | None = None) -> tuple[str, Any]:
    """Build the model (``build()``, with strategy applied) and measure two optimizer steps
    in a child process; see :func:`step_fn` (what is measured, and why two steps; the step
    of one FSDP2 rank with ``world_size > 1``; ``temporaries``: measured kernel temporaries,
    for the allocator's peak). Returns ``(strategy name, PeakMemory)``."""
    return _in_child(step_fn(build, batch_size, size, device, precision, fake,
                             accumulate_grad_batches, count_flops, world_size, rank,
                             reshard_after_forward, temporaries, fsdp=fsdp))


def trace_steps(jobs: list[dict[str, Any]], parallel: int | None = None) -> list[Any]:
    """:func:`trace_step` for several jobs (its keyword arguments each), up to ``parallel``
    children at a time (default: the CPUs this process may use). Results in job order; the
    first job that failed raises."""
    return in_children([step_fn(**job) for job in jobs], parallel)


@contextmanager
def _fake_mode() -> Iterator[None]:
    """``FakeTensorMode``, without the warning torch gives for ``deepcopy`` of a fake tensor
    (it reads ``data_ptr()``). Metric libraries deep-copy their state defaults at
    construction (torchmetrics ``add_state``), once per metric of every built model; the copy
    is right (a clone) and the warning only floods the planner's output. Hugging Face
    attention masks are built as in the real step (:func:`hf_causal_masks_as_real`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor",
                                category=UserWarning)
        # the traced step's in-place joins: the real run says so itself, once
        warnings.filterwarnings("ignore", message=r"remat: '.*' writes its input in place",
                                category=UserWarning)
        with FakeTensorMode(), hf_causal_masks_as_real():
            yield


@contextmanager
def hf_causal_masks_as_real() -> Iterator[None]:
    """Let Hugging Face ``transformers`` skip the causal mask under a fake trace as it does
    in the real step.

    Before building a causal mask, ``transformers.masking_utils`` (4.53+) looks for packed
    sequences in the position ids (``find_packed_sequence_indices``: a jump in positions
    starts another sequence); it cannot read a fake tensor's values, so under a fake trace
    it answers "packed", and the model then builds a ``(batch, 1, T, T)`` mask instead of
    letting SDPA use ``is_causal=True``, and SDPA runs its math kernel on it (with
    grouped-query attention also repeating keys and values). HF Llama (4 layers, width 128,
    2 key-value heads, fp32, CPU) traced 257.7 MiB where the step measures 185.7 MiB at
    1024 tokens, batch 4 (1.39x), and 1.73x at 2048 tokens. The trace's batches carry no
    position ids, so the model's own are ``0..T-1``, where the real step finds no packed
    sequence: under the trace the search answers so for a fake tensor. Without
    transformers, or with a version without that function, nothing changes.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    @functools.wraps(original)
    def as_real(position_ids, *args, **kwargs):
        if isinstance(position_ids, torch.Tensor) and is_fake(position_ids):
            return None
        return original(position_ids, *args, **kwargs)

    masking_utils.find_packed_sequence_indices = as_real
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def run_built(build: Callable[[], nn.Module], fn: Callable[[nn.Module], Any],
              device: torch.device, fake: bool = True) -> Any:
    """``fn(build())`` in a forked child (see :func:`built_fn`)."""
    return _in_child(built_fn(build, fn, device, fake))


def built_fn(build: Callable[[], nn.Module], fn: Callable[[nn.Module], Any],
             device: torch.device, fake: bool = True) -> Callable[[], Any]:
    """The work ``fn(build())``, to run in a forked child (:func:`_in_child`), under
    ``FakeTensorMode`` with ``fake=True`` and with the RNG seeded to 0; the child returns
    ``fn``'s (picklable) result.

    A model whose construction FakeTensorMode refuses (a data-dependent op, or a fake
    parameter ``.to()`` cannot swap: PEFT's LoRA layers) is built on ``meta`` and materialized
    as fake tensors, or, when ``meta`` fails too, built for real once and traced as a meta
    copy (see :func:`trace_step`). ``fn`` must not keep fake tensors in its result.
    """
    def run(make: Callable[[], nn.Module]) -> Any:
        # forked RNG: on CUDA the trace runs in the training process, whose seed must hold
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return fn(make())  # under _fake_mode: HF masks as in the real step

    def dev() -> Any:
        return torch.device(device) if device.type != "cpu" else nullcontext()

    def traced() -> Any:
        try:
            with _fake_mode() if fake else nullcontext(), dev():
                return run(build)
        except Exception as err:
            if not (fake and (_data_dependent(err) or _swap_refused(err))):
                raise
        try:
            with torch.device("meta"):
                skeleton = build()
        except Exception as err:  # noqa: BLE001 - e.g. ``.item()`` at init (MONAI's Swin)
            if "meta" not in str(err) and not _data_dependent(err):
                raise
            # last resort: build for real on the CPU (parameters allocated once, in this
            # child process), then trace a meta copy of it
            skeleton = meta_clone(build())
        with _fake_mode(), dev():
            return run(lambda: materialize(skeleton, device))

    return traced


def _in_child(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child process and return its (pickled) result or re-raise its
    exception here (:func:`in_children` with one job)."""
    return in_children([fn], 1)[0]


def _child(fn: Callable[[], Any], read_fd: int, write_fd: int) -> None:
    """The forked child: compute, send, leave without running any cleanup."""
    code = 1
    try:
        os.close(read_fd)
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
            logging.disable(logging.INFO)  # the model's build logs were the parent's
            gc.disable()  # the crash (see in_children) comes from a collection; we _exit
            payload = (True, fn())
        except BaseException as err:  # noqa: BLE001 - everything goes to the parent
            try:
                pickle.dumps(err)
                payload = (False, err)
            except Exception:  # noqa: BLE001
                payload = (False, RuntimeError(f"{type(err).__name__}: {err}"))
        try:
            data = pickle.dumps(payload)
        except Exception as err:  # noqa: BLE001 - a result that cannot leave the child
            data = pickle.dumps((False, RuntimeError(
                f"trace: the result of {getattr(fn, '__qualname__', fn)!r} cannot be sent to "
                f"the parent process ({type(err).__name__}: {err})")))
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(data)
        code = 0
    finally:  # never return into the parent's stack (a second training process)
        os._exit(code)


def side_by_side() -> int:
    """How many jobs :func:`in_children` runs at once by default: the CPUs this process may
    use, or 1 where the jobs run in this process (no ``os.fork``, or CUDA initialised)."""
    if not hasattr(os, "fork") or torch.cuda.is_initialized():
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def in_children(fns: list[Callable[[], Any]], parallel: int | None = None) -> list[Any]:
    """Run each ``fn`` in a forked child process, up to ``parallel`` at once (default: the
    CPUs this process may use), and return their (pickled) results in order, or re-raise
    the first job's exception that failed.

    Why children: in torch 2.14, a process that runs several fake-tensor training steps
    under MemTracker aborts with glibc heap corruption ("corrupted double-linked list")
    inside a garbage collection (seen with U-Nets after a few traces). Each trace therefore
    runs in a child with the cyclic garbage collector off, which leaves by ``os._exit``
    without collecting; the caller's heap never holds a fake tensor. Each child uses one
    thread, so children side by side use the CPUs a single trace leaves idle. Where
    ``os.fork`` does not exist (Windows), or CUDA is initialised (a forked child cannot use
    it), the jobs run in this process, one after another.
    """
    if not hasattr(os, "fork") or torch.cuda.is_initialized():
        return [fn() for fn in fns]  # no fork, or CUDA already up (a child could not use it)
    parallel = max(1, int(parallel if parallel is not None else side_by_side()))
    results: list[Any] = [None] * len(fns)
    pending = list(enumerate(fns))
    running: dict[int, tuple[int, int, bytearray]] = {}  # read fd -> (job, pid, data)
    selector = selectors.DefaultSelector()
    try:
        while pending or running:
            while pending and len(running) < parallel:
                job, fn = pending.pop(0)
                read_fd, write_fd = os.pipe()
                pid = os.fork()
                if pid == 0:
                    _child(fn, read_fd, write_fd)
                os.close(write_fd)
                running[read_fd] = (job, pid, bytearray())
                selector.register(read_fd, selectors.EVENT_READ)
            for key, _ in selector.select():
                fd = key.fd
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    running[fd][2].extend(chunk)
                    continue
                selector.unregister(fd)
                os.close(fd)
                job, pid, data = running.pop(fd)
                _, status = os.waitpid(pid, 0)
                if not data:
                    results[job] = (False, RuntimeError(
                        f"trace: the tracing process died (wait status {status}) before it "
                        "sent a result"))
                else:
                    results[job] = pickle.loads(bytes(data))
    finally:
        selector.close()
    for ok, value in results:
        if not ok:
            raise value
    return [value for _, value in results]
