"""Run by tests/test_ddp.py: Lightning DDP on 2 CPU processes (gloo) with one strategy.

Usage: python tests/ddp_script.py STRATEGY ACCUMULATE OUT_DIR [LAUNCHER]
LAUNCHER is Lightning's ``ddp`` (default: the script runs again per rank) or ``ddp_spawn``
(the wrapped module is pickled into spawned processes). Each rank saves the gradients it
holds right before the first optimizer step to OUT_DIR/rank<r>.pt. The data are 4 fixed
token windows; with 2 ranks, batch 1 and ACCUMULATE=2 one optimizer step sees all 4 (with
ACCUMULATE=1, 2 of them).
"""

import functools
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from remat.models import SequenceModule
from remat.strategies import build_strategy


def make_module(strategy: str) -> SequenceModule:
    torch.manual_seed(0)
    return SequenceModule(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16,
                          dropout=0.0, strategy=build_strategy(strategy),
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1))


def make_windows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"tokens": torch.randint(0, 32, (17,), generator=g)} for _ in range(4)]


class SaveGrads(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}
            torch.save(grads, self.out / f"rank{trainer.global_rank}.pt")


def main() -> None:
    strategy, accumulate, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    launcher = sys.argv[4] if len(sys.argv) > 4 else "ddp"
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=launcher, max_steps=1,
                        accumulate_grad_batches=accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[SaveGrads(out)])
    loader = DataLoader(make_windows(), batch_size=1, shuffle=False)
    trainer.fit(make_module(strategy), train_dataloaders=loader)


if __name__ == "__main__":
    main()
