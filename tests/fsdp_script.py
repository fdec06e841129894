"""Run by tests/test_fsdp.py under ``torch.distributed.run`` (2 CPU processes, gloo):
``trainer=fsdp`` (remat's FSDP2Strategy) with several checkpointing strategies.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 \
    tests/fsdp_script.py OUT_DIR CASE [CASE ...]

CASE is ``strategy:accumulate:precision`` (e.g. ``sqrtn:2:bf16-mixed``), ``bn:strategy``
(the conv-BatchNorm net of :class:`ConvBN`, whose per-rank running statistics are recorded
too), or
``memory:strategy`` (the MemTracker peak of one real training step per rank of
:func:`memory_module`, sharded as trainer=fsdp shards it; see :func:`measure_memory`).
Each training case trains the tiny GPT of :func:`make_module` for :data:`STEPS` optimizer
steps on fixed token windows (batch :data:`PER_RANK` per rank, no shuffling) and each rank writes
``OUT_DIR/<case>/rank<r>.pt``: the full (gathered) gradients right before every optimizer
step, the losses, and the full parameters after the last step.
:func:`run_case` with ``world_size=1`` is the single-process reference on the whole batch.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from remat.models import SequenceModule
from remat.models.base import StrategyModule
from remat.strategies import build_strategy
from tests.helpers import leave_process_group

STEPS = 3
PER_RANK = 2
WORLD = 2


def make_module(strategy: str) -> SequenceModule:
    """A 4-block GPT (width 16, no dropout: the ranks' dropout masks could not match one
    process's), AdamW."""
    torch.manual_seed(0)
    return SequenceModule(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16,
                          dropout=0.0, strategy=build_strategy(strategy),
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))


class ConvBN(StrategyModule):
    """4 conv-BN-ReLU blocks (8 channels, 8x8 px) in the chain ``blocks``, MSE to a target."""

    def __init__(self, strategy: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1),
                                               nn.BatchNorm2d(8), nn.ReLU())
                                 for _ in range(4)])
        self.wrap_net(nn.Sequential(OrderedDict(stem=nn.Conv2d(1, 8, 1), blocks=blocks,
                                                head=nn.Conv2d(8, 1, 1))),
                      ["blocks"], build_strategy(strategy))

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(self.net(batch["image"]), batch["target"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.training_loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_images(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [{"image": torch.randn(1, 8, 8, generator=g),
             "target": torch.randn(1, 8, 8, generator=g)} for _ in range(n)]


def run_bn_case(strategy: str) -> dict[str, Any]:
    """:class:`ConvBN` under FSDP2 for :data:`STEPS` steps; this rank's BatchNorm running
    statistics and the full gradients."""
    from remat.models.fsdp import FSDP2Strategy

    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=FSDP2Strategy(),
                        max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record], use_distributed_sampler=False)
    images = make_images(WORLD * PER_RANK * STEPS)
    sampler = DistributedSampler(images, num_replicas=WORLD, rank=int(os.environ["RANK"]),
                                 shuffle=False)
    module = ConvBN(strategy)
    trainer.fit(module, train_dataloaders=DataLoader(images, batch_size=PER_RANK,
                                                     sampler=sampler))
    stats = {n: b.detach().clone() for n, b in module.named_buffers()}
    return {"grads": record.grads, "params": record.params, "buffers": stats}


def make_windows(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"tokens": torch.randint(0, 32, (17,), generator=g)} for _ in range(n)]


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (gathered), or the tensor itself."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


class Record(L.Callback):
    """Full gradients before each optimizer step, losses, full parameters at the end."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []
        self.params: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: full(p.grad) for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.params = {n: full(p) for n, p in pl_module.named_parameters()}


def run_case(case: str, world_size: int) -> dict[str, Any]:
    """Train one case; ``world_size`` 2 under FSDP2 (inside torchrun), 1 on one process with
    the whole batch (``WORLD * PER_RANK`` windows per micro-batch)."""
    from remat.models.fsdp import FSDP2Strategy

    strategy, accumulate, precision = case.split(":")
    accumulate = int(accumulate)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size,
        strategy=FSDP2Strategy() if world_size > 1 else "auto",
        max_steps=STEPS, accumulate_grad_batches=accumulate, precision=precision,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record], use_distributed_sampler=False)
    windows = make_windows(WORLD * PER_RANK * accumulate * STEPS)
    if world_size > 1:  # rank r gets windows r, r + 2, ...: each step's pair of batches is
        # the reference's batch of WORLD * PER_RANK windows
        sampler = DistributedSampler(windows, num_replicas=world_size,
                                     rank=int(os.environ["RANK"]), shuffle=False)
        loader = DataLoader(windows, batch_size=PER_RANK, sampler=sampler)
    else:
        loader = DataLoader(windows, batch_size=WORLD * PER_RANK, shuffle=False)
    trainer.fit(make_module(strategy), train_dataloaders=loader)
    return {"grads": record.grads, "losses": record.losses, "params": record.params}


def memory_module(strategy: str) -> SequenceModule:
    """An 8-block GPT (width 256, 256 tokens) whose activations outweigh its parameters."""
    torch.manual_seed(0)
    return SequenceModule(vocab_size=256, block_size=256, n_layer=8, n_head=4, n_embd=256,
                          dropout=0.0, strategy=build_strategy(strategy))


MEMORY_BATCH = (4, 256)  # per-rank batch, tokens


def measure_memory(strategy: str) -> dict[str, Any]:
    """This rank's MemTracker peak (bytes, by category) over two real optimizer steps of
    :func:`memory_module` sharded over the ranks (the steps ``remat.estimate`` traces)."""
    from torch.distributed.device_mesh import init_device_mesh

    from remat.measure.trace import step_fn
    from remat.sharding import shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))

    def build() -> SequenceModule:
        module = memory_module(strategy)
        shard(module.net, mesh, module.strategy_report)
        return module

    _, peak = step_fn(build, *MEMORY_BATCH, torch.device("cpu"), "32-true", fake=False)()
    return {"peak_bytes": int(peak.peak_bytes), "categories": dict(peak.categories)}


def main() -> None:
    out = Path(sys.argv[1])
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    for case in sys.argv[2:]:
        if case.startswith("memory:"):
            result = measure_memory(case.split(":", 1)[1])
        elif case.startswith("bn:"):
            result = run_bn_case(case.split(":", 1)[1])
        else:
            result = run_case(case, WORLD)
        rank = torch.distributed.get_rank()
        folder = out / case.replace(":", "_")
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(result, folder / f"rank{rank}.pt")
    leave_process_group()


if __name__ == "__main__":
    main()
