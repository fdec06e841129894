"""3D volumes in the Medical Segmentation Decathlon layout (``data=msd``).

Layout (Antonelli et al. 2022, "The Medical Segmentation Decathlon"; nnU-Net's raw format
follows it)::

    <root>/dataset.json       {"labels": {"0": "background", "1": "spleen"},
                               "modality": {"0": "CT"},
                               "training": [{"image": "./imagesTr/x.nii.gz",
                                             "label": "./labelsTr/x.nii.gz"}, ...]}
    <root>/imagesTr/*.nii.gz  images, 3D (or 4D: one volume per modality, last axis)
    <root>/labelsTr/*.nii.gz  label maps, values the keys of "labels"

NIfTI files are read with nibabel; the MONAI transforms, patches, data check and prediction
are those of :mod:`remat.data.volume_seg`, shared with ``data=volumes``.

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
from pathlib import Path
from typing import Any

from remat.data.layout import listing
from remat.data.volume_seg import (
    INTENSITY_MODES,
    NIFTI_SUFFIXES,
    PredictVolumes,
    VolumeDataset,
    VolumePair,
    VolumeSegDataModule,
    check_volume_pair,
    verify_volumes,
    volume_name,
)

log = logging.getLogger(__name__)

MSD_LAYOUT = ("<root>/dataset.json, <root>/imagesTr/*.nii.gz, <root>/labelsTr/*.nii.gz "
              "(Medical Segmentation Decathlon)")
#: what one ``training`` entry of ``dataset.json`` looks like, for messages
TRAINING_ENTRY = ('{"image": "./imagesTr/<case>.nii.gz", "label": "./labelsTr/<case>.nii.gz"}, '
                  "paths relative to the task folder")
#: a NIfTI file's name without ``.nii.gz`` / ``.nii`` (``spleen_2.nii.gz`` -> ``spleen_2``)
nifti_name = volume_name


def read_dataset_json(root: Path) -> dict[str, Any]:
    """``<root>/dataset.json``, checked for ``labels`` and ``training``.

    Raises:
        FileNotFoundError: no ``dataset.json`` (names ``data.root``, whether it exists, the
            task folders it holds, and the layout).
        ValueError: not JSON, or ``labels`` / ``training`` missing or malformed; names the
            file, and for a bad ``training`` entry its index (``training[3]``), what is wrong
            with it and what an entry looks like.
    """
    path = root / "dataset.json"
    if not path.is_file():
        if not root.is_dir():
            state = "does not exist" if not root.exists() else "is not a folder"
        else:
            tasks = sorted(p.name for p in root.iterdir() if (p / "dataset.json").is_file())
            state = "holds no dataset.json" + (
                f" (it holds the task folder(s) {listing(tasks)}: pass data.root="
                f"{root / tasks[0]})" if tasks else "")
        raise FileNotFoundError(f"data.root={root} (data=msd) {state}; expected an MSD task "
                                f"folder: {MSD_LAYOUT}")
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
    if not isinstance(training, list) or not training:
        raise ValueError(f"{path}: 'training' must list entries {TRAINING_ENTRY}")
    for index, entry in enumerate(training):
        problem = _entry_problem(entry)
        if problem is not None:
            raise ValueError(f"{path}: training[{index}] {problem}; expected {TRAINING_ENTRY}")
    return meta


def _described(value: Any) -> str:
    """``"an int (7)"``, ``"a str ('x')"``, ``"null"``: a JSON value for messages."""
    if value is None:
        return "null"
    name = type(value).__name__
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({shown})"


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one ``training`` entry (``"has no 'label'"``), or None."""
    if not isinstance(entry, dict):
        return f"is {_described(entry)}, not an object"
    absent = [key for key in ("image", "label") if key not in entry]
    if absent:
        return "has no " + " and no ".join(f"'{key}'" for key in absent)
    for key in ("image", "label"):
        value = entry[key]
        if not isinstance(value, str):
            return f"'{key}' is {_described(value)}, not a path"
        if not value.strip():
            return f"'{key}' is an empty string"
    return None


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
    ``root``). Files are not looked for here: the data check lists every missing one with
    the other bad volumes (:func:`remat.data.volume_seg.check_volume_pair`).

    Raises:
        ValueError: two entries give one name.
    """
    pairs: list[VolumePair] = []
    seen: set[str] = set()
    for entry in meta["training"]:
        image, label = _resolve(root, entry["image"]), _resolve(root, entry["label"])
        name = nifti_name(image)
        if name in seen:
            raise ValueError(f"{root / 'dataset.json'}: two training entries are named {name}")
        seen.add(name)
        pairs.append(VolumePair(name, image, label))
    return pairs


class MSDDataModule(VolumeSegDataModule):
    """A Medical Segmentation Decathlon task folder (module docstring: layout; transforms in
    :mod:`remat.data.volume_seg`).

    Args:
        root: the task folder (holding ``dataset.json``). Hydra: ``data.root``.
        intensity: ``auto`` (``ct`` when ``dataset.json``'s modality is CT, else
            ``zscore``), ``ct``, ``zscore`` or ``none``.
        val_fraction, split_seed: seeded random val share of the ``training`` entries
            (``dataset.json``'s own ``validation`` list, when it has one, wins).
        num_classes, class_names, in_channels: what the config says the task holds (the
            ``remat.msd`` resolver reads them from ``dataset.json``); checked against it.
        **kwargs: the settings of :class:`~remat.data.volume_seg.VolumeSegDataModule`
            (``patch_size``, ``pixdim``, ``axcodes``, ``ct_window``, ``samples_per_volume``,
            ``pos_neg``, loader settings, ``verify``, ``cache``, ``limit_train``,
            ``limit_val``).

    Attributes (set at construction from ``dataset.json``): ``num_classes`` (1 = binary),
    ``class_names``, ``in_channels`` (modalities), ``modality``; after ``setup``:
    ``pairs``, ``splits``, the datasets.

    Raises:
        ValueError: bad settings (naming the ``data.`` key) or a malformed ``dataset.json``;
            at ``setup``, an empty split.
        FileNotFoundError: no ``dataset.json``.
        remat.data.verify.DataCheckError: (at ``setup``) bad volumes, or files a
            ``training`` entry names that are missing (listed together).
    """

    title = "MSD task"
    root_hint = ("data.root is not set: give the MSD task folder (the one holding "
                 "dataset.json), e.g. data.root=/data/Task09_Spleen")
    source = "dataset.json"

    def __init__(self, root: str | Path | None, intensity: str = "auto",
                 num_classes: int | None = None, class_names: Sequence[str] | None = None,
                 in_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(root, intensity=intensity, **kwargs)
        self._given = {"num_classes": num_classes, "in_channels": in_channels,
                       "class_names": tuple(class_names) if class_names is not None else None}
        self._task: dict[str, Any] | None = None
        if self.root is not None:
            self._read()  # a missing or bad dataset.json is named at construction

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
            raise ValueError(self.root_hint)
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

    def facts(self) -> dict[str, Any]:
        """``dataset.json``'s facts; without ``data.root``, the config's values or the
        binary defaults (``setup`` names the missing root)."""
        if self.root is not None:
            return self._read()
        defaults = {"num_classes": 1, "class_names": ("background", "foreground"),
                    "in_channels": 1, "label_count": 2, "modality": ["unknown"],
                    "intensity": "zscore" if self._intensity == "auto" else self._intensity}
        return {k: v if self._given.get(k) is None else self._given[k]
                for k, v in defaults.items()}

    @property
    def meta(self) -> dict[str, Any]:
        """``dataset.json`` as read."""
        return self._read()["meta"]

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
        return super().default_split(names)


__all__ = ["INTENSITY_MODES", "MSDDataModule", "NIFTI_SUFFIXES", "PredictVolumes",
           "VolumeDataset", "VolumePair", "check_volume_pair", "list_volume_pairs",
           "nifti_name", "read_dataset_json", "verify_volumes"]
