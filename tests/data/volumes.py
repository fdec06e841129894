"""Tiny MSD task folders written in the published layout (``dataset.json``, ``imagesTr/``,
``labelsTr/``, gzipped NIfTI through nibabel), for the volume tests.

Each label map is drawn first (a ball of class 1 and, for 3-class tasks, a box of class 2)
and the CT image is painted from it in Hounsfield units (soft tissue inside the CT
window), so a model can learn it in a few steps and the predictions are checkable.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SPLEEN_LABELS = {"0": "background", "1": "spleen"}


def draw_labels(shape: Sequence[int], seed: int, classes: int = 2) -> np.ndarray:
    """uint8 label map ``shape``: a ball of 1s (radius about a quarter of the side) at a
    seeded place; with ``classes == 3`` also a box of 2s."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"))
    centre = np.array([rng.integers(s // 3, s - s // 3) for s in shape]).reshape(3, 1, 1, 1)
    radius = min(shape) / 4
    labels = (((grid - centre) ** 2).sum(0) <= radius**2).astype(np.uint8)
    if classes == 3:
        labels[1:shape[0] // 4, 1:shape[1] // 4, 1:shape[2] // 4] = 2
    return labels


def paint_ct(labels: np.ndarray, seed: int) -> np.ndarray:
    """int16 HU image of a label map: fat (-100) outside, 60 HU for class 1, 150 for 2."""
    rng = np.random.default_rng(seed + 1000)
    image = np.full(labels.shape, -100.0) + rng.normal(0, 20, labels.shape)
    image[labels == 1] = 60 + rng.normal(0, 10, int((labels == 1).sum()))
    image[labels == 2] = 150 + rng.normal(0, 10, int((labels == 2).sum()))
    return image.astype(np.int16)


def affine_for(spacing: Sequence[float]) -> np.ndarray:
    """A diagonal LPS-style affine (x and y flipped, as scanners write) with ``spacing``."""
    affine = np.diag([-float(spacing[0]), -float(spacing[1]), float(spacing[2]), 1.0])
    affine[:3, 3] = [10.0, 20.0, -30.0]
    return affine


def save_nifti(array: np.ndarray, affine: np.ndarray, path: Path) -> Path:
    """Write ``array`` with ``affine`` as (gzipped) NIfTI-1."""
    import nibabel as nib

    path.parent.mkdir(parents=True, exist_ok=True)
    img = nib.Nifti1Image(array, affine)
    img.header.set_xyzt_units("mm")
    nib.save(img, str(path))
    return path


def write_msd_task(root: Path, count: int = 3, shape: Sequence[int] = (32, 32, 32),
                   spacing: Sequence[float] = (1.0, 1.0, 1.0), classes: int = 2,
                   prefix: str = "spleen", validation: Sequence[str] | None = None,
                   test_count: int = 1) -> Path:
    """An MSD task folder ``root`` with ``count`` labelled volumes ``<prefix>_<i>`` (and
    ``test_count`` unlabelled ones in ``imagesTs``); returns ``root``."""
    labels_meta = dict(SPLEEN_LABELS) if classes == 2 else {
        "0": "background", "1": "organ", "2": "lesion"}
    affine = affine_for(spacing)
    training = []
    for i in range(count):
        labels = draw_labels(shape, seed=i, classes=classes)
        save_nifti(paint_ct(labels, i), affine, root / "imagesTr" / f"{prefix}_{i}.nii.gz")
        save_nifti(labels, affine, root / "labelsTr" / f"{prefix}_{i}.nii.gz")
        training.append({"image": f"./imagesTr/{prefix}_{i}.nii.gz",
                         "label": f"./labelsTr/{prefix}_{i}.nii.gz"})
    tests = []
    for i in range(test_count):
        labels = draw_labels(shape, seed=100 + i, classes=classes)
        save_nifti(paint_ct(labels, 100 + i), affine, root / "imagesTs" / f"{prefix}_t{i}.nii.gz")
        tests.append(f"./imagesTs/{prefix}_t{i}.nii.gz")
    meta = {"name": "Spleen", "description": "tiny synthetic task", "tensorImageSize": "3D",
            "modality": {"0": "CT"}, "labels": labels_meta, "numTraining": count,
            "numTest": test_count, "training": training, "test": tests}
    if validation is not None:
        meta["validation"] = [{"image": f"./imagesTr/{n}.nii.gz",
                               "label": f"./labelsTr/{n}.nii.gz"} for n in validation]
    (root / "dataset.json").write_text(json.dumps(meta, indent=2))
    return root


def write_volume_folder(root: Path, count: int = 4, shape: Sequence[int] = (24, 24, 24),
                        suffix: str = ".nii.gz", classes: int = 2,
                        spacing: Sequence[float] = (1.0, 1.0, 1.0),
                        images: str = "images/{}", labels: str = "labels/{}") -> Path:
    """A user's volume folder ``root`` (``data=volumes``): ``count`` CT volumes
    ``case<i>`` and their label maps, as gzipped NIfTI (``suffix=".nii.gz"``, affine from
    ``spacing``) or NumPy arrays (``".npy"``: int16 images, uint8 labels, no affine);
    ``images``/``labels`` place the files (``{}`` is ``case<i>`` plus the suffix).
    Returns ``root``."""
    for i in range(count):
        label = draw_labels(shape, seed=i, classes=classes)
        image = paint_ct(label, i)
        for array, pattern in ((image, images), (label, labels)):
            path = root / pattern.format(f"case{i}{suffix}")
            if suffix == ".npy":
                path.parent.mkdir(parents=True, exist_ok=True)
                np.save(path, array)
            else:
                save_nifti(array, affine_for(spacing), path)
    return root
