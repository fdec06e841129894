"""What the datamodules share.

* :class:`SplitDataModule`: a train and a val dataset (and optionally a test one) and their
  loaders; every remat datamodule (synthetic, text, files) is one.
* :class:`FileSegDataModule`: the file-based segmentation datamodules (Kvasir-SEG, ISBI 2012,
  Dubai, DRIVE, Inria, ...): find the dataset folder in its published layout, pair images
  with masks, split them (default split, or ``data.split_file``), check every file before
  training (``data.verify``) and build the datasets. Subclasses say how their layout is
  listed, split and decoded, and what a sample looks like (:meth:`build_dataset`: random
  patches for large images, :mod:`remat.data.patch_seg`; resized images for Kvasir-SEG).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from remat.data.io import make_loader
from remat.data.layout import find_dataset_root, natural_key
from remat.data.masks import IGNORE_INDEX
from remat.data.pairs import IMAGE_MODES, ImageMaskPair, ImageReader, MaskDecoder
from remat.data.splits import check_split, load_split_file
from remat.data.verify import (
    AUTO_MAX_FILES,
    check_files_exist,
    should_verify,
    splits_title,
    verify_pairs,
    verify_setting,
)

log = logging.getLogger(__name__)

# The splits a Lightning stage reads (``test`` falls back to val when there is no test split).
_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",),
                 None: ("train", "val", "test")}


def check_limits(**limits: int | None) -> None:
    """Check ``limit_train``-style settings: each None or a positive int.

    Raises:
        ValueError: a value is a bool, a non-integer or < 1; names ``data.<key>``.
    """
    for name, value in limits.items():
        if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
            raise ValueError(f"data.{name} must be a positive int or None, got {value!r}")


def check_count(name: str, value: Any, least: int = 1) -> None:
    """Check a whole-number setting (``batch_size``, ``num_workers``, ``num_train``).

    Raises:
        ValueError: a bool, a non-integer or a value below ``least``; names ``data.<name>``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive int" if least == 1 else f"an int >= {least}"
        raise ValueError(f"data.{name} must be {kind}, got {value!r}")


class SplitDataModule(L.LightningDataModule):
    """Train/val(/test) datamodule base: subclasses build ``train_set`` and ``val_set`` (and
    optionally ``test_set``) in ``setup``; the loaders come from
    :func:`remat.data.io.make_loader` (train shuffled with a generator seeded by
    ``loader_seed``). Evaluation loaders use ``eval_batch_size`` (default: ``batch_size``; 1
    for datasets whose images differ in size). The test loader serves ``test_set``, or the
    val set when there is no labelled test split.

    Raises:
        ValueError: ``batch_size`` or ``eval_batch_size`` not a positive int, ``num_workers``
            not an int >= 0 (names the ``data.`` key).
        RuntimeError: a loader asked for before ``setup``.
    """

    def __init__(self, batch_size: int, num_workers: int, pin_memory: bool,
                 loader_seed: int, eval_batch_size: int | None = None) -> None:
        super().__init__()
        check_count("batch_size", batch_size)
        if eval_batch_size is not None:
            check_count("eval_batch_size", eval_batch_size)
        check_count("num_workers", num_workers, least=0)
        self.batch_size = batch_size
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.loader_seed = loader_seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        size = self.batch_size if train else self.eval_batch_size
        return make_loader(dataset, size, self.num_workers, train=train,
                           seed=self.loader_seed, pin_memory=self.pin_memory)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        if self.test_set is not None:
            return self._loader(self.test_set, train=False)
        return self.val_dataloader()


class FileSegDataModule(SplitDataModule):
    """Base of the file-based segmentation datamodules: layout, split, data check, datasets.

    Subclasses set the class attributes and implement :meth:`list_pairs`,
    :meth:`default_split`, :meth:`mask_decoder` and :meth:`build_dataset`.

    Args:
        root: the dataset folder, or a folder holding it under :attr:`folder` (e.g.
            ``$REMAT_DATA_DIR``). Hydra: ``data.root``.
        batch_size: training batch size.
        eval_batch_size: val/test batch size (1 where images differ in size).
        num_workers, pin_memory: DataLoader settings.
        seed: seeds the training loader's shuffle.
        image_mode: None for the dataset's default, else ``"rgb"``, ``"grey"`` (one channel)
            or ``"grey_rgb"`` (grey repeated to 3 channels).
        split_file: YAML/JSON ``{train: [names], val: [names], test: [names]}`` replacing the
            default split (see :func:`remat.data.splits.load_split_file`), or None.
        limit_train, limit_val: keep only the first n names of a split (tiny runs), or None.
        verify: ``data.verify``: decode every file of the splits a stage reads before it runs
            (:func:`remat.data.verify.verify_pairs`): True, False, or ``"auto"`` (when they
            hold at most :data:`remat.data.verify.AUTO_MAX_FILES` files).

    Attributes set by ``setup``: ``dataset_root``, ``pairs`` (``{name: ImageMaskPair}``),
    ``splits`` (``{split: [names]}``), ``train_set``, ``val_set``, ``test_set`` (None
    unless a labelled test split exists; the test loader then serves val). Class attributes:
    ``title``, ``folder`` (usual folder name), ``layout``, ``url``, ``required_dirs`` and
    ``root_subfolders`` (for :func:`remat.data.layout.find_dataset_root`), ``num_classes``
    (1 = binary), ``class_names`` (one per mask value, background first for binary),
    ``ignore_index`` (255), ``default_image_mode``.

    Raises:
        ValueError: (at construction) a bad ``image_mode``, limit or ``verify``; (in
            ``setup``) an unset ``root`` or an empty split.
        FileNotFoundError: (in ``setup``) a missing folder, unpaired files or a split file
            naming missing images.
        remat.data.verify.DataCheckError: (in ``setup``, a ``ValueError``) bad files, all of
            them listed, when the data check runs.
    """

    title: ClassVar[str] = ""
    folder: ClassVar[str] = ""
    layout: ClassVar[str] = ""
    url: ClassVar[str] = ""
    required_dirs: ClassVar[tuple[str, ...]] = ()
    root_subfolders: ClassVar[tuple[str, ...]] = ()
    class_names: ClassVar[tuple[str, ...]] = ()
    num_classes: ClassVar[int] = 1
    ignore_index: ClassVar[int] = IGNORE_INDEX
    default_image_mode: ClassVar[str] = "rgb"
    #: evaluation images are resized to ``image_size`` (else served whole, native size)
    resizes_for_eval: ClassVar[bool] = False
    image_modes: ClassVar[tuple[str, ...]] = IMAGE_MODES

    def __init__(self, root: str | Path | None, *, batch_size: int = 4,
                 eval_batch_size: int | None = 1, num_workers: int = 0,
                 pin_memory: bool = False, seed: int = 0, image_mode: str | None = None,
                 split_file: str | Path | None = None, limit_train: int | None = None,
                 limit_val: int | None = None, verify: bool | str = "auto") -> None:
        super().__init__(batch_size, num_workers, pin_memory, loader_seed=seed,
                         eval_batch_size=eval_batch_size)
        check_limits(limit_train=limit_train, limit_val=limit_val)
        self.image_mode = image_mode or self.default_image_mode
        if self.image_mode not in self.image_modes:
            raise ValueError(f"data.image_mode must be one of {self.image_modes}, got "
                             f"{image_mode!r}")
        self.root = root
        self.split_file = split_file
        self.limit_train = limit_train
        self.limit_val = limit_val
        self.verify = verify_setting(verify)
        self.dataset_root: Path | None = None
        self.splits: dict[str, list[str]] = {}
        self.pairs: dict[str, ImageMaskPair] = {}
        self._verified: set[str] = set()
        self._built = False
        self._split_source = ""
        #: serve every labelled pair as the val split (``remat.eval split=all``)
        self.eval_all = False

    # ------------------------------------------------------------------ subclass hooks

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Every labelled pair under the dataset folder ``root``."""
        raise NotImplementedError

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """The deterministic ``{"train": [...], "val": [...], ("test": [...])}`` split."""
        raise NotImplementedError

    def mask_decoder(self) -> MaskDecoder:
        """A picklable ``path -> uint8 [H, W]`` class-index decoder."""
        raise NotImplementedError

    def build_dataset(self, pairs: list[ImageMaskPair], train: bool) -> Dataset:
        """The dataset serving ``pairs`` for training (``train``) or evaluation."""
        raise NotImplementedError

    def image_reader(self) -> ImageReader | None:
        """A picklable ``path -> [C, H, W]`` reader replacing the 8-bit one, or None."""
        return None

    def image_kind(self) -> Callable[[torch.Tensor], str] | None:
        """``decoded image -> how the datasets treat it``, where images of one dataset may
        be treated differently (a data check then refuses a mix), or None."""
        return None

    def predict_dataset(self, paths: Sequence[Path], names: Sequence[str]) -> Dataset:
        """Images without masks, read and normalised as this dataset's evaluation images are
        (whole, at their own size), for ``remat.predict``: items ``{"image": float32
        [C, H, W], "name": str, "path": str}``."""
        from remat.data.folder import EightBitImages, Normalize, PredictImages

        reader = self.image_reader() or EightBitImages(self.image_mode)
        return PredictImages(paths, names, reader, Normalize("imagenet"))

    # ------------------------------------------------------------------ shared

    @property
    def in_channels(self) -> int:
        """Channels of the served images (1 only for ``image_mode="grey"``)."""
        return 1 if self.image_mode == "grey" else 3

    def is_dataset_root(self, candidate: Path) -> bool:
        """Whether ``candidate`` holds the layout (default: every :attr:`required_dirs`)."""
        return all((candidate / d).is_dir() for d in self.required_dirs)

    def find_root(self) -> Path:
        """Resolve ``root`` to the dataset folder: ``root`` or ``root/<folder>``, or one of
        :attr:`root_subfolders` below either (see :func:`remat.data.layout.find_dataset_root`).

        Raises:
            ValueError: ``root`` is None or empty.
            FileNotFoundError: no candidate holds the layout (:meth:`is_dataset_root`).
        """
        return find_dataset_root(self.root, title=self.title, folder=self.folder,
                                 layout=self.layout, url=self.url, is_root=self.is_dataset_root,
                                 subfolders=self.root_subfolders, required=self.required_dirs)

    def setup(self, stage: str | None = None) -> None:
        """Check the layout, split the names and build the datasets (no decoding here), then
        run the data check on the splits ``stage`` reads that were not checked yet.

        A split file or layout may hold only evaluation splits (no ``train``): ``validate``
        and ``test`` then run, and ``fit`` raises ``ValueError`` naming the missing split."""
        if not self._built:
            self._build()
            self._built = True
        self._require_splits(stage)
        self.check_files(stage)

    def _require_splits(self, stage: str | None) -> None:
        if stage == "fit":
            needed = ("train", "val")
        elif stage == "validate":
            needed = ("val",)
        elif stage == "test":
            needed = () if "test" in self.splits else ("val",)
        else:
            needed = ()
        missing = [k for k in needed if not self.splits.get(k)]
        if missing:
            raise ValueError(
                f"{self.title} at {self.dataset_root}: no {' and no '.join(missing)} split "
                f"({self._split_source}) but {stage} needs it; give a split file "
                "(data.split_file) or a layout with that split")

    def _build(self) -> None:
        self.dataset_root = self.find_root()
        pairs = self.list_pairs(self.dataset_root)
        self.pairs = {p.name: p for p in pairs}
        if self.eval_all:
            splits = {"val": sorted(self.pairs, key=natural_key)}
            source = f"every pair of {self.title} at {self.dataset_root} (split=all)"
        elif self.split_file is not None:
            splits = load_split_file(self.split_file, self.pairs)
            source = f"split file {self.split_file}"
        else:
            splits = self.default_split(sorted(self.pairs, key=natural_key))
            source = f"default split of {self.title} at {self.dataset_root}"
        check_split(splits, source, required=())
        self._split_source = source
        for key, limit in (("train", self.limit_train), ("val", self.limit_val),
                           ("test", self.limit_val)):
            if key in splits:
                splits[key] = splits[key][:limit]
        self.splits = splits

        def dataset(key: str) -> Dataset | None:
            names = splits.get(key)
            return self.build_dataset([self.pairs[n] for n in names], key == "train") \
                if names else None

        self.train_set, self.val_set, self.test_set = (dataset(k) for k in
                                                       ("train", "val", "test"))

    def check_files(self, stage: str | None = None) -> None:
        """The data check (``data.verify``) of the splits ``stage`` reads (``fit``: train and
        val; ``validate``: val; ``test``: test, or val without one; None: all), each split at
        most once. Its title names the splits (``all splits`` under ``eval_all``). Without
        decoding (``data.verify=false``, or ``auto`` over the limit) the files are still
        looked for, so a missing one stops the run here.

        Raises:
            remat.data.verify.DataCheckError: bad or missing files (every one listed).
        """
        wanted = _STAGE_SPLITS.get(stage, ())
        if stage == "test" and "test" not in self.splits:
            wanted = ("val",)
        todo = [k for k in wanted if k in self.splits and k not in self._verified]
        pairs = [self.pairs[n] for k in todo for n in self.splits[k]]
        if not pairs:
            return
        files = sum(len(p.files) for p in pairs)
        covered = splits_title(todo, self.eval_all)
        title = f"{self.title} at {self.dataset_root} ({covered})"
        if should_verify(self.verify, files):
            verify_pairs(pairs, self.image_mode, self.mask_decoder(), title=title,
                         image_reader=self.image_reader(),
                         splits={k: self.splits[k] for k in todo},
                         ignore_index=self.ignore_index, class_names=self.class_names,
                         image_kind=self.image_kind())
        else:
            if self.verify == "auto":
                log.info("data.verify=auto: %s (%s) holds %d files (more than %d), so they "
                         "are not decoded before training (only looked for); "
                         "data.verify=true checks them", self.title, covered, files,
                         AUTO_MAX_FILES)
            check_files_exist(pairs, title)
        self._verified.update(todo)
