"""A network given only by ``_target_`` (model=custom): its stages found by model.stages=auto,
trained under sqrtn and budget, and the mistakes a user makes with it named at build."""

from __future__ import annotations

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from remat.estimate import estimate
from remat.strategies import StageError
from remat.train import train
from tests.helpers import TINY, compose_app, compose_config, compose_train, entry_exit

PLAIN = ["model=custom", "model.net._target_=tests.models.nets.TinyUNet", "+model.net.width=8"]
MONAI = ["model=custom", "model.net._target_=monai.networks.nets.UNet",
         "+model.net.spatial_dims=2", "+model.net.in_channels=3", "+model.net.out_channels=1",
         "+model.net.channels=[8,16,32]", "+model.net.strides=[2,2]",
         "+model.net.num_res_units=1"]
# plain SGD: activations, not the optimizer state, set the peak
SGD = ["model.optimizer._target_=torch.optim.SGD", "~model.optimizer.weight_decay"]


def built(tmp_path, overrides):
    cfg = compose_train(tmp_path, [*TINY, *overrides])
    return instantiate(cfg.model, strategy=instantiate(cfg.strategy))


@pytest.mark.parametrize("net,units", [
    (PLAIN, ["down1", "down2", "fuse"]),
    (MONAI, ["model"]),  # MONAI's UNet is one nested nn.Sequential
])
def test_auto_stages_find_the_units_and_sqrtn_trains(tmp_path, net, units):
    model = built(tmp_path / "build", [*net, "strategy=sqrtn"])
    assert model.strategy_report.stages == units and model.strategy_report.wrapped
    summary = train(compose_train(tmp_path / "run", [*TINY, *net, "strategy=sqrtn"]))
    assert summary["status"] == "completed" and summary["global_step"] == 2
    assert summary["strategy_report"]["stages"] == units


def test_sqrtn_on_auto_stages_gives_none_s_gradients(tmp_path):
    torch.manual_seed(0)
    none = built(tmp_path / "a", [*PLAIN, "strategy=none"])
    sqrtn = built(tmp_path / "b", [*PLAIN, "strategy=full"])
    sqrtn.load_state_dict(none.state_dict())
    batch = none.example_batch(2, 32, torch.Generator().manual_seed(1))
    for model in (none, sqrtn):
        model.train()
        model.training_loss(batch).backward()
    for (name, a), (_, b) in zip(none.named_parameters(), sqrtn.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("net", [PLAIN, pytest.param(MONAI, marks=pytest.mark.slow)],
                         ids=["plain", "monai"])
def test_budget_plans_a_net_given_by_target(tmp_path, net):
    """A budget below none's predicted peak makes the plan recompute some unit."""
    none = estimate(compose_config("estimate", tmp_path / "est",
                                   [*net, *SGD, "data.image_size=64", "data.batch_size=4",
                                    "device=cpu"])).peak_bytes
    budget = int(0.93 * none)
    summary = train(compose_train(tmp_path / "run", [
        *TINY, *net, *SGD, "strategy=budget", f"strategy.memory={budget}",
        "strategy.device=cpu", "strategy.max_traces=2", "strategy.margin=0.0"]))
    plan = summary["plan"]
    assert summary["status"] == "completed" and plan["predicted_peak_bytes"] <= budget
    assert any(s["mode"] != "keep" for u in plan["units"] for s in u["segments"])
    assert abs(plan["measured_over_predicted"] - 1) <= 0.03


def test_budget_plans_a_net_that_is_one_sequential_of_layers(tmp_path):
    """No chain or block inside it: the planner refused it ("no unit the planner can
    wrap") though model.stages=auto takes the net itself and sqrtn trains it; the net is
    now the planner's chain (and strategy.units=[""] named a '.0' path)."""
    net = ["model=custom", "model.net._target_=tests.models.nets.layer_chain"]
    none = estimate(compose_config("estimate", tmp_path / "est",
                                   [*net, *SGD, "data.image_size=64", "data.batch_size=4",
                                    "device=cpu"])).peak_bytes
    summary = train(compose_train(tmp_path / "run", [
        *TINY, *net, *SGD, "strategy=budget", f"strategy.memory={int(0.97 * none)}",
        "strategy.device=cpu", "strategy.max_traces=2", "strategy.margin=0.0"]))
    plan = summary["plan"]
    assert summary["status"] == "completed" and [u["path"] for u in plan["units"]] == [""]
    assert any(s["mode"] == "recompute" for s in plan["units"][0]["segments"])
    assert abs(plan["measured_over_predicted"] - 1) <= 0.03


def test_budget_plans_a_chain_of_blocks_that_write_their_input(tmp_path):
    """Blocks with parameters that write their input in place (``x += self.pos``) keep a
    copy of it when recomputed, and the planner counts the copy: it answered "no plan fits"
    to a budget `full` meets (60 MiB; full 44.2 MiB measured), having modelled every such
    segment as joined. Planned for 60 MiB: predicted the measured peak to the byte."""
    net = ["model=custom", "model.net._target_=tests.models.nets.AddPosNet",
           "+model.net.width=16", "model.stages=[blocks]"]
    shape = ["data.image_size=128", "data.batch_size=4", "data.num_train=8", "data.num_val=4"]
    summary = train(compose_train(tmp_path / "run", [
        *TINY, *net, *shape, "trainer.max_steps=2", "strategy=budget", "strategy.memory=60MiB",
        "strategy.device=cpu"]))
    plan = summary["plan"]
    assert summary["status"] == "completed" and plan["predicted_peak_bytes"] <= 60 * 2**20
    assert any(s["mode"] == "recompute" for u in plan["units"] for s in u["segments"])
    assert abs(plan["measured_over_predicted"] - 1) <= 0.01


# torchvision's segmentation models return {"out": logits}; its LRASPP is the smallest, and
# its MobileNetV3 backbone is a chain of in-place Hardswish/ReLU blocks
TORCHVISION = ["model=custom",
               "model.net._target_=torchvision.models.segmentation.lraspp_mobilenet_v3_large",
               "+model.net.weights=null", "+model.net.weights_backbone=null",
               "+model.net.num_classes=1"]
# Hugging Face's SegFormer returns a SemanticSegmenterOutput whose logits are 1/4 of the
# input's side; its config built by Hydra too (a tiny one)
SEGFORMER = ["model=custom", "model.net._target_=transformers.SegformerForSemanticSegmentation",
             "+model.net.config._target_=transformers.SegformerConfig",
             "+model.net.config.num_labels=1", "+model.net.config.depths=[1,1,1,1]",
             "+model.net.config.hidden_sizes=[8,16,32,64]",
             "+model.net.config.decoder_hidden_size=16"]


@pytest.mark.parametrize("net,strategy", [(TORCHVISION, "full"), (SEGFORMER, "sqrtn")],
                         ids=["torchvision_lraspp", "hf_segformer"])
def test_library_segmentation_nets_train_with_none_s_gradients(tmp_path, net, strategy):
    """Their outputs' logits (a dict's ``out``, a ``ModelOutput``'s ``logits`` resized to
    the input's size) are the module's output; the strategy on auto stages changes no
    gradient."""
    torch.manual_seed(0)
    none = built(tmp_path / "a", [*net, "strategy=none"])
    other = built(tmp_path / "b", [*net, f"strategy={strategy}"])
    other.load_state_dict(none.state_dict())
    assert other.strategy_report.wrapped
    batch = none.example_batch(2, 64, torch.Generator().manual_seed(1))
    for model in (none, other):
        model.train()
        assert model(batch["image"]).shape == (2, 1, 64, 64)
        torch.manual_seed(2)
        model.training_loss(batch).backward()
    for (name, a), (_, b) in zip(none.named_parameters(), other.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_smaller_logits_are_resized_bilinearly_and_said_at_build(tmp_path, caplog):
    with caplog.at_level("INFO", logger="remat.models.segmentation"):
        model = built(tmp_path, SEGFORMER).eval()
    assert ("returns logits of spatial size 16x16 for a 64x64 input: resized to the input's "
            "size (bilinear)") in caplog.text
    images = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        raw = model.net(images).logits
        expected = torch.nn.functional.interpolate(raw, size=(64, 64), mode="bilinear",
                                                   align_corners=False)
        torch.testing.assert_close(model(images), expected, rtol=0, atol=0)


def test_output_channels_that_differ_from_num_classes_fail_at_build(tmp_path):
    with pytest.raises(InstantiationException) as info:
        built(tmp_path, [*PLAIN, "+model.net.out_channels=3"])
    message = str(info.value.__cause__ or info.value)
    assert ("model.net (tests.models.nets.TinyUNet) returns logits of shape (1, 3, 64, 64) for "
            "a [1, 3, 64, 64] input, but model.num_classes=1 (1 = binary) needs [1, 1, 64, 64]; "
            "build the net with 1 output channel(s) (its out_channels or classes argument), or, "
            "if the masks hold 3 classes, set model.num_classes=3 (data=folder: "
            "data.num_classes=3)") in message
    with pytest.raises(InstantiationException, match="returns tuple, not a tensor"):
        built(tmp_path, ["model=custom", "model.net._target_=tests.models.nets.ReturnsTuple"])
    with pytest.raises(InstantiationException) as info:
        built(tmp_path, ["model=custom", "model.net._target_=tests.models.nets.ReturnsDict"])
    assert ("returns dict with keys ['aux', 'main'], not a tensor; SegmentationModule needs "
            "logits [B, model.num_classes, H, W]: a tensor, a mapping with one of the keys "
            "['out', 'logits']") in str(info.value.__cause__ or info.value)


def test_a_stage_the_forward_never_calls_ends_the_run_in_one_line(tmp_path, capsys):
    """Found after the first step (Lightning's loop): still one ``error:`` line, as for
    errors found at set-up, with the override that lists the modules the forward calls."""
    cfg = compose_app("train", tmp_path, [*TINY, "model=custom", "strategy=full",
                                          "model.net._target_=tests.models.nets.RunsChildren"])
    assert entry_exit("train", cfg) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: strategy 'full' wrapped down2, but the training forward "
                              "never called it")
    assert err[-1].endswith("(train.py: model.stages=[down2.*], or name the modules the "
                            "forward calls)")
    assert not any("Traceback" in line for line in err)


def test_model_custom_without_a_target_says_what_to_give(tmp_path, capsys):
    """Omegaconf said only "Missing mandatory value: model.net._target_"."""
    assert entry_exit("train", compose_app("train", tmp_path, [*TINY, "model=custom"])) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: model.net._target_ must be set: the class (or function) that builds your "
        "network, e.g. model.net._target_=my_pkg.nets.MyUNet; its arguments go under "
        "+model.net.<name>=<value>")


def test_a_strategy_that_would_wrap_nothing_is_refused_naming_the_modules(tmp_path):
    with pytest.raises(InstantiationException) as info:
        built(tmp_path, [*PLAIN, "strategy=sqrtn", "model.stages=[]"])
    error = info.value.__cause__
    assert isinstance(error, StageError)
    assert ("strategy=sqrtn would wrap nothing: model.stages is empty, so this run would "
            "checkpoint no activations. List the modules of TinyUNet to recompute") in str(error)
    assert "down1 (ConvBlock), down2 (ConvBlock), fuse (ConvBlock)" in str(error)
    assert built(tmp_path, [*PLAIN, "strategy=none", "model.stages=[]"]).strategy_report.wrapped \
        == []


@pytest.mark.parametrize("target,why", [
    # the user's package is not on PYTHONPATH: Hydra said only "Error locating target"
    ("mypkg_absent.nets.MyNet", "module 'mypkg_absent' is not importable: the folder "
     "holding mypkg_absent/ (or mypkg_absent.py) must be on PYTHONPATH (PYTHONPATH=/path/to/"
     "that/folder python train.py ...), or install its project (pip install -e <project>)"),
    ("tests.models.nets.NoSuchNet", "module 'tests.models.nets' has no attribute 'NoSuchNet'; "
     "check the spelling of the class or function"),
    ("tests.models.needs_missing.Net", "module 'tests.models.needs_missing' imports "
     "'remat_test_missing_dependency', which is not installed "
     "(pip install remat_test_missing_dependency)"),
])
def test_a_net_that_cannot_be_imported_names_the_key_and_pythonpath(tmp_path, capsys, target,
                                                                    why):
    from remat.build import build_from_config
    from remat.errors import run_entry

    (tmp_path / "tests" / "models").mkdir(parents=True)  # a module whose own import fails
    (tmp_path / "tests" / "models" / "needs_missing.py").write_text(
        "import remat_test_missing_dependency\n")
    cfg = compose_train(tmp_path / "run", [*TINY, "model=custom", f"model.net._target_={target}"])
    with pytest.MonkeyPatch.context() as patch:
        import tests.models

        patch.setattr(tests.models, "__path__", [*tests.models.__path__,
                                                 str(tmp_path / "tests" / "models")])
        with pytest.raises(SystemExit):  # python train.py: one line, exit code 1
            run_entry(train, cfg)
        expected = f"error: model.net._target_={target} cannot be imported: {why}"
        assert capsys.readouterr().err.strip() == expected
        build, *_ = build_from_config(cfg)  # remat.plan, estimate, strategy=budget
        with pytest.raises(ImportError) as info:
            build()
    assert str(info.value) == expected.removeprefix("error: ")
    assert isinstance(info.value.__cause__, InstantiationException)  # Hydra's error chained


def test_a_network_that_is_itself_a_chain_is_the_stage_under_auto(tmp_path):
    # a network that is one nn.Sequential of blocks is that chain: auto took the chains inside
    # its blocks (lone conv, norm, activation), where full measured 1.43x none's peak
    from remat.measure import PeakMemory

    seq = ["model=custom", "model.net._target_=tests.models.nets.sequential_net",
           "+model.net.depth=6", "+model.net.width=16"]
    peaks, grads = {}, {}
    for name in ("none", "full", "sqrtn"):
        torch.manual_seed(0)
        model = built(tmp_path / name, [*seq, f"strategy={name}"])
        assert model.stage_paths == [""]
        batch = model.example_batch(4, 64, torch.Generator().manual_seed(1))
        model.train()
        with PeakMemory("cpu", modules=[model]) as peak:
            model.training_loss(batch).backward()
        peaks[name] = peak.peak_bytes
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
        if name != "none":
            assert model.strategy_report.wrapped[:2] == ["0", "1"]
            assert model.strategy_report.segments[""][0][0] == 0
    assert peaks["full"] < 0.8 * peaks["none"] and peaks["sqrtn"] < 0.8 * peaks["none"], peaks
    for name in ("full", "sqrtn"):
        torch.testing.assert_close(grads[name], grads["none"], rtol=1e-5, atol=1e-6)
    # the network named as a stage by hand, and beside another stage (it holds them all)
    assert built(tmp_path / "hand", [*seq, "strategy=sqrtn", 'model.stages=[""]']
                 ).strategy_report.stages == [""]
    with pytest.raises(InstantiationException, match=r"is the whole network, which holds "
                                                     r"every other stage \(0\)"):
        built(tmp_path / "both", [*seq, "strategy=sqrtn", 'model.stages=["", "0"]'])


def test_a_network_of_layers_only_is_refused_listing_its_layers_in_train_and_estimate(tmp_path):
    leaf = ["model=custom", "model.net._target_=tests.models.nets.LeafNet"]
    with pytest.raises(InstantiationException) as info:
        built(tmp_path / "a", [*leaf, "strategy=sqrtn"])
    message = str(info.value.__cause__)
    assert "model.stages=auto found no unit" in message
    assert "its modules: c1 (Conv2d), c2 (Conv2d), c3 (Conv2d)" in message
    assert "or model.stages=auto" not in message  # auto is what was set
    # remat.estimate raises the same error, not wrapped in the config group's
    with pytest.raises(StageError, match=r"^strategy=sqrtn would wrap nothing: model.stages="
                                         r"auto found no unit"):
        estimate(compose_config("estimate", tmp_path / "est", [
            *leaf, "strategy=sqrtn", "data.image_size=32", "data.batch_size=1", "device=cpu"]))
