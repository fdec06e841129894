"""remat: activation checkpointing strategies for Lightning + Hydra training."""

__version__ = "0.1.0"
