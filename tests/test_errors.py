"""User mistakes end an entry point with one line, ``error: <what, and the fix>``, exit code
1, before Lightning starts; HYDRA_FULL_ERROR=1 shows the traceback."""

from __future__ import annotations

import pytest

from remat.errors import run_entry
from remat.train import train
from tests.data.test_folder import write_folder
from tests.helpers import REPO, TINY, TINY_TRAINER, compose_train, run_python


def one_line_error(capsys, cfg) -> str:
    with pytest.raises(SystemExit) as stop:
        run_entry(train, cfg)
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_a_folder_that_does_not_hold_the_layout(tmp_path, capsys):
    (tmp_path / "pictures").mkdir()
    err = one_line_error(capsys, compose_train(tmp_path / "run", [
        *TINY_TRAINER, "data=folder", f"data.root={tmp_path}"]))
    assert f"data.root={tmp_path} (image folder) does not hold that layout" in err
    assert len(err.splitlines()) == 1


def test_num_classes_that_do_not_match_the_data(tmp_path, capsys):
    write_folder(tmp_path / "d", n=3, encoding="index", classes=3)
    err = one_line_error(capsys, compose_train(tmp_path / "run", [
        *TINY_TRAINER, "data=folder", f"data.root={tmp_path / 'd'}", "data.num_classes=3",
        "data.mask_encoding=index", "model.num_classes=1", "data.patch_size=16"]))
    assert err == ("error: model.num_classes=1 but data=folder serves 3 classes (1 = binary); "
                   "set model.num_classes=3 (or pick data that matches model=unet_resnet18)")


def test_a_val_size_that_leaves_no_training_image(tmp_path, capsys, kvasir_root):
    err = one_line_error(capsys, compose_train(tmp_path, [
        *TINY_TRAINER, "data=kvasir_seg", f"data.root={kvasir_root}", "data.val_size=5000"]))
    assert err.startswith("error: data.val_size must be between 1 and 999 for 1000")


def test_a_missing_corpus(tmp_path, capsys):
    err = one_line_error(capsys, compose_train(tmp_path, [
        *TINY_TRAINER, "experiment=shakespeare_gpt", f"data.root={tmp_path / 'nowhere'}"]))
    assert "nowhere" in err and "input.txt" in err


@pytest.mark.parametrize("setting, said", [
    # a file dataset's size key is patch_size (Hydra's three lines named only 'data')
    ("+data.image_size=64", "error: data.image_size: remat.data.folder.FolderSegDataModule "
                            "takes no argument 'image_size'; did you mean data.patch_size,"),
    ("+data.pach_size=64", "did you mean data.patch_size"),
    ("+strategy.k=2", "error: strategy: remat.strategies.full.FullCheckpoint takes no arguments; "
                      "remove the strategy.<name> settings given"),
])
def test_an_argument_the_target_does_not_take_is_named_with_the_closest(
        tmp_path, capsys, setting, said):
    write_folder(tmp_path / "d", n=3)
    err = one_line_error(capsys, compose_train(tmp_path / "run", [
        *TINY_TRAINER, "data=folder", f"data.root={tmp_path / 'd'}", "strategy=full",
        setting]))
    assert said in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args, said", [
    (["data=folder", "data.root=x", "data.image_size=64"],
     "data.image_size: data=folder has no key 'image_size'; did you mean data.patch_size,"),
    (["experiment=kvasir_unet", "trainer.max_step=3"],
     "trainer.max_step: trainer=default has no key 'max_step'; did you mean "
     "trainer.max_steps,"),
    (["strategy=every_k", "strategy.kk=2"], "did you mean strategy.k?"),
    # a top-level misspelling with '+' composed, and trained at 32-true without a word
    (["+precison=bf16-mixed"], "+precison: not a key of the config, so nothing reads it; "
                               "did you mean precision=... (no '+')?"),
    (["+seeed=3"], "did you mean seed=..."),
])
def test_a_key_the_config_lacks_is_named_with_the_closest(args, said):
    """Hydra's four lines ("Could not override ... Key 'image_size' is not in struct")
    named the key but not the one meant (a file dataset's size is data.patch_size)."""
    from remat.errors import unknown_key

    message = unknown_key("train", args)
    assert said in message


@pytest.mark.parametrize("entry, args, choice", [
    ("train", [], "synthetic_seg"),
    ("plan", ["experiment=kvasir_unet"], "kvasir_seg"),
    ("estimate", ["experiment=kvasir_unet"], "kvasir_seg"),
])
def test_each_entry_point_names_a_key_its_config_lacks(entry, args, choice, monkeypatch,
                                                       capsys):
    module = __import__(f"remat.{entry}", fromlist=["main"])
    monkeypatch.setattr("sys.argv", [entry, *args, "data.imge_size=64"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 1
    assert capsys.readouterr().err.startswith(
        f"error: data.imge_size: data={choice} has no key 'imge_size'; did you mean "
        "data.image_size")


@pytest.mark.parametrize("entry, args, said", [
    # Hydra named the first alone, in its own four lines
    ("train", ["data.image_sise=32", "data.num_trian=4"],
     "data.image_sise: data=synthetic_seg has no key 'image_sise'; did you mean "
     "data.image_size"),
    ("train", ["data.image_sise=32", "data.num_trian=4"], "; data.num_trian: data="),
    ("train", ["-m", "trainer.max_step=1", "strategy=none,full"],  # a multirun's other keys
     "did you mean trainer.max_steps"),
    ("train", ["precison=bf16-mixed"], "precison: the train config has no key 'precison'; "
                                       "did you mean precision?"),
    # no trainer node on these entry points: the top-level key is meant
    ("estimate", ["trainer.precision=bf16-mixed"],
     "trainer.precision: the estimate config has no 'trainer' settings; did you mean "
     "precision=...?"),
    # added with '+', read by nothing: estimated the default 256 px
    ("estimate", ["+data.image_sise=32"], "+data.image_sise: not a key of the config, so "
                                          "nothing reads it; did you mean data.image_size"),
    ("plan", ["+strategy.memry=1GiB"], "did you mean strategy.memory=..."),
    # a swept key, checked at its first value (was Hydra's message for the first value)
    ("train", ["-m", "data.imge_size=32,64"], "data.imge_size: data=synthetic_seg has no "
                                              "key 'imge_size'; did you mean data.image_size"),
    ("train", ["-m", "strategy=none,sqrtn", "+seeed=range(1,3)"], "did you mean seed"),
])
def test_unknown_keys_of_every_kind_are_one_line(entry, args, said):
    from remat.errors import unknown_key

    assert said in unknown_key(entry, args)


def test_unknown_keys_leave_good_commands_and_sweeps_to_hydra():
    from remat.errors import unknown_key

    assert unknown_key("train", ["data=folder", "data.patch_size=64"]) is None
    assert unknown_key("train", ["+notes=first try"]) is None  # a key of one's own
    assert unknown_key("train", ["-m", "data.image_size=32,64", "strategy=none,sqrtn"]) is None
    assert unknown_key("train", ["-m", "data.image_size=interval(32,64)"]) is None  # Hydra's
    assert unknown_key("train", ["-m", "+sweep=ablation"]) is None  # a group
    # a custom net's arguments, each beside the others the command line adds
    assert unknown_key("train", ["model=custom", "model.net._target_=m.Net",
                                 "+model.net.in_channels=3", "+model.net.out_channels=1",
                                 "+model.net.channels=[16,32]"]) is None


def test_the_command_line_prints_one_line(tmp_path):
    args = [str(REPO / "train.py"), *TINY, "strategy=sqrtn", "model.stages=[]",
            f"hydra.run.dir={tmp_path / 'r'}"]
    short = run_python(args, cwd=tmp_path)
    assert short.returncode == 1
    assert short.stderr.strip().splitlines()[-1].startswith(
        "error: strategy=sqrtn would wrap nothing: model.stages is empty")
    assert "Traceback" not in short.stderr


@pytest.mark.slow  # a second train.py start, 9 s: make test-all
def test_hydra_full_error_prints_the_traceback(tmp_path):
    args = [str(REPO / "train.py"), *TINY, "strategy=sqrtn", "model.stages=[]",
            f"hydra.run.dir={tmp_path / 'f'}"]
    full = run_python(args, cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode == 1 and "Traceback" in full.stderr and "StageError" in full.stderr


def test_a_bench_row_that_names_no_row_is_one_line(tmp_path, capsys):
    """remat.bench printed a traceback for a budget row ``at`` a row that does not exist."""
    from tests.helpers import compose_app, entry_exit

    cfg = compose_app("bench", tmp_path, ["model=gpt_tiny", "data.block_size=32",
                                          "strategies=[none,{name: budget, at: sqrtnn}]",
                                          "reference_points=false"])
    assert entry_exit("bench", cfg) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: bench: budget(at=sqrtnn): at='sqrtnn' is not a row a plan can be "
                   "made at; rows: none (budget rows and compiled rows are not: the planner "
                   "traces eager steps)")
