"""Run by tests/test_fsdp_resume.py under ``torch.distributed.run`` (2 CPU processes): each
rank calls :func:`remat.train.train` (the entry point ``python train.py`` runs) with
``trainer=fsdp``, for the runs of :data:`RUNS`.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 \
    tests/fsdp_resume_script.py OUT_DIR DATA_ROOT

Runs (tiny GPT with dropout on tinyshakespeare, 3 batches per epoch):
``straight``: 2 epochs in one go; ``first``: epoch 1 only, sharded ``last.ckpt``;
``resumed``: ``first``'s folder resumed from its ``last.ckpt`` to epoch 2;
``full``: epoch 1 with a full (gathered, one file) ``last.ckpt``; ``signalled``: SIGTERM sent
to rank 0 only during step 2 (both ranks must checkpoint and stop).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from remat.train import train
from tests.helpers import compose_train


def overrides(data_root: str, epochs: int, *extra: str) -> list[str]:
    """The runs' shared config: sqrtn under trainer=fsdp on 2 CPU ranks."""
    return ["experiment=shakespeare_gpt", "model=gpt_tiny", f"data.root={data_root}",
            "data.block_size=32", "data.batch_size=4", "trainer=fsdp",
            "trainer.accelerator=cpu", "trainer.log_every_n_steps=1",
            "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=2",
            "callbacks=minimal", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "model.sample_tokens=0", f"trainer.max_epochs={epochs}", "strategy=sqrtn", *extra]


RUNS = {
    "straight": (2, []),
    "first": (1, []),
    "resumed": (2, ["ckpt_path={out}/first/checkpoints/last.ckpt"]),
    "full": (1, ["trainer.strategy.save_distributed_checkpoint=false"]),
    # SIGTERM reaches rank 0 alone (as `kill <pid>` sends it), before optimizer step 2
    "signalled": (1, ["+callbacks.signal._target_=tests.helpers.SignalAtStep",
                      "+callbacks.signal.step=1", "+callbacks.signal.rank=0"]),
}


def main() -> None:
    out, data_root = Path(sys.argv[1]), sys.argv[2]
    for name, (epochs, extra) in RUNS.items():
        folder = out / ("first" if name == "resumed" else name)
        cfg = compose_train(folder, overrides(data_root, epochs,
                                              *(e.format(out=out) for e in extra)))
        try:
            train(cfg)
        except SystemExit as stop:  # the signalled run: 128 + SIGTERM, on every rank
            (folder / f"exit_rank{torch.distributed.get_rank()}").write_text(str(stop.code))


if __name__ == "__main__":
    main()
