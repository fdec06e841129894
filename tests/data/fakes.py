"""Tiny fake datasets written in the exact published layouts (names, folders, formats).

Every writer draws a known label map first and paints the image from it (foreground bright),
so tests can check that masks decode to the classes drawn and stay aligned with the image.
Files are written with Pillow in the publisher's format: 8-bit grey PNG, RGB or palette PNG,
JPEG, TIFF, GIF.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image


def save(array: np.ndarray, path: Path, **kwargs) -> Path:
    """Write a uint8 ``[H, W]`` (grey) or ``[H, W, 3]`` (RGB) array; format from the suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kwargs)
    return path


def save_palette_png(labels: np.ndarray, colours: Sequence[tuple[int, int, int]],
                     path: Path) -> Path:
    """Write class indices ``labels [H, W]`` as a palette PNG (mode ``P``) with ``colours``."""
    img = Image.fromarray(labels.astype(np.uint8), mode="P")
    flat = [c for colour in colours for c in colour]
    img.putpalette(flat + [0] * (768 - len(flat)))
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def blocks(height: int, width: int, classes: int, seed: int, block: int = 8) -> np.ndarray:
    """uint8 ``[H, W]`` label map of ``block``-px squares of random classes ``0..classes-1``."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, classes, size=(-(-height // block), -(-width // block)))
    return np.kron(coarse, np.ones((block, block), dtype=np.int64))[:height, :width].astype(
        np.uint8)


def binary_labels(height: int, width: int, seed: int) -> np.ndarray:
    """uint8 ``[H, W]`` with 1 on a random rectangle covering about a quarter, 0 elsewhere."""
    rng = np.random.default_rng(seed)
    top, left = rng.integers(0, height // 2), rng.integers(0, width // 2)
    out = np.zeros((height, width), dtype=np.uint8)
    out[top:top + height // 2, left:left + width // 2] = 1
    return out


def paint(labels: np.ndarray, seed: int, channels: int = 3) -> np.ndarray:
    """uint8 image (``[H, W, 3]`` or ``[H, W]``) whose brightness grows with the class."""
    rng = np.random.default_rng(seed)
    base = 30 + 40 * labels.astype(np.int64) + rng.integers(0, 10, labels.shape)
    base = np.clip(base, 0, 255).astype(np.uint8)
    return base if channels == 1 else np.repeat(base[..., None], 3, axis=2)


# --------------------------------------------------------------------------- Kvasir-SEG


def square_mask(height: int, width: int) -> np.ndarray:
    """uint8 ``[H, W]``: 1 on rows ``H/8:H/2``, columns ``W/8:W/2``, 0 elsewhere."""
    mask = np.zeros((height, width), dtype=np.uint8)
    mask[height // 8: height // 2, width // 8: width // 2] = 1
    return mask


def make_fake_kvasir(root: Path, n: int = 6, height: int = 48, width: int = 64) -> list[str]:
    """``images/<id>.jpg`` (RGB, 230 on the polyp, 40 + 5 i elsewhere) and ``masks/<id>.jpg``
    (RGB JPEG, 255 on the polyp, 0 elsewhere: :func:`square_mask`), ids ``fake00``...
    Returns the ids."""
    ids = [f"fake{i:02d}" for i in range(n)]
    for i, stem in enumerate(ids):
        mask = square_mask(height, width)
        image = np.where(mask == 1, 230, 40 + 5 * i).astype(np.uint8)
        save(np.repeat(image[..., None], 3, axis=2), root / "images" / f"{stem}.jpg",
             quality=95)
        save(np.repeat((mask * 255)[..., None], 3, axis=2), root / "masks" / f"{stem}.jpg",
             quality=95)
    return ids


# --------------------------------------------------------------------------- ISBI 2012


def make_fake_isbi(root: Path, n: int = 8, size: int = 40) -> list[np.ndarray]:
    """``train/image/<i>.png`` (8-bit grey) and ``train/label/<i>.png`` (0 = membrane, 255 =
    cell), i = 0..n-1, plus unlabelled ``test/<i>.png``. Returns the membrane maps (1 =
    membrane) in file order."""
    membranes = []
    for i in range(n):
        membrane = binary_labels(size, size, seed=i)
        save(paint(membrane, i, channels=1), root / "train" / "image" / f"{i}.png")
        save(np.where(membrane == 1, 0, 255).astype(np.uint8),
              root / "train" / "label" / f"{i}.png")
        save(paint(membrane, 100 + i, channels=1), root / "test" / f"{i}.png")
        membranes.append(membrane)
    return membranes


# --------------------------------------------------------------------------- Dubai aerial

DUBAI_COLOURS = [(60, 16, 152), (132, 41, 246), (110, 193, 228), (254, 221, 58),
                 (226, 169, 41), (155, 155, 155)]


def make_fake_dubai(root: Path, tiles: Sequence[int] = (1, 2, 3), parts: int = 2,
                    sizes: dict[int, tuple[int, int]] | None = None,
                    palette_tiles: Sequence[int] = (2,), black: int = 3
                    ) -> dict[str, np.ndarray]:
    """``Tile <t>/images/image_part_00<k>.jpg`` and ``Tile <t>/masks/image_part_00<k>.png``.

    Masks of ``palette_tiles`` are palette PNGs (as Tiles 2 and 4 are), the others RGB PNGs;
    the first part of every tile has ``black`` pure black pixels in its top-left row (no
    class). ``sizes`` maps tile -> (W, H) (default 48 x 40). Returns ``{name: labels}`` with
    255 where black was written.
    """
    sizes = sizes or {}
    out = {}
    for t in tiles:
        width, height = sizes.get(t, (48, 40))
        for k in range(1, parts + 1):
            labels = blocks(height, width, 6, seed=10 * t + k)
            if k == 1 and black:
                labels[0, :black] = 255
            stem = f"image_part_{k:03d}"
            save(paint(np.where(labels == 255, 0, labels), 10 * t + k),
                  root / f"Tile {t}" / "images" / f"{stem}.jpg", quality=95)
            mask_path = root / f"Tile {t}" / "masks" / f"{stem}.png"
            if t in palette_tiles:
                colours = DUBAI_COLOURS + [(0, 0, 0)]
                save_palette_png(np.where(labels == 255, 6, labels), colours, mask_path)
            else:
                rgb = np.zeros((height, width, 3), dtype=np.uint8)
                for index, colour in enumerate(DUBAI_COLOURS):
                    rgb[labels == index] = colour
                save(rgb, mask_path)
            out[f"Tile {t}/{stem}"] = labels
    return out


def _binary_pair(image_path: Path, mask_path: Path, height: int, width: int, seed: int,
                 mask_rgb: tuple[int, int, int] | None = None, jitter: int = 0,
                 **image_kwargs) -> np.ndarray:
    """Write a painted RGB image and its 0/255 label (grey, or ``mask_rgb`` on black).

    ``jitter > 0`` moves every label value up to ``jitter`` grey levels off 0/255 (labels
    that are "not pure 0 and 255", as DeepGlobe's). Returns the 0/1 labels."""
    labels = binary_labels(height, width, seed)
    save(paint(labels, seed), image_path, **image_kwargs)
    rng = np.random.default_rng(seed + 1)
    off = rng.integers(0, jitter + 1, labels.shape) if jitter else 0
    grey = np.where(labels == 1, 255 - off, off).astype(np.uint8)
    if mask_rgb is None:
        save(grey, mask_path)
    else:  # each channel scaled by the label colour: (255, 255, 255) repeats the grey
        scale = np.array(mask_rgb, dtype=np.float64) / 255
        save((grey[..., None] * scale).round().astype(np.uint8), mask_path)
    return labels


# --------------------------------------------------------------------------- medical


def make_fake_cvc(root: Path, n: int = 6, suffix: str = ".tif") -> dict[str, np.ndarray]:
    """``Original/<i>.tif`` (RGB) and ``Ground Truth/<i>.tif`` (grey 0/255), i = 1..n, 36x48
    (the 384x288 frames scaled down). Returns ``{name: labels}``."""
    return {str(i): _binary_pair(root / "Original" / f"{i}{suffix}",
                                 root / "Ground Truth" / f"{i}{suffix}", 36, 48, seed=i)
            for i in range(1, n + 1)}


def make_fake_isic(root: Path, n: int = 5) -> dict[str, np.ndarray]:
    """``ISIC2018_Task1-2_Training_Input/ISIC_<7 digits>.jpg`` (RGB, sizes vary) with
    ``ATTRIBUTION.txt``/``LICENSE.txt`` beside them, and
    ``ISIC2018_Task1_Training_GroundTruth/ISIC_<id>_segmentation.png`` (grey 0/255)."""
    images = root / "ISIC2018_Task1-2_Training_Input"
    out = {}
    for i in range(n):
        stem = f"ISIC_{i * 7:07d}"
        height, width = 30 + 4 * i, 40 + 2 * i
        out[stem] = _binary_pair(images / f"{stem}.jpg",
                                 root / "ISIC2018_Task1_Training_GroundTruth"
                                 / f"{stem}_segmentation.png", height, width, seed=i,
                                 quality=95)
    (images / "ATTRIBUTION.txt").write_text("fake attribution\n")
    (images / "LICENSE.txt").write_text("fake licence\n")
    return out


def fov_disc(height: int, width: int) -> np.ndarray:
    """uint8 ``[H, W]``: 255 inside the centred disc of radius 0.45 * min(H, W), else 0."""
    yy, xx = np.mgrid[:height, :width]
    radius = 0.45 * min(height, width)
    inside = (yy - (height - 1) / 2) ** 2 + (xx - (width - 1) / 2) ** 2 <= radius ** 2
    return (inside * 255).astype(np.uint8)


def make_fake_drive(root: Path, train_ids: Sequence[int] = range(21, 27),
                    test_ids: Sequence[int] = (1, 2), test_labels: bool = True,
                    size: tuple[int, int] = (30, 28)) -> dict[str, np.ndarray]:
    """DRIVE layout: ``training/images/<n>_training.tif`` (RGB), ``training/1st_manual/
    <n>_manual1.gif`` (0/255), ``training/mask/<n>_training_mask.gif`` (FOV disc 0/255), and
    ``test/`` likewise with ``<nn>_test.tif``/``<nn>_test_mask.gif`` (two-digit ids) and
    ``1st_manual/`` only if ``test_labels``. ``size`` is (H, W) (565x584 scaled down).
    Returns ``{name: vessel labels}`` (vessels only inside the FOV)."""
    height, width = size
    fov = fov_disc(height, width)
    out = {}
    for split, ids in (("training", train_ids), ("test", test_ids)):
        for n in ids:
            stem = f"{n:02d}"
            labels = binary_labels(height, width, seed=n) * (fov > 0)
            save(paint(labels, n), root / split / "images" / f"{stem}_{split}.tif")
            save(fov, root / split / "mask" / f"{stem}_{split}_mask.gif")
            if split == "training" or test_labels:
                save((labels * 255).astype(np.uint8),
                     root / split / "1st_manual" / f"{stem}_manual1.gif")
            out[f"{split}/{stem}"] = labels.astype(np.uint8)
    return out


# --------------------------------------------------------------------------- aerial


def make_fake_inria(root: Path, cities: Sequence[str] = ("austin", "tyrol-w"),
                    tiles: int = 7, size: int = 40) -> dict[str, np.ndarray]:
    """``AerialImageDataset/train/images/<city><n>.tif`` (RGB) and ``.../train/gt/<city><n>.tif``
    (one band, 0/255), n = 1..tiles, plus unlabelled ``test/images/bellingham1.tif``. Returns
    ``{name: labels}``."""
    base = root / "AerialImageDataset"
    out = {}
    for c, city in enumerate(cities):
        for n in range(1, tiles + 1):
            out[f"{city}{n}"] = _binary_pair(base / "train" / "images" / f"{city}{n}.tif",
                                             base / "train" / "gt" / f"{city}{n}.tif",
                                             size, size, seed=100 * c + n)
    save(paint(binary_labels(size, size, 0), 0), base / "test" / "images" / "bellingham1.tif")
    return out


def make_fake_massachusetts(root: Path, counts: tuple[int, int, int] = (4, 2, 2),
                            mask_rgb: tuple[int, int, int] | None = None,
                            size: int = 48) -> dict[str, np.ndarray]:
    """``tiff/{train,val,test}/<id>_15.tiff`` (RGB) and ``tiff/<split>_labels/<id>_15.tif``
    (grey 0/255, or ``mask_rgb`` on black), with Mnih-style numeric ids. Returns
    ``{"<split>/<id>": labels}``."""
    out = {}
    for split, count in zip(("train", "val", "test"), counts, strict=True):
        for i in range(count):
            stem = f"{10078660 + 1000 * i + len(out)}_15"
            out[f"{split}/{stem}"] = _binary_pair(
                root / "tiff" / split / f"{stem}.tiff",
                root / "tiff" / f"{split}_labels" / f"{stem}.tif", size, size,
                seed=len(out), mask_rgb=mask_rgb)
    return out


def make_fake_loveda(root: Path, per_folder: int = 2, size: int = 32) -> dict[str, np.ndarray]:
    """``{Train,Val}/{Urban,Rural}/images_png/<n>.png`` (RGB) and ``masks_png/<n>.png`` (8-bit
    labels 0..7, 0 = no-data on the first row), plus image-only ``Test/``. Returns
    ``{name: stored labels 0..7}``."""
    out = {}
    number = 0
    for split in ("Train", "Val", "Test"):
        for scene in ("Urban", "Rural"):
            for _ in range(per_folder):
                stored = blocks(size, size, 8, seed=number, block=4)
                stored[0] = 0
                folder = root / split / scene
                save(paint(stored, number), folder / "images_png" / f"{number}.png")
                if split != "Test":
                    save(stored, folder / "masks_png" / f"{number}.png")
                    out[f"{split}/{scene}/{number}"] = stored
                number += 1
    return out


def make_fake_deepglobe(root: Path, n: int = 6, size: int = 32) -> dict[str, np.ndarray]:
    """``train/<id>_sat.jpg`` (RGB) and ``train/<id>_mask.png`` (3 equal channels, white road
    on black, values up to 60 levels off 0/255 as the challenge warns), plus image-only
    ``valid/<id>_sat.jpg``. Returns ``{id: labels}``."""
    out = {}
    for i in range(n):
        stem = str(100034 + 97 * i)
        out[stem] = _binary_pair(root / "train" / f"{stem}_sat.jpg",
                                 root / "train" / f"{stem}_mask.png", size, size, seed=i,
                                 mask_rgb=(255, 255, 255), jitter=60, quality=95)
    save(paint(binary_labels(size, size, 0), 0), root / "valid" / "999_sat.jpg", quality=95)
    return out


# --------------------------------------------------------------------------- 16-bit files


def save_png16(array: np.ndarray, path: Path) -> Path:
    """Write a uint16 ``[H, W]`` (grey) or ``[H, W, 3]`` (RGB) array as a 16-bit PNG.

    Pillow writes 16-bit grey PNGs but no 16-bit RGB ones, so the file is assembled here as
    the PNG specification lays it out: signature, IHDR (bit depth 16, colour type 0 or 2),
    one zlib-compressed IDAT of big-endian rows each led by filter byte 0, IEND.
    """
    import struct
    import zlib

    array = np.asarray(array, dtype=np.uint16)
    height, width = array.shape[:2]
    colour_type = 2 if array.ndim == 3 else 0

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = array.astype(">u2").reshape(height, -1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)
    header = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path
