"""The data check that runs before training: decode every file of the splits a run reads, once,
and report every bad one (file, what is wrong, what was expected) in one error.

Bad files otherwise surface one at a time, mid-epoch, when a batch first meets them. The check
is ``data.verify``: ``true``, ``false``, or ``auto`` (the default: on when the splits to read
hold at most :data:`AUTO_MAX_FILES` files, so small and medium datasets are always checked and
a 25,000-file set does not spend its first minutes decoding).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from remat.data.io import DataFileError
from remat.data.layout import natural_key
from remat.data.pairs import ImageMaskPair, ImageReader, MaskDecoder, inspect_pair, missing_file

log = logging.getLogger(__name__)

AUTO_MAX_FILES = 3000  # data.verify=auto checks splits of up to this many files


class DataCheckError(ValueError):
    """Bad files found by the data check.

    Attributes:
        problems: one :class:`remat.data.io.DataFileError` per problem (``path``,
            ``problem``, ``expected``), in file order.
    """

    def __init__(self, message: str, problems: Sequence[DataFileError] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


def verify_setting(value: bool | str) -> bool | str:
    """Check a ``data.verify`` value: ``True``, ``False`` or ``"auto"``.

    Raises:
        ValueError: anything else; names ``data.verify``.
    """
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(f"data.verify must be true, false or auto, got {value!r}")


def should_verify(setting: bool | str, files: int) -> bool:
    """Whether to check ``files`` files under ``data.verify=setting``."""
    return setting is True or (setting == "auto" and files <= AUTO_MAX_FILES)


def splits_title(splits: Sequence[str], every: bool = False) -> str:
    """What a data check covers, for its title: ``"all splits"`` when ``every`` (``remat.eval
    split=all`` serves every labelled pair as one split), else ``"val split"``,
    ``"train and val splits"``."""
    if every:
        return "all splits"
    return " and ".join(splits) + (" splits" if len(splits) > 1 else " split")


def check_files_exist(pairs: Sequence[ImageMaskPair], title: str) -> None:
    """The check that runs when the files are not decoded (``data.verify=false``, or
    ``auto`` over :data:`AUTO_MAX_FILES` files): every file of ``pairs`` exists, so a file
    a layout or ``data.pairs`` names but that is not there stops the run before training,
    not mid-epoch.

    Raises:
        DataCheckError: one or more missing files; the message lists every one (natural
            order of the paths): path, which file of which pair it is.
    """
    problems = [missing_file(pair, key) for pair in pairs
                for key, path in (("image", pair.image), ("mask", pair.mask),
                                  ("valid", pair.valid))
                if path is not None and not path.is_file()]
    if problems:
        problems.sort(key=lambda p: natural_key(str(p.path)))
        files = sum(len(pair.files) for pair in pairs)
        raise DataCheckError(f"{title}: {len(problems)} of {files} files are missing:\n"
                             + "\n".join(problem_lines(problems)), problems)


#: problems of one kind (the same text but for its numbers) listed by path, at most; the
#: rest are counted on one line (all 1000 JPEG masks of Kvasir-SEG said the same)
LISTED_PER_KIND = 5


def problem_lines(problems: Sequence[DataFileError]) -> list[str]:
    """``"  - <problem>"`` lines of a data check's message: per kind of problem (its text
    with the numbers left out, e.g. the share of noisy pixels) the first
    :data:`LISTED_PER_KIND`, then one line counting the others of that kind."""
    kinds = [re.sub(r"\d+(\.\d+)?", "#", problem.problem) for problem in problems]
    total, seen = Counter(kinds), Counter()
    lines = []
    for problem, kind in zip(problems, kinds, strict=True):
        seen[kind] += 1
        if seen[kind] <= LISTED_PER_KIND:
            lines.append(f"  - {problem}")
        elif seen[kind] == LISTED_PER_KIND + 1:
            lines.append(f"  - ... and {total[kind] - LISTED_PER_KIND} more files with the "
                         "same problem")
    return lines


def _label_problem(split: str, masks: int, counts: torch.Tensor, ignore_index: int,
                   class_names: Sequence[str]) -> DataFileError | None:
    """The problem of a split whose masks hold one class only (or nothing labelled)."""
    ignored = int(counts[ignore_index]) if 0 <= ignore_index < len(counts) else 0
    present = [v for v in range(len(counts)) if counts[v] > 0 and v != ignore_index]
    if len(present) > 1:
        return None
    if not present:
        what = f"no labelled pixel (all {ignored} are data.ignore_index={ignore_index})"
    else:
        name = class_names[present[0]] if present[0] < len(class_names) else None
        what = f"class {present[0]}" + (f" ({name})" if name else "") + " only"
        if ignored:
            what += f" and {ignored} pixels of data.ignore_index={ignore_index}"
    return DataFileError(
        f"the {split} split has no foreground: its {masks} mask(s) hold {what}, so nothing "
        "can be learned or scored; check the mask encoding (data.mask_encoding, "
        "data.threshold) against a mask file, or give this split masks with foreground",
        problem=f"the {split} split has no foreground")


def _classes_not_in_train(totals: Mapping[str, torch.Tensor], ignore_index: int,
                          class_names: Sequence[str]) -> list[str]:
    """One line per class that the masks of another split hold and no train mask does."""
    train = totals.get("train")
    if train is None:
        return []
    lines = []
    for split, counts in totals.items():
        if split == "train":
            continue
        missing = [v for v in range(len(counts))
                   if counts[v] > 0 and train[v] == 0 and v != ignore_index]
        for value in missing:
            name = (f" ({class_names[value]})" if value < len(class_names)
                    and class_names[value] != f"class{value}" else "")
            lines.append(f"class {value}{name} is in the {split} masks ({int(counts[value])} "
                         "pixels) but in no train mask: the network never learns it, so its "
                         f"{split} Dice and IoU stay 0; put some of its images in the train "
                         "split")
    return lines


def _kinds_problem(kinds: Mapping[str, list[Path]]) -> DataFileError:
    """The problem of a dataset whose images the datasets treat in different ways."""
    parts = []
    for kind, paths in sorted(kinds.items(), key=lambda item: (-len(item[1]), item[0])):
        first = min(paths, key=lambda p: natural_key(str(p)))
        parts.append(f"{len(paths)} {kind} (e.g. {first.name})")
    return DataFileError(f"the images are of {len(kinds)} kinds that data.normalize=auto "
                         f"normalises differently: {'; '.join(parts)}; the network would "
                         "see the same picture differently by its file format. Set "
                         "data.normalize=image (every image by its own mean and std), "
                         "imagenet, or {mean: [...], std: [...]} for all of them")


def verify_pairs(pairs: Sequence[ImageMaskPair], image_mode: str, decode_mask: MaskDecoder,
                 *, title: str, progress: bool = True, image_reader: ImageReader | None = None,
                 splits: Mapping[str, Sequence[str]] | None = None,
                 ignore_index: int = 255, class_names: Sequence[str] = (),
                 image_kind: Callable[[torch.Tensor], str] | None = None) -> int:
    """Decode every file of ``pairs`` once, as the datasets will (see
    :func:`remat.data.pairs.inspect_pair`; up to 4 threads), with a progress bar on a
    terminal, and check the labels.

    Args:
        pairs: the pairs to check.
        image_mode: how the datasets read the images (``"rgb"``, ``"grey"``, ``"grey_rgb"``).
        decode_mask: the dataset's mask decoder; its ``encoding_problem(path)``, when it has
            one, reports raw files the encoding misreads (0/1 label maps under a threshold
            of 128, JPEG noise read as foreground).
        title: what is checked, for messages (``"ISBI 2012 EM membranes at /data/...,
            train and val splits"``).
        progress: show a tqdm bar (only on a terminal in any case).
        image_reader: the datasets' image reader, if not the 8-bit one.
        splits: ``{split: [pair names]}``; each split whose masks hold one class only (no
            foreground: an all-background split, or a label encoding that reads every pixel
            as one class) is a problem; a class that another split's masks hold and no
            train mask does is named in a warning.
        ignore_index: the mask value that is no class.
        class_names: names of the classes, for messages.
        image_kind: ``decoded image -> kind``, where the datasets treat images of different
            kinds differently (``data.normalize=auto``: 8-bit RGB by ImageNet statistics,
            16-bit by each image's own); images of more than one kind are a problem.

    Returns:
        The number of files checked.

    Raises:
        DataCheckError: (a ``ValueError``) one or more bad files or splits; the message lists
            every one (files in natural order of their paths, then splits): path, what is
            wrong, what was expected.
    """
    start = time.perf_counter()
    problems: list[DataFileError] = []
    counts: dict[str, torch.Tensor] = {}
    kinds: dict[str, list[Path]] = {}  # image kind -> its images
    files = sum(len(pair.files) for pair in pairs)
    # Decoding and reading release the GIL: a few threads overlap file reads with decoding.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        found = pool.map(lambda pair: inspect_pair(pair, image_mode, decode_mask,
                                                   image_reader, image_kind), pairs)
        for pair, (pair_problems, pair_counts, kind) in zip(pairs, tqdm(
                found, total=len(pairs), desc="data check", unit="pair", leave=False,
                disable=None if progress else True), strict=True):
            problems += pair_problems
            if pair_counts is not None:
                counts[pair.name] = pair_counts
            if kind is not None:
                kinds.setdefault(kind, []).append(pair.image)
    problems.sort(key=lambda p: natural_key(str(p.path)))  # the same order on every run
    totals: dict[str, torch.Tensor] = {}  # split -> its masks' pixel counts per value
    for split, names in (splits or {}).items():
        decoded = [counts[n] for n in names if n in counts]
        if decoded and len(decoded) == len(names):
            totals[split] = sum(decoded)
            problem = _label_problem(split, len(names), totals[split], ignore_index,
                                     class_names)
            if problem is not None:
                problems.append(problem)
    mixed = _kinds_problem(kinds) if len(kinds) > 1 else None
    seconds = time.perf_counter() - start
    if problems:
        bad = len({p.path for p in problems if p.path is not None})
        splits_bad = sum(p.path is None for p in problems)
        head = f"{bad} of {files} files cannot be used" + (
            f" and {splits_bad} split(s) have no foreground" if splits_bad else "")
        lines = problem_lines(problems) + ([f"  - {mixed}"] if mixed is not None else [])
        raise DataCheckError(
            f"data check of {title}: {head} (set data.verify=false to skip this check and "
            "meet them when they are read):\n" + "\n".join(lines),
            problems + ([mixed] if mixed is not None else []))
    if mixed is not None:
        raise DataCheckError(f"data check of {title}: {mixed}", [mixed])
    for line in _classes_not_in_train(totals, ignore_index, class_names):
        log.warning("data check of %s: %s", title, line)
    log.info("data check of %s: %d files decoded in %.1f s, none bad", title, files, seconds)
    return files
