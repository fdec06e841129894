"""End-to-end training through ``train(cfg)`` on tiny synthetic and real data."""

import csv
import json
import logging
import re

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from remat.measure import format_bytes
from remat.models.checks import require_keys
from remat.strategies import StageError
from remat.train import train
from tests.helpers import TINY, TINY_TRAINER, compose_train


def _summary(out):
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("strategy", ["none", "full", "sqrtn"])
def test_smoke_training_writes_run_outputs(tmp_path, strategy):
    cfg = compose_train(tmp_path, [*TINY, f"strategy={strategy}"])
    summary = train(cfg)
    assert summary == _summary(tmp_path)
    assert summary["status"] == "completed"
    assert summary["strategy"] == strategy
    assert summary["global_step"] == 2  # 8 images / batch 4
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert summary["best_model_path"] and summary["monitor"] == "val/dice"
    assert (tmp_path / "config.yaml").is_file()
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    assert any(row.get("val/dice") for row in rows)
    assert 0.0 <= summary["metrics"]["val/dice"] <= 1.0
    params = 4 * sum(p.numel() for p in instantiate(cfg.model).parameters())  # fp32 bytes
    assert summary["peak_memory_bytes"] > 2 * params  # parameters + gradients + more
    assert summary["torch_version"] == torch.__version__
    report = summary["strategy_report"]
    if strategy == "none":
        assert report["wrapped"] == [] and report["segments"] == {}
    else:
        assert report["segments"]["encoder.layer1"][0] == [0, 1]
        assert "encoder.layer4.1" in report["wrapped"]


def test_bf16_mixed_precision_trains(tmp_path):
    summary = train(compose_train(tmp_path, [*TINY, "strategy=sqrtn", "precision=bf16-mixed"]))
    assert summary["precision"] == "bf16-mixed"
    assert summary["status"] == "completed"
    assert torch.isfinite(torch.tensor(summary["metrics"]["train/loss"]))


def test_gradient_accumulation_halves_optimizer_steps(tmp_path):
    summary = train(compose_train(tmp_path, [*TINY, "strategy=full", "accumulate_grad_batches=2",
                                             "data.num_train=16"]))
    assert summary["accumulate_grad_batches"] == 2
    assert summary["global_step"] == 2  # 4 batches / 2


def test_resume_from_last_checkpoint_continues(tmp_path):
    first = train(compose_train(tmp_path / "a", [*TINY, "strategy=sqrtn"]))
    resumed = train(compose_train(tmp_path / "b", [*TINY, "strategy=sqrtn",
                                                   "trainer.max_epochs=2",
                                                   f"ckpt_path={first['last_model_path']}"]))
    assert first["global_step"] == 2
    assert resumed["global_step"] == 4 and resumed["epochs"] == 2


@pytest.mark.parametrize("mode", ["min", "max"])
def test_last_checkpoint_holds_the_current_best_record(tmp_path, mode):
    """last.ckpt is written at the same validation end as the best checkpoint; the
    ModelCheckpoint state inside it must already name this epoch's best (a resumed run
    takes its best from there), not the one before."""
    summary = train(compose_train(tmp_path, [*TINY, "trainer.max_epochs=3",
                                             "monitor=val/loss", f"monitor_mode={mode}"]))
    ck = torch.load(summary["last_model_path"], weights_only=False, map_location="cpu")
    record = next(v for k, v in ck["callbacks"].items() if k.startswith("ModelCheckpoint"))
    losses = [float(r["val/loss"]) for r in csv.DictReader(
        (tmp_path / "csv" / "metrics.csv").open()) if r.get("val/loss")]
    best_epoch = (min if mode == "min" else max)(range(3), key=losses.__getitem__)
    assert record["best_model_path"] == summary["best_model_path"]
    assert record["best_model_path"].endswith(f"epoch_{best_epoch:03d}.ckpt")
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("epoch_*.ckpt")) == [
        f"epoch_{best_epoch:03d}.ckpt"]


def test_resuming_with_another_batch_size_warns_and_skips_the_samples_trained(tmp_path,
                                                                             caplog):
    # 8 images in batches of 4: the run stops after 1 of the epoch's 2 batches
    first = train(compose_train(tmp_path / "a", [*TINY, "trainer.max_steps=1"]))
    state = torch.load(first["last_model_path"], weights_only=True)["callbacks"]["ResumeState"]
    assert state["loader"]["batches"] == 1 and state["loader"]["samples"] == 4
    assert state["loader"]["batch_size"] == 4
    with pytest.warns(UserWarning, match=r"data.batch_size 4 -> 2"), \
            caplog.at_level("INFO", logger="remat.callbacks.resume"):
        train(compose_train(tmp_path / "b", [*TINY, "data.batch_size=2", "trainer.max_steps=2",
                                             f"ckpt_path={first['last_model_path']}"]))
    assert "skipping the 1 batches (4 samples)" in caplog.text


def test_tiny_real_kvasir_run(tmp_path, kvasir_root):
    cfg = compose_train(tmp_path, [
        "experiment=kvasir_unet", f"data.root={kvasir_root}", "data.image_size=64",
        "data.limit_train=8", "data.limit_val=4", "data.batch_size=4", "strategy=sqrtn",
        *TINY_TRAINER,
    ])
    summary = train(cfg)
    assert summary["status"] == "completed"
    assert summary["global_step"] == 2
    assert summary["image_size"] == 64
    assert 0.0 <= summary["metrics"]["val/dice"] <= 1.0
    assert summary["strategy_report"]["segments"]["encoder.layer3"] == [[0, 2], [2, 4], [4, 6]]


@pytest.mark.parametrize("value", [0, -1])
def test_accumulate_grad_batches_below_one_is_rejected(tmp_path, value):
    with pytest.raises(ValueError, match=f"must be an integer >= 1.*got {value}"):
        train(compose_train(tmp_path, [*TINY, f"accumulate_grad_batches={value}"]))


def test_unknown_precision_is_rejected_and_the_run_records_it(tmp_path):
    with pytest.raises(ValueError, match="precision='fp8'.*32-true, bf16-mixed, 16-mixed"):
        train(compose_train(tmp_path, [*TINY, "strategy=sqrtn", "precision=fp8"]))
    summary = _summary(tmp_path)
    assert summary["status"] == "failed" and "fp8" in summary["error"]
    assert summary["strategy"] == "sqrtn"


def test_unknown_stage_names_close_matches_and_run_records_failure(tmp_path):
    cfg = compose_train(tmp_path, [*TINY, "strategy=sqrtn", "model.stages=[encoder.layr1]"])
    with pytest.raises(InstantiationException) as err:
        train(cfg)
    assert isinstance(err.value.__cause__, StageError) or "StageError" in str(err.value)
    assert "encoder.layr1" in str(err.value) and "encoder.layer1" in str(err.value)
    assert "model.stages=['encoder.layr1']" in str(err.value)  # the config key, not just `model`
    summary = _summary(tmp_path)
    assert summary["status"] == "failed" and "encoder.layr1" in summary["error"]


def test_missing_kvasir_root_says_what_layout_is_expected(tmp_path):
    cfg = compose_train(tmp_path, [*TINY_TRAINER, "data=kvasir_seg",
                                   f"data.root={tmp_path / 'nope'}"])
    with pytest.raises(FileNotFoundError, match="images/"):
        train(cfg)


def test_a_missing_checkpoint_is_named_before_the_data_is_read(tmp_path):
    """``ckpt_path`` of a file that is not there stops the run before the data check, which
    decodes every file (minutes on a large folder): here the data root does not even exist,
    and the error is the checkpoint's."""
    cfg = compose_train(tmp_path / "run", [*TINY_TRAINER, "data=kvasir_seg",
                                           f"data.root={tmp_path / 'nope'}",
                                           f"ckpt_path={tmp_path / 'gone.ckpt'}"])
    with pytest.raises(FileNotFoundError, match=r"ckpt_path=.*gone.ckpt: no such file"):
        train(cfg)


@pytest.mark.slow  # > 5 s on 2 cores and not the only proof: make test-all
def test_compile_strategy_trains_and_its_peak_comes_from_the_profiler(tmp_path):
    summary = train(compose_train(tmp_path, [*TINY, "strategy=compile",
                                             "strategy.backend=aot_eager"]))
    assert summary["status"] == "completed" and summary["strategy"] == "compile"
    assert summary["peak_memory_bytes"] > 0 and summary["peak_memory_note"] is None
    assert summary["peak_memory_measured"]["method"] == "allocator"


def test_gpt_model_with_image_data_names_the_mismatch(tmp_path):
    match = (r"kinds do not match: model=gpt_tiny is a sequence model but data=synthetic_seg "
             r"gives segmentation batches; pick data=tinyshakespeare or enwik8")
    with pytest.raises(ValueError, match=match):
        train(compose_train(tmp_path, [*TINY, "model=gpt_tiny"]))
    summary = _summary(tmp_path)  # refused before the Trainer was even built
    assert summary["status"] == "failed" and "global_step" not in summary
    assert "kinds do not match" in summary["error"]
    # the batch-level check (any other entry point) gives the text-data hint to a GPT too
    with pytest.raises(KeyError, match=r"sequence models: data=tinyshakespeare or enwik8"):
        require_keys({"image": 0, "mask": 0}, ("tokens",), "SequenceModule")


def test_a_sequence_model_monitors_its_own_val_loss(tmp_path, shakespeare_root):
    """``python train.py model=gpt_tiny data=tinyshakespeare``: the model config chooses its
    monitor (val/loss, min), so the run passes the first validation's monitor check (with
    train.yaml's val/dice it stopped there) and keeps its best checkpoint by val/loss."""
    cfg = compose_train(tmp_path, [*TINY_TRAINER, "model=gpt_tiny", "data=tinyshakespeare",
                                   f"data.root={shakespeare_root}", "data.block_size=32",
                                   "data.batch_size=4", "data.train_windows=8",
                                   "data.val_windows=2", "model.sample_tokens=2"])
    assert (cfg.monitor, cfg.monitor_mode) == ("val/loss", "min")
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["monitor"] == "val/loss"
    assert 0 < summary["best_model_score"] < 10  # nats per character of a 65-symbol set


def test_unet_with_text_data_names_model_and_data(tmp_path, shakespeare_root):
    cfg = compose_train(tmp_path, [*TINY_TRAINER, "data=tinyshakespeare",
                                   f"data.root={shakespeare_root}"])
    with pytest.raises(ValueError, match=r"kinds do not match: model=unet_resnet18 is a "
                                         r"segmentation model but data=tinyshakespeare"):
        train(cfg)


def test_binary_model_on_multiclass_data_fails_before_training(tmp_path, dubai_root):
    cfg = compose_train(tmp_path, [*TINY_TRAINER, "data=dubai_aerial", f"data.root={dubai_root}",
                                   "data.patch_size=64"])
    with pytest.raises(ValueError, match=r"model.num_classes=1 but data=dubai_aerial serves 6 "
                                         r"classes.*set model.num_classes=6"):
        train(cfg)
    assert "global_step" not in _summary(tmp_path)  # before the Trainer was built


def test_rgb_model_on_grey_images_names_in_channels(tmp_path, isbi_root):
    cfg = compose_train(tmp_path, [*TINY_TRAINER, "data=isbi2012", f"data.root={isbi_root}",
                                   "data.image_mode=grey"])
    with pytest.raises(ValueError, match=r"model.in_channels=3 but data=isbi2012 serves 1 "
                                         r"image channels"):
        train(cfg)


def test_monitor_key_not_logged_fails_before_training(tmp_path):
    """A segmentation model knows its validation keys: a monitor typo stops the run before
    the Trainer, naming the keys it logs."""
    cfg = compose_train(tmp_path, [*TINY, "monitor=val/dcie"])
    with pytest.raises(ValueError, match=r"monitor=val/dcie is not among.*val/dice.*val/iou"):
        train(cfg)
    summary = _summary(tmp_path)
    assert summary["status"] == "failed" and "global_step" not in summary  # no Trainer ran


SEQUENCE = ["model=gpt_tiny", "data=tinyshakespeare", "data.block_size=32", "data.batch_size=4",
            "data.train_windows=8", "data.val_windows=2", "model.sample_tokens=2"]


def test_monitor_key_not_logged_fails_at_the_first_validation(tmp_path, shakespeare_root):
    """A model without validation_keys() (the sequence models): the sanity check's
    validation catches the typo."""
    cfg = compose_train(tmp_path, [*TINY_TRAINER, *SEQUENCE, f"data.root={shakespeare_root}",
                                   "monitor=val/lss"])
    with pytest.raises(ValueError, match=r"monitor=val/lss is not among.*val/loss"):
        train(cfg)
    assert _summary(tmp_path)["global_step"] == 0  # the sanity check caught it


def test_monitor_key_checked_without_sanity_check(tmp_path, shakespeare_root):
    cfg = compose_train(tmp_path, [*TINY_TRAINER, *SEQUENCE, f"data.root={shakespeare_root}",
                                   "monitor=val/lss", "+trainer.num_sanity_val_steps=0"])
    with pytest.raises(ValueError, match=r"monitor=val/lss is not among"):
        train(cfg)
    assert _summary(tmp_path)["global_step"] > 0  # after the first epoch's validation


def test_a_training_metric_is_a_valid_monitor(tmp_path):
    # train/ keys do not exist yet at the sanity check; only val/ keys are checked there
    train(compose_train(tmp_path, [*TINY, "monitor=train/loss_epoch", "monitor_mode=min"]))
    assert _summary(tmp_path)["status"] == "completed"


def test_non_integer_seed_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"seed must be an integer.*got 'abc'"):
        train(compose_train(tmp_path, [*TINY, "seed=abc"]))


def test_resuming_from_another_models_checkpoint_gives_one_clear_message(tmp_path):
    other = instantiate(compose_train(tmp_path, TINY).model)  # unet_resnet18
    with_hparams, weights_only = tmp_path / "r18.ckpt", tmp_path / "r18_weights.ckpt"
    torch.save({"state_dict": other.state_dict(), "hyper_parameters": dict(other.hparams)},
               with_hparams)
    torch.save({"state_dict": other.state_dict()}, weights_only)
    overrides = [*TINY, "model=unet_resnet34"]
    with pytest.raises(ValueError, match=r"ckpt_path=.*r18.ckpt was trained with another model"
                                         r".*model.encoder_name: checkpoint 'resnet18', "
                                         r"config 'resnet34'"):
        train(compose_train(tmp_path / "a", [*overrides, f"ckpt_path={with_hparams}"]))
    with pytest.raises(ValueError, match=r"r18_weights.ckpt does not fit the configured model: "
                                         r"\d+ missing keys \['net.encoder.layer1.2"):
        train(compose_train(tmp_path / "b", [*overrides, f"ckpt_path={weights_only}"]))


def test_resuming_with_more_epochs_trains_on_the_longer_schedule(tmp_path, caplog):
    """Training further (README): the restored T_max=1 cosine had reached 0, so the added
    epoch trained at learning rate 0; it follows the 2-epoch cosine (half the base rate)."""
    with caplog.at_level(logging.INFO):
        first = train(compose_train(tmp_path / "a", TINY))
    # the run's checkpoint writes (one a step is allowed) gave Lightning's info line each
    assert "wrote " in caplog.text and "weights_only" not in caplog.text
    with caplog.at_level(logging.INFO, logger="remat"):
        done = train(compose_train(tmp_path / "b", [*TINY, "trainer.max_epochs=2",
                                                    f"ckpt_path={first['last_model_path']}"]))
    assert ("the LR schedule restored from the checkpoint ended after T_max=1 epochs; "
            "model.scheduler.T_max=2 extends it: epoch 1 trains at lr 0.0005 (was 0)"
            in caplog.text)
    assert done["status"] == "completed" and done["epochs"] == 2


def test_summary_holds_estimate_throughput_and_epoch_peaks(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="remat"):
        summary = train(compose_train(tmp_path, [*TINY, "strategy=sqrtn",
                                                 "trainer.max_epochs=2",
                                                 "callbacks.run_report.estimate=true",
                                                 "trainer.log_every_n_steps=1"]))
    est, measured = summary["memory_estimate"], summary["peak_memory_bytes"]
    # the start-of-run line: tensor bytes, the parts alive at the peak, none under 1 MiB
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("estimated peak of one training step"))
    assert f": {format_bytes(est['peak_bytes'])} of tensors (alive at that moment: " in line
    listed = line.split("moment: ", 1)[1].split(";")[0]
    parts = re.findall(r"(\w+) ([\d.]+) (B|KiB|MiB|GiB)", listed)
    assert parts and all(unit in ("MiB", "GiB") for _, _, unit in parts)
    assert {name for name, _, _ in parts} == {
        k for k, v in est["categories"].items() if k != "total" and v >= 2**20}
    assert est["strategy"] == "sqrtn" and (est["batch_size"], est["size"]) == (4, 64)
    # the prediction at start against the tracked Lightning batches (same step, same sizes)
    assert abs(est["peak_bytes"] - measured) <= 0.10 * measured
    assert est["categories"]["optimizer_state"] > 0 and est["categories"]["activations"] > 0
    # 2 batches per epoch: both tracked in epoch 0; epoch 1 untracked on CPU
    assert summary["peak_memory_per_epoch_bytes"] == [measured, None]
    assert summary["samples_per_s"] == pytest.approx(4000.0 / summary["median_step_ms"])
    assert summary["pixels_per_s"] == pytest.approx(summary["samples_per_s"] * 64 * 64)
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    logged = {k for row in rows for k, v in row.items() if v}
    assert {"mem/estimate_bytes", "mem/step_peak_bytes", "mem/epoch_peak_bytes",
            "time/step_ms", "time/samples_per_s", "time/pixels_per_s"} <= logged


def test_estimate_at_start_traces_a_ready_net(tmp_path):
    # the ViT segmenter is passed to SegmentationModule as a ready net (not in its
    # hyperparameters, which alone would rebuild an smp U-Net): the estimate traces a
    # structural copy of the run's module instead
    summary = train(compose_train(tmp_path, [*TINY, "model=vit_seg_tiny", "trainer.max_steps=2",
                                             "callbacks.run_report.estimate=true"]))
    est, measured = summary["memory_estimate"], summary["peak_memory_bytes"]
    assert est is not None, summary["memory_estimate_note"]
    assert abs(est["peak_bytes"] - measured) <= 0.10 * measured, (est, measured)


def test_sigterm_before_the_trainer_starts_writes_an_interrupted_summary(tmp_path):
    """SIGTERM while a run plans or builds (here: while its callbacks are built) stops it
    with ``status: interrupted`` and exit code 143; Python's default ended the process
    with no summary.json."""
    with pytest.raises(SystemExit) as stopped:
        train(compose_train(tmp_path, [*TINY, "+callbacks.kill._target_="
                                              "tests.helpers.SigtermWhenBuilt"]))
    assert stopped.value.code == 143
    summary = _summary(tmp_path)
    assert summary["status"] == "interrupted" and summary["strategy_report"] is None
    assert summary["signal"] == "SIGTERM" and summary["error"] == "stopped by SIGTERM"
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_a_resume_that_fails_before_training_keeps_the_runs_files(tmp_path):
    """A resume into a finished run's folder that fails at its config (a bad precision)
    leaves the run's files as they were and writes its record into its attempt folder; a
    later resume with the right config still finds the folder's run."""
    done = train(compose_train(tmp_path, TINY))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises(ValueError, match="precision"):
        train(compose_train(tmp_path, [*TINY, "precision=bogus", "ckpt_path=last"]))
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"
             and "resumes" not in p.relative_to(tmp_path).parts}
    assert after == before
    kept = _summary(tmp_path)
    assert kept["status"] == "completed" and kept["global_step"] == done["global_step"] == 2
    (attempt,) = (tmp_path / "resumes").iterdir()
    record = json.loads((attempt / "summary.json").read_text())
    assert record["status"] == "failed" and "precision" in record["error"]
    assert not (attempt / "overrides.yaml").exists()  # it never trained: not a resume to follow


@pytest.mark.parametrize(("after", "steps"), [(2, 4 + 8), (8, 4 + 2)])
def test_resume_from_an_epoch_end_with_another_batch_size_starts_the_next_epoch(
        tmp_path, after, steps):
    """An epoch of 4 batches of 4, then a resume at batch ``after`` for one more epoch: the
    finished epoch is not trained again (at batch 2 Lightning compared its 4 restored
    batches with the new loader's 8 and trained 4 more in epoch 0: 16 steps, not 12)."""
    base = ["data.image_size=32", "data.num_train=16", "data.num_val=2",
            "model.arch_kwargs.decoder_channels=[16,16,8,8,8]", *TINY[4:]]
    first = train(compose_train(tmp_path, [*base, "data.batch_size=4"]))
    assert first["global_step"] == 4
    resumed = train(compose_train(tmp_path, [*base, f"data.batch_size={after}",
                                             "trainer.max_epochs=2", "ckpt_path=last"]))
    assert resumed["global_step"] == steps
    assert resumed["resumed_from"] == str(tmp_path / "checkpoints" / "last.ckpt")  # not "last"


def test_resume_from_an_epoch_end_under_limit_train_batches_counts_the_limited_epoch(
        tmp_path, caplog):
    """An epoch limited to 2 of the loader's 4 batches is whole: the resume says nothing of
    an "old size" (it logged "ended after 2 batches of the old size; counted as the 4 of
    this loader", with nothing changed between the runs) and trains one more epoch of 2."""
    base = ["data.image_size=32", "data.num_train=16", "data.num_val=2", "data.batch_size=4",
            "+trainer.limit_train_batches=2",
            "model.arch_kwargs.decoder_channels=[16,16,8,8,8]", *TINY[4:]]
    assert train(compose_train(tmp_path, base))["global_step"] == 2
    with caplog.at_level("INFO", logger="remat"):
        resumed = train(compose_train(tmp_path, [*base, "trainer.max_epochs=2",
                                                 "ckpt_path=last"]))
    assert resumed["global_step"] == 4
    assert "of the old size" not in caplog.text


def test_ckpt_path_last_without_a_checkpoint_is_a_new_run_said_so(tmp_path, caplog):
    """``ckpt_path=last`` where the folder holds no checkpoint starts from scratch, as
    Lightning does (a requeued job's first start), and says so; its summary recorded
    ``resumed_from: "last"`` for a run that resumed nothing."""
    base = ["data.image_size=32", "data.num_train=4", "data.num_val=2",
            "model.arch_kwargs.decoder_channels=[16,16,8,8,8]", *TINY[4:]]
    with caplog.at_level("WARNING", logger="remat"):
        done = train(compose_train(tmp_path, [*base, "data.batch_size=4", "ckpt_path=last"]))
    assert done["status"] == "completed" and done["global_step"] == 1
    assert done["resumed_from"] is None
    assert (f"ckpt_path=last: no last.ckpt in {tmp_path / 'checkpoints'}, so this is a new "
            "run from scratch") in caplog.text


def test_the_progress_bar_switch_turns_off_the_default_callbacks_bar(tmp_path):
    # the default callback group holds a RichProgressBar: with the switch off Lightning
    # refused the pair ("configured with enable_progress_bar=False but found RichProgressBar")
    summary = train(compose_train(tmp_path, [
        "data.image_size=32", "data.num_train=4", "data.num_val=2", "data.batch_size=2",
        "trainer.max_steps=1", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false",
        "callbacks.run_report.estimate=false"]))
    assert summary["status"] == "completed" and summary["global_step"] == 1


def test_compile_true_trains_the_compiled_network_and_measures_it(tmp_path, monkeypatch):
    """compile=true compiles the wrapped network in place (aot_eager here: the same
    partitioner as inductor, no code generation); the losses are the eager run's, the peak
    is measured on the compiled step (torch.profiler on CPU) and summary.json says what
    was compiled."""
    import remat.compiling

    monkeypatch.setattr(remat.compiling, "TRAINING_BACKEND", "aot_eager")
    torch._dynamo.reset()
    overrides = [*TINY, "strategy=sqrtn", "trainer.max_steps=2"]
    eager = train(compose_train(tmp_path / "eager", overrides))
    compiled = train(compose_train(tmp_path / "compiled", [*overrides, "compile=true",
                                                           "compile_options={}",
                                                           "compile_memory_budget=0.5"]))
    assert eager["compiled"] is None
    assert compiled["compiled"]["backend"] == "aot_eager" and compiled["compiled"]["graphs"] >= 1
    # the plan's segments and the partitioner's budget together: the same losses
    assert compiled["compiled"]["memory_budget"] == 0.5
    assert compiled["status"] == "completed" and compiled["peak_memory_bytes"] > 0
    assert compiled["metrics"]["train/loss"] == pytest.approx(eager["metrics"]["train/loss"],
                                                              rel=1e-5)
    # parameter names unchanged: the compiled run's checkpoint loads into the eager model
    ckpt = torch.load(compiled["last_model_path"], weights_only=True)
    assert set(ckpt["state_dict"]) == set(torch.load(eager["last_model_path"],
                                                     weights_only=True)["state_dict"])


def test_compile_options_without_compile_are_ignored_with_a_warning(tmp_path, caplog):
    from remat.config import check_top_level

    cfg = compose_train(tmp_path, [*TINY, "compile_options={max_autotune: true}"])
    with caplog.at_level("WARNING", logger="remat"):
        check_top_level(cfg)
    assert "compile_options is ignored: compile=false" in caplog.text


@pytest.mark.parametrize("overrides,match", [
    (["compile=yes"], "compile must be true or false"),
    (["compile=true", "strategy=compile"], "compiles its stages itself"),
    (["compile=true", "compile_options={layout_optimisation: false}"],
     "compile_options.layout_optimisation: not an inductor setting"),
    (["compile=true", "compile_memory_budget=1.5"],
     r"compile_memory_budget must be a number in \[0, 1\].*got 1.5"),
    (["compile_memory_budget=half"],  # checked with compile=false too (then ignored)
     r"compile_memory_budget must be a number in \[0, 1\].*got 'half'"),
    # Lightning's own messages came through Hydra's instantiate, naming only "trainer"
    (["monitor_mode=up"], r"monitor_mode must be min or max.*got 'up'"),
    (["trainer.max_epochs=-5"], r"trainer.max_epochs must be an integer >= -1.*got -5"),
    (["trainer.max_steps=abc"], r"trainer.max_steps must be an integer >= -1.*got 'abc'"),
    # Lightning ran no batch and the summary said "completed"
    (["trainer.max_steps=0"], r"trainer.max_steps=0 trains nothing"),
    # trained fp64 while the estimate and the summary's report said 32-true
    (["trainer.precision=64"], r"trainer.precision=64 differs from precision='32-true'"),
    (["trainer.accumulate_grad_batches=4"],
     r"trainer.accumulate_grad_batches=4 differs from accumulate_grad_batches=1"),
    (["+trainer.max_step=5"], r"trainer.max_step \(did you mean max_steps.*not an argument "
                              r"of lightning.Trainer"),
])
def test_bad_compile_settings_name_the_key(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        train(compose_train(tmp_path, [*TINY, *overrides]))


def test_a_partitioner_budget_is_refused_on_a_network_that_draws_random_numbers():
    """Below 1 the partitioner may recompute dropout in the backward with other masks (a
    ViT with drop-path: gradients 1.9-2.6 relative error); remat's segments keep theirs."""
    from remat.compiling import refuse_random_ops_recomputed

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"compile_memory_budget=0.5 with modules that draw "
                                         r"random numbers \(1\).*pytorch/pytorch#190758"):
        refuse_random_ops_recomputed(net, 0.5, "compile_memory_budget")
    for budget in (None, 1.0):  # the partitioner's default recomputes no random op
        refuse_random_ops_recomputed(net, budget, "compile_memory_budget")
    net[1].p = 0.0
    refuse_random_ops_recomputed(net, 0.3, "compile_memory_budget")


def test_lora_on_a_model_without_adapters_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"model.lora: SegmentationModule .*does not train "
                                         r"LoRA adapters.*model=hf_llama"):
        train(compose_train(tmp_path, [*TINY, "+model.lora={r: 4, alpha: 8}"]))


@pytest.mark.parametrize("setting, message", [
    ("model.optimizer.lr=abc", r"model.optimizer: TypeError: '<=' not supported"),
    ("model.optimizer.lr=-1", r"model.optimizer: ValueError: Invalid learning rate: -1"),
])
def test_a_bad_optimizer_setting_is_named_before_training(tmp_path, setting, message):
    """It failed inside Lightning's configure_optimizers, with the optimizer's traceback."""
    with pytest.raises(ValueError, match=message):
        train(compose_train(tmp_path, [*TINY, setting]))
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_building_a_budget_strategy_leaves_the_run_s_random_numbers_alone(tmp_path,
                                                                        monkeypatch):
    """Building a budget strategy and planning it before the model is built (on a machine
    without a CPU calibration yet: measured then, and models built and run): the weights
    the run then draws are those of the same run without a budget."""
    from remat.planner import devices
    from remat.train import _strategy

    monkeypatch.setenv(devices.CACHE_ENV, str(tmp_path / "cache"))
    devices.calibrate_cpu.cache_clear()
    cfg = compose_train(tmp_path, [*TINY, "strategy=budget", "strategy.memory=0.9"])
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    _strategy(cfg)
    assert torch.equal(torch.rand(4), expected)
    devices.calibrate_cpu.cache_clear()
