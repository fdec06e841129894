"""LightningModule for next-token language modelling with :class:`remat.models.gpt.GPT`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from remat.models.base import StrategyModule
from remat.models.checks import require_keys
from remat.models.gpt import GPT
from remat.strategies import CheckpointStrategy


class SequenceModule(StrategyModule):
    """Causal language model on ``{"tokens": int64 [B, T+1]}`` batches (inputs and shifted
    targets in one window).

    Loss: mean cross-entropy in nats per token. Logged: ``train/loss``, ``val/loss`` and
    ``val/bpc`` = ``val/loss / ln 2`` (bits per character for character- or byte-level data).

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd, dropout: :class:`GPT` sizes.
        stages: stage paths the strategy wraps (default chain: ``blocks``).
        strategy: activation checkpointing strategy (default ``none``).
        optimizer: partial optimizer, called with parameter groups.
        scheduler: optional partial LR scheduler, called with the optimizer; stepped per step.

    Raises:
        remat.strategies.StageError: a stage matches no module.
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 256, n_layer: int = 4,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.1,
                 stages: Sequence[str] = ("blocks",), strategy: CheckpointStrategy | None = None,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["strategy", "optimizer", "scheduler"])
        self.wrap_net(GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout), stages,
                      strategy)
        self.optimizer_factory = optimizer or (lambda params: torch.optim.AdamW(params, lr=3e-4))
        self.scheduler_factory = scheduler

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` int64 -> logits ``[B, T, vocab_size]``."""
        return self.net(tokens)

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of a ``{"tokens": [B, T+1]}`` batch."""
        require_keys(batch, ("tokens",), "SequenceModule (model=gpt_*)")
        tokens = batch["tokens"]
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def example_batch(self, batch_size: int, size: int,
                      generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random tokens ``[batch_size, size + 1]`` for benchmarks (``size`` = sequence length)."""
        return {"tokens": torch.randint(0, self.hparams.vocab_size, (batch_size, size + 1),
                                        generator=generator)}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True,
                 batch_size=batch["tokens"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self.training_loss(batch)
        size = batch["tokens"].shape[0]
        self.log("val/loss", loss, on_epoch=True, prog_bar=True, batch_size=size)
        self.log("val/bpc", loss / math.log(2), on_epoch=True, batch_size=size)

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        optimizer = self.optimizer_factory(params=[{"params": decay},
                                                   {"params": no_decay, "weight_decay": 0.0}])
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer=optimizer),
                                 "interval": "step"}}
