"""The data check before training (data.verify) and 16-bit label files, on fakes in their
published layouts and on the real ISBI 2012 and Dubai copies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from remat.data import DubaiAerialDataModule, ISBI2012DataModule, LoveDADataModule
from remat.data import verify as verify_module
from remat.data.io import DataFileError, read_image
from remat.data.masks import colour_mask, index_mask, threshold_mask
from remat.data.verify import DataCheckError, problem_lines
from remat.train import train
from tests.data import fakes
from tests.helpers import TINY_TRAINER, compose_train

# ---------------------------------------------------------------------------- before training


def test_zero_byte_and_16bit_files_are_listed_before_the_first_step(tmp_path: Path):
    """The issue's case: one empty image and one 16-bit label in an ISBI 2012 copy; training
    stops before its first step with both files named, what is wrong and what was expected."""
    root = tmp_path / "ISBI2012-EM-membrane"
    fakes.make_fake_isbi(root, n=6, size=32)
    empty = root / "train" / "image" / "2.png"
    empty.write_bytes(b"")
    sixteen = root / "train" / "label" / "5.png"  # section 5 is val; 0/255 stored as 16 bit
    label = np.asarray(Image.open(sixteen)).astype(np.uint16)
    Image.fromarray(label).save(sixteen)
    assert Image.open(sixteen).mode == "I;16"
    out = tmp_path / "run"
    cfg = compose_train(out, [*TINY_TRAINER, "data=isbi2012", f"data.root={root}",
                              "data.val_sections=1", "data.patch_size=32", "data.batch_size=2"])
    with pytest.raises(DataCheckError) as info:
        train(cfg)
    message = str(info.value)
    assert "2 of 12 files cannot be used" in message
    assert f"{empty}: empty file (0 bytes); expected an 8-bit grey or RGB PNG image" in message
    assert (f"{sixteen}: 16-bit mask whose values all lie in 0..255 (an 8-bit mask saved as "
            "16 bits?); expected a grey PNG mask with the foreground < 128") in message
    assert [p.path for p in info.value.problems] == [empty, sixteen]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "global_step" not in summary  # no Trainer ran
    assert not (out / "checkpoints").exists()


def test_only_the_splits_a_stage_reads_are_checked_once(tmp_path: Path):
    fakes.make_fake_isbi(tmp_path, n=4, size=16)
    (tmp_path / "train" / "label" / "0.png").write_bytes(b"")  # a train file
    dm = ISBI2012DataModule(tmp_path, val_sections=1, patch_size=8)
    dm.setup("validate")  # section 3 only: passes
    with pytest.raises(DataCheckError, match=r"(?s)1 of 6 files .*train/label/0.png: empty file"):
        dm.setup("fit")  # train is read now: checked (val is not checked again)
    (tmp_path / "train" / "label" / "3.png").write_bytes(b"")
    dm.setup("validate")  # val was checked already
    with pytest.raises(DataCheckError, match="2 of 8 files"):
        ISBI2012DataModule(tmp_path, val_sections=1, patch_size=8).setup()  # stage None: all


def test_verify_false_skips_and_auto_stops_at_many_files(tmp_path: Path, monkeypatch, caplog):
    fakes.make_fake_isbi(tmp_path, n=4, size=16)
    (tmp_path / "train" / "image" / "1.png").write_bytes(b"")
    ISBI2012DataModule(tmp_path, val_sections=1, verify=False).setup("fit")
    with pytest.raises(DataFileError, match="1.png: empty file"):  # met when loaded instead
        dm = ISBI2012DataModule(tmp_path, val_sections=1, verify=False, patch_size=8)
        dm.setup("fit")
        dm.train_set[1]
    monkeypatch.setattr(verify_module, "AUTO_MAX_FILES", 7)
    monkeypatch.setattr("remat.data.base.AUTO_MAX_FILES", 7)
    with caplog.at_level("INFO", logger="remat.data.base"):
        ISBI2012DataModule(tmp_path, val_sections=1).setup("fit")  # 8 files > 7: not checked
    assert "holds 8 files (more than 7)" in caplog.text and "data.verify=true" in caplog.text
    with pytest.raises(DataCheckError):
        ISBI2012DataModule(tmp_path, val_sections=1, verify=True).setup("fit")
    with pytest.raises(ValueError, match="data.verify must be true, false or auto, got 'yes'"):
        ISBI2012DataModule(tmp_path, verify="yes")


def test_many_files_with_one_kind_of_problem_are_listed_five_then_counted():
    """Kvasir-SEG's 1000 JPEG masks each said the same (their noise shares differ): five are
    named, the rest counted on one line; other kinds still list their files."""
    noisy = [DataFileError(path=f"/d/masks/{i}.jpg", problem=f"{i / 10:.1f}% of its pixels "
                           "lie between 0 and 255") for i in range(12)]
    empty = [DataFileError(path=f"/d/images/{i}.png", problem="empty file (0 bytes)")
             for i in range(2)]
    lines = problem_lines([*noisy[:3], *empty, *noisy[3:]])
    assert lines == [*(f"  - {p}" for p in noisy[:3]), *(f"  - {p}" for p in empty),
                     *(f"  - {p}" for p in noisy[3:5]),
                     "  - ... and 7 more files with the same problem"]


def test_real_isbi_and_dubai_copies_pass_the_check(isbi_root: Path, dubai_root: Path, caplog):
    with caplog.at_level("INFO", logger="remat.data.verify"):
        ISBI2012DataModule(isbi_root).setup("fit")
        DubaiAerialDataModule(dubai_root).setup("validate")
    assert "60 files decoded" in caplog.text  # 30 sections: image + label
    assert "18 files decoded" in caplog.text  # Tile 3: 9 images + 9 masks


# ---------------------------------------------------------------------------- 16-bit files


def test_16bit_grey_mask_spanning_the_range_reads_as_its_8bit_twin(tmp_path: Path):
    grey = np.array([[0, 255, 0], [255, 255, 0]], dtype=np.uint8)
    eight = fakes.save(grey, tmp_path / "m8.png")
    sixteen = tmp_path / "m16.png"
    Image.fromarray(grey.astype(np.uint16) * 257).save(sixteen)  # 0/65535
    for foreground in ("bright", "dark"):
        assert torch.equal(threshold_mask(sixteen, foreground=foreground),
                           threshold_mask(eight, foreground=foreground))
    tif = tmp_path / "m16.tif"
    Image.fromarray(grey.astype(np.uint16) * 257).save(tif)
    assert torch.equal(threshold_mask(tif), threshold_mask(eight))
    black = tmp_path / "black16.png"
    Image.fromarray(np.zeros((2, 3), dtype=np.uint16)).save(black)
    assert threshold_mask(black).sum() == 0  # an empty 16-bit mask is unambiguous


def test_16bit_isbi_label_trains_like_the_8bit_one(tmp_path: Path):
    fakes.make_fake_isbi(tmp_path, n=3, size=16)
    expected = ISBI2012DataModule(tmp_path, val_sections=1)
    expected.setup()
    label = tmp_path / "train" / "label" / "2.png"
    Image.fromarray(np.asarray(Image.open(label)).astype(np.uint16) * 257).save(label)
    dm = ISBI2012DataModule(tmp_path, val_sections=1)
    dm.setup()  # the check passes
    assert torch.equal(dm.val_set[0]["mask"], expected.val_set[0]["mask"])


def test_16bit_colour_and_label_masks(tmp_path: Path):
    palette = {(60, 16, 152): 0, (132, 41, 246): 1}
    rgb = np.zeros((2, 3, 3), dtype=np.uint16)
    rgb[...] = (60, 16, 152)
    rgb[1, 2] = (132, 41, 246)
    path = fakes.save_png16(rgb * 257, tmp_path / "colour16.png")
    assert colour_mask(path, palette).tolist() == [[0, 0, 0], [0, 0, 1]]
    fakes.save_png16(rgb, path)  # 8-bit values in a 16-bit file: no colour of the table
    with pytest.raises(DataFileError, match=r"colour16.png: 16-bit colour mask with values "
                                            r"that are no 8-bit colour"):
        colour_mask(path, palette)
    lookup = {0: 255, 1: 0, 2: 1}
    labels = fakes.save_png16(np.array([[0, 1], [2, 1]]), tmp_path / "labels16.png")
    assert index_mask(labels, lookup).tolist() == [[255, 0], [1, 0]]
    fakes.save_png16(np.array([[0, 300]]), labels)
    with pytest.raises(DataFileError, match=r"labels16.png: holds value\(s\) \[300\] outside"):
        index_mask(labels, lookup)


def test_16bit_loveda_and_dubai_masks_load_through_their_datamodules(tmp_path: Path):
    stored = fakes.make_fake_loveda(tmp_path / "LoveDA", per_folder=1)
    dm = LoveDADataModule(tmp_path, patch_size=16)
    dm.setup()
    name = dm.splits["val"][0]
    fakes.save_png16(stored[name], dm.pairs[name].mask)
    again = LoveDADataModule(tmp_path, patch_size=16)
    again.setup()
    assert torch.equal(again.val_set[0]["mask"], dm.val_set[0]["mask"])

    labels = fakes.make_fake_dubai(tmp_path / "dubai", tiles=(1, 3), parts=1, black=0)
    mask_path = tmp_path / "dubai" / "Tile 3" / "masks" / "image_part_001.png"
    rgb = np.zeros((*labels["Tile 3/image_part_001"].shape, 3), dtype=np.uint16)
    for index, colour in enumerate(fakes.DUBAI_COLOURS):
        rgb[labels["Tile 3/image_part_001"] == index] = colour
    fakes.save_png16(rgb * 257, mask_path)
    dubai = DubaiAerialDataModule(tmp_path / "dubai")
    dubai.setup()
    assert dubai.val_set[0]["mask"].tolist() == labels["Tile 3/image_part_001"].tolist()


def test_16bit_images_are_refused_naming_the_file(tmp_path: Path):
    path = tmp_path / "image16.png"
    Image.fromarray(np.full((4, 4), 40000, dtype=np.uint16)).save(path)
    with pytest.raises(DataFileError, match=r"image16.png: holds 16-bit pixels; expected an "
                                            r"8-bit PNG image"):
        read_image(path)
