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

Kernel temporaries: ``kernel_temporaries=true`` also predicts the *allocator's* peak, which
adds the buffers an operator's kernel allocates and frees inside its own call (oneDNN's
reorders of a convolution's input, weight and gradient on the CPU) and the batch: each
distinct operator call of the step is run once for real on the device estimated for, with
stand-in inputs of the traced shapes (:mod:`remat.measure.kernels`, what the planner does
when it plans for this CPU), and the trace adds each call's temporaries to what is held
at that moment. On 3D convolution nets these are large: MONAI's 3D U-Net at 64^3, batch
1, peaks 33% above its tensor-level peak on this CPU. It runs every operator at the full
size, so it takes about a training step's time and the memory of its largest operator.

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

import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from remat import _compat, run_shape
from remat.build import build_from_config
from remat.config import config_dir
from remat.errors import exit_on_unknown_key, run_entry
from remat.measure import format_bytes
from remat.measure.kernels import KernelTemporaries, measured_temporaries, signatures_fn
from remat.measure.trace import Estimate, in_children, trace_step
from remat.planner.run import check_plan_fits
from remat.strategies import NoCheckpoint

_compat.preload_mem_tracker()  # imported before forking

log = logging.getLogger(__name__)

class NotTraceable(RuntimeError):
    """The configured strategy cannot be estimated under ``FakeTensorMode`` (the message says
    why); no number is given rather than a wrong one."""


def _cuda_note() -> str:
    return ("CPU: no CUDA driver here, and torch's autograd engine cannot run a backward over "
            "fake CUDA tensors without one; the CPU trace counts the same tensors except "
            "where CUDA picks other kernels (e.g. SDPA flash attention)")


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` when a CUDA driver is present, else ``cpu``; others as given
    (:func:`remat.run_shape.resolve_device`).

    Raises:
        ValueError: ``device=cuda`` asked for on a machine without CUDA (the message says
            why fake CUDA tensors cannot stand in).
    """
    try:
        return run_shape.resolve_device(device)
    except ValueError as err:
        if "CUDA" not in str(err):
            raise ValueError(f"estimate {err}") from err
        raise ValueError(f"estimate device={device}: {_cuda_note()}; use device=cpu or "
                         "auto") from err


def _configured_strategy(cfg: DictConfig) -> Any:
    """The configured strategy object, or ``None`` where its config does not build (the
    trace then reports it)."""
    try:
        return instantiate(cfg.strategy)
    except Exception:  # noqa: BLE001 - the trace reports a broken strategy config
        return None


def _needs_plan(cfg: DictConfig) -> bool:
    """Whether the configured strategy is planned before the model is built (``budget``)."""
    try:
        return bool(getattr(get_class(str(cfg.strategy.get("_target_"))), "needs_plan", False))
    except Exception:  # noqa: BLE001 - a target that does not import is the build's to name
        return False


def estimate(cfg: DictConfig, fake: bool = True) -> Estimate:
    """Estimate the peak memory of one training step of the configured run.

    Args:
        cfg: composed ``estimate.yaml`` (``model``, ``data``, ``strategy``, ``precision``,
            ``device``).
        fake: ``False`` runs the same step for real (what the estimate is checked against).

    Raises:
        ValueError: bad sizes, precision, device, or a config group that fails to build
            (naming the group and its ``_target_``); ``strategy=budget`` (planned by
            ``python -m remat.plan``, whose plan file this estimates); a plan file made
            for another run shape (``PlanMismatch``, naming ``strategy.path`` and the key).
        NotTraceable: the strategy cannot be traced under ``FakeTensorMode`` (``compile``),
            or the trace failed inside the strategy.
    """
    if _needs_plan(cfg):
        memory = cfg.strategy.get("memory")
        raise ValueError(
            f"estimate: strategy=budget (strategy.memory={memory}) is a request for a plan, "
            "not a strategy to trace: python -m remat.plan with the same keys plans it and "
            "prints its predicted peak, then estimate the plan it writes with "
            "strategy=plan strategy.path=<plan.json>")
    strategy_obj = _configured_strategy(cfg)
    if getattr(strategy_obj, "plan", None) is not None and getattr(strategy_obj, "path", None):
        # a plan file made for another run shape is refused, as training refuses it (it
        # estimated a 96 px plan at 128 px)
        check_plan_fits(strategy_obj.plan, cfg, strategy_obj.path)
    build, size_key, batch_size, size = build_from_config(cfg)
    device = resolve_device(str(cfg.get("device", "auto")))
    precision = str(cfg.precision)
    target = str(cfg.strategy.get("_target_", ""))
    name = (strategy_obj.name if fake and strategy_obj is not None
            and not getattr(strategy_obj, "traceable", True) else None)
    if name is not None:
        raise NotTraceable(
            f"estimate: strategy '{name}' cannot be estimated: its work happens in compiled "
            "code, and torch.compile does not compile while MemTracker's dispatch mode is "
            "active, so a trace would show the eager model rather than what the compiler's "
            "partitioner keeps. Measure it on the device instead (python -m remat.bench ... "
            "'strategies=[none,compile]')")
    accumulate = run_shape.normalize_size(cfg.get("accumulate_grad_batches", 1),
                                          "accumulate_grad_batches")
    sharding = run_shape.sharding_of(cfg)
    start = time.perf_counter()
    temporaries = (kernel_temporaries(build, batch_size, size, precision, device)
                   if fake and _wants_temporaries(cfg) else None)
    try:
        strategy, peak = trace_step(build, batch_size, size, device, precision, fake,
                                    accumulate_grad_batches=accumulate,
                                    world_size=sharding.world_size,
                                    reshard_after_forward=sharding.reshard_after_forward,
                                    temporaries=temporaries, fsdp=sharding.fsdp)
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
    allocator = None
    if temporaries is not None:
        allocator = int(peak.allocator_peak_bytes)
        note += (f"; allocator peak with the batch and the kernel temporaries of "
                 f"{len(temporaries.table)} operator calls measured on this {device.type}")
    if sharding.fsdp:
        note += (f"; rank 0 of {sharding.world_size} FSDP2 ranks (ZeRO-"
                 f"{3 if sharding.reshard_after_forward else 2}), batch per rank")
    return Estimate(strategy=strategy, precision=precision,
                    device=device.type, batch_size=batch_size, size=size, size_key=size_key,
                    peak_bytes=int(peak.peak_bytes), categories=peak.categories,
                    seconds=seconds, fake=fake, note=note, accumulate_grad_batches=accumulate,
                    world_size=sharding.world_size, allocator_peak_bytes=allocator,
                    fsdp=bool(sharding.fsdp))


def _wants_temporaries(cfg: DictConfig) -> bool:
    """``kernel_temporaries`` of the config as a bool (absent: ``False``).

    Raises:
        ValueError: a value other than true/false, naming the key.
    """
    value = cfg.get("kernel_temporaries", False)
    if not isinstance(value, bool):
        raise ValueError(f"estimate kernel_temporaries={value!r}: expected true or false")
    return value


def kernel_temporaries(build: Any, batch_size: int, size: Any, precision: str,
                       device: torch.device) -> KernelTemporaries:
    """Each distinct operator call of a training step of ``build`` without checkpointing
    (a recompute calls the same operators again) with the bytes its kernel allocates
    beyond its outputs, measured on ``device`` in this process (see
    :mod:`remat.measure.kernels`); the calls are listed by a fake trace in a child."""
    calls = in_children([signatures_fn(lambda: build.with_strategy(NoCheckpoint()),
                                       batch_size, size, precision, device)])[0]
    return measured_temporaries(calls, device)


def format_estimate(est: Estimate) -> str:
    """Plain-text table of an :class:`Estimate`: one line per category, MiB/GiB."""
    kind = "predicted" if est.fake else "measured"
    lines = [f"{kind} peak of one training step: strategy {est.strategy}, {est.precision}, "
             f"batch {est.batch_size}, {est.size_key}={est.size}, "
             + (f"accumulate_grad_batches={est.accumulate_grad_batches}, "
                if est.accumulate_grad_batches > 1 else "")
             + (f"one of {est.world_size} FSDP2 ranks, " if est.fsdp else "")
             + f"device {est.device} ({est.seconds:.1f} s)"]
    for name, value in est.categories.items():
        if name != "total":
            lines.append(f"  {name:<16}{format_bytes(value):>12}")
    lines.append(f"  {'total':<16}{format_bytes(est.peak_bytes):>12}")
    if est.allocator_peak_bytes is not None:
        lines.append(f"  {'allocator':<16}{format_bytes(est.allocator_peak_bytes):>12}  "
                     "(total + batch + kernel temporaries)")
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
    keep = {k: cfg[k] for k in ("model", "data", "strategy", "precision",
                                "accumulate_grad_batches", "device", "world_size",
                                "reshard_after_forward", "kernel_temporaries") if k in cfg}
    record = asdict(est) | {"config": OmegaConf.to_container(OmegaConf.create(keep),
                                                              resolve=False)}
    (out / "estimate.json").write_text(json.dumps(record, indent=2, default=str))
    return est


def _app(cfg: DictConfig) -> None:
    """Hydra app around :func:`run`; a strategy that cannot be traced exits with code 2 and
    the reason, instead of a number; a user error (a config, data or model-build error)
    exits with code 1 and its message on one line (:func:`remat.errors.run_entry`)."""
    try:
        run_entry(run, cfg)
    except NotTraceable as err:
        print(str(err), file=sys.stderr)
        sys.exit(2)


_hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir()),
                         config_name="estimate")(_app)


def main() -> None:
    """``python -m remat.estimate`` / ``remat-estimate``: a key the config lacks ends it with one
    line naming the closest keys (:func:`remat.errors.exit_on_unknown_key`), then the Hydra
    app (:func:`_app`)."""
    exit_on_unknown_key("estimate")
    _hydra_main()


if __name__ == "__main__":
    main()
