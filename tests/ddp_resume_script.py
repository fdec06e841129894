"""Run by tests/test_ddp_resume.py under ``torch.distributed.run`` (2 CPU processes, gloo):
each rank calls :func:`remat.train.train` with ``trainer=ddp`` for the runs of :data:`RUNS`.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 \
    tests/ddp_resume_script.py OUT_DIR

Runs (tiny ViT segmenter with dropout and drop-path on the synthetic set, fp32; 11 shuffled
images, batch 2 per rank: the ranks' shares are padded to 6 images, 3 steps per epoch,
2 epochs): ``straight`` in one go; ``killed``: SIGTERM to rank 1 alone while optimizer
step 4 runs (epoch 1, its second batch), every rank checkpoints at step 4 and stops;
``resumed``: ``killed``'s folder resumed from its ``last.ckpt``; ``killed_end`` and
``resumed_end``: the same with SIGTERM during epoch 0's last step (the checkpoint is written
after that epoch's validation). Every rank records its own per-step losses
(:class:`tests.helpers.RecordLosses`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from remat.train import train
from tests.helpers import compose_train, leave_process_group


def overrides(out: Path, folder: str, *extra: str) -> list[str]:
    """The runs' shared config: the ViT segmenter under trainer=ddp on 2 CPU ranks."""
    return ["model=vit_seg_tiny", "data=synthetic_seg", "data.image_size=32",
            "data.num_train=11", "data.num_val=2", "data.batch_size=2",
            "model.net.embed_dim=32", "model.net.depth=2", "model.net.num_heads=2",
            "model.net.decoder_channels=[8,8]", "model.net.drop_rate=0.1",
            "model.net.attn_drop_rate=0.1", "model.net.drop_path_rate=0.1",
            "strategy=sqrtn", "trainer=ddp", "trainer.accelerator=cpu",
            "trainer.max_epochs=2", "trainer.log_every_n_steps=1", "callbacks=minimal",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
            "+callbacks.losses._target_=tests.helpers.RecordLosses",
            f"+callbacks.losses.folder={out / folder}", *extra]


def kill_once(out: Path, step: int = 3, name: str = "killed") -> list[str]:
    """SIGTERM to rank 1 alone when the batch of optimizer step ``step + 1`` starts, once."""
    return ["+callbacks.kill._target_=tests.helpers.SignalAtStep", f"+callbacks.kill.step={step}",
            "+callbacks.kill.rank=1", f"+callbacks.kill.once_file={out / (name + '.sent')}"]


def kill_at_epoch_end(out: Path) -> list[str]:
    """SIGTERM to rank 1 during epoch 0's last batch: the stop comes after its validation."""
    return kill_once(out, 2, "killed_end")


RUNS = {
    "straight": lambda out: [],
    "killed": kill_once,
    "resumed": lambda out: [*kill_once(out), f"ckpt_path={out}/killed/checkpoints/last.ckpt"],
    "killed_end": kill_at_epoch_end,
    "resumed_end": lambda out: [*kill_at_epoch_end(out),
                                f"ckpt_path={out}/killed_end/checkpoints/last.ckpt"],
}
RESUMES = {"resumed": "killed", "resumed_end": "killed_end"}  # resumed into that folder


def main() -> None:
    out = Path(sys.argv[1])
    for name, extra in RUNS.items():
        folder = RESUMES.get(name, name)
        cfg = compose_train(out / folder, overrides(out, folder, *extra(out)))
        try:
            train(cfg)
        except SystemExit as stop:  # the killed run: 128 + SIGTERM, on every rank
            rank = torch.distributed.get_rank()
            (out / folder / f"exit_rank{rank}").write_text(str(stop.code))
            if rank == 0:  # the step its checkpoint holds
                ckpt = torch.load(out / folder / "checkpoints" / "last.ckpt", weights_only=True)
                (out / folder / "stopped_at").write_text(str(ckpt["global_step"]))
    leave_process_group()


if __name__ == "__main__":
    main()
