"""Strategies side by side in one process: peak memory, step time, gradient parity.

``python -m remat.bench model=unet_resnet34 data.image_size=512 data.batch_size=2`` or
``python -m remat.bench model=gpt_small data.batch_size=2 'data.block_size=[512,1024,2048]'``
(a list of sizes runs one after another in one process; one table with a size column).

Protocol (GUIDE.md sec. 4): every strategy wraps a copy of the same model (same weights);
peak memory of one training step (forward, loss, backward; parameters and gradients
included, no optimizer state) is measured per strategy (CUDA allocator peak, or exact
tensor-level MemTracker on CPU); step times are interleaved across strategies after
``warmup`` rounds and the median of ``steps`` timed rounds is kept. A memory saving counts
only if the strategy's gradients match ``none`` on the same batch and seed.

Reference rows from outside remat, measured in the same run: torch's
``checkpoint_sequential`` with ceil(sqrt(N)) segments per ``nn.Sequential`` stage, and timm's
``set_grad_checkpointing`` wherever a timm model holds the stages (``tu-`` encoders, timm
ViTs); ``reference_points=false`` drops them.
"""

from __future__ import annotations

import copy
import csv
import json
import logging
import platform
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from torch.utils.checkpoint import checkpoint_sequential

from remat import run_shape
from remat.config import config_dir
from remat.measure import (
    TOLERANCES,
    PeakMemory,
    StepTimer,
    compare_gradients,
    device_name,
    format_bytes,
    gradients_of,
    training_step,
)
from remat.strategies import (
    CheckpointStrategy,
    StageError,
    StrategyReport,
    TimmNative,
    build_strategy,
    resolve_stages,
    sqrt_segments,
)
from remat.strategies.segmented import _patch, unpatch_all

log = logging.getLogger(__name__)

# image side (px) when data.image_size is null (configs/bench.yaml)
DEFAULT_IMAGE_SIZE = 512
TIMM_REFERENCE = "timm_set_grad_checkpointing"



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
    reserved_bytes: int | None = None
    size: int | None = None


def _step(module: L.LightningModule, batch: dict, device: torch.device, precision: str) -> None:
    module.zero_grad(set_to_none=True)
    training_step(module, batch, None, device, precision)


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
        grads[name] = gradients_of(model)
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
        parity = compare_gradients(grads["none"], grads[name], rtol=rtol, atol=atol)
        rows.append(BenchRow(name, int(peaks[name].peak_bytes), float(timers[name].median_ms),
                             parity.match, parity.max_abs_diff, step_ms=timers[name].times_ms,
                             reserved_bytes=peaks[name].reserved_bytes))
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
    """Plain-text table: size, strategy, peak memory, x none, median step ms, x none, grads
    match (yes/NO)."""
    w = max([len("strategy"), *(len(r.strategy) for r in rows)]) + 2
    lines = [f"{'size':>6}  {'strategy':<{w}}{'peak memory':>14}{'x none':>9}{'step time':>13}"
             f"{'x none':>9}{'grads match':>13}"]
    for r in rows:
        lines.append(f"{r.size if r.size is not None else '':>6}  {r.strategy:<{w}}"
                     f"{format_bytes(r.peak_bytes):>14}{r.peak_ratio:>9.2f}"
                     f"{r.median_ms:>10.1f} ms{r.time_ratio:>9.2f}"
                     f"{'yes' if r.grads_match else 'NO':>13}")
    return "\n".join(lines)


def _sizes(cfg: DictConfig) -> tuple[str, list[int]]:
    """The size key and its values: ``data.block_size`` for sequence models (default
    ``model.block_size``), ``data.image_size`` for image models (default
    :data:`DEFAULT_IMAGE_SIZE` px); one value or a list.

    Raises:
        ValueError: a missing size or one that is not an integer >= 1 (names the key); the
            size key of the other model kind set (``data.image_size`` for a GPT,
            ``data.block_size`` for an image model), naming both keys.
    """
    sequence = run_shape.is_sequence_model(cfg.model)
    other, used = (("data.image_size", "data.block_size") if sequence
                   else ("data.block_size", "data.image_size"))
    if cfg.data.get(other.split(".")[1]) is not None:
        kind = "sequence" if sequence else "image"
        raise ValueError(f"bench: {other} does not apply to this {kind} model "
                         f"(model._target_={cfg.model.get('_target_')}); set {used} instead")
    if sequence:
        key, value = "data.block_size", cfg.data.get("block_size")
        if value is None:  # the model config's own fallback, as without a data.block_size
            fallback = cfg.copy()
            with open_dict(fallback):
                del fallback.data["block_size"]
            value = fallback.model.block_size
    else:
        key, value = "data.image_size", cfg.data.get("image_size")
        value = DEFAULT_IMAGE_SIZE if value is None else value
    values = list(value) if isinstance(value, ListConfig | list | tuple) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
        raise ValueError(f"bench: {key} must be an integer >= 1 or a list of them, got "
                         f"{shown!r}")
    return key, [int(v) for v in values]


def _timm_reference(base: L.LightningModule, stages: Sequence[str]) -> TimmNative | None:
    """timm's own ``set_grad_checkpointing`` as a reference row, if the model supports it
    (a timm model or an smp ``tu-`` encoder holds the stages); else ``None``."""
    probe = copy.deepcopy(base.net)
    try:
        TimmNative().apply(probe, list(stages))
    except StageError as err:
        log.info("no timm reference row: %s", str(err).split(";")[0])
        return None
    return TimmNative()


def bench(cfg: DictConfig) -> dict[str, Any]:
    """Run the benchmark the config describes, once per size in the size list; write
    ``bench.csv``, ``bench.json`` and ``bench.png`` (one table, a ``size`` column).

    Raises:
        ValueError: unknown strategy (lists valid ones), bad sizes (naming the key) or
            precision.
    """
    precision = run_shape.check_precision(cfg.precision, cfg.device, run_shape.TRACED_PRECISIONS,
                                          "bench precision")
    batch_size = cfg.data.get("batch_size")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"bench: data.batch_size must be an integer >= 1, got {batch_size!r}")
    size_key, sizes = _sizes(cfg)
    device = run_shape.resolve_device(cfg.device)
    strategies: dict[str, CheckpointStrategy] = {}
    for spec in cfg.strategies:
        name, overrides = (spec, {}) if isinstance(spec, str) else (
            spec["name"], {k: v for k, v in spec.items() if k != "name"})
        args = ", ".join(f"{k}={v}" for k, v in overrides.items())
        label = f"{name}({args})" if overrides else name
        strategies[label] = build_strategy(name, **overrides)
    rows: list[BenchRow] = []
    for size in sizes:
        L.seed_everything(cfg.seed, workers=False)
        run_cfg = copy.deepcopy(cfg)  # this size in data.*, so ${data...} in the model follow
        with open_dict(run_cfg):
            run_cfg.data[size_key.split(".")[1]] = size
            model_cfg = run_cfg.model  # one step, no optimizer: drop the scheduler
            model_cfg.scheduler = None
            if size_key == "data.block_size":
                model_cfg.block_size = size  # the model follows the data, as in training
        base = instantiate(model_cfg)  # no strategy: wraps nothing
        runs = dict(strategies)
        if cfg.get("reference_points", True):
            runs[TorchCheckpointSequential.name] = TorchCheckpointSequential()
            timm = _timm_reference(base, list(cfg.model.stages))
            if timm is not None:
                runs[TIMM_REFERENCE] = timm
        generator = torch.Generator().manual_seed(cfg.seed)
        batch = base.example_batch(batch_size, size, generator)
        size_rows = run_benchmark(base, list(cfg.model.stages), runs, batch, device,
                                  precision, int(cfg.warmup), int(cfg.steps),
                                  int(cfg.seed))
        for row in size_rows:
            row.size = size
        rows.extend(size_rows)
        print(format_table(size_rows), flush=True)  # progress: one size at a time
        del base, batch
    model_name = cfg.model._target_.rsplit(".", 1)[-1]
    record = {
        "model": OmegaConf.to_container(cfg.model, resolve=False),
        "batch_size": batch_size, "size_key": size_key, "sizes": sizes,
        "precision": str(cfg.precision), "device": device_name(device),
        "torch_version": torch.__version__, "machine": platform.machine(),
        "warmup": int(cfg.warmup), "steps": int(cfg.steps),
        "rows": [asdict(r) for r in rows],
    }
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(record, indent=2))
    title = (f"{model_name}, batch {batch_size}, {size_key} {', '.join(map(str, sizes))}, "
             f"{cfg.precision}, {record['device']}")
    plot(rows, out / "bench.png", title)
    with (out / "bench.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["size", "strategy", "peak_bytes", "peak_ratio", "median_ms",
                         "time_ratio", "grads_match", "max_grad_diff", "reserved_bytes"])
        for r in rows:
            writer.writerow([r.size, r.strategy, r.peak_bytes, f"{r.peak_ratio:.4f}",
                             f"{r.median_ms:.2f}", f"{r.time_ratio:.4f}", r.grads_match,
                             f"{r.max_grad_diff:.3g}", r.reserved_bytes or ""])
    print(f"{model_name} batch {batch_size}, {size_key} {sizes}, {cfg.precision}, "
          f"{record['device']}, torch {torch.__version__}")
    print(format_table(rows))
    print(f"wrote {out / 'bench.csv'}, {out / 'bench.json'} and {out / 'bench.png'}")
    return record


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="bench")
def main(cfg: DictConfig) -> None:
    """Hydra app around :func:`bench`."""
    bench(cfg)


if __name__ == "__main__":
    main()
