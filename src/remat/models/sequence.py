"""LightningModule for next-token language modelling: remat's :class:`~remat.models.gpt.GPT`
or a ready causal LM (e.g. a Hugging Face ``LlamaForCausalLM`` built from a config)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from remat.models.base import StrategyModule
from remat.models.checks import require_keys
from remat.models.gpt import GPT, sample_tokens
from remat.models.hf import (
    apply_lora,
    causal_lm_logits,
    check_config_keys,
    config_vocab_size,
    is_hf_model,
    load_pretrained,
    lora_stage_paths,
    parameter_counts,
)
from remat.strategies import CheckpointStrategy

log = logging.getLogger(__name__)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 100,
                  min_lr_ratio: float = 0.1) -> LambdaLR:
    """Per-step LR schedule: linear warm-up from 0 to the base LR over ``warmup_steps``, then
    cosine decay to ``min_lr_ratio`` x base LR at ``total_steps`` (held there after).

    The recipe of GPT-3 (Brown et al. 2020, appendix B: warm-up, cosine decay to 10 %) as used
    by nanoGPT. :class:`SequenceModule` passes ``total_steps`` =
    ``trainer.estimated_stepping_batches``.

    Raises:
        ValueError: ``total_steps < 1``, ``warmup_steps < 0`` or ``min_lr_ratio`` outside [0, 1].
    """
    if total_steps < 1 or warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(
            f"model.scheduler: need total_steps >= 1 (set trainer.max_steps or max_epochs), "
            f"warmup_steps >= 0 and 0 <= min_lr_ratio <= 1; got total_steps={total_steps}, "
            f"warmup_steps={warmup_steps}, min_lr_ratio={min_lr_ratio}"
        )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


class SequenceModule(StrategyModule):
    """Causal language model on ``{"tokens": int64 [B, T+1]}`` batches (inputs and shifted
    targets in one window).

    The network is remat's :class:`GPT` built from ``n_layer``, ``n_head``, ... or, when
    ``net`` is given, that ready network, the way :class:`SegmentationModule` takes a ready
    ``net``: any module mapping tokens ``[B, T]`` to logits ``[B, T, vocab_size]``, or a
    Hugging Face causal LM (``transformers.PreTrainedModel`` with a ``*ForCausalLM`` head),
    which is called as ``net(input_ids=tokens, use_cache=False)`` and read at ``.logits``
    (:func:`remat.models.hf.causal_lm_logits`; no key/value cache in training or sampling).

    Loss: mean cross-entropy in nats per token. Logged: ``train/loss``, ``val/loss`` and
    ``val/bpc`` = ``val/loss / ln 2`` (bits per character for character- or byte-level data).
    At the end of each validation (not the sanity check) a text sample of ``sample_tokens``
    tokens is generated from ``sample_prompt``, decoded with the datamodule's vocabulary
    (``decode``), logged and written to ``<trainer.default_root_dir>/samples/epoch_<n>.txt``.

    Args:
        vocab_size: tokens in the vocabulary (the width of the logits).
        block_size: context length (tokens) of :meth:`example_batch` and of sampling.
        n_layer, n_head, n_embd, dropout, pos_embedding: :class:`GPT` arguments
            (``pos_embedding``: ``learned`` or ``rotary``); ignored when ``net`` is given.
        net: a ready network used instead of a :class:`GPT` (see above), e.g.
            ``LlamaForCausalLM(LlamaConfig(...))`` (``configs/model/hf_llama.yaml``).
        pretrained: a local folder written by ``save_pretrained``; its causal LM
            (:func:`remat.models.hf.load_pretrained`, offline) is the network, instead of
            ``net`` or a :class:`GPT`.
        lora: LoRA settings (``r``, ``alpha``, ``dropout``, ``target_modules``; see
            :func:`remat.models.hf.lora_config`): the network is wrapped by PEFT, every
            weight of it frozen and only the adapters trained; ``stages`` keep naming the
            network's own modules (PEFT's ``base_model.model.`` prefix is added,
            :func:`remat.models.hf.lora_stage_paths`).
        stages: stage paths the strategy wraps (default chain: ``blocks``; a Llama's decoder
            layers: ``model.layers``).
        strategy: activation checkpointing strategy (default ``none``).
        optimizer: partial optimizer, called with parameter groups (weights decayed, biases
            and norms not).
        scheduler: optional partial LR scheduler, called with the optimizer and
            ``total_steps`` (e.g. :func:`warmup_cosine`); stepped every optimizer step.
        sample_tokens: tokens generated after each validation (0: no sample).
        sample_prompt: text the sample starts from (must be in the vocabulary).
        sample_temperature, sample_top_k: sampling settings (see :meth:`GPT.generate`).

    Raises:
        remat.strategies.StageError: a stage matches no module.
        ValueError: an HF ``net`` whose ``config.vocab_size`` differs from ``vocab_size``
            (names ``model.net.config.vocab_size``); a bad ``model.lora``; at fit start, the
            datamodule's ``vocab_size`` differs from ``model.vocab_size``.
        FileNotFoundError: ``pretrained`` is not a folder with a ``config.json``.
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 256, n_layer: int = 4,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.1,
                 pos_embedding: str = "learned", stages: Sequence[str] = ("blocks",),
                 strategy: CheckpointStrategy | None = None,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None, sample_tokens: int = 200,
                 sample_prompt: str = "\n", sample_temperature: float = 0.8,
                 sample_top_k: int | None = None, net: nn.Module | None = None,
                 pretrained: str | None = None, lora: Mapping[str, Any] | None = None
                 ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["strategy", "optimizer", "scheduler", "net"])
        if pretrained is not None:
            if net is not None:
                log.info("model.pretrained=%s: its saved model replaces model.net", pretrained)
            net = load_pretrained(pretrained)
        elif net is None:
            net = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, pos_embedding)
        self.hf_net = is_hf_model(net)
        if self.hf_net and pretrained is None:
            check_config_keys(net)
        net_vocab = config_vocab_size(net) if self.hf_net else None
        if net_vocab is not None and net_vocab != vocab_size:
            if pretrained is not None:
                raise ValueError(
                    f"model.pretrained={pretrained} has vocab_size={net_vocab} (its "
                    f"config.json) but model.vocab_size={vocab_size}; the data must use the "
                    "vocabulary the saved model was trained with")
            raise ValueError(
                f"model.net.config.vocab_size={net_vocab} but model.vocab_size={vocab_size}; "
                "the logits must have one entry per token of the data: set "
                "model.net.config.vocab_size: ${...vocab_size}")
        self.lora = dict(lora) if lora else None
        if self.lora is not None:
            net = apply_lora(net, self.lora)
            stages = lora_stage_paths(stages)
        self.trainable_parameters, self.total_parameters = parameter_counts(net)
        if self.lora is not None:
            log.info("LoRA run (r=%s): %d trainable parameters of %d (%.2f %%)",
                     self.lora.get("r"), self.trainable_parameters, self.total_parameters,
                     100.0 * self.trainable_parameters / max(1, self.total_parameters))
        self.wrap_net(net, stages, strategy)
        self.optimizer_factory = optimizer or (lambda params: torch.optim.AdamW(params, lr=3e-4))
        self.scheduler_factory = scheduler
        self.last_sample: str | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` int64 -> logits ``[B, T, vocab_size]``."""
        if self.hf_net:
            return causal_lm_logits(self.net, tokens)
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

    def on_fit_start(self) -> None:
        """Check that the data's vocabulary fits the model (after a checkpoint's vocabulary
        was restored)."""
        super().on_fit_start()
        datamodule = getattr(self.trainer, "datamodule", None)
        data_vocab = getattr(datamodule, "vocab_size", None)
        if data_vocab is not None and data_vocab != self.hparams.vocab_size:
            raise ValueError(
                f"model.vocab_size={self.hparams.vocab_size} but the datamodule "
                f"({type(datamodule).__name__}) has {data_vocab} tokens; set model.vocab_size="
                f"{data_vocab} or model.vocab_size='${{data.vocab_size}}'"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The strategy's record (:class:`StrategyModule`) and, for a LoRA run, under
        ``"lora"``: its settings and parameter counts (the adapters themselves are in the
        ``state_dict``, as ``...lora_A.default.weight`` / ``...lora_B.default.weight``, next
        to the frozen weights a resume needs)."""
        super().on_save_checkpoint(checkpoint)
        if self.lora is not None:
            checkpoint["lora"] = {"settings": self.lora,
                                  "trainable_parameters": self.trainable_parameters,
                                  "total_parameters": self.total_parameters}

    def on_train_end(self) -> None:
        """Write the trained network as Hugging Face saves it, for use outside remat and as
        another run's ``model.pretrained``: a LoRA run its adapters (PEFT's
        ``adapter_config.json`` and ``adapter_model.safetensors``, loadable on the base
        model with ``peft.PeftModel.from_pretrained(base, folder)``) into
        ``<run>/lora_adapter``, any other run of a Hugging Face net the whole model
        (``save_pretrained``) into ``<run>/hf_model``. Rank 0 only; not under FSDP2 (the
        weights are sharded: the checkpoint holds them)."""
        if not ((self.hf_net or self.lora is not None) and self.trainer.is_global_zero):
            return
        if getattr(self, "shard_report", None) is not None:
            log.info("sharded by FSDP2: no save_pretrained folder written (the checkpoint "
                     "holds the weights)")
            return
        folder = Path(self.trainer.default_root_dir) / (
            "lora_adapter" if self.lora is not None else "hf_model")
        self.net.save_pretrained(str(folder))
        what = (f"LoRA adapters ({self.trainable_parameters} parameters)"
                if self.lora is not None else type(self.net).__name__)
        log.info("%s written to %s (save_pretrained)", what, folder)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True,
                 batch_size=batch["tokens"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self.training_loss(batch)
        size = batch["tokens"].shape[0]
        # sync_dist: under DDP/FSDP the mean over every rank's windows, not rank 0's alone
        self.log("val/loss", loss, on_epoch=True, prog_bar=True, batch_size=size,
                 sync_dist=True)
        self.log("val/bpc", loss / math.log(2), on_epoch=True, batch_size=size,
                 sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking or self.hparams.sample_tokens < 1:
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        if not (hasattr(datamodule, "decode") and hasattr(datamodule, "encode")):
            return  # no vocabulary to decode with
        self.last_sample = self.sample(datamodule.encode, datamodule.decode)
        if self.trainer.is_global_zero:
            epoch = self.current_epoch
            log.info("sample after epoch %d (step %d):\n%s", epoch, self.global_step,
                     self.last_sample)
            folder = Path(self.trainer.default_root_dir) / "samples"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"epoch_{epoch:03d}.txt").write_text(self.last_sample, encoding="utf-8")

    def sample(self, encode: Callable[[str], torch.Tensor],
               decode: Callable[[Sequence[int]], str], seed: int = 0) -> str:
        """Generate ``sample_tokens`` tokens after ``sample_prompt`` (seeded, so samples of
        successive epochs differ only through the weights); returns prompt + continuation."""
        prompt = encode(self.hparams.sample_prompt).to(self.device).view(1, -1)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        was_training = self.net.training
        self.net.eval()
        try:
            with torch.no_grad():
                ids = sample_tokens(self, prompt, self.hparams.sample_tokens,
                                    self.hparams.block_size, self.hparams.sample_temperature,
                                    self.hparams.sample_top_k, generator=generator)
        finally:
            self.net.train(was_training)
        return decode(ids[0].tolist())

    def configure_optimizers(self) -> Any:
        # frozen parameters (a LoRA run's base) are left out: no state, no update
        trainable = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        optimizer = self.optimizer_factory(params=[{"params": decay},
                                                   {"params": no_decay, "weight_decay": 0.0}])
        if self.scheduler_factory is None:
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer=optimizer,
                                                                     total_steps=total),
                                 "interval": "step"}}
