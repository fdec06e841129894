"""3D segmentation end to end on tiny MSD task folders written in the published layout
(:mod:`tests.data.volumes`): each 3D model config wraps its stages and computes the same
first-step gradients under every checkpointing strategy; training, a budget plan, the memory
estimate, evaluation (per-class Dice) and prediction (NIfTI on the input's grid)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from remat.estimate import estimate
from remat.eval import evaluate
from remat.models import SegmentationModule
from remat.predict import predict
from remat.train import train
from tests.data.volumes import write_msd_task, write_volume_folder
from tests.helpers import TINY_TRAINER, compose_app, compose_config, compose_train

# tiny networks: a few channels, so a 32^3 step takes well under a second on a CPU
TINY_NETS = {
    "monai_unet3d": ["model.net.channels=[4,8,16,32,64]"],
    "monai_swinunetr3d": ["model.net.feature_size=12", "model.net.num_heads=[1,1,2,2]",
                          "model.net.norm_name=batch"],  # batch norm: a 32^3 patch suffices
    "monai_segresnet3d": ["model.net.init_filters=8"],
    "monai_dynunet3d": ["model.net.filters=[4,8,16,32,32]"],
}
STAGES = {
    "monai_unet3d": ["model.0", "model.1.submodule.0", "model.1.submodule.1.submodule.0",
                     "model.1.submodule.1.submodule.1.submodule.0",
                     "model.1.submodule.1.submodule.1.submodule.1.submodule"],
    "monai_swinunetr3d": [f"swinViT.layers{i}.0.blocks" for i in range(1, 5)],
    "monai_segresnet3d": [*(f"down_layers.{i}" for i in range(4)),
                          *(f"up_layers.{i}" for i in range(3))],
    "monai_dynunet3d": ["input_block", *(f"downsamples.{i}" for i in range(3)), "bottleneck"],
}
PATCH = ["data.patch_size=[32,32,32]", "data.pixdim=null", "data.batch_size=2",
         "data.samples_per_volume=1"]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    """Three labelled 32^3 CT volumes and one unlabelled one (imagesTs)."""
    return write_msd_task(tmp_path_factory.mktemp("msd") / "Task09_Spleen", count=3)


def _overrides(task: Path, model: str, strategy: str = "none") -> list[str]:
    return ["data=msd", f"data.root={task}", *PATCH, f"model={model}", *TINY_NETS[model],
            f"strategy={strategy}"]


def _gradients(cfg, batch) -> tuple[float, dict[str, torch.Tensor], list[str]]:
    torch.manual_seed(0)
    model = instantiate(cfg.model, strategy=instantiate(cfg.strategy))
    model.train()
    loss = model.training_loss(batch)
    loss.backward()
    model.strategy.verify(model.net)  # every wrapped unit was on the path the net ran
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, list(model.strategy_report.wrapped)


@pytest.mark.parametrize("model", sorted(TINY_NETS))
def test_3d_models_give_none_s_gradients_under_full_and_sqrtn(tmp_path, task, model):
    base = compose_train(tmp_path, _overrides(task, model))
    assert base.model.spatial_dims == 3 and base.model.num_classes == 1
    probe = instantiate(base.model)
    batch = probe.example_batch(2, (32, 32, 32), torch.Generator().manual_seed(1))
    assert batch["image"].shape == (2, 1, 32, 32, 32) and batch["mask"].shape == (2, 32, 32, 32)
    ref_loss, ref, wrapped_none = _gradients(base, batch)
    assert wrapped_none == [] and len(ref) == len(list(probe.parameters()))
    for strategy in ("full", "sqrtn"):
        cfg = compose_train(tmp_path / strategy, _overrides(task, model, strategy))
        loss, grads, wrapped = _gradients(cfg, batch)
        assert wrapped, f"{model} under {strategy} wrapped nothing"
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert grads.keys() == ref.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("model", sorted(TINY_NETS))
def test_3d_model_stages_resolve_to_the_listed_modules(tmp_path, task, model):
    cfg = compose_train(tmp_path, _overrides(task, model, "full"))
    built = instantiate(cfg.model, strategy=instantiate(cfg.strategy))
    assert built.strategy_report.stages == STAGES[model]
    names = dict(built.net.named_modules())
    for path in built.strategy_report.wrapped:
        assert path in names or path.rsplit(".", 1)[0] in names


@pytest.fixture(scope="module")
def trained(tmp_path_factory, task) -> tuple[Path, dict]:
    """One tiny U-Net run (one step of two 32^3 patches, sqrtn): its checkpoint, summary."""
    out = tmp_path_factory.mktemp("train3d")
    summary = train(compose_train(out, [*_overrides(task, "monai_unet3d", "sqrtn"),
                                        *TINY_TRAINER]))
    return out / "checkpoints" / "last.ckpt", summary


def test_unet3d_trains_and_validates_with_per_class_dice(trained):
    _, summary = trained
    assert summary["status"] == "completed" and summary["global_step"] == 1
    metrics = summary["metrics"]
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert 0.0 <= metrics["val/dice_spleen"] <= 1.0
    assert metrics["val/dice"] == pytest.approx(metrics["val/dice_spleen"])
    assert summary["strategy_report"]["stages"] == STAGES["monai_unet3d"]


def test_eval_scores_every_volume_with_per_class_dice(trained, tmp_path):
    ckpt, summary = trained
    result = evaluate(compose_app("eval", tmp_path, [
        f"ckpt_path={ckpt}", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]))
    scores = result["metrics"]
    assert set(scores) >= {"val/dice", "val/dice_spleen"}
    assert 0.0 <= scores["val/dice_spleen"] <= 1.0
    # the same weights on the same val volume: the run's own last validation
    assert scores["val/dice_spleen"] == pytest.approx(summary["metrics"]["val/dice_spleen"],
                                                      abs=1e-5)
    # per-volume rows give all three sides of the volume
    rows = list(csv.DictReader((tmp_path / "per_image.csv").open()))
    assert rows and all(int(r["depth"]) > 0 and int(r["height"]) > 0 for r in rows)


def test_predict_writes_nifti_with_the_inputs_affine_and_header(trained, task, tmp_path):
    import nibabel as nib

    ckpt, _ = trained
    out = tmp_path / "masks"
    result = predict(compose_app("predict", tmp_path / "p", [
        f"ckpt_path={ckpt}", f"input={task / 'imagesTs'}", f"output={out}",
        "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]))
    assert result["count"] == 1 and result["format"] == "nifti"
    source = nib.load(str(task / "imagesTs" / "spleen_t0.nii.gz"))
    mask = nib.load(str(out / "spleen_t0.nii.gz"))
    assert mask.shape == source.shape
    np.testing.assert_allclose(mask.affine, source.affine)
    assert mask.get_data_dtype() == np.uint8
    for key in ("qform_code", "sform_code", "xyzt_units", "dim"):
        assert mask.header[key] == source.header[key] if key != "dim" else \
            list(mask.header[key][:4]) == list(source.header[key][:4]), key
    np.testing.assert_allclose(mask.header["pixdim"][1:4], source.header["pixdim"][1:4])
    assert set(np.unique(np.asarray(mask.dataobj)).tolist()) <= {0, 1}
    rows = list(csv.DictReader((out / "predictions.csv").open()))
    assert rows[0]["name"] == "spleen_t0" and rows[0]["shape"] == "32x32x32"


def test_predict_restores_the_input_grid_after_resampling(tmp_path):
    """Spacing 1 x 1 x 2 mm resampled to 1.5 mm for the model: the prediction comes back on
    the file's own 20 x 24 x 16 grid, and a perfect prediction of the label is the label."""
    import nibabel as nib

    from remat.data import MSDDataModule

    root = write_msd_task(tmp_path / "Task", count=2, shape=(20, 24, 16),
                          spacing=(1.0, 1.0, 2.0), test_count=0)
    dm = MSDDataModule(root, patch_size=[16, 16, 16], pixdim=[1.5, 1.5, 1.5])
    label_path = root / "labelsTr" / "spleen_0.nii.gz"
    served = dm.load_transform(("image", "label"))(
        {"image": str(root / "imagesTr" / "spleen_0.nii.gz"), "label": str(label_path)})
    assert tuple(served["image"].shape[1:]) != (20, 24, 16)  # resampled
    probability = torch.as_tensor(served["label"].as_tensor()).float()  # [1, D, H, W]
    restored = dm.restore_labels(probability, root / "imagesTr" / "spleen_0.nii.gz",
                                 binary=True)
    truth = np.asarray(nib.load(str(label_path)).dataobj)
    assert restored.shape == truth.shape == (20, 24, 16)
    assert (restored == truth).mean() > 0.97


def _estimates(tmp_path: Path, task: Path, strategy: str, model: str = "monai_unet3d"):
    cfg = compose_config("estimate", tmp_path, [
        *_overrides(task, model, strategy), "device=cpu",
        "model.optimizer._target_=torch.optim.SGD", "~model.optimizer.weight_decay"])
    return estimate(cfg), estimate(cfg, fake=False)


@pytest.mark.parametrize("strategy", ["none", "sqrtn"])
def test_estimate_of_a_3d_model_within_3_percent_of_measured(tmp_path, task, strategy):
    predicted, measured = _estimates(tmp_path, task, strategy)
    assert predicted.fake and not measured.fake
    assert predicted.size == (32, 32, 32) and predicted.size_key == "data.patch_size"
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.03 * measured.peak_bytes, (
        predicted.categories, measured.categories)


@pytest.mark.slow  # ~80 s on a shared CPU: plans with traces, then trains
def test_budget_plans_and_trains_a_3d_model(tmp_path, task):
    # SegResNet: flat encoder/decoder chains whose activations dominate its peak
    none, _ = _estimates(tmp_path / "none", task, "none", "monai_segresnet3d")
    budget = int(0.85 * none.peak_bytes)
    summary = train(compose_train(tmp_path, [
        *_overrides(task, "monai_segresnet3d", "budget"), f"strategy.memory={budget}",
        "strategy.device=cpu", "strategy.max_traces=2", "strategy.margin=0.0",
        "model.optimizer._target_=torch.optim.SGD", "~model.optimizer.weight_decay",
        *TINY_TRAINER]))
    assert summary["status"] == "completed" and summary["strategy"] == "budget"
    plan = summary["plan"]
    assert plan["size"] == [32, 32, 32] and plan["budget_bytes"] == budget
    assert plan["predicted_peak_bytes"] <= budget < plan["none_peak_bytes"]
    assert any(s["mode"] != "keep" for u in plan["units"] for s in u["segments"])
    # the run's own measured peak (first optimizer steps) is the plan's prediction
    assert abs(plan["measured_over_predicted"] - 1) <= 0.03


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["none", "full", "sqrtn"])
@pytest.mark.parametrize("model", sorted(TINY_NETS))
def test_each_3d_model_trains_under_each_strategy(tmp_path, task, model, strategy):
    summary = train(compose_train(tmp_path, [*_overrides(task, model, strategy),
                                             *TINY_TRAINER]))
    assert summary["status"] == "completed" and summary["global_step"] == 1
    assert 0.0 <= summary["metrics"]["val/dice_spleen"] <= 1.0


def test_module_is_one_for_2d_and_3d(tmp_path, task):
    cfg = compose_train(tmp_path, _overrides(task, "monai_unet3d"))
    assert cfg.model._target_ == "remat.models.SegmentationModule"
    model = instantiate(cfg.model)
    assert isinstance(model, SegmentationModule) and model.spatial_dims == 3
    assert model.validation_keys() == ["val/loss", "val/dice_spleen", "val/dice"]
    with pytest.raises(ValueError, match="spatial_dims=3 needs a 3D network"):
        SegmentationModule(spatial_dims=3)
    volume = torch.randn(1, 1, 40, 36, 32)  # no multiple of the window: windows overlap
    model.eval()
    logits = model.infer(volume)
    assert logits.shape == (1, 1, 40, 36, 32)


# ---------------------------------------------------------------- docs/volumes.md, run

def _page_commands() -> list[str]:
    from tests.test_readme import DOCS, bash_commands

    return bash_commands(DOCS / "volumes.md")


def _with(args: list[str], extra: list[str]) -> list[str]:
    """``args`` with each key of ``extra`` replaced (or added): tiny sizes on top."""
    keys = {e.split("=", 1)[0]: e for e in extra}
    kept = [a for a in args if a.split("=", 1)[0] not in keys]
    return [*kept, *extra]


FAST_PAGE_COMMANDS = ("python train.py data=msd data.root=/data/Task09_Spleen "
                      "model=monai_unet3d strategy=sqrtn", "python -m remat.eval",
                      "python -m remat.predict")


@pytest.mark.parametrize("command", [
    c if c.startswith(FAST_PAGE_COMMANDS) else pytest.param(c, marks=pytest.mark.slow)
    for c in _page_commands()])
def test_volume_page_command_runs_at_tiny_sizes(command, task, trained, tmp_path):
    from tests.test_readme import _app_and_args

    ckpt, _ = trained
    app, args = _app_and_args(command)
    folders = {"/data/Task09_Spleen": task, "/data/new_volumes": task / "imagesTs",
               "/data/my_volumes": write_volume_folder(tmp_path / "mine", 3, (32,) * 3),
               "/data/my_ct": write_volume_folder(tmp_path / "ct", 3, (32,) * 3, classes=3),
               "/data/RawData/Training": write_volume_folder(
                   tmp_path / "btcv", 3, (32,) * 3, classes=3, images="img/img{}",
                   labels="label/label{}")}
    for given, folder in folders.items():
        args = [a.replace(given, str(folder)) for a in args]
    args = [a.replace("placeholder/checkpoints/last.ckpt", str(ckpt)) for a in args]
    recipes = {"experiment=msd_spleen_unet3d": "monai_unet3d"}
    model = next((a.split("=", 1)[1] for a in args if a.startswith("model=")),
                 next((m for e, m in recipes.items() if e in args), "monai_swinunetr3d"))
    quiet = ["trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]
    if app == "train":
        tiny = [*PATCH, *TINY_NETS[model], *TINY_TRAINER]
        if "strategy=budget" in args:
            # a budget this CPU holds (the page's is for a GPU): the plan keeps what fits
            tiny += ["strategy.device=cpu", "strategy.max_traces=2", "strategy.memory=1GiB"]
        if any(a.startswith("experiment=") for a in args):
            tiny += ["data.samples_per_volume=1", "trainer.precision=32-true"]
        summary = train(compose_train(tmp_path, _with(args, tiny)))
        assert summary["status"] == "completed" and summary["global_step"] >= 1
        assert 0.0 <= summary["metrics"]["val/dice"] <= 1.0
    elif app == "estimate":
        cfg = compose_config("estimate", tmp_path, _with(
            args, [*PATCH, *TINY_NETS[model], "device=cpu"]))
        result = estimate(cfg)
        assert result.size == (32, 32, 32) and result.peak_bytes > 0
    elif app == "eval":
        result = evaluate(compose_app("eval", tmp_path, [*args, *quiet]))
        assert 0.0 <= result["metrics"]["val/dice_spleen"] <= 1.0
    else:
        out = tmp_path / "spleen_masks"
        result = predict(compose_app("predict", tmp_path / "p", [
            *_with(args, [f"output={out}"]), *quiet]))
        assert result["count"] == 1 and (out / "spleen_t0.nii.gz").is_file()


def test_step_timing_counts_voxels_of_volume_batches():
    from remat.callbacks.timing import _batch_counts

    batch = {"image": torch.zeros(2, 1, 8, 16, 32), "mask": torch.zeros(2, 8, 16, 32)}
    assert _batch_counts(batch) == {"samples": 2, "voxels": 2 * 8 * 16 * 32}
