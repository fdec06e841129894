"""Compose the real Hydra config tree the way ``python train.py`` does, for tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from remat.config import config_dir

# Short runs: one epoch on CPU, checkpoints and measurement only, no progress bar.
TINY_TRAINER = [
    "trainer.max_epochs=1", "trainer.accelerator=cpu", "callbacks=minimal",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
]
# Plus small synthetic data: 64 px images, 8 train / 4 val, batch 4 (2 train batches).
TINY = ["data.image_size=64", "data.num_train=8", "data.num_val=4", "data.batch_size=4",
        *TINY_TRAINER]


def compose_app(config_name: str, output_dir: Path, overrides: list[str] = ()) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with overrides as its entry point does (Hydra
    config included); outputs go to ``output_dir``."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.job.num = 0
    HydraConfig().set_config(cfg)
    return cfg


def compose_train(output_dir: Path, overrides: list[str] = ()) -> DictConfig:
    """Compose ``configs/train.yaml`` with overrides; outputs go to ``output_dir``."""
    return compose_app("train", output_dir, overrides)


def run_python(args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run ``python <args>`` with this interpreter in ``cwd``; output captured as text."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def compose_config(name: str, output_dir: Path, overrides: list[str] = ()) -> DictConfig:
    """Compose ``configs/<name>.yaml`` (``estimate``, ``bench``) with overrides; outputs go
    to ``output_dir``."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        cfg = compose(name, overrides=list(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    return cfg
