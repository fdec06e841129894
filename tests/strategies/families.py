"""Model families for the strategy x family test matrix: one small builder per family.

Every builder returns a :class:`Family`: a tiny model built from its library's config with
random init (no downloads, ``encoder_weights=None``, ``pretrained=False``, HF models from a
config object), in ``train()`` mode, with dropout > 0 where the family has dropout and its
BatchNorms (where it has them) updating running statistics; the stage paths a user would
list for it; an input maker for the family's real forward; and a loss.

Forward and backward of each model take well under a second on one CPU thread. Build one
with :func:`build` (seeded), or call a builder from :data:`FAMILIES` under your own seed:

>>> family = build("hf_llama")
>>> out = family.make_input()(family.model)          # LlamaForCausalLM(input_ids=..., ...)
>>> family.loss_fn(out).backward()
>>> model, stages, make_input, loss_fn = family      # the 4-tuple form

``Family.patterns`` says, per stage, how its parent calls it (see :data:`PATTERNS`), so the
matrix can tell which call patterns a strategy must handle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub

# How a stage's parent calls it (the value of ``Family.patterns[stage]``):
PATTERNS = {
    "chain": "an nn.Sequential run as one call (its own forward feeds each block the last "
             "output)",
    "loop": "a ModuleList the parent walks with x = blk(x) and nothing else",
    "loop_args": "a ModuleList the parent walks with x = blk(x, *same_extra_args) "
                 "(MONAI Swin: the window attention mask)",
    "hf_layers": "a ModuleList of Hugging Face layers, each called with the hidden state "
                 "plus the same positional/keyword arguments (mask, position embeddings, "
                 "cache, use_cache); returns the hidden state",
    "collects": "a ModuleList whose parent reads every block's output "
                "(x = blk(x); outs.append(x))",
    "parallel": "a ModuleList whose members get different inputs (parallel heads)",
    "module": "a single module (not a chain), called with its real signature",
}


@dataclass(frozen=True)
class Call:
    """The arguments of one forward call: ``call(model)`` runs ``model(*args, **kwargs)``."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, model: nn.Module) -> Any:
        return model(*self.args, **self.kwargs)

    def to(self, device: torch.device | str) -> Call:
        """The same call with every tensor argument moved to ``device``."""
        def move(v: Any) -> Any:
            return v.to(device) if isinstance(v, torch.Tensor) else v

        return Call(tuple(move(a) for a in self.args),
                    {k: move(v) for k, v in self.kwargs.items()})


@dataclass
class Family:
    """One model family for the matrix.

    Attributes:
        name: key in :data:`FAMILIES`.
        model: the network, random init, ``train()`` mode.
        stages: stage paths (globs allowed) resolved by ``remat.strategies.resolve_stages``.
        make_input: ``make_input(seed=1) -> Call``: a fresh input of the family's real
            forward, drawn from its own ``torch.Generator`` (the global RNG is untouched).
        loss_fn: model output -> scalar loss tensor (HF models: their own ``output.loss``
            from ``labels``; image models: mean of squares of every output tensor).
        patterns: stage pattern -> how its parent calls it (a key of :data:`PATTERNS`).
        dropout: whether dropout (or stochastic depth) is active in a stage.
        batchnorm: whether a stage holds BatchNorm layers (running statistics).
        notes: what else a strategy must know about the family (parent loop quirks).
    """

    name: str
    model: nn.Module
    stages: list[str]
    make_input: Callable[..., Call]
    loss_fn: Callable[[Any], torch.Tensor]
    patterns: dict[str, str]
    dropout: bool
    batchnorm: bool
    notes: str = ""

    def __iter__(self) -> Iterator[Any]:
        """Unpack as ``model, stages, make_input, loss_fn``."""
        return iter((self.model, self.stages, self.make_input, self.loss_fn))

    def step(self, model: nn.Module | None = None, inputs: Call | None = None,
             ) -> tuple[Any, torch.Tensor]:
        """Forward and loss (no backward) of ``model`` (default: the family's) on
        ``inputs`` (default: ``make_input()``); returns ``(output, loss)``."""
        model = self.model if model is None else model
        out = (self.make_input() if inputs is None else inputs)(model)
        return out, self.loss_fn(out)


def output_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor in a model output, in order: a tensor, or tensors inside tuples, lists,
    dicts and HF ``ModelOutput``s (which are dicts), recursively; other objects (a KV cache)
    are skipped."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in output_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in output_tensors(v)]
    return []


def mean_square(out: Any) -> torch.Tensor:
    """Sum over the output's tensors of their mean square, in fp32: a loss that reaches
    every output (all feature maps of a ``features_only`` model)."""
    return sum(t.float().square().mean() for t in output_tensors(out))


def _images(shape: tuple[int, ...]) -> Callable[..., Call]:
    def make_input(seed: int = 1) -> Call:
        return Call((torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),))

    return make_input


def _tokens(vocab: int, batch: int, length: int, labels: str | None) -> Callable[..., Call]:
    """HF text input: ``input_ids`` [B, T], ``attention_mask`` [B, T] with the last 3
    positions of the second row padded (0), and ``labels`` (``causal``: the ids, ``mlm``:
    every 4th id, -100 elsewhere; padding -100)."""
    def make_input(seed: int = 1) -> Call:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1, -3:] = 0
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if labels is not None:
            target = ids.masked_fill(mask == 0, -100)
            if labels == "mlm":
                keep = torch.zeros_like(mask, dtype=torch.bool)
                keep[:, ::4] = True
                target = target.masked_fill(~keep, -100)
            kwargs["labels"] = target
        return Call((), kwargs)

    return make_input


def _hf_loss(out: Any) -> torch.Tensor:
    return out.loss


# --- families already in the matrix (kept as they were) ---------------------------------

def unet_resnet() -> Family:
    """smp U-Net, ResNet-18 encoder (BatchNorm, in-place ReLU); stages ``encoder.layer*``."""
    import segmentation_models_pytorch as smp

    model = smp.Unet("resnet18", encoder_weights=None, classes=1,
                     decoder_channels=(32, 16, 16, 8, 8))
    return Family("unet_resnet", model.train(), ["encoder.layer*"], _images((2, 3, 32, 32)),
                  mean_square, {"encoder.layer*": "chain"}, dropout=False, batchnorm=True)


def unet_timm() -> Family:
    """smp U-Net with a ``tu-convnext_atto`` timm encoder (``features_only``); stages
    ``encoder.model.stages_*.blocks``."""
    import segmentation_models_pytorch as smp

    model = smp.Unet("tu-convnext_atto", encoder_weights=None, classes=1,
                     decoder_channels=(32, 16, 16, 8, 8))
    return Family("unet_timm", model.train(), ["encoder.model.stages_*.blocks"],
                  _images((2, 3, 32, 32)), mean_square,
                  {"encoder.model.stages_*.blocks": "chain"}, dropout=False, batchnorm=False)


def vit() -> Family:
    """timm ViT (4 blocks, width 48, dropout 0.1, drop path 0.2); stage ``blocks``."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                              patch_size=8, depth=4, embed_dim=48, num_heads=3, num_classes=3,
                              drop_rate=0.1, drop_path_rate=0.2, proj_drop_rate=0.1)
    return Family("vit", model.train(), ["blocks"], _images((2, 3, 32, 32)), mean_square,
                  {"blocks": "chain"}, dropout=True, batchnorm=False)


def _gpt_tokens(seed: int = 1) -> Call:
    return Call((torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(seed)),))


def gpt() -> Family:
    """remat's GPT (5 blocks, width 32, dropout 0.2, learned positions); stage ``blocks``."""
    from remat.models.gpt import GPT

    model = GPT(vocab_size=50, block_size=32, n_layer=5, n_head=4, n_embd=32, dropout=0.2)
    return Family("gpt", model.train(), ["blocks"], _gpt_tokens, mean_square,
                  {"blocks": "chain"}, dropout=True, batchnorm=False)


def gpt_rotary() -> Family:
    """remat's GPT with rotary positions; stage ``blocks``."""
    from remat.models.gpt import GPT

    model = GPT(vocab_size=50, block_size=32, n_layer=5, n_head=4, n_embd=32, dropout=0.2,
                pos_embedding="rotary")
    return Family("gpt_rotary", model.train(), ["blocks"], _gpt_tokens, mean_square,
                  {"blocks": "chain"}, dropout=True, batchnorm=False)


def vit_seg() -> Family:
    """remat's ViT segmenter (timm ViT encoder + BatchNorm upsampling decoder); stage
    ``encoder.blocks``."""
    from remat.models.vit_seg import ViTSegmenter

    model = ViTSegmenter(img_size=32, patch_size=8, embed_dim=24, depth=4, num_heads=2,
                         decoder_channels=(8, 8, 4), drop_rate=0.1, drop_path_rate=0.2)
    return Family("vit_seg", model.train(), ["encoder.blocks"], _images((2, 3, 32, 32)),
                  mean_square, {"encoder.blocks": "chain"}, dropout=True, batchnorm=False)


# --- Hugging Face transformers -------------------------------------------------------------

def hf_gpt2() -> Family:
    """``transformers.GPT2LMHeadModel`` (4 layers, width 32, every dropout 0.1, config
    default ``use_cache=True``); stage ``transformer.h``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                        bos_token_id=0, eos_token_id=0)
    return Family(
        "hf_gpt2", GPT2LMHeadModel(config).train(), ["transformer.h"],
        _tokens(64, 2, 16, "causal"), _hf_loss, {"transformer.h": "hf_layers"},
        dropout=True, batchnorm=False,
        notes="GPT2Model passes the cache and the mask positionally, use_cache and "
              "position_ids by keyword; with use_cache=True (config default) it builds a "
              "DynamicCache in training and every layer appends to it.")


def hf_llama() -> Family:
    """``transformers.LlamaForCausalLM`` (4 layers, width 32, 4 heads / 2 KV heads,
    attention dropout 0.1, config default ``use_cache=True``); stage ``model.layers``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, attention_dropout=0.1,
                         bos_token_id=0, eos_token_id=0)
    return Family(
        "hf_llama", LlamaForCausalLM(config).train(), ["model.layers"],
        _tokens(64, 2, 16, "causal"), _hf_loss, {"model.layers": "hf_layers"},
        dropout=True, batchnorm=False,
        notes="LlamaModel iterates self.layers[: config.num_hidden_layers], a new ModuleList "
              "slice of the same layers (patching the ModuleList object is not on the path); "
              "layers get attention_mask, position_embeddings (cos, sin), position_ids, cache "
              "and use_cache by keyword.")


def hf_bert() -> Family:
    """``transformers.BertForMaskedLM`` (4 layers, width 32, dropout 0.1); stage
    ``bert.encoder.layer``."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    return Family(
        "hf_bert", BertForMaskedLM(config).train(), ["bert.encoder.layer"],
        _tokens(64, 2, 16, "mlm"), _hf_loss, {"bert.encoder.layer": "hf_layers"},
        dropout=True, batchnorm=False,
        notes="BertEncoder passes the mask and encoder states positionally, the cache by "
              "keyword.")


# --- torchvision, MONAI, timm, smp ---------------------------------------------------------

def resnet50() -> Family:
    """``torchvision.models.resnet50`` (random init, 10 classes, BatchNorm); stages
    ``layer*`` (four ``nn.Sequential`` of Bottleneck blocks)."""
    from torchvision.models import resnet50 as tv_resnet50

    return Family("resnet50", tv_resnet50(weights=None, num_classes=10).train(), ["layer*"],
                  _images((2, 3, 32, 32)), mean_square, {"layer*": "chain"},
                  dropout=False, batchnorm=True)


def monai_unetr() -> Family:
    """MONAI ``UNETR`` in 2D (12 ViT blocks of width 48, dropout 0.1, 32 px); stage
    ``vit.blocks``, whose every block's output the ViT collects (UNETR's skips read
    blocks 3, 6 and 9)."""
    from monai.networks.nets import UNETR

    model = UNETR(in_channels=3, out_channels=1, img_size=32, feature_size=8, hidden_size=48,
                  mlp_dim=96, num_heads=4, spatial_dims=2, dropout_rate=0.1)
    return Family(
        "monai_unetr", model.train(), ["vit.blocks"], _images((2, 3, 32, 32)), mean_square,
        {"vit.blocks": "collects"}, dropout=True, batchnorm=False,
        notes="monai ViT.forward: for blk in self.blocks: x = blk(x); "
              "hidden_states_out.append(x); UNETR reads hidden_states_out[3], [6], [9].")


def monai_swinunetr() -> Family:
    """MONAI ``SwinUNETR`` in 2D (feature size 12, depths 2-2-2-2, dropout, attention
    dropout and drop path 0.1, 64 px: the 1/32 bottleneck holds 2 x 2 pixels for its
    instance norm); stages ``swinViT.layers*.0.blocks`` (each stage's Swin blocks)."""
    from monai.networks.nets import SwinUNETR

    model = SwinUNETR(in_channels=3, out_channels=1, feature_size=12, depths=(2, 2, 2, 2),
                      num_heads=(1, 1, 2, 2), spatial_dims=2, drop_rate=0.1,
                      attn_drop_rate=0.1, dropout_path_rate=0.1)
    return Family(
        "monai_swinunetr", model.train(), ["swinViT.layers*.0.blocks"],
        _images((2, 3, 64, 64)), mean_square, {"swinViT.layers*.0.blocks": "loop_args"},
        dropout=True, batchnorm=False,
        notes="monai BasicLayer.forward: for blk in self.blocks: x = blk(x, attn_mask) "
              "(the same shifted-window mask, a plain tensor, for every block).")


def timm_efficientnet() -> Family:
    """timm ``efficientnet_b0`` with ``features_only=True`` (5 feature maps; BatchNorm,
    drop path 0.1); stages ``blocks.*`` (seven ``nn.Sequential`` stages of blocks)."""
    import timm

    model = timm.create_model("efficientnet_b0", pretrained=False, features_only=True,
                              drop_rate=0.1, drop_path_rate=0.1)
    return Family("timm_efficientnet", model.train(), ["blocks.*"], _images((2, 3, 32, 32)),
                  mean_square, {"blocks.*": "chain"}, dropout=True, batchnorm=True,
                  notes="EfficientNetFeatures walks self.blocks and keeps the output of "
                        "some stages; each stage chain itself runs as one call.")


def timm_convnext() -> Family:
    """timm ``convnext_atto`` with ``features_only=True`` (``FeatureListNet``, 4 feature
    maps, drop path 0.1); stages ``stages_*.blocks``."""
    import timm

    model = timm.create_model("convnext_atto", pretrained=False, features_only=True,
                              drop_path_rate=0.1)
    return Family("timm_convnext", model.train(), ["stages_*.blocks"],
                  _images((2, 3, 32, 32)), mean_square, {"stages_*.blocks": "chain"},
                  dropout=True, batchnorm=False)


def smp_unetplusplus() -> Family:
    """smp ``UnetPlusPlus``, ResNet-18 encoder (BatchNorm); stages ``encoder.layer*`` and
    the nested decoder's blocks ``decoder.blocks.x_*`` (a ModuleDict of single
    ``DecoderBlock`` modules, each called as ``block(x, skip)``)."""
    import segmentation_models_pytorch as smp

    model = smp.UnetPlusPlus("resnet18", encoder_weights=None, classes=1,
                             decoder_channels=(32, 16, 16, 8, 8))
    return Family("smp_unetplusplus", model.train(), ["encoder.layer*", "decoder.blocks.x_*"],
                  _images((2, 3, 32, 32)), mean_square,
                  {"encoder.layer*": "chain", "decoder.blocks.x_*": "module"},
                  dropout=False, batchnorm=True,
                  notes="decoder.blocks is an nn.ModuleDict (not a chain); its blocks take "
                        "(x, skip) with skip a tensor or a concatenation of several.")


def smp_fpn() -> Family:
    """smp ``FPN``, ResNet-18 encoder (BatchNorm), decoder dropout 0.2 (in place); stages
    ``encoder.layer*`` and ``decoder.seg_blocks``, a ModuleList of four segmentation heads
    the decoder calls on four different pyramid levels."""
    import segmentation_models_pytorch as smp

    model = smp.FPN("resnet18", encoder_weights=None, classes=1, decoder_pyramid_channels=64,
                    decoder_segmentation_channels=32, decoder_dropout=0.2)
    return Family("smp_fpn", model.train(), ["encoder.layer*", "decoder.seg_blocks"],
                  _images((2, 3, 32, 32)), mean_square,
                  {"encoder.layer*": "chain", "decoder.seg_blocks": "parallel"},
                  dropout=False, batchnorm=True,
                  notes="FPNDecoder: s5 = seg_blocks[0](p5); s4 = seg_blocks[1](p4); ... "
                        "(GroupNorm inside the heads); its Dropout2d is outside every stage.")


def smp_deeplabv3plus() -> Family:
    """smp ``DeepLabV3Plus``, ResNet-18 encoder at output stride 16 (dilated ``layer4``,
    BatchNorm), ASPP dropout 0.5; stages ``encoder.layer*``, ``decoder.aspp`` (ASPP,
    separable conv, BN, ReLU) and ``decoder.block2``."""
    import segmentation_models_pytorch as smp

    model = smp.DeepLabV3Plus("resnet18", encoder_weights=None, classes=1,
                              decoder_channels=32, decoder_aspp_dropout=0.5)
    stages = ["encoder.layer*", "decoder.aspp", "decoder.block2"]
    return Family("smp_deeplabv3plus", model.train(), stages, _images((2, 3, 32, 32)),
                  mean_square, dict.fromkeys(stages, "chain"), dropout=True, batchnorm=True,
                  notes="decoder.aspp's first member (ASPP) runs five parallel branches "
                        "internally, one of them global pooling + BatchNorm on 1 x 1 maps.")


FAMILIES: dict[str, Callable[[], Family]] = {
    "unet_resnet": unet_resnet, "unet_timm": unet_timm, "vit": vit, "gpt": gpt,
    "gpt_rotary": gpt_rotary, "vit_seg": vit_seg,
    "hf_gpt2": hf_gpt2, "hf_llama": hf_llama, "hf_bert": hf_bert,
    "resnet50": resnet50, "monai_unetr": monai_unetr, "monai_swinunetr": monai_swinunetr,
    "timm_efficientnet": timm_efficientnet, "timm_convnext": timm_convnext,
    "smp_unetplusplus": smp_unetplusplus, "smp_fpn": smp_fpn,
    "smp_deeplabv3plus": smp_deeplabv3plus,
}


def build(name: str, seed: int = 0) -> Family:
    """Build family ``name`` with weights drawn under ``torch.manual_seed(seed)``.

    Raises:
        KeyError: unknown name (lists the families).
    """
    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; families: {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    return FAMILIES[name]()
