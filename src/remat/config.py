"""Where the Hydra config tree lives, and checks of the top-level ablation keys."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


def config_dir() -> Path:
    """The ``configs/`` folder: ``$REMAT_CONFIG_DIR`` if set, else the repository's.

    Raises:
        FileNotFoundError: neither exists (e.g. a non-editable install without the repo).
    """
    env = os.environ.get("REMAT_CONFIG_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "configs"
    if not (path / "train.yaml").is_file():
        raise FileNotFoundError(
            f"remat config tree not found at {path} (expected train.yaml there); install remat "
            "from its repository with `pip install -e .` or set REMAT_CONFIG_DIR"
        )
    return path


def check_top_level(cfg: DictConfig) -> None:
    """Validate ``seed``, ``precision`` and ``accumulate_grad_batches`` before anything is
    built.

    Raises:
        ValueError: ``seed`` not an integer (or null); precision not one of
            :data:`PRECISIONS`; ``accumulate_grad_batches`` not an int >= 1;
            ``16-mixed`` asked for without a CUDA device.
    """
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer (or null for a random seed), got {seed!r}")
    precision = str(cfg.get("precision"))
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported; use one of: {', '.join(PRECISIONS)}"
        )
    acc = cfg.get("accumulate_grad_batches")
    if isinstance(acc, bool) or not isinstance(acc, int) or acc < 1:
        raise ValueError(
            f"accumulate_grad_batches must be an integer >= 1 (batches per optimizer step), "
            f"got {acc!r}"
        )
    if precision == "16-mixed":
        import torch

        accelerator = str(cfg.get("trainer", {}).get("accelerator", "auto"))
        if accelerator == "cpu" or not torch.cuda.is_available():
            raise ValueError(
                "precision=16-mixed needs a CUDA device (float16 autocast with a gradient "
                "scaler); on CPU use precision=bf16-mixed"
            )


def per_step_batch(effective: int, accumulation: int) -> int:
    """``data.batch_size`` for an effective batch of ``effective`` samples per optimizer step
    with ``accumulation`` batches per step (the ``remat.batch_for`` resolver of
    ``configs/sweep/ablation.yaml``).

    Raises:
        ValueError: ``effective`` not divisible by ``accumulation`` (names both keys).
    """
    effective, accumulation = int(effective), int(accumulation)
    if accumulation < 1 or effective % accumulation:
        raise ValueError(f"effective_batch_size={effective} is not divisible by "
                         f"accumulate_grad_batches={accumulation}; pick values whose product "
                         "with data.batch_size is the effective batch")
    return effective // accumulation


if not OmegaConf.has_resolver("remat.batch_for"):
    OmegaConf.register_new_resolver("remat.batch_for", per_step_batch)
