"""Getting data in: decoding image files with errors that name the file, and building loaders.

Every file that cannot be used raises :class:`DataFileError` saying which file, what is wrong
and what was expected, so a data check (:mod:`remat.data.verify`) can list every bad file of a
dataset at once and a training step that meets one names it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchvision.io import ImageReadMode, decode_image, read_file

from remat.data.seeding import SeededSamples, SeededShuffle, run_seed

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec and warns on every call;
# the decoders still work, so keep the per-sample warning out of training logs.
_CODEC_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"
# torchvision has no TIFF decoder (DRIVE, CVC-ClinicDB, Inria and the Massachusetts sets ship
# TIFFs), and its GIF decoder ignores the read mode (a GRAY read of a grey GIF returns 3
# channels, torchvision 0.29); both go through Pillow.
_PIL_SUFFIXES = {".tif", ".tiff", ".gif"}
_PIL_MODES = {ImageReadMode.RGB: "RGB", ImageReadMode.GRAY: "L"}
_PIL_16BIT_MODES = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
_EXIF_ORIENTATION = 0x0112  # the EXIF tag of how a stored image is turned for viewing
_FORMATS = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".tif": "TIFF", ".tiff": "TIFF",
            ".gif": "GIF", ".bmp": "BMP", ".webp": "WebP"}


class DataFileError(ValueError):
    """A data file that cannot be used.

    Build it with ``DataFileError(path=..., problem=..., expected=...)``; the message is
    ``"<path>: <problem>; expected <expected>"`` and the three parts stay available as
    attributes. A plain ``DataFileError(message)`` also works (DataLoader workers re-raise
    exceptions that way).

    Attributes:
        path: the file (``Path``), or None.
        problem: what is wrong with it (``"empty file (0 bytes)"``).
        expected: what a usable file holds (``"an 8-bit PNG image"``), or None.
    """

    def __init__(self, message: str = "", *, path: str | Path | None = None,
                 problem: str | None = None, expected: str | None = None) -> None:
        if path is not None:
            message = f"{path}: {problem}" + (f"; expected {expected}" if expected else "")
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.problem = problem if problem is not None else message
        self.expected = expected


def file_format(path: str | Path) -> str:
    """``"JPEG"``, ``"PNG"``, ``"TIFF"`` ... from the file's suffix (the suffix itself when it
    is none of those)."""
    suffix = Path(path).suffix.lower()
    return _FORMATS.get(suffix, suffix.lstrip(".").upper() or "image")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _upright(img: Image.Image) -> Image.Image:
    """``img`` turned as its EXIF orientation tag says (as viewers and annotation tools
    show it; masks are drawn on that view), or itself without one."""
    if img.getexif().get(_EXIF_ORIENTATION, 1) in (None, 1):
        return img
    return ImageOps.exif_transpose(img)


def _read_with_pillow(path: Path, mode: ImageReadMode, expected: str) -> torch.Tensor:
    try:
        with Image.open(path) as opened:
            img = _upright(opened)
            if img.mode in _PIL_16BIT_MODES:  # 16-bit grey: keep the values, never clip
                array = np.asarray(img).astype(np.int64)
                if array.min() < 0 or array.max() > 65535:
                    raise DataFileError(path=path, problem=f"{img.mode} pixels outside 0..65535",
                                        expected=expected)
                tensor = torch.from_numpy(array.astype(np.int32))[None].to(torch.uint16)
                return tensor.expand(3, -1, -1).contiguous() if mode == ImageReadMode.RGB \
                    else tensor
            if mode in _PIL_MODES:
                img = img.convert(_PIL_MODES[mode])
            elif img.mode == "1":  # 1-bit TIFFs (some binary label maps): 0/255 like PNGs
                img = img.convert("L")
            array = np.asarray(img)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        if isinstance(err, DataFileError):
            raise
        raise DataFileError(path=path, problem=f"cannot be decoded ({_first_line(err)})",
                            expected=expected) from err
    if array.dtype != np.uint8:
        raise DataFileError(path=path, problem=f"holds {array.dtype} pixels", expected=expected)
    tensor = torch.from_numpy(array.copy())
    return tensor[None] if tensor.ndim == 2 else tensor.permute(2, 0, 1).contiguous()


def _decode(path: str | Path, mode: ImageReadMode, expected: str) -> torch.Tensor:
    """uint8 or uint16 ``[C, H, W]`` as stored (channels converted to ``mode``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    if path.stat().st_size == 0:
        raise DataFileError(path=path, problem="empty file (0 bytes)", expected=expected)
    if path.suffix.lower() in _PIL_SUFFIXES:
        return _read_with_pillow(path, mode, expected)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _CODEC_DEPRECATION, DeprecationWarning)
        try:
            # turned as the EXIF orientation says: as viewers, and annotation tools,
            # show the photo (a phone's portrait JPEG is stored sideways)
            return decode_image(read_file(str(path)), mode=mode, apply_exif_orientation=True)
        except (RuntimeError, ValueError) as err:
            raise DataFileError(path=path, problem=f"cannot be decoded ({_first_line(err)})",
                                expected=expected) from err


def read_image(path: str | Path, mode: ImageReadMode = ImageReadMode.RGB,
               expected: str | None = None) -> torch.Tensor:
    """Decode an 8-bit image file (JPEG, PNG, GIF, TIFF) into a uint8 tensor ``[C, H, W]``.

    ``C`` is 3 for ``ImageReadMode.RGB`` and 1 for ``ImageReadMode.GRAY`` (as stored for
    ``UNCHANGED``). Palette PNGs are expanded to their colours (for RGB and GRAY). TIFFs and
    GIFs are decoded with Pillow (torchvision lacks TIFF and ignores the mode for GIF).

    Args:
        path: the file.
        mode: channels to return.
        expected: what the file should hold, for messages (default ``"an 8-bit <FORMAT>
            image"``).

    Raises:
        FileNotFoundError: the file does not exist.
        DataFileError: (a ``ValueError``) the file is empty, cannot be decoded, or holds
            16-bit (or other non-8-bit) pixels; the message names the file.
    """
    expected = expected or f"an 8-bit {file_format(path)} image"
    image = _decode(path, mode, expected)
    if image.dtype != torch.uint8:
        bits = 16 if image.dtype == torch.uint16 else image.dtype
        raise DataFileError(path=path, problem=f"holds {bits}-bit pixels", expected=expected)
    return image


def read_label(path: str | Path, mode: ImageReadMode = ImageReadMode.GRAY,
               expected: str | None = None) -> torch.Tensor:
    """Decode a label image as stored: uint8 ``[C, H, W]``, or int32 values ``0..65535`` for
    16-bit files (16-bit PNGs and grey TIFFs), which the mask decoders of
    :mod:`remat.data.masks` accept where their encoding allows.

    Raises:
        FileNotFoundError, DataFileError: as :func:`read_image` (16-bit files excepted).
    """
    expected = expected or f"an 8-bit or 16-bit {file_format(path)} label image"
    label = _decode(path, mode, expected)
    return label.to(torch.int32) if label.dtype == torch.uint16 else label


def make_loader(
    dataset: Dataset,
    batch_size: int,
    num_workers: int,
    *,
    train: bool,
    seed: int,
    pin_memory: bool = False,
) -> DataLoader:
    """Build the project's standard ``DataLoader``.

    Train loaders shuffle with a ``torch.Generator`` seeded by ``seed``, which also draws a
    seed for every sample of an epoch (mixed with the run's seed) that its random draws start
    from (:mod:`remat.data.seeding`: the same augmentation with any ``num_workers``, and
    after a resume), and drop the last partial batch only when the dataset is larger than
    ``batch_size``; eval loaders keep order and every sample. Workers persist between
    epochs when ``num_workers > 0``.
    """
    drop_last = train and len(dataset) > batch_size
    common = {"batch_size": batch_size, "drop_last": drop_last, "num_workers": num_workers,
              "persistent_workers": num_workers > 0, "pin_memory": pin_memory}
    if not train or isinstance(dataset, IterableDataset):
        return DataLoader(dataset, shuffle=train, **common)
    # the loader draws its workers' base seed from a generator of its own, once per
    # iterator (each epoch without workers, once with persistent ones): from the shuffle's,
    # it would move the epoch orders apart between num_workers=0 and >0; from the global
    # RNG, the dropout draws
    return DataLoader(SeededSamples(dataset),
                      sampler=SeededShuffle(len(dataset), torch.Generator().manual_seed(seed),
                                            run_seed()),
                      generator=torch.Generator().manual_seed(seed), **common)


# ----------------------------------------------------------------------------- any image

#: ``data.image_mode`` values of :func:`read_any_image`: the three of the shipped datasets
#: plus ``native`` (every stored channel, e.g. a 4-band or 12-channel TIFF)
ANY_IMAGE_MODES = ("rgb", "grey", "grey_rgb", "native")
_MAX_CHANNELS = 64  # a TIFF axis this short is read as channels, a longer one as pixels
_LUMA = (0.299, 0.587, 0.114)  # ITU-R 601-2, the weights of Pillow's convert("L")


def _tiff_array(path: Path, expected: str) -> np.ndarray:
    """``[C, H, W]`` of a TIFF read with tifffile (any bit depth, any number of channels).

    The axes come from the file (tifffile's series axes): ``Y``/``X`` are the pixels, the
    samples (``S``) or channel (``C``) axis the channels; a file with one more axis of
    another kind (pages ``Q``/``I``, e.g. channels written as pages) has it read as channels
    when it holds at most :data:`_MAX_CHANNELS` entries."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            array, axes = np.asarray(series.asarray()), str(series.axes)
    except Exception as err:  # tifffile raises several types for a bad file
        raise DataFileError(path=path, problem=f"cannot be decoded ({_first_line(err)})",
                            expected=expected) from err
    keep = [i for i, n in enumerate(array.shape) if n != 1 or axes[i] in "YX"]
    array = array.reshape([array.shape[i] for i in keep])
    axes = "".join(axes[i] for i in keep)
    if axes == "YX":
        return array[None]
    if len(axes) == 3 and "Y" in axes and "X" in axes:
        other = next(i for i, a in enumerate(axes) if a not in "YX")
        if array.shape[other] <= _MAX_CHANNELS:
            order = [other, axes.index("Y"), axes.index("X")]
            return np.transpose(array, order)
    raise DataFileError(path=path, problem=f"holds an array of shape {array.shape} (axes "
                        f"{axes})", expected=f"{expected} (Y and X, and at most one channel "
                        f"axis of <= {_MAX_CHANNELS}; a stack of slices is a volume)")


def _pillow_array(path: Path, expected: str) -> np.ndarray:
    """``[C, H, W]`` of an image read with Pillow: uint8, uint16 (16-bit grey) or float32."""
    try:
        with Image.open(path) as opened:
            img = _upright(opened)
            if img.mode in _PIL_16BIT_MODES or img.mode == "F":
                array = np.asarray(img)
            elif img.mode in ("L", "RGB", "RGBA"):
                array = np.asarray(img)
            elif img.mode == "LA":
                array = np.asarray(img.convert("L"))
            else:  # palette, 1-bit, CMYK, YCbCr ...: their colours
                array = np.asarray(img.convert("RGB"))
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise DataFileError(path=path, problem=f"cannot be decoded ({_first_line(err)})",
                            expected=expected) from err
    return array[None] if array.ndim == 2 else np.moveaxis(array, -1, 0)


def _as_tensor(array: np.ndarray, path: Path, expected: str) -> torch.Tensor:
    """uint8 and uint16 arrays keep their type; other numbers become float32."""
    if array.dtype == np.uint8 or array.dtype == np.uint16:
        return torch.from_numpy(np.ascontiguousarray(array))
    if array.dtype.kind in "iuf" and array.dtype.itemsize <= 8:
        if array.dtype.kind == "i" and array.min() >= 0 and array.max() <= 65535:
            return torch.from_numpy(np.ascontiguousarray(array.astype(np.uint16)))
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    raise DataFileError(path=path, problem=f"holds {array.dtype} pixels",
                        expected=f"{expected} (integer or float pixels)")


def _grey(image: torch.Tensor) -> torch.Tensor:
    """Luma ``[1, H, W]`` of an RGB ``[3, H, W]`` image in its own dtype (Pillow's weights)."""
    weights = torch.tensor(_LUMA, dtype=torch.float32)[:, None, None]
    luma = (image.float() * weights).sum(0, keepdim=True)
    if image.dtype.is_floating_point:
        return luma
    return luma.round_().to(image.dtype)


def read_any_image(path: str | Path, image_mode: str = "rgb") -> torch.Tensor:
    """Decode an image file of any common kind into ``[C, H, W]``, keeping its bit depth.

    PNG, JPEG, BMP, GIF and WebP go through Pillow; TIFFs through ``tifffile`` (16-bit grey,
    float, and multi-channel TIFFs such as 4-band aerial tiles or microscopy stacks of
    channels). The dtype is kept: uint8, uint16 (16-bit files; int32 TIFFs within
    0..65535) or float32 (float TIFFs and any other numbers), so the datamodule can scale
    each by its own range.

    Args:
        path: the image file.
        image_mode: ``"rgb"``: 3 channels (grey repeated; the alpha of an RGBA PNG or WebP
            dropped, while a 4-channel TIFF is refused, its fourth band being data);
            ``"grey"``: 1 channel (RGB -> luma, Pillow's ITU-R 601-2 weights);
            ``"grey_rgb"``: luma repeated to 3 channels; ``"native"``: every stored
            channel as it is.

    Returns:
        ``[C, H, W]`` uint8, uint16 or float32 (``C`` = 3, 1, 3, or as stored).

    Raises:
        ValueError: ``image_mode`` is not one of :data:`ANY_IMAGE_MODES`.
        FileNotFoundError: the file does not exist.
        DataFileError: (a ``ValueError``) the file is empty or cannot be decoded, or its
            channels do not fit ``image_mode`` (e.g. a 5-channel TIFF under ``rgb``; the
            message says to use ``data.image_mode=native`` and the matching
            ``model.in_channels``); names the file.
    """
    if image_mode not in ANY_IMAGE_MODES:
        raise ValueError(f"data.image_mode must be one of {ANY_IMAGE_MODES}, got "
                         f"{image_mode!r}")
    path = Path(path)
    expected = f"a {file_format(path)} image"
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    if path.stat().st_size == 0:
        raise DataFileError(path=path, problem="empty file (0 bytes)", expected=expected)
    tiff = path.suffix.lower() in (".tif", ".tiff")
    array = _tiff_array(path, expected) if tiff else _pillow_array(path, expected)
    image = _as_tensor(array, path, expected)
    channels = image.shape[0]
    if image_mode == "native":
        return image
    if channels == 4 and not tiff:
        image, channels = image[:3], 3  # RGBA PNG/WebP: the alpha channel is no content
    if channels not in (1, 3):
        raise DataFileError(path=path, problem=f"has {channels} channels",
                            expected=f"a grey or RGB image for data.image_mode={image_mode}; "
                            f"for {channels} channels set data.image_mode=native and "
                            f"model.in_channels={channels}")
    if image_mode == "rgb":
        return image if channels == 3 else image.expand(3, -1, -1).contiguous()
    grey = image if channels == 1 else _grey(image)
    return grey if image_mode == "grey" else grey.expand(3, -1, -1).contiguous()


def image_channels(path: str | Path, image_mode: str) -> int:
    """Channels :func:`read_any_image` gives for ``path`` under ``image_mode`` (decodes the
    file only for ``native``)."""
    if image_mode == "grey":
        return 1
    if image_mode != "native":
        return 3
    return int(read_any_image(path, "native").shape[0])
