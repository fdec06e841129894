"""Deterministic train/val(/test) splits and split files.

Datasets without an official split get a seeded random one (:func:`split_ids`) or hold out
their last names (:func:`tail_split`); ``data.split_file`` replaces either
(:func:`load_split_file`), and :func:`check_split` refuses empty or overlapping splits.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from omegaconf import OmegaConf

from remat.data.layout import listing


def load_split_file(path: str | Path, names: Iterable[str]) -> dict[str, list[str]]:
    """Read a split file and check it against the dataset.

    The file is YAML (or JSON) mapping ``train``, ``val`` and ``test`` (any of them: training
    needs train and val, an evaluation only the split it scores) to lists of sample names as
    the datamodule prints them (e.g. ``"Tile 3/image_part_001"`` or ``"25"``).

    Raises:
        FileNotFoundError: the file is missing, or it names samples the dataset does not have
            (the message lists them and the key).
        ValueError: not a mapping of lists, an unknown key, or no key at all.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.split_file {path} does not exist")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    if not isinstance(raw, dict) or not all(isinstance(v, list) for v in raw.values()):
        raise ValueError(f"split file {path} must map train/val[/test] to lists of names")
    unknown = sorted(set(raw) - {"train", "val", "test"})
    if unknown or not raw:
        raise ValueError(f"split file {path} must have keys among train, val and test (train "
                         f"and val to train; val or test alone to evaluate); got {sorted(raw)}")
    known = set(names)
    for key, listed in raw.items():
        missing = [str(n) for n in listed if str(n) not in known]
        if missing:
            raise FileNotFoundError(
                f"split file {path} ({key}) names {len(missing)} image(s) that are not in the "
                f"dataset: {listing(missing)}"
            )
    return {key: [str(n) for n in listed] for key, listed in raw.items()}


def check_split(split: Mapping[str, Sequence[str]], source: str,
                required: Sequence[str] = ("train", "val")) -> None:
    """Raise ``ValueError`` if a ``required`` split is missing, any listed split is empty,
    or a name sits in two splits; ``source`` says where the split came from."""
    for key in (*required, *split):
        if not split.get(key):
            raise ValueError(f"the {key} split is empty ({source}); every split needs at least "
                             "one image")
    seen: dict[str, str] = {}
    for key, names in split.items():
        for name in names:
            if name in seen and seen[name] != key:
                raise ValueError(f"{name} is in both the {seen[name]} and the {key} split "
                                 f"({source})")
            seen[name] = key


def split_ids(ids: Sequence[str], val_size: int, split_seed: int) -> tuple[list[str], list[str]]:
    """Deterministic random train/val split (880/120 for Kvasir-SEG, Jha et al. 2021).

    Sorts ``ids``, shuffles them with ``random.Random(split_seed)`` and returns the first
    ``len(ids) - val_size`` as train and the rest as val, whatever the input order.

    Raises:
        ValueError: ``val_size`` is < 1 or >= ``len(ids)`` (names ``val_size``).
    """
    if not 1 <= val_size < len(ids):
        raise ValueError(
            f"data.val_size must be between 1 and {len(ids) - 1} for {len(ids)} image/mask "
            f"pairs, got {val_size}"
        )
    order = sorted(ids)
    random.Random(split_seed).shuffle(order)
    cut = len(order) - val_size
    return order[:cut], order[cut:]


def tail_split(names: Sequence[str], count: int, key: str) -> tuple[list[str], list[str]]:
    """``names`` (in order) minus their last ``count``, and those last ``count``.

    Raises:
        ValueError: ``count`` leaves either part empty; names the config key ``key``.
    """
    if not 1 <= count < len(names):
        raise ValueError(f"data.{key} must be between 1 and {len(names) - 1} for "
                         f"{len(names)} images, got {count}")
    cut = len(names) - count
    return list(names[:cut]), list(names[cut:])
