"""data=folder: a user's own images and masks, written here in the layouts users keep them in
(0/255 and 0/1 PNGs, label maps, palette PNGs, RGB colour masks, 16-bit and multi-channel
TIFFs), and the data check that stops a run whose labels cannot be right."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from remat.data import FolderSegDataModule, KvasirSegDataModule
from remat.data.folder import glob_names
from remat.data.verify import DataCheckError
from remat.train import train
from tests.data.fakes import binary_labels, blocks, paint, save, save_palette_png
from tests.helpers import TINY_TRAINER, compose_train

COLOURS = [(0, 0, 0), (255, 0, 0), (0, 128, 255)]


def write_folder(root: Path, n: int = 5, size: tuple[int, int] = (24, 32), encoding: str = "255",
                 classes: int = 2, image_suffix: str = ".png", mask_suffix: str = ".png",
                 seed: int = 0) -> dict[str, np.ndarray]:
    """``images/case<i><image_suffix>`` + ``masks/case<i><mask_suffix>``; returns the labels
    drawn (class indices) by name. ``encoding``: ``255`` (0/255 grey), ``01`` (0/1 grey),
    ``index`` (grey label map), ``palette`` (mode P), ``colors`` (RGB, :data:`COLOURS`)."""
    labels = {}
    for i in range(n):
        name = f"case{i}"
        drawn = (binary_labels(*size, seed=seed + i) if classes == 2
                 else blocks(*size, classes=classes, seed=seed + i, block=4))
        labels[name] = drawn
        save(paint(drawn, seed=i), root / "images" / f"{name}{image_suffix}")
        mask_path = root / "masks" / f"{name}{mask_suffix}"
        if encoding == "255":
            save((drawn * 255).astype(np.uint8), mask_path)
        elif encoding in ("01", "index"):
            save(drawn.astype(np.uint8), mask_path)
        elif encoding == "palette":
            save_palette_png(drawn, COLOURS, mask_path)
        elif encoding == "colors":
            save(np.array(COLOURS, dtype=np.uint8)[drawn], mask_path)
    return labels


def decoded(dm: FolderSegDataModule) -> dict[str, np.ndarray]:
    """Every pair's decoded mask by name."""
    decode = dm.mask_decoder()
    return {name: decode(pair.mask).numpy() for name, pair in dm.pairs.items()}


@pytest.mark.parametrize("encoding,options", [
    ("255", {}), ("01", {}), ("index", {"mask_encoding": "index"}),
])
def test_binary_masks_decode_to_the_drawn_labels_whatever_the_storage(tmp_path, encoding,
                                                                        options):
    labels = write_folder(tmp_path, encoding=encoding)
    dm = FolderSegDataModule(tmp_path, patch_size=16, **options)
    dm.setup("fit")
    assert dm.num_classes == 1 and dm.class_names == ("background", "foreground")
    for name, mask in decoded(dm).items():
        np.testing.assert_array_equal(mask, labels[name])
    # 5 pairs, val_fraction 0.2: 1 val, seeded, disjoint, every pair used once
    assert len(dm.splits["val"]) == 1 and len(dm.splits["train"]) == 4
    assert sorted(dm.splits["train"] + dm.splits["val"]) == sorted(labels)


@pytest.mark.parametrize("encoding,options", [
    ("index", {"mask_encoding": "index", "num_classes": 3}),
    ("palette", {"mask_encoding": "palette", "num_classes": 3}),
    ("colors", {"mask_encoding": "colors",
                "colors": {"background": "#000000", "tumour": "#FF0000", "vessel": [0, 128, 255]}}),
])
def test_three_class_masks_in_each_encoding(tmp_path, encoding, options):
    labels = write_folder(tmp_path, encoding=encoding, classes=3)
    dm = FolderSegDataModule(tmp_path, patch_size=16, **options)
    dm.setup("fit")
    assert dm.num_classes == 3
    for name, mask in decoded(dm).items():
        np.testing.assert_array_equal(mask, labels[name])
    if encoding == "colors":
        assert dm.class_names == ("background", "tumour", "vessel")
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (4, 3, 16, 16) and batch["image"].dtype == torch.float32
    assert set(batch["mask"].unique().tolist()) <= {0, 1, 2}


def test_values_outside_the_classes_are_named_before_training(tmp_path):
    write_folder(tmp_path, encoding="index", classes=3)
    bad = tmp_path / "masks" / "case2.png"
    array = np.asarray(Image.open(bad)).copy()
    array[0, :5] = 7
    save(array, bad)
    dm = FolderSegDataModule(tmp_path, mask_encoding="index", num_classes=3, patch_size=16)
    with pytest.raises(DataCheckError) as info:
        dm.setup("fit")
    assert (f"{bad}: holds value(s) outside the classes: 7 (5 px); expected a single-channel "
            "PNG label map with values 0..2 (classes) or 255 (ignored)") in str(info.value)
    # a palette file is refused under index when its colours differ, a grey one under palette
    with pytest.raises(ValueError, match="is a mode L image, not a palette PNG"):
        FolderSegDataModule(tmp_path, mask_encoding="palette", num_classes=3)\
            .mask_decoder()(tmp_path / "masks" / "case0.png")


def test_sixteen_bit_tiff_images_and_multichannel_tiffs(tmp_path):
    labels = write_folder(tmp_path, n=3, encoding="255")
    for i, name in enumerate(labels):
        (tmp_path / "images" / f"{name}.png").unlink()
        grey16 = (labels[name].astype(np.uint16) * 40000 + 1000 + 7 * i).astype(np.uint16)
        tifffile.imwrite(tmp_path / "images" / f"{name}.tif", grey16)
    dm = FolderSegDataModule(tmp_path, patch_size=16, val_fraction=0.34)
    dm.setup("fit")
    image = dm.val_set[0]["image"]
    name = dm.val_set[0]["name"]
    assert image.shape == (3, 24, 32)  # grey repeated to rgb; whole image at native size
    # 16-bit values kept (not clipped to 8 bits): the per-image z-score of 'auto' separates
    # foreground from background exactly where the labels say
    fg = torch.from_numpy(labels[name]).bool()
    assert image[0][fg].min() > image[0][~fg].max()
    assert abs(float(image[0].mean())) < 1e-5
    assert abs(float(image[0].std(unbiased=False)) - 1) < 1e-4

    # a 5-channel TIFF: refused under rgb with the fix, served whole under native
    cube = np.stack([labels["case0"].astype(np.float32) * (c + 1) for c in range(5)])
    # planar bands, as GDAL and microscopy software write them
    tifffile.imwrite(tmp_path / "images" / "case0.tif", cube, photometric="minisblack",
                     planarconfig="separate")
    dm = FolderSegDataModule(tmp_path, patch_size=16, val_fraction=0.34)
    with pytest.raises(DataCheckError, match=r"case0.tif: has 5 channels; expected a grey or RGB "
                                             r"image for data.image_mode=rgb; for 5 channels set "
                                             r"data.image_mode=native and model.in_channels=5"):
        dm.setup("fit")
    dm = FolderSegDataModule(tmp_path, patch_size=16, image_mode="native", val_fraction=0.34,
                             verify=False)
    assert dm.in_channels == 5
    dm.setup("fit")
    whole = dm.build_dataset([dm.pairs["case0"]], train=False)[0]["image"]
    assert whole.shape == (5, 24, 32) and whole.dtype == torch.float32
    # float bands normalised per whole image and channel ('auto'): zero mean, unit std ...
    flat = whole.reshape(5, -1)
    assert torch.allclose(flat.mean(1), torch.zeros(5), atol=1e-5)
    assert torch.allclose(flat.std(1, unbiased=False), torch.ones(5), atol=1e-4)
    # ... and a training patch cut from it keeps the whole image's values (not its own stats)
    patch = dm.build_dataset([dm.pairs["case0"]], train=True)[0]["image"]
    assert patch.shape == (5, 16, 16)
    assert set(patch[0].flatten().tolist()) <= set(whole[0].flatten().tolist())


def test_size_mismatch_names_both_files(tmp_path):
    write_folder(tmp_path, n=3)
    save(np.zeros((10, 10), dtype=np.uint8), tmp_path / "masks" / "case1.png")
    dm = FolderSegDataModule(tmp_path, patch_size=8)
    with pytest.raises(DataCheckError, match=r"masks/case1.png: size mismatch for case1: its "
                                             r"image .*images/case1.png is 32x24 \(WxH\) but this "
                                             r"file is 10x10"):
        dm.setup("fit")


def test_an_empty_label_split_does_not_start_a_run(tmp_path):
    """Every mask black: the run stops before its first step, naming the split."""
    write_folder(tmp_path, n=4)
    for mask in (tmp_path / "masks").iterdir():
        save(np.zeros((24, 32), dtype=np.uint8), mask)
    out = tmp_path / "run"
    cfg = compose_train(out, [*TINY_TRAINER, "data=folder", f"data.root={tmp_path}",
                              "data.patch_size=16", "data.batch_size=2"])
    with pytest.raises(DataCheckError) as info:
        train(cfg)
    message = str(info.value)
    assert "the train split has no foreground: its 3 mask(s) hold class 0 (background) only" \
        in message and "the val split has no foreground" in message
    summary = json.loads((out / "summary.json").read_text())
    # stopped before the Trainer existed: no step recorded, no checkpoint written
    assert summary["status"] == "failed" and "global_step" not in summary
    assert "no foreground" in summary["error"] and not (out / "checkpoints").exists()
    assert not (out / "checkpoints").exists()


def test_a_class_only_val_masks_hold_is_named(tmp_path, caplog):
    """Class 2 painted in the val image only: the network could never learn it and its val
    Dice would stay 0, so the data check names it (a warning: the run may still be wanted)."""
    write_folder(tmp_path, n=4, encoding="index", classes=2)
    val = np.zeros((24, 32), dtype=np.uint8)
    val[4:12, 8:20], val[14:20, 2:10] = 1, 2
    save(val, tmp_path / "masks" / "case3.png")
    (tmp_path / "split.yaml").write_text("train: [case0, case1, case2]\nval: [case3]\n")
    dm = FolderSegDataModule(tmp_path, split_file=tmp_path / "split.yaml", patch_size=16,
                             mask_encoding="index", num_classes=3,
                             class_names=["background", "road", "car"])
    with caplog.at_level("WARNING", logger="remat.data.verify"):
        dm.setup("fit")
    [line] = [r.getMessage() for r in caplog.records if r.name == "remat.data.verify"]
    assert "class 2 (car) is in the val masks (48 pixels) but in no train mask" in line
    assert "class 1" not in line  # road is in train too
    # with car in a train mask as well, nothing is said
    save(val, tmp_path / "masks" / "case0.png")
    caplog.clear()
    with caplog.at_level("WARNING", logger="remat.data.verify"):
        FolderSegDataModule(tmp_path, split_file=tmp_path / "split.yaml", patch_size=16,
                            mask_encoding="index", num_classes=3).setup("fit")
    assert not [r for r in caplog.records if r.name == "remat.data.verify"]


def test_zero_one_masks_under_a_threshold_are_reported(tmp_path):
    """The trap of the issue: 0/1 label maps read by a 128 threshold (Kvasir's decoder, or
    data.threshold=128) train on empty labels; the check names each file and the fix."""
    write_folder(tmp_path, n=4, encoding="01")
    dm = FolderSegDataModule(tmp_path, threshold=128, patch_size=16)
    with pytest.raises(DataCheckError) as info:
        dm.setup("fit")
    message = str(info.value)
    assert message.count("holds only the values 0 and 1 (a label map?), which a threshold of "
                         "128 reads as no foreground; for 0/1 masks use data=folder with "
                         "data.mask_encoding=index") == 4
    assert "the train split has no foreground" in message
    # the same files in Kvasir-SEG's layout (JPEG, 0/1): refused before training as well
    kvasir = tmp_path / "Kvasir-SEG"
    write_folder(kvasir, n=4, encoding="01", image_suffix=".jpg", mask_suffix=".jpg")
    with pytest.raises(DataCheckError, match=r"(?s)case0.jpg: holds only the values 0 and 1.*"
                                             "the train split has no foreground"):
        KvasirSegDataModule(kvasir, image_size=16, val_size=1).setup("fit")


def test_jpeg_masks_without_a_threshold_are_reported(tmp_path):
    write_folder(tmp_path, n=3, encoding="255", mask_suffix=".jpg")
    with pytest.raises(DataCheckError, match=r"masks/case0.jpg: .*% of its pixels lie between 0 "
                                             r"and \d+ \(compression noise"):
        FolderSegDataModule(tmp_path, patch_size=16).setup("fit")
    dm = FolderSegDataModule(tmp_path, patch_size=16, threshold=128)
    dm.setup("fit")  # the fix the message gives


@pytest.mark.parametrize("options", [{}, {"threshold": 128}], ids=["default", "threshold"])
@pytest.mark.parametrize("encoding,fix", [
    ("palette", "is a palette PNG using 3 palette indices (0, 1, 2): a mask with several "
                "classes, which a binary encoding reads as one foreground; use "
                "data.mask_encoding=palette data.num_classes=3"),
    ("index", "holds 3 small values (0, 1, 2): a label map with several classes, which a "
              "binary encoding reads as one foreground; use data.mask_encoding=index "
              "data.num_classes=3")])
def test_several_class_masks_under_a_binary_encoding_are_refused(tmp_path, encoding, fix,
                                                                 options):
    """3-class palette PNGs (or grey label maps) left at the default binary encoding: the
    check named JPEG noise and suggested data.threshold=128, under which the run trained
    silently on class 2 alone (class 1's grey 76 fell below the threshold)."""
    write_folder(tmp_path, n=3, encoding=encoding, classes=3)
    with pytest.raises(DataCheckError) as info:
        FolderSegDataModule(tmp_path, patch_size=16, **options).setup("fit")
    assert str(info.value).count(fix) == 3
    assert "compression noise" not in str(info.value)
    dm = FolderSegDataModule(tmp_path, patch_size=16, mask_encoding=encoding, num_classes=3)
    dm.setup("fit")  # the fix the message gives
    assert dm.num_classes == 3


def test_split_folders_csv_and_split_file(tmp_path):
    for split, n in (("train", 3), ("val", 2), ("test", 1)):
        write_folder(tmp_path / "tree" / split, n=n, seed=10 * n)
    dm = FolderSegDataModule(tmp_path / "tree", patch_size=16)
    dm.setup()
    assert dm.splits == {"train": ["train/case0", "train/case1", "train/case2"],
                         "val": ["val/case0", "val/case1"], "test": ["test/case0"]}
    assert [b["name"] for b in dm.test_dataloader()] == [["test/case0"]]

    flat = tmp_path / "flat"
    write_folder(flat, n=4)
    rows = ["image,mask,split"] + [f"images/case{i}.png,masks/case{i}.png,"
                                   f"{'val' if i == 3 else 'train'}" for i in range(4)]
    (flat / "pairs.csv").write_text("\n".join(rows) + "\n")
    dm = FolderSegDataModule(flat, pairs=flat / "pairs.csv", patch_size=16)
    dm.setup("fit")
    assert dm.splits == {"train": ["images/case0", "images/case1", "images/case2"],
                         "val": ["images/case3"]}
    (flat / "split.yaml").write_text("train: [case0, case1]\nval: [case2, case3]\n")
    dm = FolderSegDataModule(flat, split_file=flat / "split.yaml", patch_size=16)
    dm.setup("fit")
    assert dm.splits["val"] == ["case2", "case3"]
    # the seeded val_fraction split is the same twice and moves with the seed
    picks = {seed: FolderSegDataModule(flat, val_fraction=0.5, split_seed=seed) for seed in (1, 2)}
    for dm in picks.values():
        dm.setup()
    again = FolderSegDataModule(flat, val_fraction=0.5, split_seed=1)
    again.setup()
    assert again.splits == picks[1].splits and len(picks[1].splits["val"]) == 2


def test_globs_pair_names_with_suffixes_and_subfolders(tmp_path):
    for name in ("a", "b"):
        save(np.zeros((4, 4), dtype=np.uint8), tmp_path / "img" / "site1" / f"{name}.tif")
        save(np.zeros((4, 4), dtype=np.uint8), tmp_path / "lab" / "site1" / f"{name}_mask.png")
    (tmp_path / "img" / "site1" / "notes.txt").write_text("not an image")
    assert list(glob_names(tmp_path, "img/**/*", "data.images")) == ["site1/a", "site1/b"]
    assert list(glob_names(tmp_path, "lab/**/*_mask.png", "data.masks")) == ["site1/a", "site1/b"]
    save(np.zeros((4, 4), dtype=np.uint8), tmp_path / "img" / "site1" / "a.png")
    with pytest.raises(ValueError, match="both give the name 'site1/a'"):
        glob_names(tmp_path, "img/**/*", "data.images")
    with pytest.raises(FileNotFoundError, match=r"1 image\(s\) without a mask: .*c.png"):
        save(np.zeros((4, 4), dtype=np.uint8), tmp_path / "images" / "c.png")
        save(np.zeros((4, 4), dtype=np.uint8), tmp_path / "images" / "d.png")
        save(np.zeros((4, 4), dtype=np.uint8), tmp_path / "masks" / "d.png")
        FolderSegDataModule(tmp_path).setup()


@pytest.mark.parametrize("options,match", [
    ({"mask_encoding": "rle"}, "data.mask_encoding must be one of"),
    ({"mask_encoding": "binary", "num_classes": 3}, "use data.mask_encoding=index"),
    ({"mask_encoding": "colors"}, "needs data.colors"),
    ({"mask_encoding": "colors", "colors": ["#000000", "red"]}, r"data.colors\[1\]: 'red' is no "
                                                               "colour"),
    ({"mask_encoding": "index", "num_classes": 3, "ignore_index": 2}, "is one of the 3 class"),
    ({"threshold": 300}, "data.threshold is a grey level"),
    ({"val_fraction": 1.0}, "data.val_fraction must be between 0 and 1"),
    ({"class_names": ["a", "b", "c"]}, "data.class_names has 3 names for 2 classes"),
    ({"mask_encoding": "colors", "colors": {"bg": "#000000", "road": "#FFFFFF"},
      "class_names": ["background", "road"]},
     r"data.class_names \['background', 'road'\] and the names data.colors gives its colours "
     r"\['bg', 'road'\] disagree"),
    ({"normalize": "zscore"}, "data.normalize must be one of"),
    # accepted and never read before (trial)
    ({"mask_encoding": "index", "num_classes": 3, "ignore_colors": ["#FFFFFF"]},
     "data.ignore_colors is set but data.mask_encoding=index"),
    ({"mask_encoding": "index", "num_classes": 3, "foreground_classes": [5],
      "foreground_prob": 0.5}, r"data.foreground_classes=\[5\]: \[5\] not a class; the "
                               r"classes are 0..2"),
    ({"foreground_classes": [2], "foreground_prob": 0.5}, "the classes are 0..1"),
])
def test_bad_settings_name_the_key(options, match):
    with pytest.raises(ValueError, match=match):
        FolderSegDataModule("/nowhere", **options)


def test_unset_root_says_how_to_set_it():
    with pytest.raises(ValueError, match="data.root is not set for image folder") as err:
        FolderSegDataModule(None).setup()
    # a user's own folder: no dataset folder name, no REMAT_DATA_DIR, nowhere to download
    assert "pass data.root=/path/to/your/folder (a folder with " in str(err.value)
    assert "REMAT_DATA_DIR" not in str(err.value) and "Get the data" not in str(err.value)


@pytest.mark.parametrize("encoding,overrides,metric", [
    ("01", [], "val/dice"),
    ("palette", ["data.mask_encoding=palette", "data.num_classes=3",
                 "data.class_names=[background,tumour,vessel]"], "val/iou_vessel"),
])
def test_training_on_a_folder_takes_the_classes_from_the_data_keys(tmp_path, encoding,
                                                                   overrides, metric):
    """model.num_classes, model.ignore_index and the metric set follow data=folder's keys;
    val images (40x56, no multiple of 32) are scored whole at their own size."""
    root = tmp_path / "my_data"
    write_folder(root, n=6, size=(40, 56), encoding=encoding,
                 classes=3 if encoding == "palette" else 2)
    out = tmp_path / "run"
    cfg = compose_train(out, [*TINY_TRAINER, "data=folder", f"data.root={root}",
                              "data.patch_size=32", "data.batch_size=2", "data.val_fraction=0.34",
                              *overrides, *([] if encoding == "01" else ["monitor=val/miou"])])
    assert cfg.model.num_classes == (3 if encoding == "palette" else 1)
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["global_step"] == 2
    assert 0.0 <= summary["metrics"][metric] <= 1.0


def test_a_monitor_the_model_does_not_log_stops_the_run_before_lightning(tmp_path):
    """3-class masks with train.yaml's monitor=val/dice: refused before the Trainer with the
    key to use (it failed after the sanity check with a 40-line traceback)."""
    write_folder(tmp_path / "data", n=4, encoding="palette", classes=3)
    out = tmp_path / "run"
    cfg = compose_train(out, [*TINY_TRAINER, "data=folder", f"data.root={tmp_path / 'data'}",
                              "data.mask_encoding=palette", "data.num_classes=3",
                              "data.patch_size=16", "data.batch_size=2"])
    with pytest.raises(ValueError, match=r"monitor=val/dice is not among the metrics this "
                                         r"model logs in validation \(val/loss, val/acc, val/miou, "
                                         r".*\); set monitor=val/miou monitor_mode=max"):
        train(cfg)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "global_step" not in summary


def test_a_folder_without_the_layout_says_what_it_expected(tmp_path):
    (tmp_path / "pictures").mkdir()
    with pytest.raises(FileNotFoundError, match=rf"^data.root={re.escape(str(tmp_path))} "
                                                r"\(image folder\) does not hold that layout\. "
                                                r"Expected layout: images/<name>.<ext> and "
                                                r"masks/<name>.<ext>.*\(in [^ ]+\)$"):
        FolderSegDataModule(tmp_path).setup()
    with pytest.raises(FileNotFoundError, match=r"^data.root=\S+absent \(image folder\) does "
                                                r"not exist\. Expected layout: images/"):
        FolderSegDataModule(tmp_path / "absent").setup()


def test_the_data_check_of_split_all_names_all_splits(tmp_path, caplog):
    """``remat.eval split=all`` serves every pair as one split: the check's title said
    '(val split)'; it names what is scored, and the fit check names both splits."""
    import logging

    write_folder(tmp_path, n=4)
    dm = FolderSegDataModule(tmp_path, patch_size=16, verify=True)
    dm.eval_all = True
    with caplog.at_level(logging.INFO, logger="remat"):
        dm.setup("validate")
    checks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data check")]
    assert len(checks) == 1 and checks[0].startswith(
        f"data check of image folder at {tmp_path} (all splits): 8 files decoded in ")
    save(np.zeros((10, 10), dtype=np.uint8), tmp_path / "masks" / "case3.png")
    bad = FolderSegDataModule(tmp_path, patch_size=16, verify=True)
    bad.eval_all = True
    with pytest.raises(DataCheckError) as info:
        bad.setup("validate")
    assert str(info.value).startswith(
        f"data check of image folder at {tmp_path} (all splits): 1 of 8 files cannot be used")
    fit = FolderSegDataModule(tmp_path, patch_size=16, verify=True)
    with pytest.raises(DataCheckError) as info:
        fit.setup("fit")
    assert str(info.value).startswith(
        f"data check of image folder at {tmp_path} (train and val splits): 1 of 8 files")


def _pairs_csv(root: Path, rows: list[tuple[str, str, str]]) -> Path:
    lines = ["image,mask,split"] + [",".join(row) for row in rows]
    (root / "pairs.csv").write_text("\n".join(lines) + "\n")
    return root / "pairs.csv"


def test_a_missing_mask_is_listed_with_the_other_bad_files(tmp_path):
    """A CSV row naming a mask that does not exist raised alone, before the data check
    collected the other bad files; now every problem is in one listing."""
    write_folder(tmp_path, n=4)
    gone = tmp_path / "masks" / "case1.png"
    gone.unlink()
    empty = tmp_path / "images" / "case2.png"
    empty.write_bytes(b"")
    csv = _pairs_csv(tmp_path, [(f"images/case{i}.png", f"masks/case{i}.png",
                                 "val" if i == 3 else "train") for i in range(4)])
    dm = FolderSegDataModule(tmp_path, pairs=csv, patch_size=16, verify=True)
    with pytest.raises(DataCheckError) as info:
        dm.setup("fit")
    message = str(info.value)
    assert message.startswith(f"data check of image folder at {tmp_path} (train and val "
                              "splits): 2 of 8 files cannot be used")
    assert [p.path for p in info.value.problems] == [empty, gone]
    assert f"  - {gone}: mask file not found; expected the mask of images/case1" in message
    assert f"  - {empty}: empty file (0 bytes)" in message
    # without the data check (data.verify=false) a missing file still stops setup, listed
    # with every other missing one, before any batch is read
    (tmp_path / "images" / "case3.png").unlink()
    quick = FolderSegDataModule(tmp_path, pairs=csv, patch_size=16, verify=False)
    with pytest.raises(DataCheckError) as info:
        quick.setup("fit")
    assert [p.path for p in info.value.problems] == [tmp_path / "images" / "case3.png", gone]
    assert str(info.value).startswith(
        f"image folder at {tmp_path} (train and val splits): 2 of 8 files are missing")


def test_colour_masks_give_the_model_as_many_classes_as_colours(tmp_path):
    """The documented colour-mask command (docs/your-own-data.md) set no data.num_classes and
    was refused: model.num_classes=1 but data=folder serves 3 classes. The class count of
    mask_encoding=colors is the number of colours listed; a given data.num_classes wins."""
    colors = "data.colors=['#000000','#FF0000','#00FF00']"
    cfg = compose_train(tmp_path, ["data=folder", "data.root=x", "data.mask_encoding=colors",
                                   colors])
    assert cfg.data.num_classes == cfg.model.num_classes == 3
    named = compose_train(tmp_path, ["data=folder", "data.root=x", "data.mask_encoding=colors",
                                     "data.colors={road: '#FFFFFF', land: '#000000'}"])
    assert named.model.num_classes == 2
    assert compose_train(tmp_path, ["data=folder", "data.root=x"]).model.num_classes == 1
    given = compose_train(tmp_path, ["data=folder", "data.root=x", colors, "data.num_classes=4"])
    assert given.model.num_classes == 4


def test_a_csv_row_with_an_empty_cell_names_its_line(tmp_path):
    """A row ``images/extra.jpg,`` was reported as the CSV's folder not being a mask file;
    the row's line and the empty column are named instead."""
    write_folder(tmp_path, n=2)
    csv = _pairs_csv(tmp_path, [("images/case0.png", "masks/case0.png", "train"),
                                ("images/case1.png", "", "val")])
    with pytest.raises(ValueError, match=re.escape(
            f"data.pairs={csv} line 3: the mask column is empty; every row names an image "
            "and its mask file")):
        FolderSegDataModule(tmp_path, pairs=csv, patch_size=16).setup("fit")


def test_images_that_auto_would_normalise_two_ways_are_refused(tmp_path):
    """8-bit PNGs (ImageNet statistics) beside 16-bit TIFFs (each image's own) under
    data.normalize=auto: the same picture reached the network two ways, silently."""
    labels = write_folder(tmp_path, n=4, encoding="255")
    for name in list(labels)[2:]:
        png = tmp_path / "images" / f"{name}.png"
        tifffile.imwrite(tmp_path / "images" / f"{name}.tif",
                         np.asarray(Image.open(png)).astype(np.uint16) * 257)
        png.unlink()
    dm = FolderSegDataModule(tmp_path, patch_size=16, val_fraction=0.25)
    with pytest.raises(DataCheckError, match=(
            r"the images are of 2 kinds that data.normalize=auto normalises differently: "
            r"2 are 16-bit, float or of another channel count: each by its own mean and std "
            r"\(e.g. case2.tif\); 2 are 8-bit with 1 or 3 channels: ImageNet mean and std "
            r"\(e.g. case0.png\); the network would see .* Set "
            r"data.normalize=image")):
        dm.setup("fit")
    # one way for all of them: trained as asked
    for how in ("image", "imagenet"):
        FolderSegDataModule(tmp_path, patch_size=16, val_fraction=0.25, normalize=how).setup("fit")


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
def test_photos_are_read_upright_as_their_exif_orientation_says(tmp_path, suffix):
    """A phone's portrait photo is stored sideways with an EXIF orientation tag; the mask
    is drawn on the photo as shown. Read as stored, a square photo trained against a mask
    turned 90 degrees (silently) and a portrait one was refused for its size."""
    from remat.data.io import read_any_image, read_image

    shown = paint(binary_labels(40, 56, seed=1), seed=1)  # [H, W, 3] as the viewer shows it
    labels = {"a": binary_labels(40, 56, seed=1)}
    stored = np.ascontiguousarray(np.rot90(shown, k=1))  # stored turned; tag 6 turns it back
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view"
    (tmp_path / "images").mkdir()
    Image.fromarray(stored).save(tmp_path / "images" / f"a{suffix}", exif=exif, quality=100)
    save((labels["a"] * 255).astype(np.uint8), tmp_path / "masks" / "a.png")
    upright = np.asarray(Image.open(tmp_path / "images" / f"a{suffix}").transpose(
        Image.Transpose.ROTATE_270))
    assert upright.shape[:2] == (40, 56)
    for image in (read_any_image(tmp_path / "images" / f"a{suffix}"),
                  read_image(tmp_path / "images" / f"a{suffix}")):
        assert image.shape == (3, 40, 56)
        assert torch.equal(image, torch.from_numpy(upright).permute(2, 0, 1))
    write_folder(tmp_path, n=3, size=(40, 56))  # case0..2 beside it: the check passes
    dm = FolderSegDataModule(tmp_path, patch_size=16, val_fraction=0.25)
    dm.setup("fit")
