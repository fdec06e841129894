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
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tqdm.auto import tqdm

from remat.data.io import DataFileError
from remat.data.pairs import ImageMaskPair, MaskDecoder, check_pair

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


def verify_pairs(pairs: Sequence[ImageMaskPair], image_mode: str, decode_mask: MaskDecoder,
                 *, title: str, progress: bool = True) -> int:
    """Decode every file of ``pairs`` once, as the datasets will (see
    :func:`remat.data.pairs.check_pair`; up to 4 threads), with a progress bar on a terminal.

    Args:
        pairs: the pairs to check.
        image_mode: how the datasets read the images (``"rgb"``, ``"grey"``, ``"grey_rgb"``).
        decode_mask: the dataset's mask decoder.
        title: what is checked, for messages (``"ISBI 2012 EM membranes at /data/...,
            train and val splits"``).
        progress: show a tqdm bar (only on a terminal in any case).

    Returns:
        The number of files checked.

    Raises:
        DataCheckError: (a ``ValueError``) one or more bad files; the message lists every
            one: path, what is wrong, what was expected.
    """
    start = time.perf_counter()
    problems: list[DataFileError] = []
    files = sum(len(pair.files) for pair in pairs)
    # Decoding and reading release the GIL: a few threads overlap file reads with decoding.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        found = pool.map(lambda pair: check_pair(pair, image_mode, decode_mask), pairs)
        for pair_problems in tqdm(found, total=len(pairs), desc="data check", unit="pair",
                                  leave=False, disable=None if progress else True):
            problems += pair_problems
    seconds = time.perf_counter() - start
    if problems:
        bad = len({p.path for p in problems})
        raise DataCheckError(
            f"data check of {title}: {bad} of {files} files cannot be used (set "
            "data.verify=false to skip this check and meet them during training):\n"
            + "\n".join(f"  - {p}" for p in problems), problems)
    log.info("data check of %s: %d files decoded in %.1f s, none bad", title, files, seconds)
    return files
