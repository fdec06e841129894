"""Predicted masks written to files: what ``python -m remat.predict`` runs.

Inputs are a folder (every image below it that a glob matches) or one file; each prediction
is the trained model's whole-image output at the image's own size (sliding windows when
``model.inference`` is set, see :meth:`remat.models.SegmentationModule.predict_step`).
:class:`MaskWriter`, a Lightning ``BasePredictionWriter``, writes one mask per image in the
encoding of the run's data (:func:`mask_format`): binary masks as 0/255 grey PNGs, label maps
as grey PNGs of class indices, palette masks as palette PNGs, colour masks in their colours;
optionally the class probabilities as ``.npy``; and a ``predictions.csv`` of what was written.
:class:`VolumeMaskWriter` writes volumes (``data=msd``) as NIfTI label maps on the grid of
each input file: its shape, affine and header.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from PIL import Image

from remat.data.folder import IMAGE_SUFFIXES
from remat.data.io import DataFileError
from remat.data.verify import DataCheckError, problem_lines

FORMATS = ("auto", "index", "binary", "palette", "colors")


def _strip(name: str, suffixes: Sequence[str]) -> str:
    """``name`` without the longest of ``suffixes`` it ends with (case-insensitive)."""
    for suffix in sorted(suffixes, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def refuse_output_inside(source: str | Path, output: str | Path) -> None:
    """Refuse an ``output`` folder inside (or equal to) the ``source`` folder: a later run
    on that folder would predict on this run's masks as images.

    Raises:
        ValueError: names both settings.
    """
    path = Path(str(source)).expanduser()
    if path.is_dir() and Path(str(output)).expanduser().resolve().is_relative_to(
            path.resolve()):
        raise ValueError(f"output={output} lies inside input={source}: a later predict on "
                         "that folder would read these masks as images; give an output "
                         "folder outside it")


def list_inputs(source: str | Path, pattern: str = "**/*",
                suffixes: Sequence[str] = IMAGE_SUFFIXES) -> tuple[list[Path], list[str]]:
    """The image files to predict and their output names.

    Args:
        source: a folder, or one image file.
        pattern: glob below a folder; files with one of ``suffixes`` only (default
            :data:`IMAGE_SUFFIXES`; volumes: ``.nii.gz``, ``.nii``). Names are the paths
            below the folder without the suffix (``site1/case3``); a single file's name is
            its name without the suffix.

    Raises:
        FileNotFoundError: ``source`` does not exist, or the folder holds no image (names
            the folder, the glob and the suffixes looked for).
        ValueError: two files give one name (``a.png`` and ``a.jpg``).
    """
    path = Path(str(source)).expanduser()
    suffixes = tuple(s.lower() for s in suffixes)
    if path.is_file():
        return [path], [_strip(path.name, suffixes)]
    if not path.is_dir():
        raise FileNotFoundError(f"input={source}: no such file or folder (give a folder of "
                                "images or one image file)")
    files = sorted(p for p in path.glob(pattern) if p.is_file()
                   and p.name.lower().endswith(suffixes) and not p.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"input={source}: no image matches {pattern!r} there "
                                f"(suffixes {', '.join(suffixes)})")
    names = [_strip(str(PurePosixPath(*p.relative_to(path).parts)), suffixes) for p in files]
    seen: dict[str, Path] = {}
    for name, file in zip(names, files, strict=True):
        if name in seen:
            raise ValueError(f"input={source}: {seen[name]} and {file} both give the output "
                             f"name {name!r}; keep one of them")
        seen[name] = file
    return files, names


def _default_palette(classes: int) -> list[tuple[int, int, int]]:
    """Distinct colours for class indices (PASCAL VOC's bit-interleaved colour map)."""
    colours = []
    for index in range(max(classes, 2)):
        r = g = b = 0
        value = index
        for shift in range(7, -1, -1):
            r |= (value & 1) << shift
            g |= ((value >> 1) & 1) << shift
            b |= ((value >> 2) & 1) << shift
            value >>= 3
        colours.append((r, g, b))
    return colours


def mask_format(datamodule: Any, num_classes: int, setting: str = "auto"
                ) -> tuple[str, list[tuple[int, int, int]] | None]:
    """``(kind, colours)`` of the masks to write: ``auto`` follows the run's data
    (``binary`` for a binary model, then the datamodule's ``mask_encoding``: ``index``,
    ``palette`` with the palette of its first mask where one is found, or ``colors`` with
    its colour table); any other ``setting`` as given.

    Raises:
        ValueError: an unknown ``setting``, ``binary`` for a multi-class model, or
            ``colors`` without a colour table.
    """
    if setting not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {setting!r}")
    encoding = getattr(datamodule, "mask_encoding", None)
    kind = setting
    if setting == "auto":
        kind = "binary" if num_classes == 1 else (
            encoding if encoding in ("palette", "colors") else "index")
    if kind == "binary" and num_classes != 1:
        raise ValueError(f"format=binary writes 0/255 masks of a binary model; this one has "
                         f"{num_classes} classes (use index, palette or colors)")
    if kind == "colors":
        colours = list(getattr(datamodule, "colours", None) or [])
        if not colours:
            raise ValueError("format=colors needs the run's colour table (data.colors); use "
                             "index or palette")
        return kind, colours
    if kind == "palette":
        palette = getattr(datamodule, "mask_palette", None)
        found = palette() if callable(palette) else None
        return kind, found or _default_palette(max(2, num_classes))
    return kind, None


class MaskWriter(BasePredictionWriter):
    """Write each predicted mask (and, optionally, its probabilities) as a file.

    Args:
        output: the folder; ``<output>/<name>.png`` per image (sub-folders of names made).
        kind, colours: from :func:`mask_format`.
        probabilities: also write ``<output>/probabilities/<name>.npy``, float16
            ``[K, H, W]`` (binary: ``[1, H, W]``, the foreground probability).

    After the loop, ``<output>/predictions.csv`` lists ``name, image, mask, height, width``
    and each class's share of the pixels (``fraction_<k>``), and :attr:`rows` holds it.
    """

    def __init__(self, output: str | Path, kind: str, colours: Sequence[tuple[int, int, int]]
                 | None = None, probabilities: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.output = Path(output)
        self.kind, self.colours, self.probabilities = kind, colours, probabilities
        self.rows: list[dict[str, Any]] = []

    def _image(self, labels: np.ndarray) -> Image.Image:
        if self.kind == "binary":
            return Image.fromarray((labels > 0).astype(np.uint8) * 255, mode="L")
        if self.kind == "index":
            return Image.fromarray(labels.astype(np.uint8), mode="L")
        assert self.colours is not None
        if self.kind == "palette":
            img = Image.fromarray(labels.astype(np.uint8), mode="P")
            flat = [c for colour in self.colours for c in colour]
            img.putpalette(flat + [0] * (768 - len(flat)))
            return img
        table = np.asarray(self.colours, dtype=np.uint8)
        return Image.fromarray(table[labels], mode="RGB")

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: dict[str, Any],
                           batch_indices: Any, batch: Any, batch_idx: int,
                           dataloader_idx: int = 0) -> None:
        labels = prediction["labels"].cpu().numpy()
        probs = prediction["probabilities"]
        for i, name in enumerate(prediction["name"]):
            target = self.output / f"{name}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            self._image(labels[i]).save(target)
            row: dict[str, Any] = {"name": name, "image": prediction["path"][i],
                                   "mask": str(target), "height": int(labels[i].shape[0]),
                                   "width": int(labels[i].shape[1])}
            counts = np.bincount(labels[i].reshape(-1), minlength=max(2, probs.shape[1]))
            row.update({f"fraction_{k}": round(float(c) / labels[i].size, 6)
                        for k, c in enumerate(counts)})
            if self.probabilities:
                npy = self.output / "probabilities" / f"{name}.npy"
                npy.parent.mkdir(parents=True, exist_ok=True)
                np.save(npy, probs[i].cpu().to(torch.float16).numpy())
                row["probabilities"] = str(npy)
            self.rows.append(row)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        write_rows(self.output, self.rows)


def write_rows(output: Path, rows: Sequence[dict[str, Any]]) -> None:
    """``<output>/predictions.csv`` of ``rows`` (nothing when there are none)."""
    if not rows:
        return
    with (output / "predictions.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


class VolumeMaskWriter(BasePredictionWriter):
    """Write each predicted volume as a NIfTI label map ``<output>/<name>.nii.gz`` on its
    input file's grid: the probabilities go back through the datamodule's inverse
    orientation and resampling (``datamodule.restore_labels``), and the file keeps the
    input's affine and header (data type uint8, class indices). An ``.npy`` input (no
    affine) gets ``<output>/<name>.npy``: uint8 class indices of the input array's shape.

    Args:
        output: the folder (sub-folders of names made).
        datamodule: the run's volume datamodule (:class:`remat.data.MSDDataModule`,
            :class:`remat.data.VolumeFolderDataModule`).
        binary: the model has one output channel (foreground probability).

    After the loop, ``<output>/predictions.csv`` lists ``name, image, mask`` and the
    volume's shape and each class's share of the voxels (``fraction_<k>``); :attr:`rows`
    holds it.
    """

    def __init__(self, output: str | Path, datamodule: Any, binary: bool) -> None:
        super().__init__(write_interval="batch")
        self.output, self.datamodule, self.binary = Path(output), datamodule, binary
        self.rows: list[dict[str, Any]] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: dict[str, Any],
                           batch_indices: Any, batch: Any, batch_idx: int,
                           dataloader_idx: int = 0) -> None:
        import nibabel as nib

        probs = prediction["probabilities"]
        for i, name in enumerate(prediction["name"]):
            source = prediction["path"][i]
            labels = self.datamodule.restore_labels(probs[i], source, self.binary)
            if str(source).lower().endswith(".npy"):  # no affine to keep: an array again
                target = self.output / f"{name}.npy"
                target.parent.mkdir(parents=True, exist_ok=True)
                np.save(target, labels)
                self._row(name, source, target, labels, probs.shape[1])
                continue
            reference = nib.load(source)
            header = reference.header.copy()
            header.set_data_dtype(np.uint8)
            image = nib.Nifti1Image(labels, reference.affine, header)
            image.set_qform(reference.get_qform(), code=int(reference.header["qform_code"]))
            image.set_sform(reference.get_sform(), code=int(reference.header["sform_code"]))
            target = self.output / f"{name}.nii.gz"
            target.parent.mkdir(parents=True, exist_ok=True)
            nib.save(image, str(target))
            self._row(name, source, target, labels, probs.shape[1])

    def _row(self, name: str, source: str, target: Path, labels: np.ndarray,
             channels: int) -> None:
        counts = np.bincount(labels.reshape(-1), minlength=max(2, channels))
        row: dict[str, Any] = {"name": name, "image": source, "mask": str(target),
                               "shape": "x".join(str(v) for v in labels.shape)}
        row.update({f"fraction_{k}": round(float(c) / labels.size, 6)
                    for k, c in enumerate(counts)})
        self.rows.append(row)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        write_rows(self.output, self.rows)


def _problem(dataset: Any, path: Path) -> DataFileError | None:
    try:
        dataset.check(path)
    except DataFileError as err:
        return err if err.path is not None else DataFileError(path=path, problem=str(err))
    except (OSError, ValueError, EOFError) as err:
        text = str(err).strip().splitlines()
        problem = text[0] if text else type(err).__name__
        return DataFileError(path=path, problem=problem.removeprefix(f"{path}: "))
    return None


def check_inputs(dataset: Any, source: str | Path) -> None:
    """Open every input of a prediction dataset (its ``check(path)``: images decoded, volume
    headers read) before any mask is written, so one unreadable file does not stop a run
    halfway with part of the output written.

    Raises:
        remat.data.verify.DataCheckError: names every unreadable file (the first five per
            kind of problem, then a count) and how to go on.
    """
    paths = list(dataset.paths)
    # decoding releases the GIL: a few threads overlap reads with decoding
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        problems = [p for p in pool.map(lambda path: _problem(dataset, path), paths) if p]
    if problems:
        raise DataCheckError("\n".join([
            f"input={source}: {len(problems)} of {len(paths)} file(s) cannot be read; no "
            "mask was written:", *problem_lines(problems),
            "Fix or remove them, or choose the others with images=<glob>."]), problems)


def check_output(output: Path, overwrite: bool) -> list[Path]:
    """Refuse an output folder that already holds files (earlier predictions are not
    written over) unless ``overwrite``; return the files it holds.

    Raises:
        FileExistsError: names the folder, how many files it holds and the two ways on.
    """
    if output.is_file():
        raise FileExistsError(f"output={output} is a file; give a folder")
    held = [p for p in output.rglob("*") if p.is_file()] if output.is_dir() else []
    if held and not overwrite:
        raise FileExistsError(f"output={output} already holds {len(held)} file(s); give "
                              "another folder, or overwrite=true to write over them")
    return held


def stale_files(held: Sequence[Path], rows: Sequence[dict[str, Any]]) -> list[Path]:
    """The files of ``held`` (in the output folder before an ``overwrite=true`` run) that
    the run did not write again (``rows``: its ``predictions.csv`` rows; the list itself is
    rewritten): masks of inputs this run did not have. They are left in place."""
    written = {Path(str(r[k])).resolve() for r in rows for k in ("mask", "probabilities")
               if r.get(k)}
    return [p for p in held if p.name != "predictions.csv" and p.resolve() not in written]
