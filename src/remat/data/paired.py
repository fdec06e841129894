"""Image/mask file pairs on disk -> training patches and whole-image evaluation samples.

The machinery every file-based segmentation datamodule shares (ISBI 2012, Dubai, DRIVE,
Inria, ...; Kvasir-SEG uses the root finder, pairing and :func:`split_ids`): find the dataset
folder (:func:`find_dataset_root`), list and pair the files of a published layout with errors
naming what is missing (:func:`match_pairs`), split them deterministically
(:func:`split_ids`, :func:`tail_split`, per-dataset rules) or from a split file, and serve

* training items: a random ``patch_size`` crop (:class:`remat.data.patches.PatchSampler`),
  flips and mild brightness/contrast jitter (``torchvision.transforms.v2``), normalised;
* evaluation items: the whole image at full resolution, normalised, never resized
  (batch size 1: sizes differ; score it with sliding-window inference).

Items are ``{"image": float32 [C, h, w], "mask": int64 [h, w], "name": str}`` plus
``"valid": bool [h, w]`` when the dataset has a region-of-interest mask (DRIVE field of view).
Mask pixels that belong to no class hold ``ignore_index`` (255).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.io import ImageReadMode
from torchvision.transforms import v2

from remat.data.base import SplitDataModule, check_limits
from remat.data.io import read_image
from remat.data.masks import IGNORE_INDEX
from remat.data.patches import PatchSampler, as_pair, crop_pad
from remat.data.transforms import IMAGENET_MEAN, IMAGENET_STD

_SHOW = 5  # how many offending names an error message lists
# Grey images fed as one channel are normalised with the mean of ImageNet's channel statistics.
GREY_MEAN = sum(IMAGENET_MEAN) / 3
GREY_STD = sum(IMAGENET_STD) / 3
IMAGE_MODES = ("rgb", "grey", "grey_rgb")


@dataclass(frozen=True)
class ImageMaskPair:
    """One labelled image: its name (unique in the dataset) and file paths.

    ``valid`` is an optional region-of-interest mask file (non-zero = inside).
    """

    name: str
    image: Path
    mask: Path
    valid: Path | None = None


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    return shown + (f" and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


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
                prefix: str = "", root: Path | None = None) -> list[ImageMaskPair]:
    """Pair images with masks (and FOV masks) by name.

    Args:
        images, masks, valid: ``{name: path}`` as from :func:`list_files`.
        where: the folder and dataset, for messages.
        layout: the expected layout, for messages.
        prefix: prepended to every name (``"Tile 1/"``, ``"train/"``) to keep names unique.
        root: messages name files relative to it (``images/cju0.jpg``); None: bare file names.

    Returns:
        Pairs sorted by name.

    Raises:
        FileNotFoundError: no images, or an image lacks its mask (or FOV mask), or a mask lacks
            its image; the message lists up to five files of each kind and the layout.
    """
    if not images:
        raise FileNotFoundError(f"no images found in {where}; expected {layout}")

    def shown(files: Mapping[str, Path], names: Iterable[str]) -> str:
        return _listing([str(files[n].relative_to(root)) if root else files[n].name
                         for n in names])

    problems = []
    kinds = [("mask", masks)] + ([("FOV mask", valid)] if valid is not None else [])
    for kind, files in kinds:
        lone = sorted(images.keys() - files.keys())
        if lone:
            problems.append(f"{len(lone)} image(s) without a {kind}: {shown(images, lone)}")
    lone_masks = sorted(masks.keys() - images.keys())
    if lone_masks:
        problems.append(f"{len(lone_masks)} mask(s) without an image: "
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
        FileNotFoundError: no candidate holds the layout; names ``root``, the layout, the
            missing sub-folders and where to get the data.
    """
    if root is None or not str(root).strip():
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
    below = f", or in {' or '.join(f'{s}/' for s in subfolders)} below either" if subfolders else ""
    raise FileNotFoundError(
        f"{title} root {given} {state}. Expected layout: {layout} (in {given} or "
        f"{given}/{folder}/{below}). Get it from {url}"
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


def load_split_file(path: str | Path, names: Iterable[str]) -> dict[str, list[str]]:
    """Read a split file and check it against the dataset.

    The file is YAML (or JSON) mapping ``train``, ``val`` and optionally ``test`` to lists of
    sample names as the datamodule prints them (e.g. ``"Tile 3/image_part_001"`` or ``"25"``).

    Raises:
        FileNotFoundError: the file is missing, or it names samples the dataset does not have
            (the message lists them and the key).
        ValueError: not a mapping of lists, an unknown key, or ``train``/``val`` missing.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.split_file {path} does not exist")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    if not isinstance(raw, dict) or not all(isinstance(v, list) for v in raw.values()):
        raise ValueError(f"split file {path} must map train/val[/test] to lists of names")
    unknown = sorted(set(raw) - {"train", "val", "test"})
    if unknown or not {"train", "val"} <= set(raw):
        raise ValueError(f"split file {path} must have keys train and val (test optional); "
                         f"got {sorted(raw)}")
    known = set(names)
    for key, listed in raw.items():
        missing = [str(n) for n in listed if str(n) not in known]
        if missing:
            raise FileNotFoundError(
                f"split file {path} ({key}) names {len(missing)} image(s) that are not in the "
                f"dataset: {_listing(missing)}"
            )
    return {key: [str(n) for n in listed] for key, listed in raw.items()}


def check_split(split: Mapping[str, Sequence[str]], source: str) -> None:
    """Raise ``ValueError`` if ``train`` or ``val`` is missing, any listed split (``test``
    too) is empty, or a name sits in two splits; ``source`` says where the split came from."""
    for key in ("train", "val", *split):
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


class PairedSegDataset(Dataset):
    """Image/mask pairs served as random training patches or whole evaluation images.

    Args:
        pairs: the files to serve.
        decode_mask: ``path -> uint8 [H, W]`` class indices (see :mod:`remat.data.masks`).
        train: True: random patches (``sampler``), flips, jitter; False: whole images.
        sampler: where to crop training patches; required when ``train``.
        patches_per_image: training items per image per epoch.
        image_mode: ``"rgb"`` (3 channels), ``"grey"`` (1 channel) or ``"grey_rgb"`` (grey
            repeated to 3 channels, so ImageNet-style 3-channel encoders take it).
        augment: flips and brightness/contrast jitter on training patches.
        ignore_index: mask value of padding and of pixels that are no class.
        cache: keep decoded files in memory (per worker process).

    Items: ``{"image": float32 [C, h, w] (normalised: ImageNet mean/std, or their channel mean
    0.449/0.226 for one grey channel), "mask": int64 [h, w], "name": str}`` and ``"valid":
    bool [h, w]`` if the pairs have FOV masks. ``h, w`` is the patch size (padded with image 0,
    mask ``ignore_index``, valid False when the image is smaller) or the full image size.

    Raises (on ``__getitem__``):
        ValueError: image, mask (and FOV mask) sizes differ; names the files and both sizes.
        RuntimeError: a file cannot be decoded; ValueError from the mask decoder.
    """

    def __init__(self, pairs: Sequence[ImageMaskPair], decode_mask: Callable[[Path], torch.Tensor],
                 train: bool, sampler: PatchSampler | None = None, patches_per_image: int = 1,
                 image_mode: str = "rgb", augment: bool = True, ignore_index: int = IGNORE_INDEX,
                 cache: bool = False) -> None:
        if image_mode not in IMAGE_MODES:
            raise ValueError(f"image_mode must be one of {IMAGE_MODES}, got {image_mode!r}")
        if train and sampler is None:
            raise ValueError("a training PairedSegDataset needs a PatchSampler")
        if patches_per_image < 1:
            raise ValueError(f"data.patches_per_image must be >= 1, got {patches_per_image}")
        self.pairs = list(pairs)
        self.decode_mask = decode_mask
        self.train = train
        self.sampler = sampler
        self.patches_per_image = patches_per_image if train else 1
        self.image_mode = image_mode
        self.ignore_index = ignore_index
        self.cache = cache
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        grey = image_mode == "grey"
        steps: list[v2.Transform] = []
        if train and augment:
            steps += [v2.RandomHorizontalFlip(), v2.RandomVerticalFlip(),
                      v2.ColorJitter(brightness=0.2, contrast=0.2)]
        steps += [v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
                  v2.Normalize(mean=[GREY_MEAN] if grey else list(IMAGENET_MEAN),
                               std=[GREY_STD] if grey else list(IMAGENET_STD))]
        self.transform = v2.Compose(steps)

    def __len__(self) -> int:
        return len(self.pairs) * self.patches_per_image

    def load(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Decode pair ``index``: image uint8 ``[C, H, W]`` (``C`` = 1 for grey modes), mask
        uint8 ``[H, W]``, FOV bool ``[H, W]`` or None, after checking that their sizes agree."""
        if index in self._cache:
            return self._cache[index]
        pair = self.pairs[index]
        read_mode = ImageReadMode.RGB if self.image_mode == "rgb" else ImageReadMode.GRAY
        image = read_image(pair.image, read_mode)
        mask = self.decode_mask(pair.mask)
        valid = None
        files = [(pair.image, image), (pair.mask, mask)]
        if pair.valid is not None:
            valid = read_image(pair.valid, ImageReadMode.GRAY)[0] > 0
            files.append((pair.valid, valid))
        (ih, iw) = image.shape[-2:]
        for path, tensor in files[1:]:
            (mh, mw) = tensor.shape[-2:]
            if (mh, mw) != (ih, iw):
                raise ValueError(f"size mismatch for {pair.name}: image {pair.image} is "
                                 f"{iw}x{ih} (WxH) but {path} is {mw}x{mh}")
        if self.cache:
            self._cache[index] = (image, mask, valid)
        return image, mask, valid

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        pair_index = index // self.patches_per_image
        image, mask, valid = self.load(pair_index)
        if self.image_mode == "grey_rgb":
            image = image.expand(3, -1, -1)
        if self.train:
            assert self.sampler is not None
            box = self.sampler(mask)
            size = self.sampler.patch
            image = crop_pad(image, box, size, 0)
            mask = crop_pad(mask, box, size, self.ignore_index)
            valid = None if valid is None else crop_pad(valid, box, size, False)
        parts = {"image": tv_tensors.Image(image), "mask": tv_tensors.Mask(mask)}
        if valid is not None:
            parts["valid"] = tv_tensors.Mask(valid)
        parts = self.transform(parts)
        sample: dict[str, Any] = {
            "image": parts["image"].as_subclass(torch.Tensor),
            "mask": parts["mask"].as_subclass(torch.Tensor).long(),
            "name": self.pairs[pair_index].name,
        }
        if valid is not None:
            sample["valid"] = parts["valid"].as_subclass(torch.Tensor).bool()
        return sample


class PairedSegDataModule(SplitDataModule):
    """Base of the file-based segmentation datamodules: layout check, split, loaders.

    Subclasses set the class attributes and implement :meth:`list_pairs`,
    :meth:`default_split` and :meth:`mask_decoder`.

    Args:
        root: the dataset folder, or a folder holding it under :attr:`folder` (e.g.
            ``$REMAT_DATA_DIR``). Hydra: ``data.root``.
        patch_size: training patch side (or ``[height, width]``) in pixels.
        patches_per_image: training patches drawn from each image per epoch.
        foreground_prob: probability that a training patch is centred on a foreground pixel.
        foreground_classes: classes that count as foreground; None: class 1 for binary
            tasks, every class for multi-class ones.
        batch_size: training batch size; evaluation batches hold one whole image.
        num_workers, pin_memory: DataLoader settings.
        seed: seeds the training loader's shuffle.
        augment: flips and brightness/contrast jitter on training patches.
        image_mode: None for the dataset's default, else ``"rgb"``, ``"grey"`` or
            ``"grey_rgb"`` (grey images repeated to 3 channels; the default for grey data).
        split_file: YAML/JSON ``{train: [names], val: [names], test: [names]}`` replacing the
            default split (see :func:`load_split_file`), or None.
        limit_train, limit_val: keep only the first n names of a split (tiny runs), or None.
        cache: keep decoded images in memory.

    Attributes set by ``setup``: ``dataset_root``, ``splits`` (``{split: [names]}``),
    ``train_set``, ``val_set``, ``test_set`` (the val set unless a labelled test split
    exists). Class attributes: ``title``, ``folder`` (usual folder name), ``layout``, ``url``,
    ``required_dirs`` and ``root_subfolders`` (for :func:`find_dataset_root`),
    ``num_classes`` (1 = binary), ``class_names`` (one per mask value, background first for
    binary), ``ignore_index`` (255).

    Raises (in ``setup``): ValueError for an unset ``root``, a bad option or an empty split;
    FileNotFoundError for a missing folder, unpaired files or a split file naming missing
    images. Decoding errors, unknown mask colours and size mismatches surface when the sample
    is loaded.
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

    def __init__(self, root: str | Path | None, patch_size: int | Sequence[int] = 256,
                 patches_per_image: int = 1, foreground_prob: float = 0.0,
                 foreground_classes: Sequence[int] | None = None, batch_size: int = 4,
                 num_workers: int = 0, pin_memory: bool = False, seed: int = 0,
                 augment: bool = True, image_mode: str | None = None,
                 split_file: str | Path | None = None, limit_train: int | None = None,
                 limit_val: int | None = None, cache: bool = False) -> None:
        super().__init__(batch_size, num_workers, pin_memory, loader_seed=seed,
                         eval_batch_size=1)
        check_limits(limit_train=limit_train, limit_val=limit_val)
        self.patch_size = as_pair(patch_size if isinstance(patch_size, int)
                                  else list(patch_size), "data.patch_size")
        if foreground_classes is None:
            foreground_classes = (1,) if self.num_classes == 1 else range(self.num_classes)
        self.sampler = PatchSampler(self.patch_size, foreground_prob, foreground_classes)
        self.image_mode = image_mode or self.default_image_mode
        if self.image_mode not in IMAGE_MODES:
            raise ValueError(f"data.image_mode must be one of {IMAGE_MODES}, got {image_mode!r}")
        if patches_per_image < 1:
            raise ValueError(f"data.patches_per_image must be >= 1, got {patches_per_image}")
        self.root = root
        self.patches_per_image = patches_per_image
        self.augment = augment
        self.split_file = split_file
        self.limit_train = limit_train
        self.limit_val = limit_val
        self.cache = cache
        self.dataset_root: Path | None = None
        self.splits: dict[str, list[str]] = {}
        self.pairs: dict[str, ImageMaskPair] = {}

    # ------------------------------------------------------------------ subclass hooks

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Every labelled pair under the dataset folder ``root``."""
        raise NotImplementedError

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """The deterministic ``{"train": [...], "val": [...], ("test": [...])}`` split."""
        raise NotImplementedError

    def mask_decoder(self) -> Callable[[Path], torch.Tensor]:
        """A picklable ``path -> uint8 [H, W]`` class-index decoder."""
        raise NotImplementedError

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
        :attr:`root_subfolders` below either (see :func:`find_dataset_root`).

        Raises:
            ValueError: ``root`` is None or empty.
            FileNotFoundError: no candidate holds the layout (:meth:`is_dataset_root`).
        """
        return find_dataset_root(self.root, title=self.title, folder=self.folder,
                                 layout=self.layout, url=self.url, is_root=self.is_dataset_root,
                                 subfolders=self.root_subfolders, required=self.required_dirs)

    def setup(self, stage: str | None = None) -> None:
        """Check the layout, split the names and build the datasets (no decoding here)."""
        if self.train_set is not None:
            return
        self.dataset_root = self.find_root()
        pairs = self.list_pairs(self.dataset_root)
        self.pairs = {p.name: p for p in pairs}
        if self.split_file is not None:
            splits = load_split_file(self.split_file, self.pairs)
            source = f"split file {self.split_file}"
        else:
            splits = self.default_split(sorted(self.pairs, key=natural_key))
            source = f"default split of {self.title} at {self.dataset_root}"
        check_split(splits, source)
        splits["train"] = splits["train"][: self.limit_train]
        splits["val"] = splits["val"][: self.limit_val]
        if "test" in splits:
            splits["test"] = splits["test"][: self.limit_val]
        self.splits = splits
        decode = self.mask_decoder()

        def build(key: str, train: bool) -> PairedSegDataset:
            return PairedSegDataset(
                [self.pairs[n] for n in splits[key]], decode, train=train, sampler=self.sampler,
                patches_per_image=self.patches_per_image, image_mode=self.image_mode,
                augment=self.augment, ignore_index=self.ignore_index, cache=self.cache)

        self.train_set = build("train", True)
        self.val_set = build("val", False)
        self.test_set = build("test", False) if splits.get("test") else None


class SeededSplitDataModule(PairedSegDataModule):
    """A :class:`PairedSegDataModule` whose default split is :func:`split_ids`: for datasets
    with no official split (CVC-ClinicDB, ISIC 2018 Task 1 training set, DeepGlobe Road).

    Args:
        root: see :class:`PairedSegDataModule`.
        val_size: val images; None: the class's :attr:`default_val_size` (about 10 % of the
            published set). The sorted names are shuffled with ``random.Random(split_seed)``
            and the last ``val_size`` are val.
        split_seed: seed of that shuffle.
        **kwargs: the other options of :class:`PairedSegDataModule`.

    Raises (in ``setup``): ValueError when ``val_size`` leaves train or val empty.
    """

    default_val_size: ClassVar[int] = 1

    def __init__(self, root: str | Path | None, val_size: int | None = None,
                 split_seed: int = 42, **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.val_size = self.default_val_size if val_size is None else val_size
        self.split_seed = split_seed

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """Seeded random split (see the class docstring)."""
        train, val = split_ids(names, self.val_size, self.split_seed)
        return {"train": train, "val": val}
