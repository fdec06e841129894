"""A user's own 3D volumes: a folder of images and label maps (``data=volumes``).

Layouts (``data.root`` is the folder):

* ``images/`` and ``labels/`` holding files of the same name: ``images/case1.nii.gz`` pairs
  with ``labels/case1.nii.gz`` (or ``.nii``, ``.npy``; the two of a pair may differ); other
  names through the globs ``data.images`` and ``data.labels``, whose first ``*`` is the
  pair's name (``img/img*.nii.gz`` and ``label/label*.nii.gz`` pair ``img0001.nii.gz`` with
  ``label0001.nii.gz``, BTCV's layout);
* the same inside ``train/``, ``val/`` and ``test/`` sub-folders, which are then the splits;
* or a CSV file (``data.pairs``) with the columns ``image`` and ``label`` (paths relative to
  the CSV's folder) and optionally ``split`` (train / val / test) and ``name``.

Without sub-folder or CSV splits a seeded random ``data.val_fraction`` of the volumes is
val. Pairing is :func:`remat.data.folder.list_folder_pairs`, the 2D folder's own.

Files: NIfTI (``.nii``, ``.nii.gz``) with their affine, or NumPy ``.npy`` arrays, read with
the identity affine (1 mm voxels, axes as RAS: resampling with ``data.pixdim`` treats them
as 1 mm). 3D files hold one channel, 4D files ``data.in_channels`` on their last axis.
Label maps hold the class values ``0..K-1`` (``K = 2`` for ``data.num_classes=1``, binary).
Transforms, patches, the data check and prediction are :mod:`remat.data.volume_seg`'s,
shared with ``data=msd``; ``remat.predict`` writes a NIfTI input's labels as ``.nii.gz``
with the input's affine, and an ``.npy`` input's as ``.npy`` (uint8, the input's grid).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.data.folder import list_folder_pairs
from remat.data.volume_seg import VOLUME_SUFFIXES, VolumePair, VolumeSegDataModule, volume_name

VOLUMES_LAYOUT = ("images/<name>.nii.gz|.nii|.npy and labels/<name>.nii.gz|.nii|.npy (or "
                  "data.images / data.labels globs; or train/, val/, test/ sub-folders holding "
                  "them; or data.pairs=<csv> with columns image,label[,split])")


class VolumeFolderDataModule(VolumeSegDataModule):
    """A user's own folder of 3D volumes and label maps (``data=volumes``; layouts in the
    module docstring).

    Args:
        root: the folder. Hydra: ``data.root``.
        images, labels: globs below ``root`` (or below each split folder); a pair shares
            the name (:func:`remat.data.folder.glob_names`; a glob ending in ``*`` takes
            ``.nii.gz``, ``.nii`` and ``.npy`` files).
        pairs: a CSV of ``image,label[,split][,name]`` rows instead of the globs.
        num_classes: 1 for binary (labels 0/1), else K (labels ``0..K-1``).
        class_names: one name per label value (binary: 2), or None (``background`` and
            ``foreground``, or ``class0..``).
        in_channels: image channels (4D files: volumes on the last axis).
        intensity: ``zscore``, ``ct`` (window ``ct_window`` HU to [0, 1]), ``none``; ``auto``
            is ``zscore`` (a folder states no modality).
        pixdim: voxel size (mm) to resample to, or None (default) to keep each volume's.
        **kwargs: the settings of :class:`~remat.data.volume_seg.VolumeSegDataModule`.

    Raises:
        ValueError: (at construction) a bad class count, class names or channel count,
            naming the ``data.`` key; (at ``setup``) an unset root, a split without volumes,
            two files of one name, a malformed CSV.
        FileNotFoundError: (at ``setup``) no images, unpaired files, a missing CSV.
        remat.data.verify.DataCheckError: (at ``setup``) bad volumes, or files a CSV row
            names that are missing (listed together).
    """

    title = "volume folder"
    root_hint = ("data.root is not set: give the folder of your volumes (holding images/ and "
                 f"labels/), e.g. data.root=/data/my_volumes; expected {VOLUMES_LAYOUT}")
    source = "data.num_classes"
    channel_source = "data.in_channels"
    input_suffixes = VOLUME_SUFFIXES

    def __init__(self, root: str | Path | None, images: str = "images/*",
                 labels: str = "labels/*", pairs: str | Path | None = None,
                 num_classes: int = 1, class_names: Sequence[str] | None = None,
                 in_channels: int = 1, intensity: str = "zscore",
                 pixdim: Sequence[float] | None = None, **kwargs: Any) -> None:
        super().__init__(root, intensity=intensity, pixdim=pixdim, **kwargs)
        for key, value in (("num_classes", num_classes), ("in_channels", in_channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{key} must be an int >= 1, got {value!r}"
                                 + (" (1 = binary)" if key == "num_classes" else ""))
        count = max(2, num_classes)
        if class_names is not None and len(class_names) != count:
            raise ValueError(f"data.class_names has {len(class_names)} names for {count} "
                             f"label values (data.num_classes={num_classes}; binary: "
                             f"background and foreground): {list(class_names)}")
        names = tuple(str(n) for n in class_names) if class_names is not None else (
            ("background", "foreground") if num_classes == 1
            else tuple(f"class{i}" for i in range(count)))
        self.images, self.labels = str(images), str(labels)
        self.pairs_csv = Path(str(pairs)).expanduser() if pairs else None
        self._facts = {"num_classes": num_classes, "class_names": names,
                       "in_channels": in_channels, "label_count": count,
                       "modality": [f"channel{i}" for i in range(in_channels)],
                       "intensity": "zscore" if intensity == "auto" else intensity}
        self._listed_splits: dict[str, list[str]] = {}

    def facts(self) -> dict[str, Any]:
        """The config's classes and channels (``data.num_classes``, ``data.class_names``,
        ``data.in_channels``)."""
        return self._facts

    def list_pairs(self) -> list[VolumePair]:
        """Pairs of the CSV, of each split folder, or of ``root``."""
        found, self._listed_splits = list_folder_pairs(
            self.root, self.images, self.labels, self.pairs_csv, suffixes=VOLUME_SUFFIXES,
            masks_key="data.labels", mask_column="label", name_of=volume_name,
            layout=VOLUMES_LAYOUT, what="volume folder")
        return [VolumePair(p.name, p.image, p.mask) for p in found]

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """The layout's own splits (folders, CSV column), else a seeded ``val_fraction``."""
        if self._listed_splits:
            return {k: list(v) for k, v in self._listed_splits.items()}
        return super().default_split(names)

    def describe(self) -> str:
        """One line: folder, classes, channels, patch."""
        return (f"{self.root}: {self.in_channels} channel(s), classes "
                f"{list(self.class_names)}, patch {self.patch_size}, "
                f"spacing {self.pixdim or 'native'}")


__all__ = ["VOLUMES_LAYOUT", "VolumeFolderDataModule"]
