"""Peak memory of one training step predicted without allocating it (no GPU needed).

``python -m remat.estimate model=unet_resnet34 data.image_size=2048 data.batch_size=8
strategy=sqrtn precision=bf16-mixed`` builds the configured model, strategy and optimizer
under torch's ``FakeTensorMode`` (tensors carry shape, dtype and device but no data, so
nothing is allocated) and runs two training steps in Lightning's order (forward, loss,
zero_grad, backward, optimizer step; the second step has the optimizer state and the
previous gradients allocated, the peak of the two is reported) inside ``MemTracker``
(``torch.distributed._tools.mem_tracker``), which adds up tensor
storages as they are created and freed and keeps the peak, split into parameters,
buffers, gradients, optimizer state, activations and temporaries. It takes seconds on a CPU
for sizes that would need tens of GiB.

What it predicts: the tensor-level peak, i.e. what ``MemTracker`` measures on a real run of
the same step (``tests/test_estimate.py`` checks it within 10% for every traceable strategy
at two sizes). On CUDA the allocator peak (``max_memory_allocated``) adds the CUDA kernels'
workspaces and rounding to 512-byte blocks; ``max_memory_reserved`` adds fragmentation.

Device: ``device=auto`` estimates for CUDA when a CUDA driver is present; without one it
estimates for the CPU and says so, because torch's autograd engine needs a CUDA context to
run a backward over (fake) CUDA tensors ("hasPrimaryContext expects a valid device index").
Kernel choices differ between devices (e.g. SDPA's flash kernel on CUDA against the math
path on CPU), so a CPU estimate of a CUDA run is an approximation.

Strategies that cannot be traced this way: ``compile`` (dynamo does not compile while a
``TorchDispatchMode`` such as MemTracker is active, so the trace would be of the eager model,
not of what the partitioner keeps); the estimator raises :class:`NotTraceable` instead.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import pickle
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools import mem_tracker  # noqa: F401 - imported before forking

from remat.config import config_dir
from remat.measure import PeakMemory, autocast, format_bytes
from remat.strategies import CompileBudget

log = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1


class NotTraceable(RuntimeError):
    """The configured strategy cannot be estimated under ``FakeTensorMode`` (the message says
    why); no number is given rather than a wrong one."""


@dataclass
class Estimate:
    """Predicted (or, with ``fake=False``, measured) peak of one training step.

    ``peak_bytes`` and ``categories`` (``parameters``, ``buffers``, ``gradients``,
    ``optimizer_state``, ``activations``, ``temporaries``, ``other``, ``total``) in bytes,
    ``seconds`` wall time of the trace, ``device`` the device type estimated for, ``note``
    what the number means there.
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
    torch_version: str = field(default_factory=lambda: torch.__version__)


def _cuda_note() -> str:
    return ("CPU: no CUDA driver here, and torch's autograd engine cannot run a backward over "
            "fake CUDA tensors without one; the CPU trace counts the same tensors except "
            "where CUDA picks other kernels (e.g. SDPA flash attention)")


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` when a CUDA driver is present, else ``cpu``; others as given.

    Raises:
        ValueError: ``device=cuda`` asked for on a machine without CUDA (the message says
            why fake CUDA tensors cannot stand in).
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"estimate device={device}: {_cuda_note()}; use device=cpu or auto")
    return dev


def check_sizes(batch_size: Any, size: Any, size_key: str, channels: int = 1
                ) -> tuple[int, int | tuple[int, int]]:
    """Validate ``data.batch_size`` and the size key; the input tensor must fit int64.

    Args:
        batch_size, size: the config values; ``size`` is an image side (px), an image size
            ``[h, w]`` (px; ``data.patch_size`` may be either) or a sequence length (tokens),
            named by ``size_key`` (e.g. ``data.image_size``).
        channels: input channels (images: ``h * w`` pixels each).

    Returns:
        ``(batch_size, size)``, a ``[h, w]`` size as a tuple (a square one as an int).

    Raises:
        ValueError: not an integer >= 1 (or a pair of them for image sizes), or the input's
            element count overflows int64; the message names the key.
    """
    image = size_key in ("data.image_size", "data.patch_size")
    if image and isinstance(size, list | tuple) and len(size) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size):
        size = size[0] if size[0] == size[1] else (int(size[0]), int(size[1]))
    for key, value in (("data.batch_size", batch_size), (size_key, size)):
        if isinstance(value, tuple) and key == size_key:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            expected = "an integer >= 1" + (" or [h, w]" if image and key == size_key else "")
            raise ValueError(f"estimate: {key} must be {expected}, got {value!r}")
    pixels = (size[0] * size[1] if isinstance(size, tuple) else size * size) if image else size
    numel = batch_size * channels * pixels
    if numel > INT64_MAX:
        raise ValueError(f"estimate: {size_key}={size} with data.batch_size={batch_size} "
                         f"gives an input of {numel:.3e} elements, more than int64 can index "
                         f"({INT64_MAX:.3e}); use a smaller {size_key}")
    return batch_size, size


def _optimizer(module: nn.Module) -> torch.optim.Optimizer:
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
        for table in (mod._parameters, mod._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in done:
                    new = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    done[id(tensor)] = (nn.Parameter(new, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, nn.Parameter) else new)
                table[name] = done[id(tensor)]
    return module


def _batch(model: nn.Module, batch_size: int, size: int | tuple[int, int],
           device: torch.device) -> dict[str, torch.Tensor]:
    """``model.example_batch`` at ``size``; an ``(h, w)`` size crops a square batch of side
    ``max(h, w)`` to ``[..., h, w]`` (image ``[B, C, h, w]``, mask ``[B, h, w]``)."""
    if isinstance(size, int):
        batch = model.example_batch(batch_size, size)
    else:
        h, w = size
        batch = {k: v[..., :h, :w].contiguous() if v.ndim >= 3 else v
                 for k, v in model.example_batch(batch_size, max(h, w)).items()}
    return {k: v.to(device) for k, v in batch.items()}


def lightning_step_peak(model: nn.Module, batch: dict[str, torch.Tensor],
                        optimizer: torch.optim.Optimizer, device: torch.device,
                        precision: str) -> PeakMemory:
    """Peak of one training step in the order Lightning's automatic optimization runs it
    (``lightning.pytorch.loops.optimization.automatic.Closure``): forward and loss under
    autocast, then ``zero_grad(set_to_none=True)``, ``backward``, ``optimizer.step()``.
    So the previous step's gradients are still allocated during this step's forward.

    Returns the finished :class:`~remat.measure.PeakMemory` (bytes, split by category).
    """
    with PeakMemory(device, modules=[model], optimizers=[optimizer],
                    tracker="memtracker") as peak:
        with autocast(device, precision):
            loss = model.training_loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        del loss
    return peak


def trace_step(build: Callable[[], nn.Module], batch_size: int, size: int | tuple[int, int],
               device: torch.device, precision: str, fake: bool = True) -> tuple[str, Any]:
    """Build the model (``build()``, with strategy applied) and measure two training steps;
    the larger peak is returned.

    Why two: the first step allocates the optimizer state at its end (after backward has
    freed the activations), while every later step runs forward and backward with that
    state, and (Lightning's order, see :func:`lightning_step_peak`) the previous step's
    gradients, already allocated. Which of the two is higher depends on the model (the
    tiny GPT of ``experiment=shakespeare_gpt``: the second, by 37%). Training's
    :class:`~remat.callbacks.PeakMemoryMonitor` measures the first two batches as well.

    Under ``fake=True`` everything (parameters, optimizer state, batch) is a fake tensor on
    ``device``; with ``fake=False`` the same steps run for real (the reference the estimate
    is tested against). A model whose construction calls data-dependent ops (timm's
    ``trunc_normal_`` init: ``aten._local_scalar_dense``), which FakeTensorMode refuses, is
    built on the ``meta`` device instead and turned into fake tensors by :func:`materialize`
    (same shapes and dtypes; values do not matter to a fake trace).
    ``size`` is a side (px), a sequence length (tokens) or an ``(h, w)`` image size.
    Returns ``(strategy name, PeakMemory)``.
    """
    def run(make: Callable[[], nn.Module]) -> tuple[str, Any]:
        # forked RNG: on CUDA the trace runs in the training process, whose seed must hold
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return run_seeded(make)

    def run_seeded(make: Callable[[], nn.Module]) -> tuple[str, Any]:
        model = make().train()
        optimizer = _optimizer(model)
        peaks = []
        for _ in range(2):
            batch = _batch(model, batch_size, size, device)
            peaks.append(lightning_step_peak(model, batch, optimizer, device, precision))
            del batch
        peak = max(peaks, key=lambda p: p.peak_bytes)
        for p in peaks:
            p.modules, p.optimizers = [], []  # keep no fake tensor alive past the mode
        return model.strategy_report.strategy, peak

    def dev() -> Any:
        return torch.device(device) if device.type != "cpu" else nullcontext()

    def traced() -> tuple[str, Any]:
        try:
            with FakeTensorMode() if fake else nullcontext(), dev():
                return run(build)
        except Exception as err:
            if not (fake and _data_dependent(err)):
                raise
        with torch.device("meta"):
            skeleton = build()
        with FakeTensorMode(), dev():
            return run(lambda: materialize(skeleton, device))

    return _in_child(traced)


def _in_child(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child process and return its (pickled) result or re-raise its
    exception here.

    Why: in torch 2.14, a process that runs several fake-tensor training steps under
    MemTracker aborts with glibc heap corruption ("corrupted double-linked list") inside a
    garbage collection (seen with U-Nets after a few traces). Each trace therefore runs in
    a child with the cyclic garbage collector off, which leaves by ``os._exit`` without
    collecting; the caller's heap never holds a fake tensor. Where ``os.fork`` does not
    exist (Windows), or CUDA is initialised (a forked child cannot use it), ``fn`` runs in
    this process.
    """
    if not hasattr(os, "fork") or torch.cuda.is_initialized():
        return fn()  # no fork, or CUDA already up (a forked child could not use it)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: compute, send, leave without running any cleanup
        code = 1
        try:
            os.close(read_fd)
            try:
                torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
                gc.disable()  # the crash above comes from a collection; the child _exits
                payload = (True, fn())
            except BaseException as err:  # noqa: BLE001 - everything goes to the parent
                try:
                    pickle.dumps(err)
                    payload = (False, err)
                except Exception:  # noqa: BLE001
                    payload = (False, RuntimeError(f"{type(err).__name__}: {err}"))
            with os.fdopen(write_fd, "wb") as pipe:
                pickle.dump(payload, pipe)
            code = 0
        finally:  # never return into the parent's stack (a second training process)
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"estimate: the tracing process died (wait status {status}) before "
                           "it sent a result")
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value


def _model_size(cfg: DictConfig) -> tuple[str, Any]:
    """The key and value of the input size: ``data.image_size`` for image models (or, for
    datamodules that train on random crops without one, ``data.patch_size``: int or
    ``[h, w]``), ``data.block_size`` (or ``model.block_size``) for sequence models."""
    if "block_size" in cfg.model:
        if cfg.data.get("block_size") is not None:
            return "data.block_size", cfg.data.block_size
        return "model.block_size", cfg.model.block_size
    if cfg.data.get("image_size") is None and cfg.data.get("patch_size") is not None:
        return "data.patch_size", _plain(cfg.data.patch_size)  # random crops are the input
    return "data.image_size", cfg.data.get("image_size")


def _plain(value: Any) -> Any:
    """A ListConfig as a list; anything else as it is."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def build_from_config(cfg: DictConfig
                      ) -> tuple[Callable[[], nn.Module], str, int, int | tuple[int, int]]:
    """Check the config and return ``(build, size_key, batch_size, size)``; ``build()``
    instantiates ``cfg.strategy`` and ``cfg.model`` (scheduler dropped: one step).

    Raises:
        ValueError: bad sizes (naming the key) or precision.
    """
    size_key, size = _model_size(cfg)
    channels = int(cfg.model.get("in_channels", 1) or 1)
    batch_size, size = check_sizes(cfg.data.get("batch_size"), size, size_key, channels)
    precision = str(cfg.precision)
    if precision not in ("32-true", "bf16-mixed", "16-mixed"):
        raise ValueError(f"estimate: precision={precision!r}; use 32-true, bf16-mixed or "
                         "16-mixed")
    model_cfg = cfg.model.copy()
    with open_dict(model_cfg):
        model_cfg.scheduler = None  # one step; its ${trainer...} interpolations need no trainer
        if "block_size" in model_cfg and isinstance(size, int) and size > int(
                model_cfg.block_size):
            model_cfg.block_size = size  # positions must cover the sequence

    for group, node in (("strategy", cfg.strategy), ("model", model_cfg)):
        try:  # import here, once: the traces run in forked children, which would re-import
            get_class(str(node._target_))
        except Exception as err:
            raise ValueError(f"estimate: config group '{group}' failed to build: _target_ "
                             f"{node.get('_target_')!r} cannot be imported ({err})") from err

    def build() -> nn.Module:
        try:
            strategy = instantiate(cfg.strategy)
        except InstantiationException as err:
            raise ValueError(f"estimate: config group 'strategy' failed to build "
                             f"({cfg.strategy.get('_target_')}): {err}") from err
        try:
            return instantiate(model_cfg, strategy=strategy)
        except InstantiationException as err:
            raise ValueError(f"estimate: config group 'model' failed to build "
                             f"({model_cfg.get('_target_')}): {err}") from err

    return build, size_key, batch_size, size


def estimate(cfg: DictConfig, fake: bool = True) -> Estimate:
    """Estimate the peak memory of one training step of the configured run.

    Args:
        cfg: composed ``estimate.yaml`` (``model``, ``data``, ``strategy``, ``precision``,
            ``device``).
        fake: ``False`` runs the same step for real (what the estimate is checked against).

    Raises:
        ValueError: bad sizes, precision, device, or a config group that fails to build
            (naming the group and its ``_target_``).
        NotTraceable: the strategy cannot be traced under ``FakeTensorMode`` (``compile``),
            or the trace failed inside the strategy.
    """
    build, size_key, batch_size, size = build_from_config(cfg)
    device = resolve_device(str(cfg.get("device", "auto")))
    precision = str(cfg.precision)
    target = str(cfg.strategy.get("_target_", ""))
    if target.endswith(CompileBudget.__name__) and fake:
        raise NotTraceable(
            "estimate: strategy 'compile' cannot be estimated: torch.compile does not compile "
            "while MemTracker's dispatch mode is active, so a trace would show the eager "
            "model rather than what the compiler's partitioner keeps. Measure it on the "
            "device instead (python -m remat.bench ... 'strategies=[none,compile]')")
    start = time.perf_counter()
    try:
        strategy, peak = trace_step(build, batch_size, size, device, precision, fake)
    except RuntimeError as err:
        if "overflow" in str(err).lower():
            raise ValueError(f"estimate: {size_key}={size} with data.batch_size={batch_size} "
                             f"overflows int64 inside the model ({err}); use a smaller "
                             f"{size_key}") from err
        if fake:
            raise NotTraceable(f"estimate: strategy {target.rsplit('.', 1)[-1]} could not be "
                               f"traced under FakeTensorMode: {type(err).__name__}: "
                               f"{err}") from err
        raise
    seconds = time.perf_counter() - start
    fell_back = fake and device.type == "cpu" and str(cfg.get("device", "auto")) == "auto"
    note = f"tensor-level peak on {device.type}" + (f" ({_cuda_note()})" if fell_back else "")
    return Estimate(strategy=strategy, precision=precision,
                    device=device.type, batch_size=batch_size, size=size, size_key=size_key,
                    peak_bytes=int(peak.peak_bytes), categories=peak.categories,
                    seconds=seconds, fake=fake, note=note)


def format_estimate(est: Estimate) -> str:
    """Plain-text table of an :class:`Estimate`: one line per category, MiB/GiB."""
    kind = "predicted" if est.fake else "measured"
    lines = [f"{kind} peak of one training step: strategy {est.strategy}, {est.precision}, "
             f"batch {est.batch_size}, {est.size_key}={est.size}, device {est.device} "
             f"({est.seconds:.1f} s)"]
    for name, value in est.categories.items():
        if name != "total":
            lines.append(f"  {name:<16}{format_bytes(value):>12}")
    lines.append(f"  {'total':<16}{format_bytes(est.peak_bytes):>12}")
    lines.append(f"  note: {est.note}")
    return "\n".join(lines)


def run(cfg: DictConfig) -> Estimate:
    """Estimate, print the table and write ``estimate.json`` (the estimate's fields and the
    composed ``model``/``data``/``strategy``/``precision``/``device`` config) into
    ``cfg.paths.output_dir``."""
    est = estimate(cfg)
    print(format_estimate(est))
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    keep = {k: cfg[k] for k in ("model", "data", "strategy", "precision", "device") if k in cfg}
    record = asdict(est) | {"config": OmegaConf.to_container(OmegaConf.create(keep),
                                                              resolve=False)}
    (out / "estimate.json").write_text(json.dumps(record, indent=2, default=str))
    return est


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="estimate")
def main(cfg: DictConfig) -> None:
    """Hydra app around :func:`run`; a strategy that cannot be traced exits with code 2 and
    the reason, instead of a number."""
    try:
        run(cfg)
    except NotTraceable as err:
        print(str(err), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
