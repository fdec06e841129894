"""A user's own 2D segmentation data: a folder of images and masks (``data=folder``).

Layouts (``data.root`` is the folder):

* ``images/`` and ``masks/`` holding files of the same name (any suffix each:
  ``images/case1.jpg`` pairs with ``masks/case1.png``); other names and suffixes through the
  globs ``data.images`` and ``data.masks`` (``masks/*_mask.png`` pairs ``case1.jpg`` with
  ``case1_mask.png``; ``**`` reaches into sub-folders, whose path becomes part of the name);
* the same inside ``train/``, ``val/`` and ``test/`` sub-folders, which are then the splits;
* or a CSV file (``data.pairs``) with the columns ``image`` and ``mask`` (paths relative to
  the CSV's folder) and optionally ``split`` (train / val / test) and ``name``.

Without sub-folder or CSV splits, ``data.split_file`` names the splits, or a seeded random
``data.val_fraction`` of the images is val. Images are read by :func:`remat.data.io.
read_any_image` (PNG, JPEG, TIFF including 16-bit grey, float and multi-channel ones, ...);
masks by the encoding ``data.mask_encoding``:

``binary``
    foreground wherever the stored value is non-zero (0/1, 0/255, 0/65535 alike), or where
    the grey level is ``>= data.threshold`` (for JPEG masks, whose compression noise is
    non-zero: ``data.threshold=128``);
``index``
    a label map: stored values ``0..K-1`` are the classes (``data.num_classes`` = K; 1 for a
    0/1 binary map), ``data.ignore_index`` is no class;
``palette``
    a palette (mode ``P``) PNG whose palette indices are the classes (the colours are
    ignored; PASCAL VOC style);
``colors``
    an RGB colour per class (``data.colors``: a list in class order, or a mapping of class
    name to colour, each ``"#RRGGBB"`` or ``[R, G, B]``); ``data.ignore_colors`` are no
    class.

Training draws random ``data.patch_size`` crops (images smaller than a patch are padded);
validation, test and prediction run on whole images at their own resolution.
"""

from __future__ import annotations

import csv
import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

import torch
from torchvision.transforms import v2

from remat.data.io import ANY_IMAGE_MODES, DataFileError, image_channels, read_any_image
from remat.data.layout import listing, match_pairs
from remat.data.masks import (
    IGNORE_INDEX,
    ColourTableMask,
    LabelMapMask,
    NonZeroMask,
    ThresholdMask,
    parse_colour,
)
from remat.data.pairs import ImageMaskPair, MaskDecoder
from remat.data.patch_seg import PatchSegDataModule, PatchSegDataset
from remat.data.splits import split_ids
from remat.data.transforms import GREY_MEAN, GREY_STD, IMAGENET_MEAN, IMAGENET_STD

log = logging.getLogger(__name__)

MASK_ENCODINGS = ("binary", "index", "palette", "colors")
NORMALIZATIONS = ("auto", "imagenet", "image")
#: suffixes an ``images/*``-style glob (a wildcard suffix) takes as images or masks
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".gif", ".webp")
SPLIT_FOLDERS = ("train", "val", "test")
FOLDER_LAYOUT = ("images/<name>.<ext> and masks/<name>.<ext> (or data.images / data.masks "
                 "globs; or train/, val/, test/ sub-folders holding them; or data.pairs=<csv> "
                 "with columns image,mask[,split])")


class FolderImages:
    """Picklable image reader of a folder dataset: :func:`remat.data.io.read_any_image`
    with the configured ``image_mode``."""

    def __init__(self, image_mode: str) -> None:
        self.image_mode = image_mode

    def __call__(self, path: Path) -> torch.Tensor:
        return read_any_image(path, self.image_mode)


class EightBitImages:
    """Picklable reader of the shipped datasets' 8-bit images
    (:func:`remat.data.io.read_image` in ``image_mode``; ``grey_rgb`` repeated to 3)."""

    def __init__(self, image_mode: str) -> None:
        self.image_mode = image_mode

    def __call__(self, path: Path) -> torch.Tensor:
        from torchvision.io import ImageReadMode

        from remat.data.io import read_image

        mode = ImageReadMode.RGB if self.image_mode == "rgb" else ImageReadMode.GRAY
        image = read_image(path, mode)
        return image.expand(3, -1, -1) if self.image_mode == "grey_rgb" else image


class Normalize:
    """Scale and normalise a decoded image ``[C, H, W]`` (uint8, uint16 or float32) into the
    float32 the network reads.

    Args:
        how: ``"imagenet"``: scale 8/16-bit images to ``[0, 1]``, then the ImageNet mean/std
            (3 channels) or their channel average 0.449/0.226 (1 channel);
            ``"image"``: each channel of each whole image to zero mean and unit variance
            (nnU-Net's z-score scheme for non-CT images, Isensee et al. 2021; training
            patches use the statistics of the image they are cut from);
            ``"auto"``: ``imagenet`` for 8-bit images of 1 or 3 channels, else ``image``;
            or a mapping ``{mean: [...], std: [...]}``, one value per channel, in the units
            after scaling (8/16-bit images to ``[0, 1]``, float images as stored).

    Raises:
        ValueError: an unknown ``how``, or mean/std lists of unequal length or with a zero
            std (names ``data.normalize``).
    """

    def __init__(self, how: str | Mapping[str, Sequence[float]] = "auto") -> None:
        if isinstance(how, Mapping):
            mean, std = list(how.get("mean", ())), list(how.get("std", ()))
            if not mean or len(mean) != len(std) or any(float(s) == 0 for s in std):
                raise ValueError(f"data.normalize: mean and std must be lists of equal length "
                                 f"with non-zero std, got {dict(how)}")
            self.how: str | tuple[list[float], list[float]] = (
                [float(m) for m in mean], [float(s) for s in std])
        elif how in NORMALIZATIONS:
            self.how = str(how)
        else:
            raise ValueError(f"data.normalize must be one of {NORMALIZATIONS} or "
                             f"{{mean: [...], std: [...]}}, got {how!r}")

    @staticmethod
    def scale(image: torch.Tensor) -> torch.Tensor:
        """uint8 / uint16 -> float32 in ``[0, 1]``; float as it is (float32)."""
        if image.dtype == torch.uint8:
            return image.float() / 255.0
        if image.dtype == torch.uint16:
            return image.float() / 65535.0
        return image.float()

    @staticmethod
    def image_stats(image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and std ``[C]`` of a scaled image ``[C, H, W]`` (a zero std
        becomes 1, so a constant channel maps to 0)."""
        flat = image.reshape(image.shape[0], -1).double()
        std = flat.std(dim=1, unbiased=False)
        return flat.mean(dim=1).float(), torch.where(std > 0, std, 1.0).float()

    def per_image(self, raw_dtype: torch.dtype, channels: int) -> bool:
        """Whether images of this dtype and channel count are normalised by their own
        statistics (``image``, or ``auto`` off 8-bit 1/3-channel images)."""
        if self.how == "auto":
            return not (raw_dtype == torch.uint8 and channels in (1, 3))
        return self.how == "image"

    def auto_kind(self, image: torch.Tensor) -> str:
        """How ``auto`` treats a decoded image ``[C, H, W]``, in words (the data check's
        message names the two kinds it found)."""
        if self.per_image(image.dtype, image.shape[0]):
            return "are 16-bit, float or of another channel count: each by its own mean and std"
        return "are 8-bit with 1 or 3 channels: ImageNet mean and std"

    def __call__(self, image: torch.Tensor, raw_dtype: torch.dtype,
                 stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Normalise ``image`` (already scaled by :meth:`scale`) decoded as ``raw_dtype``;
        for per-image normalisation, ``stats`` are those of the whole image the patch was cut
        from (:meth:`image_stats`; default: the patch's own).

        Raises:
            ValueError: ``imagenet`` or mean/std that do not fit the channels.
        """
        channels = image.shape[0]
        how = self.how
        if self.per_image(raw_dtype, channels):
            mean, std = stats if stats is not None else self.image_stats(image)
            return (image - mean[:, None, None]) / std[:, None, None]
        if how == "auto":
            how = "imagenet"
        if how == "imagenet":
            if channels not in (1, 3):
                raise ValueError(f"data.normalize=imagenet needs 1 or 3 channels, the image "
                                 f"has {channels}; use data.normalize=image or give mean/std")
            mean, std = ((list(IMAGENET_MEAN), list(IMAGENET_STD)) if channels == 3
                         else ([GREY_MEAN], [GREY_STD]))
        else:
            mean, std = how
            if len(mean) != channels:
                raise ValueError(f"data.normalize gives {len(mean)} means for images of "
                                 f"{channels} channels")
        m = torch.tensor(mean, dtype=image.dtype)[:, None, None]
        s = torch.tensor(std, dtype=image.dtype)[:, None, None]
        return (image - m) / s


class FolderSegDataset(PatchSegDataset):
    """:class:`remat.data.patch_seg.PatchSegDataset` for a user's files: any bit depth and
    channel count, normalised by :class:`Normalize`. Flips for every image; brightness and
    contrast jitter only for 8/16-bit images of 1 or 3 channels (jitter clamps to
    ``[0, 1]``, which would cut float images).

    Args:
        normalize: a :class:`Normalize`.
        **kwargs: the arguments of :class:`~remat.data.patch_seg.PatchSegDataset`
            (``image_reader`` included).

    Items: ``{"image": float32 [C, h, w], "mask": int64 [h, w], "name": str}``.
    """

    def __init__(self, *args: Any, normalize: Normalize, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.normalize = normalize
        flips: list[v2.Transform] = ([v2.RandomHorizontalFlip(), v2.RandomVerticalFlip()]
                                     if self.train and kwargs.get("augment", True) else [])
        jitter = [v2.ColorJitter(brightness=0.2, contrast=0.2)] if flips else []
        self._plain = v2.Compose(flips or [v2.Identity()])
        self._jitter = v2.Compose([*flips, *jitter] or [v2.Identity()])
        self._raw_dtype = torch.uint8
        self._stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def load(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Decode pair ``index`` (see the base class) and keep its whole-image statistics
        for per-image normalisation of the patch cut from it."""
        loaded = super().load(index)
        image = loaded[0]
        self._stats = (Normalize.image_stats(Normalize.scale(image))
                       if self.normalize.per_image(image.dtype, image.shape[0]) else None)
        return loaded

    def transform_for(self, image: torch.Tensor) -> v2.Transform:
        """Flips (training), then jitter for 8/16-bit images of 1 or 3 channels."""
        self._raw_dtype = image.dtype
        jitter = not image.dtype.is_floating_point and image.shape[0] in (1, 3)
        return _Scaled(self._jitter if jitter else self._plain)

    def finish(self, image: torch.Tensor) -> torch.Tensor:
        """Normalise the scaled image (see :class:`Normalize`)."""
        return self.normalize(image, self._raw_dtype, self._stats)


class _Scaled:
    """Scale the sample's image to float (``Normalize.scale``), then run ``transform``."""

    def __init__(self, transform: v2.Transform) -> None:
        self.transform = transform

    def __call__(self, parts: dict[str, Any]) -> dict[str, Any]:
        from torchvision import tv_tensors

        image = parts["image"]
        parts = {**parts, "image": tv_tensors.Image(Normalize.scale(
            image.as_subclass(torch.Tensor)))}
        return self.transform(parts)


class PredictImages(torch.utils.data.Dataset):
    """Images without masks, served as the datamodule's evaluation items are (whole images,
    normalised), for ``remat.predict``.

    Args:
        paths: the image files.
        names: one output name per file (relative path without suffix).
        reader: ``path -> [C, H, W]`` (the datamodule's image reader).
        normalize: a :class:`Normalize`.

        resize: ``(h, w)`` px to resize every image to (datasets that train and evaluate on
            resized images, as Kvasir-SEG), or None for the native size.

    Items: ``{"image": float32 [C, h, w], "name": str, "path": str, "size": int64 [2]}``
    (``size``: the native ``(H, W)``, to which predictions are resized back).
    """

    def __init__(self, paths: Sequence[Path], names: Sequence[str], reader: Any,
                 normalize: Normalize, resize: tuple[int, int] | None = None) -> None:
        self.paths, self.names = list(paths), list(names)
        self.reader, self.normalize, self.resize = reader, normalize, resize

    def __len__(self) -> int:
        return len(self.paths)

    def check(self, path: Path) -> None:
        """Decode one input as :meth:`__getitem__` will (``remat.predict`` checks every input
        before it writes a mask).

        Raises:
            remat.data.io.DataFileError: the file is not a readable image.
        """
        self.reader(path)

    def __getitem__(self, index: int) -> dict[str, Any]:
        raw = self.reader(self.paths[index])
        size = torch.tensor(raw.shape[-2:], dtype=torch.int64)
        if self.resize is not None and tuple(raw.shape[-2:]) != tuple(self.resize):
            raw = v2.functional.resize(raw, list(self.resize), antialias=True)  # as eval does
        image = self.normalize(Normalize.scale(raw), raw.dtype)
        return {"image": image, "name": self.names[index], "path": str(self.paths[index]),
                "size": size}


# ----------------------------------------------------------------------------- listing


def _pattern_regex(name_pattern: str) -> tuple[re.Pattern[str], bool]:
    """A regex for a file-name glob whose first ``*`` captures the pair's name, and whether
    the capture runs to the end (a wildcard suffix, stripped from the name afterwards)."""
    out, captured = [], False
    for char in name_pattern:
        if char == "*":
            out.append("(.*)" if not captured else ".*")
            captured = True
        elif char == "?":
            out.append(".")
        else:
            out.append(re.escape(char))
    if not captured:
        raise ValueError(f"the glob {name_pattern!r} has no '*' for the name part")
    return re.compile("".join(out), re.IGNORECASE), name_pattern.endswith("*")


def _other_files(base: Path, pattern: str, suffixes: Sequence[str]) -> str:
    """``; images/* holds 6 files of other types (.png x6), read: .nii.gz, .nii, .npy``
    when the glob matches files this data does not read, else ``""``."""
    def kind(path: Path) -> str:
        ends = path.suffixes[-2:] if path.name.lower().endswith(".gz") else path.suffixes[-1:]
        return "".join(ends).lower() or "(no suffix)"

    kinds = Counter(kind(p) for p in base.glob(pattern)
                    if p.is_file() and not p.name.startswith("."))
    if not kinds:
        return ""
    listed = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    return (f"; {pattern} holds {sum(kinds.values())} files of other types ({listed}), this "
            f"data reads {', '.join(suffixes)}")


def glob_names(base: Path, pattern: str, key: str,
               suffixes: Sequence[str] = IMAGE_SUFFIXES) -> dict[str, Path]:
    """``{name: path}`` of the files matching ``pattern`` below ``base``.

    The name is what the file name's first ``*`` matched (without the suffix when the glob
    ends in ``*``), prefixed by the sub-folders between the glob's fixed part and the file;
    a glob ending in ``*`` takes files ending in one of ``suffixes`` only (default
    :data:`IMAGE_SUFFIXES`; multi-part ones such as ``.nii.gz`` too).

    Raises:
        ValueError: the glob has no ``*`` in its file-name part, or two files get one name
            (``a.png`` and ``a.jpg``); names the config ``key``.
    """
    parts = PurePosixPath(pattern).parts
    fixed = 0
    while fixed < len(parts) - 1 and not any(c in parts[fixed] for c in "*?["):
        fixed += 1
    anchor = base.joinpath(*parts[:fixed])
    try:
        regex, open_suffix = _pattern_regex(parts[-1])
    except ValueError as err:
        raise ValueError(f"{key}={pattern!r}: {err} (e.g. images/* or masks/*_mask.png)") from None
    found: dict[str, Path] = {}
    if not anchor.is_dir():
        return found
    for path in sorted(anchor.glob(str(PurePosixPath(*parts[fixed:])))):
        if path.name.startswith(".") or not path.is_file():
            continue
        match = regex.fullmatch(path.name)
        if match is None:
            continue
        stem = match.group(1)
        if open_suffix:
            suffix = next((s for s in suffixes if path.name.lower().endswith(s)), None)
            if suffix is None:
                continue
            stem = stem[: len(stem) - len(suffix)]
        rel = path.relative_to(anchor).parent
        name = str(PurePosixPath(*rel.parts, stem)) if rel.parts else stem
        if name in found:
            raise ValueError(f"{key}={pattern!r}: {found[name]} and {path} both give the name "
                             f"{name!r}; keep one, or make the glob's suffix explicit "
                             "(e.g. images/*.png)")
        found[name] = path
    return found


def read_pairs_csv(path: Path, mask_column: str = "mask",
                   name_of: Callable[[str], str] | None = None,
                   ) -> tuple[list[ImageMaskPair], dict[str, list[str]]]:
    """Pairs (and splits, if the CSV has a ``split`` column) from a CSV of image/mask paths.

    Args:
        path: the CSV.
        mask_column: the column of the mask files (``label`` for volumes).
        name_of: a pair's name from its image path when the row has no ``name``
            (default: the path without its suffix).

    Files the CSV names are not looked for here: the datamodule's data check lists every
    missing one with the other bad files.

    Raises:
        FileNotFoundError: the CSV is missing.
        ValueError: no ``image``/``mask`` header, an unknown split, or a name twice.
    """
    if not path.is_file():
        raise FileNotFoundError(f"data.pairs={path}: no such file (expected a CSV with the "
                                f"columns image,{mask_column} and optionally split,name)")
    pairs: list[ImageMaskPair] = []
    splits: dict[str, list[str]] = {}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = [c.strip().lower() for c in reader.fieldnames or []]
        if not {"image", mask_column} <= set(columns):
            raise ValueError(f"data.pairs={path}: the header must name the columns image and "
                             f"{mask_column} (and optionally split, name); got {columns}")
        seen: set[str] = set()
        for line, row in enumerate(reader, start=2):
            row = {k.strip().lower(): (v or "").strip() for k, v in row.items() if k}
            empty = [c for c in ("image", mask_column) if not row.get(c)]
            if empty:
                raise ValueError(f"data.pairs={path} line {line}: the {' and '.join(empty)} "
                                 f"column{'s are' if len(empty) > 1 else ' is'} empty; every "
                                 f"row names an image and its {mask_column} file (paths "
                                 "relative to the CSV)")
            image, mask = path.parent / row["image"], path.parent / row[mask_column]
            name = row.get("name") or (name_of(row["image"]) if name_of is not None else
                                       str(PurePosixPath(row["image"]).with_suffix("")))
            if name in seen:
                raise ValueError(f"data.pairs={path} line {line}: the name {name!r} is used "
                                 "twice; give a unique name column")
            seen.add(name)
            pairs.append(ImageMaskPair(name, image, mask))
            split = row.get("split", "")
            if split:
                if split not in SPLIT_FOLDERS:
                    raise ValueError(f"data.pairs={path} line {line}: split {split!r} is none of "
                                     f"{SPLIT_FOLDERS}")
                splits.setdefault(split, []).append(name)
    if splits and len(splits.get("train", [])) + len(splits.get("val", [])) + \
            len(splits.get("test", [])) != len(pairs):
        raise ValueError(f"data.pairs={path}: some rows have a split and some have none; give "
                         "every row a split, or none (then data.val_fraction splits)")
    return pairs, splits


def split_dirs(root: Path, images: str) -> list[str]:
    """The split sub-folders (:data:`SPLIT_FOLDERS`) of ``root`` that hold the folder of the
    ``images`` glob, when ``root`` itself does not."""
    anchor = PurePosixPath(images).parts[0]
    if (root / anchor).exists():
        return []
    return [s for s in SPLIT_FOLDERS if (root / s / anchor).is_dir()]


def list_folder_pairs(root: Path, images: str, masks: str, pairs_csv: Path | None = None, *,
                      suffixes: Sequence[str] = IMAGE_SUFFIXES, masks_key: str = "data.masks",
                      mask_column: str = "mask", name_of: Callable[[str], str] | None = None,
                      layout: str = FOLDER_LAYOUT, what: str = "image folder",
                      ) -> tuple[list[ImageMaskPair], dict[str, list[str]]]:
    """A user folder's pairs and its own splits (``{}`` when it has none): the rows of the
    CSV ``pairs_csv`` (relative to ``root``), or the ``images``/``masks`` globs matched
    (:func:`glob_names`, :func:`remat.data.layout.match_pairs`) below each split folder
    (names prefixed ``train/``, ...) or below ``root``.

    Args:
        suffixes: file endings a glob ending in ``*`` takes.
        masks_key, mask_column: the config key of the mask glob and the CSV's mask column,
            for messages (``data.labels`` / ``label`` for volumes).
        name_of: names of CSV rows without a ``name`` (see :func:`read_pairs_csv`).
        layout, what: the expected layout and what the folder is, for messages.

    Raises:
        FileNotFoundError: ``root`` missing (names ``data.root``), no images, unpaired files,
            a missing CSV (files a CSV names are looked for by the data check).
        ValueError: a glob without ``*``, two files of one name, a malformed CSV.
    """
    if pairs_csv is not None:
        return read_pairs_csv(pairs_csv if pairs_csv.is_absolute() else root / pairs_csv,
                              mask_column, name_of)

    if not root.is_dir():
        state = "does not exist" if not root.exists() else "is not a folder"
        raise FileNotFoundError(f"data.root={root} ({what}) {state}; expected {images} and "
                                f"{masks} below it ({layout})")

    def listed(base: Path, prefix: str) -> list[ImageMaskPair]:
        found = glob_names(base, images, "data.images", suffixes)
        labels = glob_names(base, masks, masks_key, suffixes)
        where = (f"the {what} data.root={base}" if base == root
                 else f"the {what} {base} (split {prefix[:-1]} of data.root)")
        expected = f"{images} and {masks} below {base} ({layout})"
        if not found:
            expected += _other_files(base, images, suffixes)
        return match_pairs(found, labels, where, expected, prefix=prefix, root=base,
                           kind=mask_column)

    splits = split_dirs(root, images)
    if not splits:
        return listed(root, ""), {}
    pairs: list[ImageMaskPair] = []
    own: dict[str, list[str]] = {}
    for split in splits:
        found = listed(root / split, f"{split}/")
        own[split] = [p.name for p in found]
        pairs += found
    return pairs, own


# ----------------------------------------------------------------------------- datamodule


class FolderSegDataModule(PatchSegDataModule):
    """A user's own folder of images and masks (``data=folder``; layouts and encodings in
    the module docstring).

    Args:
        root: the folder. Hydra: ``data.root``.
        images, masks: globs below ``root`` (or below each split folder) giving the image and
            mask files; a pair shares the name (see :func:`glob_names`).
        pairs: a CSV of ``image,mask[,split][,name]`` rows instead of the globs.
        mask_encoding: one of :data:`MASK_ENCODINGS`.
        threshold: ``binary`` only: grey level (of 255) from which a pixel is foreground;
            None: any non-zero value.
        num_classes: 1 for binary; K for ``index``/``palette``/``colors`` (``colors``: the
            number of colours, when None).
        ignore_index: mask value that is no class (0..255; 255 by default).
        class_names: one name per class (binary: background and foreground), or None.
        colors: ``colors`` only: a list of colours in class order, or ``{name: colour}``.
        ignore_colors: ``colors`` only: colours that are no class.
        val_fraction: share of the images that is val when the layout has no splits and no
            ``split_file`` is given (seeded by ``split_seed``; at least one image each).
        split_seed: seed of that split.
        normalize: see :class:`Normalize`.
        **kwargs: :class:`~remat.data.patch_seg.PatchSegDataModule` options (``patch_size``,
            ``patches_per_image``, ``foreground_prob``, ``augment``, ``cache``,
            ``batch_size``, ``num_workers``, ``seed``, ``image_mode`` (also ``native``),
            ``split_file``, ``limit_train``, ``limit_val``, ``verify``).

    Raises:
        ValueError: (at construction) a bad encoding, threshold, class count, colour,
            ``ignore_index`` or ``val_fraction``, naming the ``data.`` key; (in ``setup``) an
            unset root, an empty split or a layout that yields two files of one name.
        FileNotFoundError: (in ``setup``) no images, unpaired files, a missing CSV.
        remat.data.verify.DataCheckError: (in ``setup``) the data check found bad or missing
            files (a CSV row naming a file that is not there) or a split without foreground.
    """

    title = "image folder"
    folder = ""
    layout = FOLDER_LAYOUT
    url = "your own files"
    image_modes: ClassVar[tuple[str, ...]] = ANY_IMAGE_MODES

    def __init__(self, root: str | Path | None, images: str = "images/*",
                 masks: str = "masks/*", pairs: str | Path | None = None,
                 mask_encoding: str = "binary", threshold: int | None = None,
                 num_classes: int | None = 1, ignore_index: int = IGNORE_INDEX,
                 class_names: Sequence[str] | None = None,
                 colors: Sequence[Any] | Mapping[str, Any] | None = None,
                 ignore_colors: Sequence[Any] = (), val_fraction: float = 0.2,
                 split_seed: int = 42, normalize: str | Mapping[str, Any] = "auto",
                 **kwargs: Any) -> None:
        if mask_encoding not in MASK_ENCODINGS:
            raise ValueError(f"data.mask_encoding must be one of {MASK_ENCODINGS}, got "
                             f"{mask_encoding!r}")
        if not isinstance(ignore_index, int) or not 0 <= ignore_index <= 255:
            raise ValueError(f"data.ignore_index must be an int in 0..255 (masks are 8-bit "
                             f"class maps), got {ignore_index!r}")
        self.mask_encoding, self.ignore_index = mask_encoding, ignore_index
        names_from_colours = None
        self.colours: list[tuple[int, int, int]] = []
        if mask_encoding == "colors":
            if not colors:
                raise ValueError("data.mask_encoding=colors needs data.colors: a list of "
                                 "'#RRGGBB' (or [R, G, B]) in class order, or {name: colour}")
            if isinstance(colors, Mapping):
                names_from_colours = [str(k) for k in colors]
                colors = list(colors.values())
            self.colours = [parse_colour(c, f"data.colors[{i}]") for i, c in enumerate(colors)]
            if len(set(self.colours)) != len(self.colours):
                raise ValueError(f"data.colors lists a colour twice: {self.colours}")
            if num_classes is None or num_classes == 1 and len(self.colours) != 2:
                num_classes = 1 if len(self.colours) == 2 else len(self.colours)
            if max(2, num_classes) != len(self.colours):
                raise ValueError(f"data.colors has {len(self.colours)} colours but "
                                 f"data.num_classes={num_classes} (1 = binary: 2 colours)")
        elif colors:
            raise ValueError(f"data.colors is set but data.mask_encoding={mask_encoding}; "
                             "use data.mask_encoding=colors")
        if ignore_colors and mask_encoding != "colors":  # read by the colour table only
            raise ValueError(f"data.ignore_colors is set but data.mask_encoding="
                             f"{mask_encoding}; use data.mask_encoding=colors (for label maps "
                             "the value that is no class is data.ignore_index)")
        self.ignore_colours = [parse_colour(c, f"data.ignore_colors[{i}]")
                               for i, c in enumerate(ignore_colors or ())]
        if num_classes is None or isinstance(num_classes, bool) or \
                not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"data.num_classes must be an int >= 1 (1 = binary), got "
                             f"{num_classes!r}")
        if mask_encoding == "binary" and num_classes != 1:
            raise ValueError(f"data.mask_encoding=binary serves one foreground class, but "
                             f"data.num_classes={num_classes}; for label maps with "
                             f"{num_classes} classes use data.mask_encoding=index (or palette)")
        if max(2, num_classes) > ignore_index and mask_encoding != "binary":
            raise ValueError(f"data.ignore_index={ignore_index} is one of the "
                             f"{max(2, num_classes)} class values; pick a value above them")
        if threshold is not None and (mask_encoding != "binary" or isinstance(threshold, bool)
                                      or not isinstance(threshold, int)
                                      or not 1 <= threshold <= 255):
            raise ValueError("data.threshold is a grey level 1..255 for "
                             f"data.mask_encoding=binary, got {threshold!r} with "
                             f"mask_encoding={mask_encoding}")
        self.threshold = threshold
        self.num_classes = num_classes
        k = max(2, num_classes)
        if class_names and names_from_colours and list(class_names) != names_from_colours:
            raise ValueError(f"data.class_names {list(class_names)} and the names data.colors "
                             f"gives its colours {names_from_colours} disagree; name the "
                             "classes in one place (drop data.class_names, or give "
                             "data.colors as a list of colours)")
        names = list(class_names) if class_names else names_from_colours
        if names is not None and len(names) != k:
            raise ValueError(f"data.class_names has {len(names)} names for {k} classes "
                             f"(data.num_classes={num_classes}; binary: background and "
                             f"foreground): {names}")
        self.class_names = tuple(names) if names else (
            ("background", "foreground") if num_classes == 1
            else tuple(f"class{i}" for i in range(k)))
        if not 0.0 < float(val_fraction) < 1.0:
            raise ValueError(f"data.val_fraction must be between 0 and 1 (exclusive), got "
                             f"{val_fraction!r}")
        self.images, self.masks = str(images), str(masks)
        self.pairs_csv = Path(pairs).expanduser() if pairs else None
        self.val_fraction, self.split_seed = float(val_fraction), int(split_seed)
        self.normalizer = Normalize(normalize)
        self._trained_as: str | None = None  # what auto made of the training images
        self._listed_splits: dict[str, list[str]] = {}
        super().__init__(root, **kwargs)

    # ---------------------------------------------------------------- layout

    def is_dataset_root(self, candidate: Path) -> bool:
        """Whether ``candidate`` holds the folder of the ``images`` glob, split folders
        holding it, or the ``pairs`` CSV."""
        if self.pairs_csv is not None:
            return (self.pairs_csv if self.pairs_csv.is_absolute()
                    else candidate / self.pairs_csv).is_file()
        anchor = PurePosixPath(self.images).parts[0]
        return (candidate / anchor).is_dir() or any(
            (candidate / split / anchor).is_dir() for split in SPLIT_FOLDERS)

    def list_pairs(self, root: Path) -> list[ImageMaskPair]:
        """Pairs of the CSV, of each split folder, or of ``root`` (names prefixed with the
        split folder, ``train/case1``, when there are split folders)."""
        pairs, self._listed_splits = list_folder_pairs(root, self.images, self.masks,
                                                       self.pairs_csv)
        return pairs

    def default_split(self, names: Sequence[str]) -> dict[str, list[str]]:
        """The layout's own splits (folders, CSV column), else a seeded ``val_fraction``."""
        if self._listed_splits:
            return {k: list(v) for k, v in self._listed_splits.items()}
        if len(names) < 2:
            raise ValueError(f"{self.title} at {self.dataset_root} holds {len(names)} image "
                             "pair(s); a train/val split needs at least 2 (or give "
                             "data.split_file with a val or test split to evaluate)")
        val = min(len(names) - 1, max(1, round(self.val_fraction * len(names))))
        train, held = split_ids(names, val, self.split_seed)
        return {"train": train, "val": held}

    # ---------------------------------------------------------------- decoding

    def mask_decoder(self) -> MaskDecoder:
        """The decoder of ``data.mask_encoding`` (see the module docstring)."""
        if self.mask_encoding == "binary":
            return NonZeroMask() if self.threshold is None else ThresholdMask(
                threshold=self.threshold)
        if self.mask_encoding in ("index", "palette"):
            return LabelMapMask(self.num_classes, self.ignore_index,
                                palette=self.mask_encoding == "palette")
        return ColourTableMask(self.colours, self.ignore_colours, self.ignore_index)

    def image_reader(self) -> FolderImages:
        """:func:`remat.data.io.read_any_image` with ``data.image_mode``."""
        return FolderImages(self.image_mode)

    def image_kind(self) -> Callable[[torch.Tensor], str] | None:
        """Under ``data.normalize=auto``, how :class:`Normalize` treats a decoded image:
        ImageNet statistics or its own (a folder of 8-bit PNGs and 16-bit TIFFs trained
        with the same picture normalised two ways, silently); None otherwise."""
        return self.normalizer.auto_kind if self.normalizer.how == "auto" else None

    def state_dict(self) -> dict[str, Any]:
        """``{"normalize": "imagenet" | "image"}``: what ``data.normalize=auto`` made of the
        training images (one way for all: the data check refuses a mix), saved in every
        checkpoint, so that :meth:`load_state_dict` gives new images (``remat.predict``,
        ``remat.eval`` on another folder) the normalisation the network was trained with:
        a 16-bit copy of an 8-bit training image was z-scored instead (a trial: mIoU 0.953
        against 0.993). Empty under any other ``data.normalize``, or before ``setup``."""
        if self._trained_as is None and self.normalizer.how == "auto":
            first = next((self.pairs[n] for n in self.splits.get("train", ())
                          if n in self.pairs), None)
            if first is None:
                return {}
            image = self.image_reader()(first.image)
            self._trained_as = ("image" if self.normalizer.per_image(image.dtype,
                                                                      image.shape[0])
                                else "imagenet")
        return {"normalize": self._trained_as} if self._trained_as else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Normalise as the checkpoint's training images were (:meth:`state_dict`) where
        ``data.normalize=auto`` would decide by each new image's own kind; the datasets
        built already share the normaliser, so they follow."""
        trained = state_dict.get("normalize")
        if self.normalizer.how == "auto" and trained in ("imagenet", "image"):
            self.normalizer.how = trained
            self._trained_as = trained

    @property
    def in_channels(self) -> int:
        """Channels of the served images: 3 (``rgb``, ``grey_rgb``), 1 (``grey``) or, for
        ``native``, those of the first image file."""
        if self.image_mode != "native":
            return 1 if self.image_mode == "grey" else 3
        try:
            first = next(iter(self.pairs.values()), None)
            if first is None:
                root = self.find_root()
                found = self.list_pairs(root)
                first = found[0] if found else None
        except (ValueError, FileNotFoundError):
            return 3  # setup() reports the layout problem itself
        if first is None:
            return 3
        try:
            return image_channels(first.image, "native")
        except (DataFileError, FileNotFoundError):
            return 3  # the data check names the file

    def build_dataset(self, pairs: list[ImageMaskPair], train: bool) -> FolderSegDataset:
        """Random patches (``train``) or whole images of ``pairs``."""
        return FolderSegDataset(
            pairs, self.mask_decoder(), train=train, sampler=self.sampler,
            patches_per_image=self.patches_per_image, image_mode=self.image_mode,
            augment=self.augment, ignore_index=self.ignore_index, cache=self.cache,
            image_reader=self.image_reader(), normalize=self.normalizer)

    def predict_dataset(self, paths: Sequence[Path], names: Sequence[str]) -> PredictImages:
        """Whole images read and normalised as val images are (for ``remat.predict``)."""
        return PredictImages(paths, names, self.image_reader(), self.normalizer)

    def mask_palette(self) -> list[tuple[int, int, int]] | None:
        """The palette of the first mask file (``mask_encoding=palette``), one colour per
        class, so predicted masks show as the user's own do; None without one."""
        if self.mask_encoding != "palette":
            return None
        from PIL import Image

        try:
            pairs = list(self.pairs.values()) or self.list_pairs(self.find_root())
            with Image.open(pairs[0].mask) as img:
                flat = img.getpalette() if img.mode == "P" else None
        except (OSError, ValueError, IndexError):
            return None
        if not flat:
            return None
        k = max(2, self.num_classes)
        return [tuple(flat[3 * i:3 * i + 3]) for i in range(k)]

    def describe(self) -> str:
        """One line: folder, encoding, classes (for logs)."""
        extra = f", threshold {self.threshold}" if self.threshold is not None else ""
        return (f"{self.dataset_root}: {self.mask_encoding} masks{extra}, "
                f"{max(2, self.num_classes)} classes {listing(list(self.class_names))}")
