"""SegmentationModule: metric sets per benchmark, ignore index / field of view in loss and
metrics, sliding-window validation, per-class IoU logged by name."""

import lightning as L
import pytest
import torch
from torch import nn

from remat.inference import SlidingWindow, sliding_window_inference
from remat.models import SegmentationModule
from remat.models.metrics import SegmentationMetrics

IGNORE = 255


def _small(**kwargs) -> SegmentationModule:
    torch.manual_seed(0)
    return SegmentationModule(encoder_name="resnet18", arch_kwargs={
        "decoder_channels": [16, 16, 16, 16, 16]}, **kwargs)


def test_per_image_dice_and_iou_are_means_over_images_and_skip_ignored_pixels():
    metrics = SegmentationMetrics("per_image", num_classes=1)
    target = torch.tensor([[[1, 1, 0, 0]], [[1, 0, 0, IGNORE]]])
    preds = torch.tensor([[[1, 0, 0, 0]], [[1, 1, 0, 1]]])  # last pixel ignored
    metrics.update(preds, target)
    out = metrics.compute()
    # image 1: TP 1, FP 0, FN 1 -> Dice 2/3, IoU 1/2; image 2: TP 1, FP 1, FN 0 -> 2/3, 1/2
    assert out["dice"].item() == pytest.approx(2 / 3)
    assert out["iou"].item() == pytest.approx(1 / 2)
    # pooled: TP 2, FP 1, FN 1 -> Dice 4/6, IoU 2/4
    assert out["dice_dataset"].item() == pytest.approx(2 / 3)
    assert out["iou_dataset"].item() == pytest.approx(1 / 2)
    assert metrics.score_one(preds[:1], target[:1])["dice"] == pytest.approx(2 / 3)


def test_binary_pooled_counts_pixels_of_the_whole_split():
    metrics = SegmentationMetrics("binary_pooled", num_classes=1)
    metrics.update(torch.tensor([[[1, 1, 0, 0]]]), torch.tensor([[[1, 0, 0, IGNORE]]]))
    metrics.update(torch.tensor([[[0, 1, 1, 0]]]), torch.tensor([[[1, 1, 1, 1]]]))
    out = metrics.compute()
    # TP 3, FP 1, FN 2, TN 1 over 7 counted pixels
    assert out["dice"].item() == pytest.approx(6 / 9)
    assert out["iou"].item() == pytest.approx(3 / 6)
    assert out["acc"].item() == pytest.approx(4 / 7)


def test_multiclass_miou_per_class_iou_and_accuracy_with_ignore_index():
    metrics = SegmentationMetrics("multiclass", num_classes=3, class_names=["a", "b", "c"])
    target = torch.tensor([[[0, 0, 1, 1, IGNORE, IGNORE]]])
    preds = torch.tensor([[[0, 1, 1, 1, 2, 0]]])
    metrics.update(preds, target)
    out = metrics.compute()
    assert out["iou_a"].item() == pytest.approx(1 / 2)   # TP 1, FN 1
    assert out["iou_b"].item() == pytest.approx(2 / 3)   # TP 2, FP 1
    assert torch.isnan(out["iou_c"])                     # absent from target and prediction
    assert out["miou"].item() == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert out["acc"].item() == pytest.approx(3 / 4)
    assert "iou_class" not in out


def test_metric_set_errors_name_the_config_key():
    with pytest.raises(ValueError, match="model.inference: .*'stride'"):
        _small(inference={"patch_size": 64, "stride": 32})
    with pytest.raises(ValueError, match="model.metrics must be auto or one of"):
        SegmentationMetrics("dice", num_classes=1)
    with pytest.raises(ValueError, match="binary_pooled needs model.num_classes=1"):
        SegmentationMetrics("binary_pooled", num_classes=3)
    with pytest.raises(ValueError, match="model.class_names has 2 names"):
        SegmentationMetrics("multiclass", num_classes=3, class_names=["a", "b"])


@pytest.mark.parametrize("num_classes", [1, 4])
def test_losses_ignore_pixels_marked_ignore_or_outside_the_valid_mask(num_classes):
    module = _small(num_classes=num_classes)
    logits = torch.randn(2, num_classes, 8, 8, requires_grad=True)
    mask = torch.randint(0, max(num_classes, 2), (2, 8, 8))
    mask[:, :, :3] = IGNORE
    loss = module._loss(logits, mask)
    loss.backward()
    assert torch.isfinite(loss)
    assert logits.grad[..., :3].abs().max() == 0  # ignored pixels get no gradient
    assert logits.grad[..., 3:].abs().max() > 0
    changed = logits.detach().clone()
    changed[..., :3] = 50.0
    assert module._loss(changed, mask).item() == pytest.approx(loss.item(), rel=1e-6)
    valid = torch.ones(2, 8, 8, dtype=torch.bool)
    valid[:, :, :3] = False
    batch = {"image": torch.zeros(2, 3, 8, 8), "mask": mask.clamp(max=max(num_classes, 2) - 1),
             "valid": valid}
    assert torch.equal(module.target(batch), mask)


def test_validation_uses_sliding_windows_when_configured():
    window = {"patch_size": 64, "overlap": 0.5, "batch_size": 3}
    module = _small(num_classes=3, metrics="multiclass", inference=window).eval()
    image = torch.randn(1, 3, 96, 160)
    batch = {"image": image, "mask": torch.randint(0, 3, (1, 96, 160))}
    with torch.no_grad():
        _, preds, _ = module.evaluate_batch(batch)
        expected = sliding_window_inference(module.net, image, SlidingWindow(**window))
        plain = module.net(image)
    assert torch.equal(preds, expected.argmax(1))
    assert not torch.equal(expected, plain)  # overlapping 64-px windows differ from one pass


class _Whole(torch.utils.data.Dataset):
    """Two whole images of odd sizes with a 4-class mask and some ignored pixels."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        mask = torch.randint(0, 4, (70, 90), generator=gen)
        mask[:5] = IGNORE
        return {"image": torch.randn(3, 70, 90, generator=gen), "mask": mask}


def test_validate_logs_miou_and_per_class_iou_by_name():
    names = ["building", "land", "road", "water"]
    module = _small(num_classes=4, metrics="multiclass", class_names=names,
                    inference={"patch_size": 64, "overlap": 0.25})
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    loader = torch.utils.data.DataLoader(_Whole(), batch_size=1)
    (logged,) = trainer.validate(module, dataloaders=loader, verbose=False)
    assert {f"val/iou_{n}" for n in names} | {"val/miou", "val/acc", "val/loss"} <= set(logged)
    present = [logged[f"val/iou_{n}"] for n in names]
    assert logged["val/miou"] == pytest.approx(sum(present) / 4, abs=1e-6)
    assert all(0.0 <= v <= 1.0 for v in present)


def test_default_metrics_keep_the_kvasir_keys():
    module = _small()
    assert isinstance(module.metrics["val"], nn.Module)
    module.metrics["val"].update(torch.ones(1, 4, 4, dtype=torch.long),
                                 torch.ones(1, 4, 4, dtype=torch.long))
    assert set(module.metrics["val"].compute()) == {"dice", "iou", "dice_dataset",
                                                    "iou_dataset"}
