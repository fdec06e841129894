"""3D volumes in the Medical Segmentation Decathlon layout (``data=msd``).

Layout (Antonelli et al. 2022, "The Medical Segmentation Decathlon"; nnU-Net's raw format
follows it)::

    <root>/dataset.json       {"labels": {"0": "background", "1": "spleen"},
                               "modality": {"0": "CT"},
                               "training": [{"image": "./imagesTr/x.nii.gz",
                                             "label": "./labelsTr/x.nii.gz"}, ...]}
    <root>/imagesTr/*.nii.gz  images, 3D (or 4D: one volume per modality, last axis)
    <root>/labelsTr/*.nii.gz  label maps, values the keys of "labels"

NIfTI files are read with nibabel. MONAI transforms do the volume work: ``LoadImaged``,
``EnsureChannelFirstd``, ``Orientationd`` (``data.axcodes``), ``Spacingd``
(``data.pixdim``, voxel size in mm; images bilinear, labels nearest), intensity scaling
(``ScaleIntensityRanged`` windowing of CT into [0, 1], ``NormalizeIntensityd`` z-score of
the non-zero voxels otherwise), and for training ``SpatialPadd`` + ``RandCropByPosNegLabeld``
(random patches of ``data.patch_size`` voxels centred on foreground or background with the
odds ``data.pos_neg``). Validation, test and prediction serve whole volumes (batch 1); the
model infers them with sliding windows.

Batches: ``{"image": float32 [B, C, D, H, W], "mask": int64 [B, D, H, W], "name": [...]}``
(``D, H, W`` the volume's axes after reorientation, in ``data.axcodes`` order).
Classes come from ``dataset.json``: two labels (background + one structure) give a binary
model (``num_classes = 1``), K > 2 labels ``num_classes = K``; ``class_names`` are the
labels' names.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from remat.data.base import SplitDataModule, check_limits
from remat.data.masks import IGNORE_INDEX
from remat.data.splits import split_ids
from remat.data.verify import DataCheckError, should_verify, verify_setting

log = logging.getLogger(__name__)

MSD_LAYOUT = ("<root>/dataset.json, <root>/imagesTr/*.nii.gz, <root>/labelsTr/*.nii.gz "
              "(Medical Segmentation Decathlon)")
NIFTI_SUFFIXES = (".nii.gz", ".nii")
INTENSITY_MODES = ("auto", "ct", "zscore", "none")


def nifti_name(path: str | Path) -> str:
    """A NIfTI file's name without ``.nii.gz`` / ``.nii`` (``spleen_2.nii.gz`` ->
    ``spleen_2``)."""
    name = Path(path).name
    for suffix in NIFTI_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return Path(name).stem


@dataclass(frozen=True)
class VolumePair:
    """One labelled volume: ``name``, ``image`` and ``label`` file paths."""

    name: str
    image: Path
    label: Path


def read_dataset_json(root: Path) -> dict[str, Any]:
    """``<root>/dataset.json``, checked for ``labels`` and ``training``.

    Raises:
        FileNotFoundError: no ``dataset.json`` (names the layout).
        ValueError: not JSON, or ``labels`` / ``training`` missing or malformed; names the
            file.
    """
    path = root / "dataset.json"
    if not path.is_file():
        raise FileNotFoundError(f"data=msd: no dataset.json in {root}; expected {MSD_LAYOUT}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from err
    labels = meta.get("labels") if isinstance(meta, dict) else None
    if not isinstance(labels, dict) or not labels:
        raise ValueError(f"{path}: 'labels' must map label values to names, e.g. "
                         '{"0": "background", "1": "spleen"}')
    try:
        values = sorted(int(k) for k in labels)
    except ValueError as err:
        raise ValueError(f"{path}: 'labels' keys must be integers, got {list(labels)}") from err
    if values != list(range(len(values))):
        raise ValueError(f"{path}: 'labels' keys must be 0..K-1, got {values}")
    training = meta.get("training")
    if not isinstance(training, list) or not training or not all(
            isinstance(t, dict) and "image" in t and "label" in t for t in training):
        raise ValueError(f"{path}: 'training' must list {{'image': ..., 'label': ...}} entries")
    return meta


INFO_KEYS = ("num_classes", "class_names", "in_channels")


def dataset_info(root: Any, key: str) -> Any:
    """One fact of the task at ``root`` read from its ``dataset.json``: ``num_classes``
    (1 for two labels = binary, else the label count), ``class_names`` (label names in
    value order) or ``in_channels`` (modalities). Defaults (1, ``[background,
    foreground]``, 1) when ``root`` is unset or its ``dataset.json`` is missing or bad.

    Raises:
        ValueError: an unknown ``key``.
    """
    if key not in INFO_KEYS:
        raise ValueError(f"remat.msd: key must be one of {INFO_KEYS}, got {key!r}")
    defaults = {"num_classes": 1, "class_names": ["background", "foreground"],
                "in_channels": 1}
    if root is None or not str(root):
        return defaults[key]
    try:
        meta = read_dataset_json(Path(str(root)).expanduser())
    except (OSError, ValueError):
        return defaults[key]
    labels = {int(k): str(v) for k, v in meta["labels"].items()}
    names = [labels[i] for i in range(len(labels))]
    if key == "class_names":
        return names
    if key == "num_classes":
        return 1 if len(names) == 2 else len(names)
    return len(meta.get("modality") or {"0": "unknown"})


def _resolve(root: Path, entry: str) -> Path:
    return (root / entry).resolve() if not Path(entry).is_absolute() else Path(entry)


def list_volume_pairs(root: Path, meta: Mapping[str, Any]) -> list[VolumePair]:
    """The ``training`` entries of ``dataset.json`` as :class:`VolumePair` (paths below
    ``root``).

    Raises:
        FileNotFoundError: an entry names a missing file (names it and the entry).
        ValueError: two entries give one name.
    """
    pairs: list[VolumePair] = []
    seen: set[str] = set()
    for entry in meta["training"]:
        image, label = _resolve(root, entry["image"]), _resolve(root, entry["label"])
        for kind, path in (("image", image), ("label", label)):
            if not path.is_file():
                raise FileNotFoundError(f"{root / 'dataset.json'}: training {kind} "
                                        f"{entry[kind]} is missing ({path})")
        name = nifti_name(image)
        if name in seen:
            raise ValueError(f"{root / 'dataset.json'}: two training entries are named {name}")
        seen.add(name)
        pairs.append(VolumePair(name, image, label))
    return pairs


def check_volume_pair(pair: VolumePair, classes: int, channels: int,
                      atol: float = 1e-3) -> str | None:
    """The problem of one image/label pair, or None: a file nibabel cannot read, an image
    that is not 3D (or 4D with ``channels`` volumes), a label of another shape or affine
    than its image, or label values that are no integer in ``0..classes-1``.

    Args:
        classes: label values allowed (``dataset.json``'s ``labels``).
        channels: volumes per image (``dataset.json``'s ``modality`` entries).
        atol: largest difference of two affines' entries counted as equal (mm).

    Returns:
        ``"<file>: <what is wrong>"``, or None.
    """
    import nibabel as nib

    arrays = {}
    for kind, path in (("image", pair.image), ("label", pair.label)):
        try:
            img = nib.load(str(path))
            arrays[kind] = (img, np.asanyarray(img.dataobj) if kind == "label" else None)
        except Exception as err:  # noqa: BLE001 - nibabel raises many types for a bad file
            return f"{path}: not a readable NIfTI file ({type(err).__name__}: {err})"
    image, (label, values) = arrays["image"][0], arrays["label"]
    shape = tuple(image.shape)
    expected = 3 if channels == 1 else 4
    if len(shape) != expected and not (channels == 1 and len(shape) == 4 and shape[3] == 1):
        return (f"{pair.image}: image of shape {shape}; expected 3D"
                + (f" x {channels} modalities (4D)" if channels > 1 else ""))
    if channels > 1 and shape[3] != channels:
        return f"{pair.image}: {shape[3]} modalities, dataset.json lists {channels}"
    if tuple(label.shape[:3]) != shape[:3] or len(label.shape) > 3 and label.shape[3:] != (1,):
        return (f"{pair.label}: label of shape {tuple(label.shape)} but its image "
                f"{pair.image.name} has {shape[:3]}")
    if not np.allclose(label.affine, image.affine, atol=atol):
        return (f"{pair.label}: affine differs from its image {pair.image.name} "
                f"(label {np.round(label.affine, 3).tolist()} vs image "
                f"{np.round(image.affine, 3).tolist()})")
    found = np.unique(values)
    bad = [v for v in found.tolist() if v != int(v) or not 0 <= int(v) < classes]
    if bad:
        return (f"{pair.label}: label values {bad[:5]} are not among dataset.json's classes "
                f"0..{classes - 1}")
    return None


def verify_volumes(pairs: Sequence[VolumePair], classes: int, channels: int,
                   title: str) -> None:
    """Check every pair (:func:`check_volume_pair`) before training.

    Raises:
        DataCheckError: one line naming each bad file and what is wrong.
    """
    problems = [p for p in (check_volume_pair(pair, classes, channels) for pair in pairs) if p]
    if problems:
        raise DataCheckError(f"{title}: {len(problems)} bad volume(s): " + "; ".join(problems))


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

    def __getitem__(self, index: int) -> dict[str, Any]:
        out = self.finish(self.load({"image": str(self.paths[index])}))
        out.update(name=self.names[index], path=str(self.paths[index]))
        return out


class MSDDataModule(SplitDataModule):
    """A Medical Segmentation Decathlon task folder (module docstring: layout, transforms).

    Args:
        root: the task folder (holding ``dataset.json``). Hydra: ``data.root``.
        patch_size: training patch ``[d, h, w]`` (voxels, after resampling).
        pixdim: voxel size ``[x, y, z]`` (mm) to resample to, or None to keep each volume's.
        axcodes: orientation the volumes are turned to (``RAS``), or None to keep it.
        intensity: ``auto`` (``ct`` when ``dataset.json``'s modality is CT, else
            ``zscore``), ``ct`` (window ``ct_window`` HU to [0, 1], clipped), ``zscore``
            (per channel, non-zero voxels) or ``none``.
        ct_window: ``[low, high]`` HU of the CT window.
        samples_per_volume: random patches drawn per volume and epoch.
        pos_neg: odds ``[pos, neg]`` of a patch centred on foreground / background.
        val_fraction, split_seed: seeded random val share of the ``training`` entries
            (``dataset.json``'s own ``validation`` list, when it has one, wins).
        batch_size, num_workers, pin_memory, seed: loader settings (``seed`` seeds the
            shuffle and the patch draws).
        verify: ``data.verify``: check every volume before a stage runs
            (:func:`verify_volumes`): True, False or ``auto``.
        cache: keep loaded (resampled) volumes in memory between epochs.
        limit_train, limit_val: keep only the first n volumes of a split, or None.
        num_classes, class_names, in_channels: what the config says the task holds (the
            ``remat.msd`` resolver reads them from ``dataset.json``); checked against it.

    Attributes (set at construction from ``dataset.json``): ``num_classes`` (1 = binary),
    ``class_names``, ``in_channels`` (modalities), ``modality``; after ``setup``:
    ``pairs``, ``splits``, the datasets.

    Raises:
        ValueError: bad settings (naming the ``data.`` key) or a malformed ``dataset.json``;
            at ``setup``, an empty split.
        FileNotFoundError: no ``dataset.json`` or a file it names is missing.
        remat.data.verify.DataCheckError: (at ``setup``) bad volumes.
    """

    title = "MSD task"
    ignore_index = IGNORE_INDEX
    #: files ``remat.predict`` reads from an input folder
    input_suffixes = NIFTI_SUFFIXES

    def __init__(self, root: str | Path | None, patch_size: Sequence[int] = (96, 96, 96),
                 pixdim: Sequence[float] | None = (1.5, 1.5, 2.0), axcodes: str | None = "RAS",
                 intensity: str = "auto", ct_window: Sequence[float] = (-175.0, 250.0),
                 samples_per_volume: int = 2, pos_neg: Sequence[float] = (1.0, 1.0),
                 val_fraction: float = 0.2, split_seed: int = 42, batch_size: int = 2,
                 eval_batch_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
                 seed: int = 0, verify: bool | str = "auto", cache: bool = False,
                 limit_train: int | None = None, limit_val: int | None = None,
                 num_classes: int | None = None, class_names: Sequence[str] | None = None,
                 in_channels: int | None = None) -> None:
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
        self._given = {"num_classes": num_classes, "in_channels": in_channels,
                       "class_names": tuple(class_names) if class_names is not None else None}
        self._intensity = intensity
        self._task: dict[str, Any] | None = None
        if self.root is not None:
            self._read()  # a missing or bad dataset.json is named at construction
        self.pairs: dict[str, VolumePair] = {}
        self.splits: dict[str, list[str]] = {}
        self._verified: set[str] = set()
        #: serve every labelled volume as the val split (``remat.eval split=all``)
        self.eval_all = False

    # ---------------------------------------------------------------- dataset.json

    def _read(self) -> dict[str, Any]:
        """What ``dataset.json`` says (read once), checked against the config's values.

        Raises:
            ValueError: ``data.root`` unset; a malformed ``dataset.json``; a config value
                that differs from it.
            FileNotFoundError: no ``dataset.json``.
        """
        if self._task is not None:
            return self._task
        if self.root is None:
            raise ValueError("data.root is not set: give the MSD task folder (the one holding "
                             "dataset.json), e.g. data.root=/data/Task09_Spleen")
        meta = read_dataset_json(self.root)
        labels = {int(k): str(v) for k, v in meta["labels"].items()}
        count = len(labels)
        modality = meta.get("modality") or {"0": "unknown"}
        modalities = [str(modality[k]) for k in sorted(modality, key=int)]
        task = {"meta": meta, "label_count": count,
                "num_classes": 1 if count == 2 else count,
                "class_names": tuple(labels[i] for i in range(count)),
                "modality": modalities, "in_channels": len(modalities),
                "intensity": (("ct" if modalities[0].upper() == "CT" else "zscore")
                              if self._intensity == "auto" else self._intensity)}
        for key, given in self._given.items():
            if given is not None and given != task[key]:
                raise ValueError(f"data.{key}={given!r} but {self.root / 'dataset.json'} "
                                 f"gives {task[key]!r}; leave data.{key} to follow dataset.json")
        self._task = task
        return task

    def _fact(self, key: str, default: Any) -> Any:
        if self.root is None:  # setup() names the missing root
            given = self._given.get(key)
            return default if given is None else given
        return self._read()[key]

    @property
    def meta(self) -> dict[str, Any]:
        """``dataset.json`` as read."""
        return self._read()["meta"]

    @property
    def num_classes(self) -> int:
        """1 for two labels (binary), else the label count."""
        return self._fact("num_classes", 1)

    @property
    def class_names(self) -> tuple[str, ...]:
        """Label names in value order (background first)."""
        return self._fact("class_names", ("background", "foreground"))

    @property
    def in_channels(self) -> int:
        """Modalities (image channels)."""
        return self._fact("in_channels", 1)

    @property
    def label_count(self) -> int:
        """Label values ``dataset.json`` allows (``0..label_count-1``)."""
        return self._fact("label_count", 2)

    @property
    def modality(self) -> list[str]:
        """``dataset.json``'s modality names, in channel order."""
        return self._fact("modality", ["unknown"])

    @property
    def intensity(self) -> str:
        """The intensity scaling in use (``auto`` resolved by the modality)."""
        return self._fact("intensity", "zscore" if self._intensity == "auto"
                          else self._intensity)

    # ---------------------------------------------------------------- transforms

    def load_transform(self, keys: Sequence[str] = ("image", "label")) -> Any:
        """The deterministic MONAI pipeline: read, channel first, orient, resample, scale."""
        from monai import transforms as mt

        keys = list(keys)
        steps: list[Any] = [mt.LoadImaged(keys, reader="NibabelReader", image_only=True),
                            mt.EnsureChannelFirstd(keys)]
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

    def list_pairs(self) -> list[VolumePair]:
        """Every ``training`` entry of ``dataset.json``."""
        return list_volume_pairs(self.root, self.meta)

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """``dataset.json``'s own ``validation`` list when it has one, else a seeded
        ``val_fraction`` of the names.

        Raises:
            ValueError: fewer than 2 volumes, or a ``validation`` entry that is no training
                volume.
        """
        own = self.meta.get("validation")
        if isinstance(own, list) and own:
            held = [nifti_name(e["image"] if isinstance(e, dict) else e) for e in own]
            unknown = [n for n in held if n not in names]
            if unknown:
                raise ValueError(f"{self.root / 'dataset.json'}: validation names {unknown} "
                                 "are no training volumes")
            return {"train": [n for n in names if n not in held], "val": held}
        if len(names) < 2:
            raise ValueError(f"{self.title} at {self.root} holds {len(names)} volume(s); a "
                             "train/val split needs at least 2")
        val = min(len(names) - 1, max(1, round(self.val_fraction * len(names))))
        train, held = split_ids(list(names), val, self.split_seed)
        return {"train": train, "val": held}

    def setup(self, stage: str | None = None) -> None:
        """List and split the volumes, run the data check on the splits ``stage`` reads,
        and build the datasets."""
        self._read()
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
            self.val_set = VolumeDataset([self.pairs[n] for n in splits["val"]], load,
                                         cache=self.cache)
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": ("val",)}.get(
            stage, ("train", "val"))
        if stage == "fit" and not self.splits.get("train"):
            raise ValueError(f"{self.title} at {self.root}: no train split")
        todo = [k for k in wanted if k in self.splits and k not in self._verified]
        pairs = [self.pairs[n] for k in todo for n in self.splits[k]]
        if pairs and should_verify(self.verify, 2 * len(pairs)):
            verify_volumes(pairs, self.label_count, self.in_channels,
                           f"{self.title} at {self.root} ({' and '.join(todo)} split)")
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


__all__ = ["MSDDataModule", "VolumeDataset", "VolumePair", "check_volume_pair",
           "list_volume_pairs", "nifti_name", "read_dataset_json", "verify_volumes"]
