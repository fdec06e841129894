"""A run resumed with more epochs trains on the schedule its config asks for."""

import math
from types import SimpleNamespace

import pytest
import torch

from remat.models.checks import extend_restored_schedule


def _cosine_after_one_epoch(base=1e-3):
    """An optimizer and the CosineAnnealingLR(T_max=1) of a 1-epoch run, after its epoch."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=base)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1)
    optimizer.step()
    scheduler.step()
    return optimizer, scheduler


def test_a_resumed_run_with_more_epochs_follows_the_configured_cosine(caplog):
    """Resumed with trainer.max_epochs=5 (T_max=${trainer.max_epochs}: 5), the checkpoint's
    T_max=1 cosine went 0, 1e-3, 0, 1e-3 (torch's cosine past T_max); the run follows the
    5-epoch cosine from epoch 1 instead."""
    optimizer, scheduler = _cosine_after_one_epoch()
    trainer = SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(
        scheduler=scheduler, interval="epoch")], max_epochs=5, ckpt_path="last.ckpt")
    with caplog.at_level("INFO", logger="remat"):
        extend_restored_schedule(trainer, 5)
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(3):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    expected = [1e-3 * (1 + math.cos(math.pi * e / 5)) / 2 for e in range(1, 5)]
    assert rates == pytest.approx(expected, rel=1e-9)
    assert "model.scheduler.T_max=5 extends it: epoch 1 trains at lr 0.000905" in caplog.text
    # a fresh run whose T_max is below its epochs is told, not changed
    optimizer, scheduler = _cosine_after_one_epoch()
    fresh = SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(
        scheduler=scheduler, interval="epoch")], max_epochs=5, ckpt_path=None)
    with pytest.warns(UserWarning, match="T_max=1 epochs is below trainer.max_epochs=5"):
        extend_restored_schedule(fresh, 1)
    assert scheduler.T_max == 1 and optimizer.param_groups[0]["lr"] == 0.0
