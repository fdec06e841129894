"""``data=msd``: Medical Segmentation Decathlon task folders written by the test in the
published layout (``dataset.json``, ``imagesTr``/``labelsTr`` gzipped NIfTI): classes and
channels from ``dataset.json``, seeded splits, MONAI patches, and the data check that keeps a
run with bad volumes from starting."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hydra.utils import instantiate

from remat.data import DataCheckError, MSDDataModule
from remat.train import train
from tests.data.volumes import affine_for, draw_labels, save_nifti, write_msd_task
from tests.helpers import TINY_TRAINER, compose_train


@pytest.fixture
def task(tmp_path):
    return write_msd_task(tmp_path / "Task09_Spleen", count=4)


def test_classes_channels_and_splits_come_from_dataset_json(task, tmp_path):
    dm = MSDDataModule(task, patch_size=[16, 16, 16], pixdim=None)
    assert (dm.num_classes, dm.class_names, dm.in_channels) == (1, ("background", "spleen"), 1)
    assert dm.intensity == "ct"  # modality CT: HU window scaled to [0, 1]
    dm.setup("fit")
    assert sorted(dm.splits["train"] + dm.splits["val"]) == [f"spleen_{i}" for i in range(4)]
    assert len(dm.splits["val"]) == 1  # round(0.2 * 4)
    again = MSDDataModule(task, patch_size=[16, 16, 16], pixdim=None)
    again.setup("fit")
    assert again.splits == dm.splits  # seeded
    other = MSDDataModule(task, patch_size=[16, 16, 16], pixdim=None, split_seed=3)
    other.setup("fit")
    assert sorted(other.splits["val"] + other.splits["train"]) == sorted(
        dm.splits["val"] + dm.splits["train"])
    # dataset.json's own validation list wins over the seeded fraction
    own = write_msd_task(tmp_path / "own", count=3, validation=["spleen_0"])
    listed = MSDDataModule(own, patch_size=[16, 16, 16], pixdim=None)
    listed.setup("fit")
    assert listed.splits == {"train": ["spleen_1", "spleen_2"], "val": ["spleen_0"]}


def test_three_label_task_is_multiclass(tmp_path):
    root = write_msd_task(tmp_path / "Task03_Liver", count=2, classes=3, prefix="liver")
    dm = MSDDataModule(root, patch_size=[16, 16, 16], pixdim=None)
    assert dm.num_classes == 3 and dm.class_names == ("background", "organ", "lesion")
    cfg = compose_train(tmp_path / "cfg", ["data=msd", f"data.root={root}",
                                           "model=monai_unet3d"])
    assert cfg.model.num_classes == 3 and list(cfg.model.class_names) == list(dm.class_names)
    assert cfg.model.in_channels == 1


def test_batches_are_patches_and_whole_volumes(task):
    dm = MSDDataModule(task, patch_size=[16, 16, 16], pixdim=[1.0, 1.0, 1.0],
                       batch_size=2, pos_neg=[1, 0], samples_per_volume=2)
    dm.setup("fit")
    assert len(dm.train_set) == 2 * len(dm.splits["train"])
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (2, 1, 16, 16, 16) and batch["image"].dtype == torch.float32
    assert batch["mask"].shape == (2, 16, 16, 16) and batch["mask"].dtype == torch.int64
    assert type(batch["image"]) is torch.Tensor  # no MONAI metadata in the model's batches
    assert 0.0 <= float(batch["image"].min()) and float(batch["image"].max()) <= 1.0
    assert set(batch["mask"].unique().tolist()) <= {0, 1}
    # pos_neg=[1, 0]: every patch is centred on foreground
    assert all(bool((m == 1).any()) for m in batch["mask"])
    # the foreground is the bright tissue: image and label stay aligned through the crop
    image, mask = batch["image"][:, 0], batch["mask"]
    assert float(image[mask == 1].mean()) > float(image[mask == 0].mean()) + 0.3
    val = next(iter(dm.val_dataloader()))
    assert val["image"].shape == (1, 1, 32, 32, 32) and val["name"] == dm.splits["val"]
    # patches are drawn from torch's generator: a seeded run draws the same ones again
    draws = []
    for _ in range(2):
        torch.manual_seed(5)
        draws.append(next(iter(dm.train_dataloader())))
    assert torch.equal(draws[0]["mask"], draws[1]["mask"])
    assert draws[0]["name"] == draws[1]["name"]


def test_msd_config_composes_and_trains_one_step(task, tmp_path):
    cfg = compose_train(tmp_path, [
        "data=msd", f"data.root={task}", "data.patch_size=[32,32,32]", "data.pixdim=null",
        "data.batch_size=2", "data.samples_per_volume=1", "model=monai_unet3d",
        "model.net.channels=[4,8,16,32,64]", "strategy=full", *TINY_TRAINER])
    assert isinstance(instantiate(cfg.data), MSDDataModule)
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["global_step"] == 1
    assert 0.0 <= summary["metrics"]["val/dice_spleen"] <= 1.0


def _refused(root, match):
    dm = MSDDataModule(root, patch_size=[16, 16, 16], pixdim=None, verify=True)
    with pytest.raises(DataCheckError, match=match) as caught:
        dm.setup("fit")
    assert "\n" not in str(caught.value)  # one line
    return str(caught.value)


def test_data_check_refuses_a_label_of_another_shape(task):
    bad = task / "labelsTr" / "spleen_1.nii.gz"
    save_nifti(draw_labels((32, 32, 30), seed=1), affine_for((1, 1, 1)), bad)
    message = _refused(task, r"1 bad volume")
    assert f"{bad}: label of shape (32, 32, 30) but its image spleen_1.nii.gz has " \
           "(32, 32, 32)" in message


def test_data_check_refuses_label_values_outside_the_classes(task):
    labels = draw_labels((32, 32, 32), seed=2)
    labels[0, 0, :3] = 3
    bad = save_nifti(labels, affine_for((1, 1, 1)), task / "labelsTr" / "spleen_2.nii.gz")
    message = _refused(task, r"label values \[3\] are not among dataset.json's classes 0..1")
    assert str(bad) in message


def test_data_check_refuses_an_affine_mismatch_and_an_unreadable_file(task):
    save_nifti(draw_labels((32, 32, 32), seed=0), affine_for((1, 1, 2)),
               task / "labelsTr" / "spleen_0.nii.gz")
    (task / "imagesTr" / "spleen_3.nii.gz").write_bytes(b"not a nifti file")
    message = _refused(task, r"2 bad volume\(s\)")
    assert "spleen_0.nii.gz: affine differs from its image" in message
    assert "spleen_3.nii.gz: not a readable NIfTI file" in message


def test_a_run_with_bad_volumes_does_not_start(task, tmp_path):
    labels = draw_labels((32, 32, 32), seed=2)
    labels[1, 1, 1] = 7
    save_nifti(labels, affine_for((1, 1, 1)), task / "labelsTr" / "spleen_2.nii.gz")
    cfg = compose_train(tmp_path, ["data=msd", f"data.root={task}", "model=monai_unet3d",
                                   "data.verify=true", *TINY_TRAINER])
    with pytest.raises(DataCheckError, match="spleen_2.nii.gz: label values \\[7\\]"):
        train(cfg)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "spleen_2.nii.gz" in summary["error"]


def test_layout_errors_name_the_file(tmp_path, task):
    with pytest.raises(FileNotFoundError, match=r"^data.root=\S+empty_dir \(data=msd\) does "
                                                r"not exist; expected an MSD task folder: "
                                                r"<root>/dataset.json, <root>/imagesTr/"):
        MSDDataModule(tmp_path / "empty_dir", patch_size=[16, 16, 16])
    # the folder holding the task: the message names the task folder to pass
    with pytest.raises(FileNotFoundError, match=rf"^data.root={re.escape(str(task.parent))} "
                                                r"\(data=msd\) holds no dataset.json \(it "
                                                rf"holds the task folder\(s\) {task.name}: "
                                                rf"pass data.root={re.escape(str(task))}\)"):
        MSDDataModule(task.parent, patch_size=[16, 16, 16])
    meta = json.loads((task / "dataset.json").read_text())
    meta["training"].append({"image": "./imagesTr/gone.nii.gz", "label": "./labelsTr/gone.nii.gz"})
    (task / "dataset.json").write_text(json.dumps(meta))
    # the entry's files are looked for by the data check, which lists both
    with pytest.raises(DataCheckError) as info:
        MSDDataModule(task, patch_size=[16, 16, 16]).setup()
    assert (f"{task / 'imagesTr' / 'gone.nii.gz'}: image file not found; expected the image "
            f"of volume gone; {task / 'labelsTr' / 'gone.nii.gz'}: label file not found; "
            "expected the label of volume gone") in str(info.value)
    with pytest.raises(ValueError, match=r"data.patch_size must be \[d, h, w\]"):
        MSDDataModule(task, patch_size=[16, 16])
    with pytest.raises(ValueError, match="data.num_classes=3 but"):
        MSDDataModule(task, num_classes=3)


@pytest.mark.parametrize("entry,expected", [
    ("./imagesTr/spleen_0.nii.gz", "is a str ('./imagesTr/spleen_0.nii.gz'), not an object"),
    ({"image": "./imagesTr/spleen_0.nii.gz"}, "has no 'label'"),
    ({"label": "./labelsTr/spleen_0.nii.gz"}, "has no 'image'"),
    ({"image": 7, "label": "./labelsTr/spleen_0.nii.gz"}, "'image' is an int (7), not a path"),
    ({"image": "./imagesTr/spleen_0.nii.gz", "label": ""}, "'label' is an empty string"),
])
def test_a_malformed_training_entry_is_named_by_its_index(task, entry, expected):
    """A bad ``training`` entry said only that entries must be image/label objects; the
    message names the file, the entry's index and what was expected."""
    meta = json.loads((task / "dataset.json").read_text())
    meta["training"].insert(3, entry)
    (task / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError) as info:
        MSDDataModule(task, patch_size=[16, 16, 16])
    assert str(info.value) == (
        f"{task / 'dataset.json'}: training[3] {expected}; expected {{\"image\": "
        "\"./imagesTr/<case>.nii.gz\", \"label\": \"./labelsTr/<case>.nii.gz\"}, paths "
        "relative to the task folder")


def test_a_missing_label_is_listed_with_the_other_bad_volumes(task):
    """A training entry whose label file is missing raised alone (FileNotFoundError while
    listing), before the data check collected the other bad volumes."""
    gone = task / "labelsTr" / "spleen_1.nii.gz"
    gone.unlink()
    (task / "imagesTr" / "spleen_3.nii.gz").write_bytes(b"not a nifti file")
    message = _refused(task, r"2 bad volume\(s\)")
    assert message.startswith(f"MSD task at {task} (train and val splits): 2 bad volume(s): "
                              f"{gone}: label file not found; expected the label of volume "
                              f"spleen_1; {task / 'imagesTr' / 'spleen_3.nii.gz'}: not a "
                              "readable NIfTI file")
    # data.verify=false skips decoding, not the missing file: setup still names it
    dm = MSDDataModule(task, patch_size=[16, 16, 16], pixdim=None, verify=False)
    with pytest.raises(DataCheckError) as info:
        dm.setup("fit")
    assert str(info.value) == (f"MSD task at {task} (train and val splits): 1 of 8 volume "
                               f"files are missing: {gone} (the label of volume spleen_1)")
