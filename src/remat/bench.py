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

On CUDA one model is on the device at a time: every model, and every stored gradient copy,
waits on the CPU; the measured one is moved in, measured (or timed: the moves are outside
the timed region) and moved out again, and the allocator cache is emptied, so a row's
``max_memory_allocated`` counts that model alone (:class:`remat.measure.DeviceSlot`). On
the CPU nothing moves.

Reference rows from outside remat, measured in the same run: torch's
``checkpoint_sequential`` with ceil(sqrt(N)) segments per ``nn.Sequential`` stage, timm's
``set_grad_checkpointing`` wherever a timm model holds the stages (``tu-`` encoders, timm
ViTs), and Hugging Face's own activation checkpointing wherever a ``transformers``
``PreTrainedModel`` holds them (:class:`remat.strategies.HFGradientCheckpointing`); a
reference that cannot apply to the stages is skipped with a printed note;
``reference_points=false`` drops them. The rows are :data:`remat.strategies.REFERENCES`,
measured by :mod:`remat.benchmarking`.

``compiled=true`` adds rows measured on models compiled with ``torch.compile`` (backend
``compile_backend``, default ``inductor``; strategies ``compile_strategies``, default none,
full, sqrtn), with
ratios to ``none`` compiled and gradients compared with eager ``none``; they are timed in
the same interleaved rounds as the eager rows, so their ratios to eager ``none``
(``eager_time_ratio``) are interleaved too. On the CPU their peak comes from
``torch.profiler`` memory events (:class:`remat.measure.ProfilerPeakMemory`): MemTracker
is a ``TorchDispatchMode``, under which dynamo runs the model eagerly. ``peak_by=profiler``
measures the eager rows that way as well (allocator events include kernels' temporaries,
which a tensor-level MemTracker does not see). ``compile_options`` are inductor settings for
every compiled row (``torch.compile(options=...)``); ``null`` gives inductor's own but
``layout_optimization`` off under ``32-true``, as training's ``compile=true`` does
(:mod:`remat.compiling` says why), ``{}`` inductor's own.
"""

from __future__ import annotations

import copy
import json
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from remat import run_shape
from remat.benchmarking import (
    BenchRow,
    bench_sizes,
    budget_rows_above_their_rows,
    build_strategies,
    check_budget_rows,
    format_table,
    measure_groups,
    planned_strategies,
    plot,
    reference_rows,
    write_csv,
)
from remat.compiling import (
    TRAINING_BACKEND,
    check_compile_options,
    options_record,
    training_options,
)
from remat.config import config_dir
from remat.errors import run_entry
from remat.measure import DeviceSlot, device_name
from remat.strategies import COMPILED_REFERENCES, REFERENCES
from remat.strategies.stages import nothing_to_wrap


def _is_budget(spec: Any) -> bool:
    name = spec if isinstance(spec, str) else (spec.get("name") if hasattr(spec, "get") else None)
    return name == "budget"


def _fsdp_mesh(cfg: DictConfig, device: torch.device) -> Any:
    """The 1-D mesh of all ranks for ``fsdp=true`` (the process group initialised from the
    launcher's environment), or None.

    Raises:
        ValueError: ``fsdp=true`` outside a multi-process launch, or with rows it does not
            measure (``compiled``, ``budget``).
    """
    if not cfg.get("fsdp", False):
        return None
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError("bench fsdp=true measures each rank in its own process: launch it "
                         "with python -m torch.distributed.run --nproc-per-node 2 -m "
                         "remat.bench fsdp=true ...")
    if cfg.get("compiled", False):
        raise ValueError("bench fsdp=true measures eager rows only: set compiled=false")
    if any(_is_budget(s) for s in cfg.strategies):
        raise ValueError("bench fsdp=true: budget rows are planned per rank by "
                         "python -m remat.plan world_size=...; list fixed strategies here")
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _refuse_rows_that_wrap_nothing(base: L.LightningModule, strategies: list[Any]) -> None:
    """A network without stages (``model.stages=auto`` found no unit, or an empty list) gives
    every row but ``none`` (and a plan or budget, which name their own units) the same step as
    ``none``: refused as training refuses it, naming ``model.stages`` and the modules.

    Raises:
        remat.strategies.StageError: such rows were asked for.
    """
    if base.stage_paths:
        return
    # a budget row plans its own units (and says so when it finds none)
    empty = sorted({s.name for s in strategies if s.name not in ("none", "budget")
                    and not getattr(s, "names_own_units", False)})
    if empty:  # each such row would be none's step
        raise nothing_to_wrap(f"bench: {', '.join(empty)}", base.net,
                              f"{type(base.net).__name__} has no stages (model.stages is "
                              "empty, or auto found no unit)", suggest_auto=False)


def bench(cfg: DictConfig) -> dict[str, Any]:
    """Run the benchmark the config describes, once per size in the size list; write
    ``bench.csv``, ``bench.json`` and ``bench.png`` (one table, a ``size`` column).

    Reference rows that cannot apply to the stages are skipped with a printed note (also
    in ``bench.json``, ``notes``); so are compiled rows whose compilation fails.

    Raises:
        ValueError: unknown strategy (lists valid ones), bad sizes (naming the key) or
            precision; ``compile_strategies`` without ``none``.
    """
    precision = run_shape.check_precision(cfg.precision, cfg.device, run_shape.TRACED_PRECISIONS,
                                          "bench precision")
    batch_size = cfg.data.get("batch_size")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"bench: data.batch_size must be an integer >= 1, got {batch_size!r}")
    size_key, sizes = bench_sizes(cfg)
    device = run_shape.resolve_device(cfg.device)
    strategies = build_strategies(cfg.strategies)
    if any(isinstance(s, tuple(COMPILED_REFERENCES.values())) for s in strategies.values()):
        raise ValueError("bench: torch_compile_budget is a compiled reference row: list it in "
                         "compile_strategies (with compiled=true), not in strategies")
    eager_budget = [label for label, s in strategies.items()
                    if getattr(s, "activation_memory_budget", None) is not None]
    if eager_budget:
        raise ValueError(f"bench: {eager_budget[0]}: compile_memory_budget is the compiler's "
                         "partitioner budget: give it in compile_strategies rows (with "
                         "compiled=true), not in strategies")
    if "none" not in strategies:
        raise ValueError("bench strategies must include 'none', the reference")
    references_asked = REFERENCES if cfg.get("reference_points", True) else {}
    check_budget_rows(strategies, references_asked)
    if int(cfg.steps) < 1 or int(cfg.warmup) < 0:
        raise ValueError(f"bench needs steps >= 1 and warmup >= 0, got {cfg.steps}, "
                         f"{cfg.warmup}")
    compiled = bool(cfg.get("compiled", False))
    backend = str(cfg.get("compile_backend", "inductor"))
    options = cfg.get("compile_options")
    options = OmegaConf.to_container(options) if isinstance(options, DictConfig) else options
    # inductor: what training's compile=true uses (layout optimisation off) with these on top
    compile_options = ({} if not compiled else
                       training_options(options) if backend == TRAINING_BACKEND
                       else check_compile_options(options, backend))
    compile_runs = build_strategies(cfg.get("compile_strategies") or []) if compiled else {}
    peak_by = str(cfg.get("peak_by", "auto"))
    if peak_by not in ("auto", "profiler"):
        raise ValueError(f"bench: peak_by must be auto or profiler, got {peak_by!r}")
    check_budget_rows(compile_runs, [*strategies, *references_asked])
    if compiled and "none" not in compile_runs:
        raise ValueError(f"bench: compile_strategies must include 'none' (the compiled "
                         f"reference), got {list(compile_runs)}")
    mesh = _fsdp_mesh(cfg, device)
    primary = mesh is None or torch.distributed.get_rank() == 0
    slot = DeviceSlot(device)
    rows: list[BenchRow] = []
    notes: list[str] = []
    if mesh is not None:
        notes.append(f"FSDP2 over {mesh.size()} ranks (one process each), data.batch_size per "
                     "rank; peak: the highest rank's; gradients compared gathered")
    # with several sizes each one's table and notes are printed as it ends, then all
    # together (with one size, the final print alone: it was printed twice)
    progress = len(sizes) > 1
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
        _refuse_rows_that_wrap_nothing(base, [*strategies.values(), *compile_runs.values()])
        references: dict[str, Any] = {}
        if cfg.get("reference_points", True) and mesh is None:
            references, skipped = reference_rows(base, list(base.stage_paths))
            for note in skipped if progress else ():
                print(f"note: {note}", flush=True)
            notes.extend(f"size {size}: {n}" for n in skipped)
        runs = planned_strategies(strategies, model_cfg, batch_size, size, precision,
                        list(base.stage_paths), f"size {size}", notes, rows=references)
        size_compile_runs = planned_strategies(compile_runs, model_cfg, batch_size, size, precision,
                                     list(base.stage_paths), f"size {size}, compiled", notes,
                                     known=runs, rows={**strategies, **references},
                                     compiled=True)
        runs.update(references)
        generator = torch.Generator().manual_seed(cfg.seed)
        batch = {k: v.to(device)
                 for k, v in base.example_batch(batch_size, size, generator).items()}
        size_notes: list[str] = []
        size_rows = measure_groups(base, list(base.stage_paths), runs, size_compile_runs,
                                    batch, device, precision, int(cfg.warmup), int(cfg.steps),
                                    int(cfg.seed), slot, backend if compiled else None,
                                    size_notes, mesh, peak_by, compile_options)
        size_notes += budget_rows_above_their_rows(size_rows, strategies)
        for note in size_notes if progress else ():
            print(f"note: {note}", flush=True)
        notes.extend(f"size {size}: {n}" for n in size_notes)
        for row in size_rows:
            row.size = size
        rows.extend(size_rows)
        if primary and progress:
            print(format_table(size_rows), flush=True)  # progress: one size at a time
        del base, batch
    model_name = cfg.model._target_.rsplit(".", 1)[-1]
    record = {
        "model": OmegaConf.to_container(cfg.model, resolve=False),
        "batch_size": batch_size, "size_key": size_key, "sizes": sizes,
        "precision": str(cfg.precision), "device": device_name(device),
        "torch_version": torch.__version__, "machine": platform.machine(),
        "warmup": int(cfg.warmup), "steps": int(cfg.steps), "peak_by": peak_by,
        "compiled": compiled, "compile_backend": backend if compiled else None,
        "compile_options": options_record(compile_options),
        "one_model_on_device": slot.swap, "notes": notes,
        "fsdp_world_size": mesh.size() if mesh is not None else None,
        "rows": [asdict(r) for r in rows],
    }
    if not primary:
        return record  # rank 0 writes and prints
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(record, indent=2))
    title = (f"{model_name}, batch {batch_size}, {size_key} {', '.join(map(str, sizes))}, "
             f"{cfg.precision}, {record['device']}")
    plot(rows, out / "bench.png", title)
    write_csv(rows, out / "bench.csv")
    print(f"{model_name} batch {batch_size}, {size_key} {sizes}, {cfg.precision}, "
          f"{record['device']}, torch {torch.__version__}")
    print(format_table(rows))
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {out / 'bench.csv'}, {out / 'bench.json'} and {out / 'bench.png'}")
    return record


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="bench")
def main(cfg: DictConfig) -> None:
    """Hydra app around :func:`bench`: a user error (a bad row, size or key) ends it with
    one ``error:`` line, as the other entry points do."""
    run_entry(bench, cfg)


if __name__ == "__main__":
    main()
