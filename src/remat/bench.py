"""Strategies side by side in one process: peak memory, step time, gradient parity.

``python -m remat.bench model=gpt_small batch_size=2 input_size=1024`` or
``python -m remat.bench model=unet_resnet34 batch_size=2 input_size=512``.

Protocol (GUIDE.md sec. 4): every strategy wraps a copy of the same model (same weights);
peak memory of one training step (forward, loss, backward; parameters and gradients
included, no optimizer state) is measured per strategy (CUDA allocator peak, or exact
tensor-level MemTracker on CPU); step times are interleaved across strategies after
``warmup`` rounds and the median of ``steps`` timed rounds is kept. A memory saving counts
only if the strategy's gradients match ``none`` on the same batch and seed.
"""

from __future__ import annotations

import copy
import csv
import json
import logging
import platform
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.utils.checkpoint import checkpoint_sequential

from remat.config import config_dir
from remat.measure import PeakMemory, StepTimer, device_name, format_bytes
from remat.strategies import (
    CheckpointStrategy,
    StageError,
    StrategyReport,
    build_strategy,
    resolve_stages,
    sqrt_segments,
)
from remat.strategies.segmented import _patch, unpatch_all

log = logging.getLogger(__name__)

TOLERANCES = {"32-true": (1e-5, 1e-6), "bf16-mixed": (2e-2, 2e-2), "16-mixed": (1e-2, 1e-2)}


@dataclass
class BenchRow:
    """One strategy's result. Bytes and milliseconds; ratios are to ``none``."""

    strategy: str
    peak_bytes: int
    median_ms: float
    grads_match: bool
    max_grad_diff: float
    peak_ratio: float = float("nan")
    time_ratio: float = float("nan")
    step_ms: list[float] = field(default_factory=list)


def _autocast(device: torch.device, precision: str):
    if precision == "32-true":
        return nullcontext()
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if dtype is None:
        raise ValueError(f"bench precision={precision!r}: use 32-true, bf16-mixed or 16-mixed")
    return torch.autocast(device.type, dtype=dtype)


def _step(module: L.LightningModule, batch: dict, device: torch.device, precision: str) -> None:
    module.zero_grad(set_to_none=True)
    with _autocast(device, precision):
        loss = module.training_loss(batch)
    loss.backward()


def run_benchmark(base: L.LightningModule, stages: Sequence[str],
                  strategies: dict[str, CheckpointStrategy], batch: dict[str, torch.Tensor],
                  device: torch.device | str = "cpu", precision: str = "32-true",
                  warmup: int = 2, steps: int = 5, seed: int = 0) -> list[BenchRow]:
    """Measure every strategy on copies of ``base`` (a module with ``training_loss(batch)``).

    Args:
        base: model without any strategy applied; each strategy wraps a deep copy.
        stages: stage paths inside ``base.net`` the strategies act on.
        strategies: name -> strategy; must include ``none`` (the reference).
        batch: one batch (same for every strategy).
        warmup, steps: untimed and timed interleaved rounds (>= 1 timed round).

    Returns:
        one :class:`BenchRow` per strategy, in the given order.

    Raises:
        ValueError: ``none`` missing, ``steps < 1``, or unknown precision.
    """
    if "none" not in strategies:
        raise ValueError("bench strategies must include 'none', the reference")
    if steps < 1 or warmup < 0:
        raise ValueError(f"bench needs steps >= 1 and warmup >= 0, got {steps}, {warmup}")
    device = torch.device(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    models = {}
    for name, strategy in strategies.items():
        model = copy.deepcopy(base).to(device).train()
        strategy.apply(model.net, list(stages))
        models[name] = model

    grads: dict[str, dict[str, torch.Tensor]] = {}
    for name, model in models.items():  # gradient parity: same batch, same RNG
        torch.manual_seed(seed)
        _step(model, batch, device, precision)
        grads[name] = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    peaks = {}
    for name, model in models.items():
        model.zero_grad(set_to_none=True)
        with PeakMemory(device, modules=[model]) as peak:
            _step(model, batch, device, precision)
        peaks[name] = peak
    timers = {name: StepTimer(device, warmup=warmup) for name in models}
    for _ in range(warmup + steps):
        for name, model in models.items():
            timers[name].start()
            _step(model, batch, device, precision)
            timers[name].stop()

    rtol, atol = TOLERANCES.get(precision, (1e-2, 1e-2))
    rows = []
    for name in models:
        ref, got = grads["none"], grads[name]
        match = ref.keys() == got.keys() and all(
            torch.allclose(got[k], ref[k], rtol=rtol, atol=atol) for k in ref)
        diff = max(((got[k] - ref[k]).abs().max().item() for k in ref if k in got), default=0.0)
        rows.append(BenchRow(name, int(peaks[name].peak_bytes), float(timers[name].median_ms),
                             bool(match), float(diff), step_ms=timers[name].times_ms))
    ref_row = rows[0] if rows[0].strategy == "none" else next(r for r in rows
                                                                 if r.strategy == "none")
    for row in rows:
        row.peak_ratio = row.peak_bytes / ref_row.peak_bytes
        row.time_ratio = row.median_ms / ref_row.median_ms
    return rows


class TorchCheckpointSequential(CheckpointStrategy):
    """Reference point from outside remat: ``torch.utils.checkpoint.checkpoint_sequential``
    with ceil(sqrt(N)) segments on each ``nn.Sequential`` stage (non-reentrant).

    Plain torch, so its recompute updates BatchNorm running statistics a second time; the
    benchmark compares gradients only.
    """

    name = "torch_checkpoint_sequential"

    def apply(self, model: torch.nn.Module, stages: Iterable[str]) -> StrategyReport:
        resolved = resolve_stages(model, stages)
        unpatch_all(model)
        report = StrategyReport(strategy=self.name, stages=[p for p, _ in resolved])
        for path, chain in resolved:
            if not isinstance(chain, torch.nn.Sequential):
                raise StageError(f"{self.name} needs nn.Sequential stages; '{path}' is a "
                                 f"{type(chain).__name__}")
            _patch(chain, _checkpoint_sequential_forward, None, self)
            report.segments[path] = sqrt_segments(len(chain))
            report.wrapped.extend(f"{path}.{i}" for i in range(len(chain)))
        return report

    def remove(self, model: torch.nn.Module) -> None:
        unpatch_all(model)


def _checkpoint_sequential_forward(self: torch.nn.Sequential, x):
    if not (self.training and torch.is_grad_enabled()):
        return type(self).forward(self, x)
    return checkpoint_sequential(list(self), max(1, len(sqrt_segments(len(self)))), x,
                                 use_reentrant=False)


def plot(rows: Sequence[BenchRow], path: Path, title: str) -> None:
    """Scatter of peak memory (MiB) against median step time (ms), one point per strategy,
    ``none`` marked; written as PNG with matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ref = r.strategy == "none"
        ax.scatter(r.median_ms, r.peak_bytes / 2**20, marker="*" if ref else "o",
                   s=160 if ref else 50, color="black" if ref else None, zorder=3)
        ax.annotate(r.strategy, (r.median_ms, r.peak_bytes / 2**20), fontsize=8,
                    xytext=(5, 4), textcoords="offset points")
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(rows: Sequence[BenchRow]) -> str:
    """Plain-text table: strategy, peak MiB, x none, median step ms, x none, grads match."""
    w = max([len("strategy"), *(len(r.strategy) for r in rows)]) + 2
    lines = [f"{'strategy':<{w}}{'peak memory':>14}{'x none':>9}{'step time':>13}{'x none':>9}"
             f"{'grads match':>13}"]
    for r in rows:
        lines.append(f"{r.strategy:<{w}}{format_bytes(r.peak_bytes):>14}{r.peak_ratio:>9.2f}"
                     f"{r.median_ms:>10.1f} ms{r.time_ratio:>9.2f}"
                     f"{'yes' if r.grads_match else 'NO':>13}")
    return "\n".join(lines)


def bench(cfg: DictConfig) -> dict[str, Any]:
    """Run the benchmark the config describes; write ``bench.csv`` and ``bench.json``.

    Raises:
        ValueError: unknown strategy (lists valid ones), bad sizes or precision.
    """
    if str(cfg.precision) == "16-mixed" and not (cfg.device != "cpu" and torch.cuda.is_available()):
        raise ValueError("bench precision=16-mixed needs a CUDA device; on CPU use bf16-mixed")
    if int(cfg.batch_size) < 1 or int(cfg.input_size) < 1:
        raise ValueError(f"batch_size and input_size must be >= 1, got {cfg.batch_size}, "
                         f"{cfg.input_size}")
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if cfg.device == "auto" else cfg.device))
    strategies: dict[str, CheckpointStrategy] = {}
    for spec in cfg.strategies:
        name, overrides = (spec, {}) if isinstance(spec, str) else (
            spec["name"], {k: v for k, v in spec.items() if k != "name"})
        args = ", ".join(f"{k}={v}" for k, v in overrides.items())
        label = f"{name}({args})" if overrides else name
        strategies[label] = build_strategy(name, **overrides)
    if cfg.get("reference_points", True):
        strategies[TorchCheckpointSequential.name] = TorchCheckpointSequential()
    L.seed_everything(cfg.seed, workers=False)
    model_cfg = cfg.model.copy()
    with open_dict(model_cfg):  # one step, no optimizer: the scheduler (and its ${trainer...}) goes
        model_cfg.scheduler = None
    base = instantiate(model_cfg)  # no strategy: wraps nothing
    generator = torch.Generator().manual_seed(cfg.seed)
    batch = base.example_batch(int(cfg.batch_size), int(cfg.input_size), generator)
    rows = run_benchmark(base, list(cfg.model.stages), strategies, batch, device,
                         str(cfg.precision), int(cfg.warmup), int(cfg.steps), int(cfg.seed))
    record = {
        "model": OmegaConf.to_container(model_cfg, resolve=True),
        "batch_size": int(cfg.batch_size), "input_size": int(cfg.input_size),
        "precision": str(cfg.precision), "device": device_name(device),
        "torch_version": torch.__version__, "machine": platform.machine(),
        "warmup": int(cfg.warmup), "steps": int(cfg.steps),
        "rows": [asdict(r) for r in rows],
    }
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(record, indent=2))
    title = (f"{cfg.model._target_.rsplit('.', 1)[-1]}, batch {cfg.batch_size}, input "
             f"{cfg.input_size}, {cfg.precision}, {record['device']}")
    plot(rows, out / "bench.png", title)
    with (out / "bench.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["strategy", "peak_bytes", "peak_ratio", "median_ms", "time_ratio",
                         "grads_match", "max_grad_diff"])
        for r in rows:
            writer.writerow([r.strategy, r.peak_bytes, f"{r.peak_ratio:.4f}", f"{r.median_ms:.2f}",
                             f"{r.time_ratio:.4f}", r.grads_match, f"{r.max_grad_diff:.3g}"])
    print(f"{cfg.model._target_.rsplit('.', 1)[-1]} batch {cfg.batch_size}, input "
          f"{cfg.input_size}, {cfg.precision}, {record['device']}, torch {torch.__version__}")
    print(format_table(rows))
    print(f"wrote {out / 'bench.csv'}, {out / 'bench.json'} and {out / 'bench.png'}")
    return record


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="bench")
def main(cfg: DictConfig) -> None:
    """Hydra app around :func:`bench`."""
    bench(cfg)


if __name__ == "__main__":
    main()
