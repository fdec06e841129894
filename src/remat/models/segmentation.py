"""LightningModule for semantic segmentation of images (2D) and volumes (3D): any smp
architecture and encoder, or a ready network (ViT segmenter, MONAI 2D/3D nets)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import segmentation_models_pytorch as smp
import torch
from torch import nn

from remat.inference import SlidingWindow, sliding_window_inference, volume_window_inference
from remat.models.base import StrategyModule
from remat.models.checks import extend_restored_schedule, require_keys
from remat.models.hf import check_config_keys
from remat.models.metrics import SegmentationMetrics
from remat.models.weights import load_encoder_weights
from remat.strategies import CheckpointStrategy

log = logging.getLogger(__name__)


def build_smp_model(arch: str, encoder_name: str, encoder_weights: str | None,
                    in_channels: int, num_classes: int, **kwargs: Any) -> nn.Module:
    """Build an smp model; a wrong ``arch`` or ``encoder_name`` names the config key.

    Raises:
        ValueError: unknown ``model.arch`` or ``model.encoder_name`` (the message keeps smp's
            list of valid options).
    """
    try:
        return smp.create_model(arch, encoder_name=encoder_name, encoder_weights=encoder_weights,
                                in_channels=in_channels, classes=num_classes, **kwargs)
    except KeyError as err:
        raise ValueError(f"model.arch / model.encoder_name: {err.args[0]}") from err


#: whole images are padded to a multiple of this for one forward pass (smp encoders: 32)
SIZE_DIVISOR = 32
#: side (px) of the zero image a given network is probed with at build time
PROBE_SIZE = 64
#: side (voxels) of the zero volume a 3D network is probed with (small: a CPU forward)
PROBE_SIZE_3D = 32


#: keys of the segmentation logits in a network's mapping output, in the order looked up:
#: torchvision's segmentation models (``{"out": ..., "aux": ...}``), Hugging Face's
#: ``ModelOutput`` (``logits``)
LOGITS_KEYS = ("out", "logits")


def main_logits(out: Any) -> Any:
    """The segmentation logits in a network's output: a tensor as it is; of a mapping
    (torchvision's ``FCN``/``DeepLabV3``/``LRASPP`` dict, a Hugging Face ``ModelOutput``)
    the entry under the first of :data:`LOGITS_KEYS` it holds (torchvision's auxiliary
    ``aux`` head is left out of the loss); of another object its ``logits`` attribute.
    Anything else (a deep-supervision tuple, whose main output is first in some libraries
    and last in others) is returned as it is, for :func:`not_logits_message`."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        for key in LOGITS_KEYS:
            if isinstance(out.get(key), torch.Tensor):
                return out[key]
        return out
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else out


def not_logits_message(name: str, out: Any) -> str:
    """Why ``out`` (what ``name`` returned) holds no logits :func:`main_logits` can take."""
    kind = type(out).__name__
    if isinstance(out, Mapping):
        kind += f" with keys {sorted(map(str, out))}"
    return (f"{name} returns {kind}, not a tensor; SegmentationModule needs logits "
            f"[B, model.num_classes, H, W]: a tensor, a mapping with one of the keys "
            f"{list(LOGITS_KEYS)} (torchvision, Hugging Face) or an object with .logits. "
            "Wrap the net so its forward returns the main output (of a deep-supervision "
            "tuple, the one at full resolution)")


def _resizable(spatial: Sequence[int], size: Sequence[int]) -> bool:
    """Whether logits of sides ``spatial`` can be resized to ``size``: as many sides, none
    larger."""
    return len(spatial) == len(size) and all(a <= b for a, b in zip(spatial, size,
                                                                      strict=True))


def upsample_logits(logits: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``logits [B, C, *s]`` resized to ``size`` when every side of ``s`` is at most the
    input's and one is smaller (Hugging Face's SegFormer gives 1/4 of the input's side):
    bilinear (volumes trilinear), ``align_corners=False``, as transformers' semantic
    segmentation models resize their logits for their own loss. Others as they are."""
    spatial, size = tuple(logits.shape[2:]), tuple(size)
    if spatial == size or not _resizable(spatial, size):
        return logits
    mode = "bilinear" if len(size) == 2 else "trilinear"
    return nn.functional.interpolate(logits, size=size, mode=mode, align_corners=False)


def check_net_output(net: nn.Module, in_channels: int, num_classes: int,
                     spatial_dims: int = 2) -> None:
    """Run ``net`` once on a zero image ``[1, in_channels, 64, 64]`` (3D: a zero volume
    ``[1, in_channels, 32, 32, 32]``; ``eval()``, no grad, no random numbers drawn, train
    mode restored) and check its :func:`main_logits` are ``[1, num_classes, 64, 64]`` (3D:
    ``[1, num_classes, 32, 32, 32]``), or smaller sides (resized in ``forward``). A network
    that cannot take that input (a fixed image size, another channel count it states
    itself) is not checked here; the first step reports it.

    Raises:
        ValueError: the output holds no logits, has another channel count than
            ``model.num_classes`` or a larger spatial size; names ``model.net`` (its class),
            ``model.num_classes`` and the fix.
    """
    name = f"model.net ({type(net).__module__}.{type(net).__qualname__})"
    side = PROBE_SIZE if spatial_dims == 2 else PROBE_SIZE_3D
    spatial = (side,) * spatial_dims
    shown = "x".join(map(str, spatial))
    training = net.training
    try:
        net.eval()
        with torch.no_grad():
            out = net(torch.zeros(1, in_channels, *spatial))
    except Exception:  # noqa: BLE001 - any failure here is the first step's to report
        return
    finally:
        net.train(training)
    out = main_logits(out)
    if not isinstance(out, torch.Tensor):
        raise ValueError(not_logits_message(name, out))
    ndim = 2 + spatial_dims
    if out.ndim != ndim or out.shape[1] != num_classes:
        got = tuple(out.shape)
        channels = out.shape[1] if out.ndim == ndim else None
        fix = (f"build the net with {num_classes} output channel(s) (its out_channels or "
               f"classes argument), or, if the masks hold {channels} classes, set "
               f"model.num_classes={channels} (data=folder: data.num_classes={channels})"
               if channels else ("return [B, C, H, W]" if spatial_dims == 2 else
                                 "return [B, C, D, H, W] (or set model.spatial_dims)"))
        raise ValueError(
            f"{name} returns logits of shape {got} for a {[1, in_channels, *spatial]} input, "
            f"but model.num_classes={num_classes} (1 = binary) needs "
            f"{[1, num_classes, *spatial]}; {fix}")
    if not _resizable(tuple(out.shape[2:]), spatial):
        raise ValueError(
            f"{name} returns logits of spatial size {tuple(out.shape[2:])} for a "
            f"{shown} input; segmentation logits must have the input's size, or a smaller "
            "one (resized to it), never a larger one (crop inside the net)")
    if tuple(out.shape[2:]) != spatial:
        log.info("%s returns logits of spatial size %s for a %s input: resized to the "
                 "input's size (%s) for the loss and the metrics", name,
                 "x".join(map(str, out.shape[2:])), shown,
                 "bilinear" if spatial_dims == 2 else "trilinear")


class SegmentationModule(StrategyModule):
    """Binary or multiclass segmentation of ``{"image": [B,3,H,W], "mask": [B,H,W]}`` batches,
    or of volumes ``{"image": [B,C,D,H,W], "mask": [B,D,H,W]}`` (``spatial_dims=3``): one
    module for both, every shape following the input's; ``spatial_dims`` only sets the
    shape of the build-time probe and of :meth:`example_batch`.

    Masks hold class indices (int64); pixels equal to ``ignore_index`` and, when the batch has
    a ``"valid"`` bool ``[B,H,W]`` entry (DRIVE field of view), pixels where it is False count
    in neither the loss nor the metrics.

    The network is ``smp.create_model(arch, encoder_name, ...)`` (segmentation-models-pytorch);
    its output has ``num_classes`` channels (1 for binary). The activation checkpointing
    ``strategy`` is applied in place to ``stages`` (dotted paths with globs into the smp
    model, e.g. ``encoder.layer*``) when the module is built; the report is kept in
    ``strategy_report`` and logged.

    Loss (smp.losses, both with ``ignore_index``): Dice + BCE-with-logits for binary (BCE
    averaged over non-ignored pixels), Dice + cross-entropy for multiclass.
    Metrics: the set named by ``metrics`` (:mod:`remat.models.metrics`: ``per_image`` =
    per-image Dice/IoU as polyp papers report, ``binary_pooled`` = foreground Dice/IoU and
    pixel accuracy over the split, ``multiclass`` = mIoU, per-class ``iou_<class>``, pixel
    accuracy), logged under ``val/`` and ``test/`` at the end of each epoch.
    Validation and test run on whole images: with ``inference`` set, by sliding-window
    inference (:func:`remat.inference.sliding_window_inference`; volumes by MONAI's,
    :func:`remat.inference.volume_window_inference`, Gaussian blending), else one forward
    pass. For volumes ``metrics=volume`` gives per-class Dice (``dice_<class>``).

    Args:
        arch, encoder_name, encoder_weights, in_channels, num_classes: smp model arguments
            (``num_classes`` is smp's ``classes``); ``encoder_weights=None`` is random init.
        pretrained: a local weights file (``.safetensors``, ``.pth``) loaded into the
            encoder (``net.encoder``; the whole net where it has none), e.g. timm's or
            torchvision's weights of the encoder's architecture, offline
            (:func:`remat.models.weights.load_encoder_weights`).
        stages: stage paths the strategy wraps.
        strategy: a :class:`~remat.strategies.CheckpointStrategy` (default: ``none``).
        optimizer: partial optimizer, called with the parameters.
        scheduler: optional partial LR scheduler, called with the optimizer; stepped per epoch.
        arch_kwargs: extra smp model arguments (e.g. ``decoder_channels``).
        net: a ready network (``[B, in_channels, H, W]`` -> ``[B, num_classes, H, W]``) used
            instead of an smp model, e.g. a ViT segmenter; ``arch``/``encoder_*`` are then
            ignored.
        metrics: metric set name (``per_image`` | ``binary_pooled`` | ``multiclass``).
        ignore_index: mask value excluded from loss and metrics (255 in every datamodule).
        class_names: class names for per-class metric keys (``val/iou_<name>``).
        inference: sliding-window settings for validation/test, keys of
            :class:`remat.inference.SlidingWindow` (``patch_size``, ``overlap``,
            ``batch_size``, ``blend``, ``size_divisor``), or None for one forward pass.
        spatial_dims: 2 (images) or 3 (volumes): the probe's and :meth:`example_batch`'s
            shape; training and evaluation follow the batches' own shapes.

    Raises:
        ValueError: ``num_classes < 1``; ``spatial_dims`` not 2 or 3 (3 needs ``net``);
            unknown arch/encoder; a bad ``metrics`` name or ``inference`` value (naming the
            ``model.`` key); a ``pretrained`` file that does not fit the encoder.
        FileNotFoundError: no ``pretrained`` file.
        remat.strategies.StageError: a stage matches no module (close names are listed).
    """

    def __init__(self, arch: str = "Unet", encoder_name: str = "resnet34",
                 encoder_weights: str | None = None, in_channels: int = 3, num_classes: int = 1,
                 stages: Sequence[str] = (), strategy: CheckpointStrategy | None = None,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None,
                 arch_kwargs: dict[str, Any] | None = None, net: nn.Module | None = None,
                 metrics: str = "per_image", ignore_index: int = 255,
                 class_names: Sequence[str] | None = None,
                 inference: dict[str, Any] | None = None, pretrained: str | None = None,
                 spatial_dims: int = 2) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"model.num_classes must be >= 1 (1 = binary), got {num_classes}")
        if spatial_dims not in (2, 3):
            raise ValueError(f"model.spatial_dims must be 2 (images) or 3 (volumes), got "
                             f"{spatial_dims!r}")
        if spatial_dims == 3 and net is None:
            raise ValueError("model.spatial_dims=3 needs a 3D network in model.net (smp "
                             "models are 2D), e.g. model=monai_unet3d")
        self.save_hyperparameters(ignore=["strategy", "optimizer", "scheduler", "net"])
        self.spatial_dims = spatial_dims
        if net is None:
            net = build_smp_model(arch, encoder_name, encoder_weights, in_channels, num_classes,
                                  **dict(arch_kwargs or {}))
        else:
            check_config_keys(net)  # a Hugging Face net's misspelled config setting
            check_net_output(net, in_channels, num_classes, spatial_dims)
        if pretrained is not None:
            loaded, skipped = load_encoder_weights(net, pretrained)
            log.info("model.pretrained=%s loaded into %s (%d tensors of the file skipped)",
                     pretrained, type(loaded).__name__, skipped)
        self.wrap_net(net, stages, strategy)
        self.optimizer_factory = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        self.scheduler_factory = scheduler
        self.binary = num_classes == 1
        self.ignore_index = ignore_index
        if self.binary:
            self.dice_loss = smp.losses.DiceLoss(mode="binary", from_logits=True,
                                                 ignore_index=ignore_index)
            self.ce_loss = smp.losses.SoftBCEWithLogitsLoss(ignore_index=ignore_index,
                                                            reduction="none")
        else:
            self.dice_loss = smp.losses.DiceLoss(mode="multiclass", from_logits=True,
                                                 ignore_index=ignore_index)
            self.ce_loss = nn.CrossEntropyLoss(ignore_index=ignore_index)
        try:
            self.window = SlidingWindow(**dict(inference)) if inference else None
        except TypeError as err:
            raise ValueError(f"model.inference: {err}; expected keys patch_size, overlap, "
                             "batch_size, blend, size_divisor") from err
        self.metrics = nn.ModuleDict({
            stage: SegmentationMetrics(metrics, num_classes, ignore_index, class_names)
            for stage in ("val", "test")})

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, in_channels, H, W]`` -> logits ``[B, num_classes, H, W]`` (volumes:
        ``[B, in_channels, D, H, W]`` -> ``[B, num_classes, D, H, W]``): the network's
        :func:`main_logits`, resized to the input's size if smaller (:func:`upsample_logits`).

        Raises:
            ValueError: the network's output holds no logits (:func:`not_logits_message`).
        """
        out = self.net(images)
        logits = main_logits(out)
        if not isinstance(logits, torch.Tensor):
            raise ValueError(not_logits_message(f"model.net ({type(self.net).__name__})", out))
        return upsample_logits(logits, images.shape[2:])

    def infer(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_classes, H, W]`` of whole images at their own size: sliding-window
        inference when ``inference`` is set (under ``no_grad``), else one forward pass, with
        sides that are no multiple of :data:`SIZE_DIVISOR` padded (reflect) up to one and the
        logits cropped back (encoders that downsample 32x need such sizes). Volumes
        ``[B, C, D, H, W]`` go through MONAI's sliding windows when ``inference`` is set,
        else through one forward pass padded (replicate) the same way."""
        if images.ndim == 5:
            if self.window is not None:
                return volume_window_inference(self, images, self.window)
            pads = [-side % SIZE_DIVISOR for side in images.shape[2:]]
            if not any(pads):
                return self(images)
            flat = [p for pad in reversed(pads) for p in (0, pad)]
            logits = self(torch.nn.functional.pad(images, flat, mode="replicate"))
            d, h, w = images.shape[2:]
            return logits[..., :d, :h, :w]
        if self.window is not None:
            return sliding_window_inference(self, images, self.window)
        height, width = images.shape[-2:]
        pad_h, pad_w = -height % SIZE_DIVISOR, -width % SIZE_DIVISOR
        if not pad_h and not pad_w:
            return self(images)
        mode = "reflect" if pad_h < height and pad_w < width else "replicate"
        padded = torch.nn.functional.pad(images, (0, pad_w, 0, pad_h), mode=mode)
        return self(padded)[..., :height, :width]

    def target(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's mask ``[B, H, W]`` with pixels outside ``batch["valid"]`` (if any) set
        to ``ignore_index``."""
        require_keys(batch, ("image", "mask"), "SegmentationModule")
        mask = batch["mask"]
        valid = batch.get("valid")
        if valid is not None:
            mask = mask.masked_fill(~valid.bool(), self.ignore_index)
        return mask

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Dice + cross-entropy loss of a ``{"image", "mask"}`` batch (scalar)."""
        return self._loss(self(batch["image"]), self.target(batch))

    def example_batch(self, batch_size: int, size: int | Sequence[int],
                      generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random images ``[batch_size, in_channels, size, size]`` and masks for benchmarks;
        with ``spatial_dims=3`` volumes ``[batch_size, in_channels, size, size, size]``, or
        of the sides ``size`` when it is a tuple (``(h, w)`` px or ``(d, h, w)`` voxels)."""
        classes = 2 if self.binary else self.hparams.num_classes
        spatial = ((int(size),) * self.spatial_dims if isinstance(size, int)
                   else tuple(int(v) for v in size))
        return {
            "image": torch.randn(batch_size, self.hparams.in_channels, *spatial,
                                 generator=generator),
            "mask": torch.randint(0, classes, (batch_size, *spatial), generator=generator),
        }

    def _loss(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.binary:
            target = mask.unsqueeze(1).float()
            keep = (target != self.ignore_index).float()
            bce = (self.ce_loss(logits, target) * keep).sum() / keep.sum().clamp_min(1.0)
            return self.dice_loss(logits, target) + bce
        return self.dice_loss(logits, mask) + self.ce_loss(logits, mask)

    def predict_labels(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C, H, W]`` -> class indices ``[B, H, W]`` (int64)."""
        if self.binary:
            return (logits[:, 0] > 0).long()
        return logits.argmax(dim=1)

    def setup(self, stage: str) -> None:
        """Take the datamodule's class names for per-class metric keys (``iou_<name>``)
        when ``model.class_names`` is unset and the counts agree."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer else None
        names = getattr(datamodule, "class_names", None)
        if self.hparams.get("class_names") or not names:
            return
        for metrics in self.metrics.values():
            if metrics.kind in ("multiclass", "volume") and \
                    len(names) == max(2, metrics.num_classes):
                metrics.class_names = list(names)

    def on_train_start(self) -> None:
        extend_restored_schedule(self.trainer, getattr(self.scheduler_factory, "keywords",
                                                       {}).get("T_max"))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True,
                 batch_size=batch["image"].shape[0])
        return loss

    def evaluate_batch(self, batch: dict[str, torch.Tensor],
                       stage: str = "val") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole-image logits, predicted labels ``[B, H, W]`` and target of a batch; adds
        them to the ``stage`` metrics. Returns ``(loss, preds, target)``."""
        target = self.target(batch)
        logits = self.infer(batch["image"])
        preds = self.predict_labels(logits)
        self.metrics[stage].update(preds, target)
        return self._loss(logits, target), preds, target

    def _eval_step(self, batch: dict[str, torch.Tensor], stage: str) -> None:
        loss, _, _ = self.evaluate_batch(batch, stage)
        self.log(f"{stage}/loss", loss, on_epoch=True, prog_bar=True,
                 batch_size=batch["image"].shape[0])

    def _log_metrics(self, stage: str) -> None:
        metrics = self.metrics[stage]
        values = {f"{stage}/{k}": v for k, v in metrics.compute().items()}
        metrics.reset()
        self.log_dict(values, prog_bar=False)

    def validation_keys(self) -> list[str]:
        """The ``val/`` keys this module logs in validation (``val/loss`` and its metric
        set's scores), known before anything runs."""
        return ["val/loss", *(f"val/{n}" for n in self.metrics["val"].names())]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._log_metrics("test")

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        """Whole-image prediction of a ``{"image": [B, C, h, w], "name", "path"}`` batch
        (``"size"``: int64 ``[B, 2]``, each image's native ``(H, W)``, when the data served
        it resized): logits
        by :meth:`infer`, resized back to the native size (bilinear) where they differ.

        Returns:
            ``{"labels": int64 [B, H, W], "probabilities": float32 [B, K, H, W] (K = 1 for
            binary: the foreground probability), "name": [...], "path": [...]}``.
        """
        logits = self.infer(batch["image"]).float()
        size = batch.get("size")
        if size is not None:
            native = tuple(int(v) for v in size[0])  # int64 [B, 2]: (H, W) per image
            if tuple(logits.shape[-2:]) != native:
                logits = torch.nn.functional.interpolate(logits, size=native, mode="bilinear",
                                                         align_corners=False)
        probabilities = logits.sigmoid() if self.binary else logits.softmax(dim=1)
        return {"labels": self.predict_labels(logits), "probabilities": probabilities,
                "name": batch.get("name"), "path": batch.get("path")}

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
