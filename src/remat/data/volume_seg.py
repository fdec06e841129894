"""The shared base of the 3D volume datamodules (``data=msd``, ``data=volumes``): labelled
volume pairs, the data check, the MONAI transform pipeline, patch and whole-volume datasets,
splits, and prediction on a volume's own grid.

Files are NIfTI (``.nii``/``.nii.gz``, read with nibabel) or NumPy ``.npy`` arrays. A NIfTI
file carries its affine (voxel axes to scanner mm); an ``.npy`` array carries none and is
read with the identity affine (1 mm voxels, axes taken as RAS, the MONAI ``NumpyReader``'s
default). A 3D file holds one channel; a 4D file holds ``in_channels`` volumes on its last
axis (as the Medical Segmentation Decathlon stores modalities).

MONAI transforms do the volume work: ``LoadImaged``, ``EnsureChannelFirstd``,
``Orientationd`` (``data.axcodes``), ``Spacingd`` (``data.pixdim``, voxel size in mm; images
bilinear, labels nearest), intensity scaling (``ScaleIntensityRanged`` windowing of CT into
[0, 1], ``NormalizeIntensityd`` z-score of the non-zero voxels), and for training
``SpatialPadd`` + ``RandCropByPosNegLabeld`` (random patches of ``data.patch_size`` voxels
centred on foreground or background at the odds ``data.pos_neg``). Validation, test and
prediction serve whole volumes (batch 1); the model infers them with sliding windows.

Batches: ``{"image": float32 [B, C, D, H, W], "mask": int64 [B, D, H, W], "name": [...]}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from remat.data.base import SplitDataModule, check_limits
from remat.data.layout import natural_key
from remat.data.masks import IGNORE_INDEX
from remat.data.splits import split_ids
from remat.data.verify import DataCheckError, should_verify, splits_title, verify_setting

log = logging.getLogger(__name__)

NIFTI_SUFFIXES = (".nii.gz", ".nii")
NUMPY_SUFFIXES = (".npy",)
VOLUME_SUFFIXES = NIFTI_SUFFIXES + NUMPY_SUFFIXES
INTENSITY_MODES = ("auto", "ct", "zscore", "none")


def volume_name(path: str | Path) -> str:
    """A volume file's name without ``.nii.gz`` / ``.nii`` / ``.npy`` (``spleen_2.nii.gz``
    -> ``spleen_2``)."""
    name = Path(path).name
    for suffix in VOLUME_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return Path(name).stem


def is_numpy(path: str | Path) -> bool:
    """Whether ``path`` is a NumPy ``.npy`` file (read with the identity affine)."""
    return str(path).lower().endswith(NUMPY_SUFFIXES)


@dataclass(frozen=True)
class VolumePair:
    """One labelled volume: ``name``, ``image`` and ``label`` file paths."""

    name: str
    image: Path
    label: Path


def read_volume(path: Path, data: bool) -> tuple[tuple[int, ...], np.ndarray, np.ndarray | None]:
    """A volume file's shape, affine ``[4, 4]`` (mm) and, if ``data``, its voxels.

    NIfTI through nibabel (its affine); ``.npy`` through ``numpy.load`` (memory-mapped, no
    pickles; the identity affine).

    Raises:
        ValueError: the file is not a readable NIfTI / ``.npy`` file (names it and what was
            expected).
    """
    if is_numpy(path):
        try:
            array = np.load(str(path), mmap_mode="r", allow_pickle=False)
        except Exception as err:  # noqa: BLE001 - numpy raises many types for a bad file
            raise ValueError(f"{path}: not a readable .npy array ({type(err).__name__}: "
                             f"{err}); expected a NumPy array saved with numpy.save") from err
        return tuple(array.shape), np.eye(4), (np.asarray(array) if data else None)
    import nibabel as nib

    try:
        img = nib.load(str(path))
        values = np.asanyarray(img.dataobj) if data else None
    except Exception as err:  # noqa: BLE001 - nibabel raises many types for a bad file
        raise ValueError(f"{path}: not a readable NIfTI file ({type(err).__name__}: "
                         f"{err})") from err
    return tuple(img.shape), np.asarray(img.affine), values


def missing_volume_files(pair: VolumePair) -> list[tuple[Path, str]]:
    """The pair's files that do not exist, image first, each with its kind: ``(path,
    "label")``."""
    return [(path, kind) for kind, path in (("image", pair.image), ("label", pair.label))
            if not Path(path).is_file()]


def check_volume_pair(pair: VolumePair, classes: int, channels: int,
                      atol: float = 1e-3, source: str = "the task",
                      channel_source: str | None = None,
                      found_values: set[int] | None = None) -> str | None:
    """The problem of one image/label pair, or None: a file that cannot be read, an image
    that is not 3D (or 4D with ``channels`` volumes on its last axis), a label of another
    shape or affine than its image, or label values that are no integer in
    ``0..classes-1``.

    Args:
        classes: label values allowed.
        channels: volumes per image.
        atol: largest difference of two affines' entries counted as equal (mm).
        source: where ``classes`` come from, for messages
        channel_source: where ``channels`` comes from (default: ``source``)
            (``dataset.json``, ``data.num_classes``).
        found_values: a set the label values of a good pair are added to.

    Returns:
        ``"<file>: <what is wrong>"`` with what was expected (every missing file of the
        pair: ``"<file>: label file not found; expected the label of volume <name>"``), or
        None.
    """
    missing = missing_volume_files(pair)
    if missing:
        return "; ".join(f"{path}: {kind} file not found; expected the {kind} of volume "
                         f"{pair.name}" for path, kind in missing)
    try:
        shape, image_affine, _ = read_volume(pair.image, data=False)
        label_shape, label_affine, values = read_volume(pair.label, data=True)
    except ValueError as err:
        return str(err)
    channel_source = channel_source or source
    expected = 3 if channels == 1 else 4
    if len(shape) != expected and not (channels == 1 and len(shape) == 4 and shape[3] == 1):
        return (f"{pair.image}: image of shape {shape}; expected 3D"
                + (f" x {channels} channels on the last axis (4D)" if channels > 1 else "")
                + f" ({channel_source}={channels})")
    if channels > 1 and shape[3] != channels:
        return (f"{pair.image}: {shape[3]} channels; expected {channels} "
                f"({channel_source}={channels})")
    if tuple(label_shape[:3]) != shape[:3] or len(label_shape) > 3 and label_shape[3:] != (1,):
        return (f"{pair.label}: label of shape {tuple(label_shape)} but its image "
                f"{pair.image.name} has {shape[:3]}")
    if not np.allclose(label_affine, image_affine, atol=atol):
        return (f"{pair.label}: affine differs from its image {pair.image.name} "
                f"(label {np.round(label_affine, 3).tolist()} vs image "
                f"{np.round(image_affine, 3).tolist()}); expected the same voxel grid")
    found = np.unique(values)
    bad = [v for v in found.tolist() if v != int(v) or not 0 <= int(v) < classes]
    if bad:
        hint = ""
        if source.startswith("data.") and all(v == int(v) and v >= 0 for v in bad):
            hint = (f"; more classes? set {source}={int(max(bad)) + 1} "
                    "(and data.class_names to name them)")
        return (f"{pair.label}: label values {bad[:5]} are not among {source}'s classes "
                f"0..{classes - 1}{hint}")
    if found_values is not None:
        found_values.update(int(v) for v in found.tolist())
    return None


def verify_volumes(pairs: Sequence[VolumePair], classes: int, channels: int,
                   title: str, source: str = "the task",
                   channel_source: str | None = None) -> None:
    """Check every pair (:func:`check_volume_pair`) before training; a class no label holds
    (``data.num_classes=3`` on 0/1 labels) is a warning: its Dice is empty, and the model
    learns never to predict it.

    Raises:
        DataCheckError: one line naming each bad file (in the natural order of the pairs'
            names) and what is wrong.
    """
    start = time.perf_counter()
    ordered = sorted(pairs, key=lambda pair: natural_key(pair.name))  # split order is random
    found: set[int] = set()
    problems = [p for p in (check_volume_pair(pair, classes, channels, source=source,
                                              channel_source=channel_source, found_values=found)
                            for pair in ordered) if p]
    if problems:
        raise DataCheckError(f"{title}: {len(problems)} bad volume(s): " + "; ".join(problems))
    absent = [v for v in range(classes) if v not in found]
    if absent:
        log.warning("data check of %s: label value(s) %s appear in no label file (classes "
                    "0..%d from %s; values found: %s); check %s against the labels", title,
                    absent, classes - 1, source, sorted(found), source)
    log.info("data check of %s: %d volume pairs read in %.1f s, none bad", title,
             len(ordered), time.perf_counter() - start)


def _plain(value: Any) -> torch.Tensor:
    """A MONAI ``MetaTensor`` (or array) as a plain tensor, metadata dropped."""
    value = value.as_tensor() if hasattr(value, "as_tensor") else value
    return torch.as_tensor(value)


class ToSegSample:
    """MONAI dict -> remat sample: ``label`` ``[1, D, H, W]`` becomes ``mask`` int64
    ``[D, H, W]``; ``image`` float32 plain tensor (no MONAI metadata)."""

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        out = {"image": _plain(data["image"]).float().contiguous()}
        if "label" in data:
            out["mask"] = _plain(data["label"])[0].round().long().contiguous()
        return out


class VolumeDataset(Dataset):
    """Volumes through MONAI transforms: ``load`` (deterministic: read, orient, resample,
    scale) then, for training, ``crop`` (random patches), each sample drawn with a seed from
    torch's generator (so a seeded loader repeats itself, and workers differ).

    Items: ``{"image": float32 [C, D, H, W], "mask": int64 [D, H, W], "name": str}``;
    training length is ``len(pairs) * samples_per_volume``.
    """

    def __init__(self, pairs: Sequence[VolumePair], load: Any, crop: Any | None = None,
                 samples_per_volume: int = 1, cache: bool = False) -> None:
        self.pairs = list(pairs)
        self.load, self.crop = load, crop
        self.samples = samples_per_volume if crop is not None else 1
        self.cache = cache
        self._cached: dict[int, Any] = {}
        self.finish = ToSegSample()

    def __len__(self) -> int:
        return len(self.pairs) * self.samples

    def _loaded(self, index: int) -> Any:
        if index in self._cached:
            return self._cached[index]
        pair = self.pairs[index]
        data = self.load({"image": str(pair.image), "label": str(pair.label)})
        if self.cache:
            self._cached[index] = data
        return data

    def __getitem__(self, index: int) -> dict[str, Any]:
        pair_index = index // self.samples
        data = self._loaded(pair_index)
        if self.crop is not None:
            self.crop.set_random_state(seed=int(torch.randint(0, 2**31 - 1, ()).item()))
            data = self.crop(dict(data))
            data = data[0] if isinstance(data, list) else data
        out = self.finish(data)
        out["name"] = self.pairs[pair_index].name
        return out


class PredictVolumes(Dataset):
    """Unlabelled volumes read as the evaluation volumes are, for ``remat.predict``: items
    ``{"image": float32 [C, D, H, W], "name": str, "path": str}``."""

    def __init__(self, paths: Sequence[Path], names: Sequence[str], load: Any) -> None:
        self.paths, self.names, self.load = list(paths), list(names), load
        self.finish = ToSegSample()

    def __len__(self) -> int:
        return len(self.paths)

    def check(self, path: Path) -> None:
        """Open one input's header (``remat.predict`` checks every input before it writes a
        mask; the voxels are read when the volume is predicted).

        Raises:
            ValueError: not a readable NIfTI / ``.npy`` file (:func:`read_volume`), or not
                3D (4D: channels on the last axis).
        """
        shape, _, _ = read_volume(path, data=False)
        if len(shape) not in (3, 4):
            raise ValueError(f"{path}: image of shape {shape}; expected a 3D volume (4D: "
                             "channels on the last axis)")

    def __getitem__(self, index: int) -> dict[str, Any]:
        out = self.finish(self.load({"image": str(self.paths[index])}))
        out.update(name=self.names[index], path=str(self.paths[index]))
        return out


class VolumeSegDataModule(SplitDataModule):
    """Labelled 3D volumes: settings, transforms, splits, data check and prediction shared
    by the volume datamodules. Subclasses say where the pairs and the task's facts come from.

    Subclass hooks:
        :meth:`facts` (``num_classes``, ``class_names``, ``in_channels``, ``label_count``,
        ``modality``, ``intensity``), :meth:`list_pairs`, optionally :meth:`default_split`;
        class attributes ``title``, ``root_hint`` (the message for an unset ``data.root``)
        and ``source`` (where the classes come from, for the data check's messages).

    Args:
        root: the folder. Hydra: ``data.root``.
        patch_size: training patch ``[d, h, w]`` (voxels, after resampling).
        pixdim: voxel size ``[x, y, z]`` (mm) to resample to, or None to keep each volume's.
        axcodes: orientation the volumes are turned to (``RAS``), or None to keep it.
        intensity: ``ct`` (window ``ct_window`` HU to [0, 1], clipped), ``zscore`` (per
            channel, non-zero voxels), ``none``, or ``auto`` (the subclass decides).
        ct_window: ``[low, high]`` HU of the CT window.
        samples_per_volume: random patches drawn per volume and epoch.
        pos_neg: odds ``[pos, neg]`` of a patch centred on foreground / background.
        val_fraction, split_seed: seeded random val share when the layout has no splits.
        batch_size, eval_batch_size, num_workers, pin_memory, seed: loader settings
            (``seed`` seeds the shuffle and the patch draws).
        verify: ``data.verify``: check every volume before a stage runs
            (:func:`verify_volumes`): True, False or ``auto``.
        cache: keep loaded (resampled) volumes in memory between epochs.
        limit_train, limit_val: keep only the first n volumes of a split, or None.

    Raises:
        ValueError: bad settings (naming the ``data.`` key); at ``setup``, an unset root or
            an empty split.
        remat.data.verify.DataCheckError: (at ``setup``) bad volumes.
    """

    title = "volumes"
    root_hint = "data.root is not set"
    source = "the task"
    channel_source: str | None = None  # where in_channels comes from (default: source)
    ignore_index = IGNORE_INDEX
    #: files ``remat.predict`` reads from an input folder
    input_suffixes: tuple[str, ...] = NIFTI_SUFFIXES

    def __init__(self, root: str | Path | None, patch_size: Sequence[int] = (96, 96, 96),
                 pixdim: Sequence[float] | None = (1.5, 1.5, 2.0), axcodes: str | None = "RAS",
                 intensity: str = "auto", ct_window: Sequence[float] = (-175.0, 250.0),
                 samples_per_volume: int = 2, pos_neg: Sequence[float] = (1.0, 1.0),
                 val_fraction: float = 0.2, split_seed: int = 42, batch_size: int = 2,
                 eval_batch_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
                 seed: int = 0, verify: bool | str = "auto", cache: bool = False,
                 limit_train: int | None = None, limit_val: int | None = None) -> None:
        super().__init__(batch_size, num_workers, pin_memory, loader_seed=seed,
                         eval_batch_size=eval_batch_size)
        patch = [int(v) for v in patch_size]
        if len(patch) != 3 or min(patch) < 1:
            raise ValueError(f"data.patch_size must be [d, h, w] voxels, got {list(patch_size)}")
        if intensity not in INTENSITY_MODES:
            raise ValueError(f"data.intensity must be one of {INTENSITY_MODES}, got "
                             f"{intensity!r}")
        if not 0.0 < float(val_fraction) < 1.0:
            raise ValueError(f"data.val_fraction must be between 0 and 1, got {val_fraction!r}")
        if int(samples_per_volume) < 1:
            raise ValueError(f"data.samples_per_volume must be >= 1, got {samples_per_volume}")
        check_limits(limit_train=limit_train, limit_val=limit_val)
        self.root = Path(str(root)).expanduser() if root is not None and str(root) else None
        self.patch_size = patch
        self.pixdim = [float(v) for v in pixdim] if pixdim is not None else None
        self.axcodes = axcodes
        self.ct_window = [float(v) for v in ct_window]
        self.samples_per_volume = int(samples_per_volume)
        self.pos_neg = [float(v) for v in pos_neg]
        self.val_fraction, self.split_seed = float(val_fraction), int(split_seed)
        self.verify = verify_setting(verify)
        self.cache = bool(cache)
        self.limit_train, self.limit_val = limit_train, limit_val
        self._intensity = intensity
        self.pairs: dict[str, VolumePair] = {}
        self.splits: dict[str, list[str]] = {}
        self._verified: set[str] = set()
        #: serve every labelled volume as the val split (``remat.eval split=all``)
        self.eval_all = False

    # ---------------------------------------------------------------- subclass hooks

    def facts(self) -> dict[str, Any]:
        """The task's ``num_classes`` (1 = binary), ``class_names``, ``in_channels``,
        ``label_count`` (label values ``0..label_count-1``), ``modality`` (channel names)
        and ``intensity`` (``auto`` resolved)."""
        raise NotImplementedError

    def list_pairs(self) -> list[VolumePair]:
        """Every labelled volume below :attr:`root`."""
        raise NotImplementedError

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """A seeded ``val_fraction`` of the names (at least one each).

        Raises:
            ValueError: fewer than 2 volumes.
        """
        if len(names) < 2:
            raise ValueError(f"{self.title} at {self.root} holds {len(names)} volume(s); a "
                             "train/val split needs at least 2")
        val = min(len(names) - 1, max(1, round(self.val_fraction * len(names))))
        train, held = split_ids(list(names), val, self.split_seed)
        return {"train": train, "val": held}

    # ---------------------------------------------------------------- facts

    @property
    def num_classes(self) -> int:
        """1 for two labels (binary), else the label count."""
        return self.facts()["num_classes"]

    @property
    def class_names(self) -> tuple[str, ...]:
        """Label names in value order (background first)."""
        return tuple(self.facts()["class_names"])

    @property
    def in_channels(self) -> int:
        """Image channels (modalities)."""
        return self.facts()["in_channels"]

    @property
    def label_count(self) -> int:
        """Label values allowed (``0..label_count-1``)."""
        return self.facts()["label_count"]

    @property
    def modality(self) -> list[str]:
        """Channel names (modalities), in channel order."""
        return list(self.facts()["modality"])

    @property
    def intensity(self) -> str:
        """The intensity scaling in use (``auto`` resolved)."""
        return self.facts()["intensity"]

    # ---------------------------------------------------------------- transforms

    def load_transform(self, keys: Sequence[str] = ("image", "label")) -> Any:
        """The deterministic MONAI pipeline: read (NIfTI by nibabel, ``.npy`` by numpy),
        channel first, orient, resample, scale."""
        from monai import transforms as mt
        from monai.data import NumpyReader

        keys = list(keys)
        # reader=None: LoadImage picks the reader by file suffix (NIfTI: MONAI's default
        # NibabelReader, tried before the other defaults), instead of trying each reader in
        # turn, where every NIfTI file first failed in the NumpyReader and logged an INFO
        # line "NumpyReader: unable to load ..." per file and key.
        load = mt.LoadImaged(keys, reader=None, image_only=True)
        # registered last, so tried first for the suffixes it reads: 4D arrays hold channels last
        load.register(NumpyReader(channel_dim=-1 if self.in_channels > 1 else None))
        steps: list[Any] = [load, mt.EnsureChannelFirstd(keys)]
        if self.axcodes:
            steps.append(mt.Orientationd(keys, axcodes=self.axcodes,
                                         labels=(("L", "R"), ("P", "A"), ("I", "S"))))
        if self.pixdim is not None:
            modes = ["bilinear" if k == "image" else "nearest" for k in keys]
            steps.append(mt.Spacingd(keys, pixdim=self.pixdim, mode=modes))
        if self.intensity == "ct":
            low, high = self.ct_window
            steps.append(mt.ScaleIntensityRanged("image", a_min=low, a_max=high, b_min=0.0,
                                                 b_max=1.0, clip=True))
        elif self.intensity == "zscore":
            steps.append(mt.NormalizeIntensityd("image", nonzero=True, channel_wise=True))
        return mt.Compose(steps)

    def crop_transform(self) -> Any:
        """The random part of training: pad to the patch, crop by foreground/background."""
        from monai import transforms as mt

        keys = ["image", "label"]
        pos, neg = self.pos_neg
        return mt.Compose([
            mt.SpatialPadd(keys, spatial_size=self.patch_size),
            mt.RandCropByPosNegLabeld(keys, label_key="label", spatial_size=self.patch_size,
                                      pos=pos, neg=neg, num_samples=1, image_key="image",
                                      image_threshold=0),
        ])

    # ---------------------------------------------------------------- setup

    def setup(self, stage: str | None = None) -> None:
        """List and split the volumes, build the datasets and run the data check on the
        splits ``stage`` reads (titled ``all splits`` under ``eval_all``); without it
        (``data.verify=false``, or ``auto`` over the limit) the files are still looked for.

        Raises:
            ValueError: no ``data.root``; ``fit`` without a train split.
            remat.data.verify.DataCheckError: bad or missing volume files (every one listed).
        """
        if self.root is None:
            raise ValueError(self.root_hint)
        self.facts()
        if not self.pairs:
            pairs = self.list_pairs()
            self.pairs = {p.name: p for p in pairs}
            names = sorted(self.pairs)
            splits = {"val": names} if self.eval_all else self.default_split(names)
            for key, limit in (("train", self.limit_train), ("val", self.limit_val)):
                if key in splits:
                    splits[key] = splits[key][:limit]
            self.splits = splits
            load = self.load_transform()
            self.train_set = VolumeDataset([self.pairs[n] for n in splits.get("train", [])],
                                           load, self.crop_transform(),
                                           self.samples_per_volume, self.cache) \
                if splits.get("train") else None
            self.val_set = VolumeDataset([self.pairs[n] for n in splits.get("val", [])], load,
                                         cache=self.cache) if splits.get("val") else None
            self.test_set = VolumeDataset([self.pairs[n] for n in splits["test"]], load,
                                          cache=self.cache) if splits.get("test") else None
        test = "test" if self.splits.get("test") else "val"
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": (test,)}.get(
            stage, ("train", "val"))
        for key in wanted if stage is not None else ():
            if not self.splits.get(key):
                raise ValueError(f"{self.title} at {self.root}: no {key} split")
        todo = [k for k in wanted if k in self.splits and k not in self._verified]
        pairs = [self.pairs[n] for k in todo for n in self.splits[k]]
        title = f"{self.title} at {self.root} ({splits_title(todo, self.eval_all)})"
        if pairs and should_verify(self.verify, 2 * len(pairs)):
            verify_volumes(pairs, self.label_count, self.in_channels, title,
                           self.source, self.channel_source)
        elif pairs:  # not read: still looked for, so a missing file stops the run here
            missing = sorted((f"{path} (the {kind} of volume {pair.name})" for pair in pairs
                              for path, kind in missing_volume_files(pair)), key=natural_key)
            if missing:
                raise DataCheckError(f"{title}: {len(missing)} of {2 * len(pairs)} volume "
                                     "files are missing: " + "; ".join(missing))
        self._verified.update(todo)

    # ---------------------------------------------------------------- prediction

    def predict_dataset(self, paths: Sequence[Path], names: Sequence[str]) -> PredictVolumes:
        """Unlabelled volumes read as val volumes are (for ``remat.predict``)."""
        return PredictVolumes(paths, names, self.load_transform(("image",)))

    def restore_labels(self, probabilities: torch.Tensor, path: str | Path,
                       binary: bool) -> np.ndarray:
        """Class indices of one prediction on the grid of its input file: the
        probabilities ``[K, D, H, W]`` (binary: ``K = 1``, the foreground's) are taken back
        through the inverse of the orientation and resampling (MONAI ``Compose.inverse``,
        bilinear), then thresholded at 0.5 (binary) or argmax-ed.

        Returns:
            uint8 ``[X, Y, Z]``: the input file's voxel grid (its shape and affine).
        """
        from monai.data import MetaTensor

        load = self.load_transform(("image",))
        reference = load({"image": str(path)})["image"]
        pred = MetaTensor(probabilities.detach().cpu().float(), meta=dict(reference.meta),
                          applied_operations=list(reference.applied_operations))
        back = load.inverse({"image": pred})["image"]
        back = torch.as_tensor(back)
        labels = (back[0] > 0.5) if binary else back.argmax(dim=0)
        return labels.to(torch.uint8).numpy()

    def describe(self) -> str:
        """One line: folder, modality, classes, patch."""
        return (f"{self.root}: {', '.join(self.modality)}, classes "
                f"{list(self.class_names)}, patch {self.patch_size}, "
                f"spacing {self.pixdim or 'native'}")


__all__ = ["NIFTI_SUFFIXES", "VOLUME_SUFFIXES", "PredictVolumes", "VolumeDataset",
           "VolumePair", "VolumeSegDataModule", "check_volume_pair", "is_numpy",
           "missing_volume_files", "read_volume", "verify_volumes", "volume_name"]
