"""Every option of every config group composes, and builds what it names."""

from pathlib import Path

import lightning as L
import pytest
from hydra.errors import MissingConfigException
from hydra.utils import instantiate

from remat.config import config_dir
from remat.strategies import CheckpointStrategy
from tests.helpers import compose_train

GROUPS = ["data", "model", "strategy", "trainer", "callbacks", "logger", "experiment", "debug"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def test_every_group_has_options():
    for group in GROUPS + ["paths", "hydra"]:
        assert _options(group), f"configs/{group}/ is empty"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_option_composes_and_instantiates(tmp_path, kvasir_root, group, option):
    overrides = [f"{group}={option}"]
    if "kvasir" in option:
        overrides.append(f"data.root={kvasir_root}")
    if option == "timm_native":  # needs a timm model: the tu- ConvNeXt U-Net
        overrides += ["model=unet_convnext", "model.stages=[encoder.model]"]
    if option == "custom":  # a user's network, by _target_ (tests/models/nets.py)
        overrides.append("model.net._target_=tests.models.nets.TinyUNet")
    if option == "plan":  # replays a plan file: one that recomputes the first encoder layer
        from remat.planner import Plan, UnitPlan

        plan = Plan(units=[UnitPlan("encoder.layer1", "chain", [(0, 2, "recompute")])])
        overrides.append(f"strategy.path={plan.save(tmp_path / 'plan.json')}")
    if option == "shakespeare_llama_lora":  # LoRA on a saved model: a random tiny Llama
        from tests.models.test_lora import tiny_llama

        tiny_llama().save_pretrained(tmp_path / "base")
        overrides.append(f"model.pretrained={tmp_path / 'base'}")
    cfg = compose_train(tmp_path, overrides)
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, CheckpointStrategy)
    if getattr(strategy, "needs_plan", False):
        return  # planned before the model is built: tests/planner/test_train_budget.py
    datamodule = instantiate(cfg.data)
    assert isinstance(datamodule, L.LightningDataModule)
    if group in ("model", "experiment", "strategy"):
        model = instantiate(cfg.model, strategy=strategy)
        assert model.strategy_report.stages
    if group in ("trainer", "callbacks", "logger", "debug"):
        from remat.train import instantiate_group

        callbacks = instantiate_group(cfg.get("callbacks"), "callbacks")
        loggers = instantiate_group(cfg.get("logger"), "logger")
        if group == "trainer" and option in ("gpu", "ddp"):
            return  # needs GPUs / several processes: composing is what is checked here
        trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
        assert isinstance(trainer, L.Trainer)


@pytest.mark.parametrize("group", ["strategy", "model", "data"])
def test_unknown_option_lists_valid_ones(tmp_path, group):
    with pytest.raises(MissingConfigException) as err:
        compose_train(tmp_path, [f"{group}=does_not_exist"])
    message = str(err.value)
    assert f"Could not find '{group}/does_not_exist'" in message
    for option in _options(group):
        assert option in message


def test_top_level_toggles_reach_the_trainer(tmp_path):
    cfg = compose_train(tmp_path, ["precision=bf16-mixed", "accumulate_grad_batches=3"])
    assert cfg.trainer.precision == "bf16-mixed"
    assert cfg.trainer.accumulate_grad_batches == 3


def test_experiment_pins_kvasir_recipe(tmp_path):
    cfg = compose_train(tmp_path, ["experiment=kvasir_unet"])
    assert cfg.data._target_.endswith("KvasirSegDataModule")
    assert cfg.model.encoder_name == "resnet34"
    assert cfg.data.val_size == 120
    assert Path(cfg.data.root).name == "Kvasir-SEG"


@pytest.mark.parametrize("option", _options("experiment"))
def test_experiment_monitor_is_a_metric_its_model_logs(tmp_path, option):
    """GPT experiments log val/loss (no Dice): their monitor must say so, or MonitorCheck
    stops the run at the first validation."""
    cfg = compose_train(tmp_path, [f"experiment={option}"])
    sequence = "vocab_size" in cfg.model
    assert (cfg.monitor, cfg.monitor_mode) == (("val/loss", "min") if sequence
                                               else (cfg.monitor, "max"))
    assert sequence or cfg.monitor in ("val/dice", "val/iou", "val/miou")

