"""``data=volumes``: a user's own folder of 3D volumes, written by the test as gzipped NIfTI
and as NumPy ``.npy`` arrays: pairing by name (globs, split folders, a CSV), classes and
channels from the config, MONAI patches, the data check that names each bad file and what
was expected, a 1-step run of the 3D U-Net and prediction in the input's own format."""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest
from hydra.utils import instantiate

from remat.data import DataCheckError, MSDDataModule, VolumeFolderDataModule
from remat.data.volume_seg import VolumeSegDataModule
from remat.predict import predict
from remat.train import train
from tests.data.volumes import (
    affine_for,
    draw_labels,
    paint_ct,
    save_nifti,
    write_volume_folder,
)
from tests.helpers import TINY_TRAINER, compose_app, compose_train

TINY_UNET = ["model=monai_unet3d", "model.net.channels=[4,8,16,32,64]",
             "data.patch_size=[16,16,16]", "data.batch_size=2", "data.samples_per_volume=1"]


def _dm(root, **kwargs) -> VolumeFolderDataModule:
    return VolumeFolderDataModule(root, patch_size=[16, 16, 16], verify=True, **kwargs)


def test_msd_and_volumes_share_one_base():
    assert issubclass(MSDDataModule, VolumeSegDataModule)
    assert issubclass(VolumeFolderDataModule, VolumeSegDataModule)
    for method in ("load_transform", "crop_transform", "setup", "restore_labels",
                   "predict_dataset"):
        assert method not in vars(MSDDataModule) and method not in vars(VolumeFolderDataModule)


def test_nifti_folder_pairs_by_name_and_serves_patches(tmp_path):
    root = write_volume_folder(tmp_path / "ct", count=4, classes=3)
    dm = _dm(root, num_classes=3, class_names=["background", "organ", "lesion"],
             intensity="ct", pos_neg=[1, 0], batch_size=2)
    assert (dm.num_classes, dm.label_count, dm.in_channels) == (3, 3, 1)
    dm.setup("fit")
    assert sorted(dm.splits["train"] + dm.splits["val"]) == [f"case{i}" for i in range(4)]
    assert len(dm.splits["val"]) == 1  # round(0.2 * 4), seeded
    again = _dm(root, num_classes=3)
    again.setup("fit")
    assert again.splits == dm.splits
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (2, 1, 16, 16, 16) and batch["mask"].shape == (2, 16, 16, 16)
    assert set(batch["mask"].unique().tolist()) <= {0, 1, 2}
    # labels stay aligned with the image: the painted organ is brighter than fat
    image, mask = batch["image"][:, 0], batch["mask"]
    assert float(image[mask == 1].mean()) > float(image[mask == 0].mean()) + 0.3
    val = next(iter(dm.val_dataloader()))
    assert val["image"].shape == (1, 1, 24, 24, 24) and val["name"] == dm.splits["val"]


def test_npy_folder_reads_arrays_with_the_identity_affine(tmp_path):
    root = write_volume_folder(tmp_path / "arrays", count=3, suffix=".npy",
                               shape=(20, 24, 16))
    dm = _dm(root, pixdim=[2.0, 2.0, 2.0], val_fraction=0.34)
    dm.setup("fit")
    val = next(iter(dm.val_dataloader()))
    # identity affine: 1 mm voxels, so resampling to 2 mm halves every side
    assert val["image"].shape == (1, 1, 10, 12, 8)
    assert dm.splits["val"] == val["name"]


def test_split_folders_globs_and_csv(tmp_path):
    root = tmp_path / "split"
    write_volume_folder(root, count=3, images="train/images/{}", labels="train/labels/{}")
    write_volume_folder(root / "val", count=1)
    dm = _dm(root)
    dm.setup("fit")
    assert dm.splits == {"train": ["train/case0", "train/case1", "train/case2"],
                         "val": ["val/case0"]}
    # BTCV-style names: img0001.nii.gz pairs with label0001.nii.gz
    btcv = tmp_path / "btcv"
    for i in (1, 2):
        save_nifti(paint_ct(draw_labels((16,) * 3, i), i), affine_for((1, 1, 1)),
                   btcv / "img" / f"img000{i}.nii.gz")
        save_nifti(draw_labels((16,) * 3, i), affine_for((1, 1, 1)),
                   btcv / "label" / f"label000{i}.nii.gz")
    dm = _dm(btcv, images="img/img*.nii.gz", labels="label/label*.nii.gz")
    assert [p.name for p in dm.list_pairs()] == ["0001", "0002"]
    # a CSV of pairs, with its own splits
    flat = write_volume_folder(tmp_path / "flat", count=2)
    with (flat / "pairs.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["image", "label", "split"])
        writer.writerow(["images/case0.nii.gz", "labels/case0.nii.gz", "train"])
        writer.writerow(["images/case1.nii.gz", "labels/case1.nii.gz", "val"])
    dm = _dm(flat, pairs="pairs.csv")
    dm.setup("fit")
    assert dm.splits == {"train": ["case0"], "val": ["case1"]}


def test_layout_and_setting_errors_name_what_was_expected(tmp_path):
    root = write_volume_folder(tmp_path / "v", count=2)
    (root / "labels" / "case1.nii.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"1 image\(s\) without a label: "
                                                r"images/case1.nii.gz"):
        _dm(root).setup("fit")
    with pytest.raises(ValueError, match="data.class_names has 2 names for 3 label values"):
        _dm(root, num_classes=3, class_names=["background", "liver"])
    with pytest.raises(ValueError, match="data.root is not set"):
        _dm(None).setup("fit")


def test_a_missing_or_empty_root_names_data_root_and_the_layout(tmp_path):
    """A wrong data.root said 'no images found in the volume folder <path>', not which key."""
    absent = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match=rf"^data.root={re.escape(str(absent))} "
                                                r"\(volume folder\) does not exist; expected "
                                                r"images/\* and labels/\* below it \(images/"
                                                r"<name>.nii.gz"):
        _dm(absent).setup("fit")
    with pytest.raises(FileNotFoundError, match=rf"^no images found in the volume folder "
                                                rf"data.root={re.escape(str(tmp_path))}; "
                                                r"expected images/\* and labels/\*"):
        _dm(tmp_path).setup("fit")
    # a folder of 2D images given to data=volumes: the files it found are named
    (tmp_path / "images").mkdir()
    for name in ("a.png", "b.png", "c.tif"):
        (tmp_path / "images" / name).write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"images/\* holds 3 files of other types "
                                                r"\(.png x2, .tif x1\), this data reads "
                                                r".nii.gz, .nii, .npy"):
        _dm(tmp_path).setup("fit")


def _refused(root, match, **kwargs) -> str:
    with pytest.raises(DataCheckError, match=match) as caught:
        _dm(root, **kwargs).setup("fit")
    assert "\n" not in str(caught.value)  # one line
    return str(caught.value)


def test_data_check_names_each_bad_file_and_what_was_expected(tmp_path):
    root = write_volume_folder(tmp_path / "v", count=4)
    shape_bad = save_nifti(draw_labels((24, 24, 20), 1), affine_for((1, 1, 1)),
                           root / "labels" / "case1.nii.gz")
    affine_bad = save_nifti(draw_labels((24, 24, 24), 2), affine_for((1, 1, 2)),
                            root / "labels" / "case2.nii.gz")
    values = draw_labels((24, 24, 24), 3)
    values[0, 0, 0] = 4
    values_bad = save_nifti(values, affine_for((1, 1, 1)), root / "labels" / "case3.nii.gz")
    message = _refused(root, r"3 bad volume\(s\)")
    assert f"{shape_bad}: label of shape (24, 24, 20) but its image case1.nii.gz has " \
           "(24, 24, 24)" in message
    assert f"{affine_bad}: affine differs from its image case2.nii.gz" in message
    assert "expected the same voxel grid" in message
    assert f"{values_bad}: label values [4] are not among data.num_classes's classes 0..1; " \
        "more classes? set data.num_classes=5" in message
    # in the order of the names, not of the (seeded, random) train/val split
    assert message.index(str(shape_bad)) < message.index(str(affine_bad)) \
        < message.index(str(values_bad))
    # three classes allow 0..2, not 4
    assert "label values [4]" in _refused(root, "bad volume", num_classes=3)


def test_data_check_refuses_bad_npy_files(tmp_path):
    root = write_volume_folder(tmp_path / "a", count=3, suffix=".npy")
    (root / "images" / "case0.npy").write_bytes(b"not an array")
    np.save(root / "labels" / "case1.npy", np.zeros((24, 24, 23), np.uint8))
    message = _refused(root, r"2 bad volume\(s\)")
    assert "case0.npy: not a readable .npy array" in message
    assert "expected a NumPy array saved with numpy.save" in message
    assert "case1.npy: label of shape (24, 24, 23) but its image case1.npy has (24, 24, " \
           "24)" in message
    # an .npy label next to a NIfTI image: identity vs the scanner affine
    mixed = write_volume_folder(tmp_path / "m", count=2)
    (mixed / "labels" / "case0.nii.gz").unlink()
    np.save(mixed / "labels" / "case0.npy", draw_labels((24, 24, 24), 0))
    assert "case0.npy: affine differs from its image case0.nii.gz" in _refused(mixed, "bad")


def test_npy_folder_trains_one_step_and_predicts_arrays(tmp_path):
    """The one fast end-to-end proof: config -> 1 training step -> validation Dice ->
    predict writes .npy label maps of the input arrays' shape."""
    root = write_volume_folder(tmp_path / "arrays", count=3, suffix=".npy")
    run = tmp_path / "run"
    cfg = compose_train(run, ["data=volumes", f"data.root={root}", *TINY_UNET,
                              "data.limit_val=1", "strategy=sqrtn", *TINY_TRAINER])
    assert isinstance(instantiate(cfg.data), VolumeFolderDataModule)
    assert cfg.model.num_classes == 1 and cfg.model.in_channels == 1
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["global_step"] == 1
    assert 0.0 <= summary["metrics"]["val/dice_foreground"] <= 1.0
    out = tmp_path / "masks"
    args = [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"input={root / 'images'}",
            f"output={out}", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]
    (root / "images" / "broken.npy").write_bytes(b"\x93NUMPY garbage")  # checked first
    np.save(root / "images" / "flat.npy", np.zeros((32, 32), np.int16))  # a 2D array
    with pytest.raises(ValueError, match=r"2 of 5 file\(s\) cannot be read(.|\n)*broken.npy"
                                         r"(.|\n)*flat.npy: image of shape \(32, 32\); "
                                         r"expected a 3D volume"):
        predict(compose_app("predict", tmp_path / "p0", args))
    assert not out.exists() or not any(out.rglob("*"))
    (root / "images" / "broken.npy").unlink()
    (root / "images" / "flat.npy").unlink()
    result = predict(compose_app("predict", tmp_path / "p", args))
    assert result["count"] == 3
    mask = np.load(out / "case0.npy")
    assert mask.shape == (24, 24, 24) and mask.dtype == np.uint8
    assert set(np.unique(mask).tolist()) <= {0, 1}


def test_nifti_folder_trains_and_predicts_nifti_with_the_input_affine(tmp_path):
    import nibabel as nib

    root = write_volume_folder(tmp_path / "ct", count=3, classes=3, spacing=(1.0, 1.0, 2.0))
    run = tmp_path / "run"
    summary = train(compose_train(run, [
        "data=volumes", f"data.root={root}", "data.num_classes=3", "data.intensity=ct",
        "data.class_names=[background,organ,lesion]", "data.pixdim=[1.5,1.5,2.0]",
        *TINY_UNET, *TINY_TRAINER]))
    assert summary["status"] == "completed"
    assert {"val/dice_organ", "val/dice_lesion"} <= set(summary["metrics"])
    out = tmp_path / "masks"
    predict(compose_app("predict", tmp_path / "p", [
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"input={root / 'images'}",
        f"output={out}", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]))
    source = nib.load(str(root / "images" / "case0.nii.gz"))
    mask = nib.load(str(out / "case0.nii.gz"))
    assert mask.shape == source.shape  # back on the file's grid after resampling
    np.testing.assert_allclose(mask.affine, source.affine)
    assert set(np.unique(np.asarray(mask.dataobj)).tolist()) <= {0, 1, 2}


def test_unpaired_volumes_say_label_and_list_in_order_with_the_total(tmp_path):
    """The volume layout calls them labels (it said 'mask'); a long list is cut at five in
    natural order and says how many there are in all."""
    root = write_volume_folder(tmp_path / "v", count=12)
    for i in (11, 3, 10, 2, 9, 4, 8):
        (root / "labels" / f"case{i}.nii.gz").unlink()
    (root / "images" / "case0.nii.gz").unlink()
    with pytest.raises(FileNotFoundError) as info:
        _dm(root).setup("fit")
    assert str(info.value).startswith(
        f"the volume folder data.root={root} is incomplete; 7 image(s) without a label: "
        "images/case2.nii.gz, images/case3.nii.gz, images/case4.nii.gz, images/case8.nii.gz, "
        "images/case9.nii.gz and 2 more (7 in all); 1 label(s) without an image: "
        "labels/case0.nii.gz. Expected images/* and labels/* below")


@pytest.mark.parametrize("suffix", [".nii.gz", ".npy"])
def test_loading_volumes_logs_no_reader_attempts(tmp_path, caplog, suffix):
    """Each NIfTI file was first tried with MONAI's NumpyReader, which logged an INFO line
    'NumpyReader: unable to load ...' per file and key (12 lines for a 3-volume epoch)."""
    import logging

    root = write_volume_folder(tmp_path / "v", count=2, suffix=suffix)
    dm = _dm(root)
    with caplog.at_level(logging.INFO, logger="remat"):
        dm.setup("fit")
    # the data check says it ran, as for 2D folders
    assert any(re.match(r"data check of volume folder at .*: 2 volume pairs read in "
                        r"[\d.]+ s, none bad", r.getMessage()) for r in caplog.records)
    load = dm.load_transform()
    with caplog.at_level(logging.DEBUG):
        sample = load({"image": str(root / "images" / f"case0{suffix}"),
                       "label": str(root / "labels" / f"case0{suffix}")})
    assert tuple(sample["image"].shape) == (1, 24, 24, 24)
    assert [r.getMessage() for r in caplog.records if r.name == "LoadImage"] == []
    # errors still reach the user: a file no reader can read
    (root / "images" / f"case1{suffix}").write_bytes(b"not a volume")
    with pytest.raises(RuntimeError, match="applying transform"):
        load({"image": str(root / "images" / f"case1{suffix}"),
              "label": str(root / "labels" / f"case1{suffix}")})


def test_the_data_check_of_split_all_names_all_splits(tmp_path):
    """``remat.eval split=all`` checked every volume under the title '(val split)'."""
    root = write_volume_folder(tmp_path / "v", count=3)
    labels = draw_labels((24, 24, 24), seed=1)
    labels[0, 0, 0] = 5
    bad = save_nifti(labels, affine_for((1, 1, 1)), root / "labels" / "case1.nii.gz")
    dm = _dm(root)
    dm.eval_all = True
    with pytest.raises(DataCheckError) as info:
        dm.setup("validate")
    assert str(info.value) == (f"volume folder at {root} (all splits): 1 bad volume(s): {bad}: "
                               "label values [5] are not among data.num_classes's classes "
                               "0..1; more classes? set data.num_classes=6 (and "
                               "data.class_names to name them)")
    with pytest.raises(DataCheckError, match=rf"^volume folder at {re.escape(str(root))} "
                                             r"\(train and val splits\): 1 bad volume"):
        _dm(root).setup("fit")


def test_a_missing_label_in_the_csv_is_listed_with_the_other_bad_volumes(tmp_path):
    """A CSV row naming a missing label raised alone (FileNotFoundError at listing); it is
    one more line of the data check's listing now."""
    flat = write_volume_folder(tmp_path / "flat", count=3)
    gone = flat / "labels" / "case0.nii.gz"
    gone.unlink()
    (flat / "images" / "case2.nii.gz").write_bytes(b"not a nifti file")
    with (flat / "pairs.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["image", "label", "split"])
        for i in range(3):
            writer.writerow([f"images/case{i}.nii.gz", f"labels/case{i}.nii.gz",
                             "val" if i == 2 else "train"])
    with pytest.raises(DataCheckError) as info:
        _dm(flat, pairs="pairs.csv").setup("fit")
    message = str(info.value)
    assert message.startswith(f"volume folder at {flat} (train and val splits): 2 bad "
                              f"volume(s): {gone}: label file not found; expected the label "
                              f"of volume case0; {flat / 'images' / 'case2.nii.gz'}: not a "
                              "readable NIfTI file")


def test_a_class_no_label_holds_is_a_warning_of_the_data_check(tmp_path, caplog):
    """data.num_classes=3 on labels of 0 and 1 trained without a word; the data check now
    names the absent value and where the class count came from."""
    import logging

    root = write_volume_folder(tmp_path / "v", count=2, suffix=".npy", classes=2)
    with caplog.at_level(logging.WARNING, logger="remat"):
        _dm(root, num_classes=3).setup("fit")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("label value(s) [2] appear in no label file (classes 0..2 from "
               "data.num_classes; values found: [0, 1])" in m for m in warned), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat"):
        _dm(root).setup("fit")
    assert not [r for r in caplog.records if "appear in no label" in r.getMessage()]
