"""Finding a dataset's folder and pairing its files, in the layout its publisher ships.

:func:`find_dataset_root` resolves the ``data.root`` setting (the dataset folder, or a folder
that holds it such as ``$REMAT_DATA_DIR``); :func:`list_files` and :func:`match_pairs` pair
images with masks by name, with errors that name what is missing and the expected layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from remat.data.pairs import ImageMaskPair

_SHOW = 5  # how many offending names an error message lists


def listing(names: Iterable[str]) -> str:
    """The first five names in natural order (:func:`natural_key`: the same message for the
    same files, whatever order they were found in), comma-separated, then "and N more (M in
    all)"."""
    ordered = sorted((str(n) for n in names), key=natural_key)
    shown = ", ".join(ordered[:_SHOW])
    more = len(ordered) - _SHOW
    return shown + (f" and {more} more ({len(ordered)} in all)" if more > 0 else "")


def list_files(folder: Path, endings: Iterable[str]) -> dict[str, Path]:
    """``{name: path}`` of the files in ``folder`` whose name ends with one of ``endings``
    (case-insensitive); the name is the file name without that ending, e.g.
    ``list_files(p, ["_training.tif"])`` maps ``"21"`` to ``p/21_training.tif``. Hidden files
    are skipped; a missing folder gives ``{}``."""
    endings = tuple(e.lower() for e in endings)
    found: dict[str, Path] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        lower = path.name.lower()
        if path.name.startswith(".") or not path.is_file():
            continue
        for ending in endings:
            if lower.endswith(ending) and len(lower) > len(ending):
                found.setdefault(path.name[: len(path.name) - len(ending)], path)
                break
    return found


def match_pairs(images: Mapping[str, Path], masks: Mapping[str, Path], where: str,
                layout: str, valid: Mapping[str, Path] | None = None,
                prefix: str = "", root: Path | None = None,
                kind: str = "mask") -> list[ImageMaskPair]:
    """Pair images with masks (and FOV masks) by name.

    Args:
        images, masks, valid: ``{name: path}`` as from :func:`list_files`.
        where: the folder and dataset, for messages.
        layout: the expected layout, for messages.
        prefix: prepended to every name (``"Tile 1/"``, ``"train/"``) to keep names unique.
        root: messages name files relative to it (``images/cju0.jpg``); None: bare file names.
        kind: what the layout calls the second file of a pair: ``mask``, or ``label`` for
            volumes (MSD / nnU-Net label maps).

    Returns:
        Pairs sorted by name.

    Raises:
        FileNotFoundError: no images, or an image lacks its mask (or FOV mask), or a mask lacks
            its image; the message gives each count and lists the first five files of each
            kind (:func:`listing`) and the layout.
    """
    if not images:
        raise FileNotFoundError(f"no images found in {where}; expected {layout}")

    def shown(files: Mapping[str, Path], names: Iterable[str]) -> str:
        return listing([str(files[n].relative_to(root)) if root else files[n].name
                         for n in names])

    problems = []
    kinds = [(kind, masks)] + ([("FOV mask", valid)] if valid is not None else [])
    for what, files in kinds:
        lone = sorted(images.keys() - files.keys())
        if lone:
            problems.append(f"{len(lone)} image(s) without a {what}: {shown(images, lone)}")
    lone_masks = sorted(masks.keys() - images.keys())
    if lone_masks:
        problems.append(f"{len(lone_masks)} {kind}(s) without an image: "
                        f"{shown(masks, lone_masks)}")
    if problems:
        raise FileNotFoundError(f"{where} is incomplete; " + "; ".join(problems)
                                + f". Expected {layout}")
    return [ImageMaskPair(prefix + n, images[n], masks[n], valid[n] if valid else None)
            for n in sorted(images)]


def find_dataset_root(root: str | Path | None, *, title: str, folder: str, layout: str,
                      url: str, is_root: Callable[[Path], bool],
                      subfolders: Sequence[str] = (), required: Sequence[str] = ()) -> Path:
    """Resolve the ``data.root`` setting to the folder that holds a dataset's layout.

    Tries ``root``, ``root/<folder>`` and, below each, every one of ``subfolders`` (e.g. a
    release archive's own top folder), and returns the first for which ``is_root`` holds.

    Args:
        root: the setting; ``~`` is expanded.
        title, folder, layout, url: the dataset's name, usual folder name, expected layout and
            download page, for messages.
        is_root: whether a candidate folder holds the layout.
        required: sub-folders the layout needs; the message names those ``root`` lacks.

    Raises:
        ValueError: ``root`` is None or blank; says how to set it.
        FileNotFoundError: no candidate holds the layout; names ``data.root=<root>``, whether
            it is missing or what it lacks, the layout and where to get the data.
    """
    if root is None or not str(root).strip():
        if "://" not in url:  # a user's own folder: no dataset folder name, no download
            raise ValueError(f"data.root is not set for {title}: pass data.root=/path/to/"
                             f"your/folder (a folder with {layout})")
        raise ValueError(
            f"data.root is not set for {title}: pass data.root=/path/to/{folder} "
            f"(a folder with {layout}) or set REMAT_DATA_DIR to the folder that holds "
            f"{folder}/. Get the data from {url}"
        )
    given = Path(root).expanduser()
    for base in (given, given / folder):
        for candidate in (base, *(base / sub for sub in subfolders)):
            if is_root(candidate):
                return candidate
    if not given.exists():
        state = "does not exist"
    else:
        lacking = [f"{d}/" for d in required if not (given / d).is_dir()]
        state = "lacks " + ", ".join(lacking) if lacking else "does not hold that layout"
    places = f"{given}" + (f" or {given / folder}/" if folder else "")
    below = (f", or in {' or '.join(f'{s}/' for s in subfolders)} below "
             f"{'either' if folder else 'it'}" if subfolders else "")
    source = f". Get it from {url}" if "://" in url else ""  # not for a user's own folder
    raise FileNotFoundError(
        f"data.root={given} ({title}) {state}. Expected layout: {layout} (in {places}{below})"
        f"{source}"
    )


def natural_key(name: str) -> tuple:
    """Sort key that orders digit runs by value: ``"2" < "10"``, ``"tile2" < "tile10"``."""
    parts: list[Any] = []
    number = ""
    text = ""
    for char in name:
        if char.isdigit():
            if text:
                parts.append((1, text))
                text = ""
            number += char
        else:
            if number:
                parts.append((0, int(number)))
                number = ""
            text += char
    if number:
        parts.append((0, int(number)))
    if text:
        parts.append((1, text))
    return tuple(parts)
