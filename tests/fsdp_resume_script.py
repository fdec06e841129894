"""Run by tests/test_fsdp_resume.py under ``torch.distributed.run`` (2 CPU processes): each
rank calls :func:`remat.train.train` (the entry point ``python train.py`` runs) with
``trainer=fsdp``, for the runs of :data:`RUNS`.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 \
    tests/fsdp_resume_script.py OUT_DIR DATA_ROOT

Runs (tiny GPT with dropout on tinyshakespeare, 3 batches per epoch):
``straight``: 2 epochs in one go; ``first``: epoch 1 only, sharded ``last.ckpt``;
``resumed``: ``first``'s folder resumed from its ``last.ckpt`` to epoch 2;
``full``: epoch 1 with a full (gathered, one file) ``last.ckpt``; ``signalled``: SIGTERM sent
to rank 0 only during step 2 (both ranks must checkpoint and stop); ``killed``: 2 epochs,
SIGTERM to rank 1 only during step 5 (inside epoch 1), then resumed into its folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from remat.train import train
from tests.helpers import compose_train, leave_process_group


def overrides(data_root: str, epochs: int, *extra: str) -> list[str]:
    """The runs' shared config: sqrtn under trainer=fsdp on 2 CPU ranks."""
    return ["experiment=shakespeare_gpt", "model=gpt_tiny", f"data.root={data_root}",
            "data.block_size=32", "data.batch_size=4", "trainer=fsdp",
            "trainer.accelerator=cpu", "trainer.log_every_n_steps=1",
            "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=2",
            "callbacks=minimal", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "model.sample_tokens=0", f"trainer.max_epochs={epochs}", "strategy=sqrtn", *extra]


def record(folder: str) -> list[str]:
    """Every rank writes its per-step losses into ``{out}/<folder>``."""
    return ["+callbacks.losses._target_=tests.helpers.RecordLosses",
            f"+callbacks.losses.folder={{out}}/{folder}"]


# SIGTERM to rank 1 alone when the batch of optimizer step 5 starts (epoch 1, its second
# batch), once: the resume inherits the callback from the run's config
KILL_INSIDE_EPOCH = ["+callbacks.kill._target_=tests.helpers.SignalAtStep",
                     "+callbacks.kill.step=4", "+callbacks.kill.rank=1",
                     "+callbacks.kill.once_file={out}/killed.sent"]

RUNS = {
    "straight": (2, record("straight")),
    "first": (1, []),
    "resumed": (2, ["ckpt_path={out}/first/checkpoints/last.ckpt"]),
    "full": (1, ["trainer.strategy.save_distributed_checkpoint=false"]),
    # SIGTERM reaches rank 0 alone (as `kill <pid>` sends it), before optimizer step 2
    "signalled": (1, ["+callbacks.signal._target_=tests.helpers.SignalAtStep",
                      "+callbacks.signal.step=1", "+callbacks.signal.rank=0"]),
    # stopped inside epoch 1 (its shuffled windows: WindowSampler), then resumed
    "killed": (2, [*record("killed"), *KILL_INSIDE_EPOCH]),
    "killed_resumed": (2, [*record("killed"), *KILL_INSIDE_EPOCH,
                           "ckpt_path={out}/killed/checkpoints/last.ckpt"]),
}


def main() -> None:
    out, data_root = Path(sys.argv[1]), sys.argv[2]
    for name, (epochs, extra) in RUNS.items():
        folder = out / {"resumed": "first", "killed_resumed": "killed"}.get(name, name)
        cfg = compose_train(folder, overrides(data_root, epochs,
                                              *(e.format(out=out) for e in extra)))
        rank = os.environ.get("RANK", "?")
        print(f"remat-test: run {name} rank {rank} starts", flush=True)
        try:
            train(cfg)
        except SystemExit as stop:  # the signalled run: 128 + SIGTERM, on every rank
            (folder / f"exit_rank{torch.distributed.get_rank()}").write_text(str(stop.code))
    leave_process_group()


if __name__ == "__main__":
    main()
