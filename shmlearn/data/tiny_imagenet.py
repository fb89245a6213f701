"""Tiny ImageNet (tiny-imagenet-200): 200 classes of 64x64 JPEGs.

Layout: wnids.txt (one WordNet id per line; the line order is the class index),
train/<wnid>/images/*.JPEG, val/images/*.JPEG with val/val_annotations.txt (tab-separated:
file name, wnid, bounding box). The val split is used as the test set (the official test split
has no labels). `data_dir` may be the tiny-imagenet-200 folder or its parent.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from PIL import Image

from ..errors import BadInput
from .base import Dataset
from .common import image_dataset
from .files import find_tiny_root as _find_root, tiny_imagenet_dir

SIZE = 64
_IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


def _decode(path: Path) -> np.ndarray:
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")  # a few Tiny ImageNet JPEGs are grayscale
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise BadInput(f"{path}: cannot decode image: {e}") from None
    if im.size != (SIZE, SIZE):
        raise BadInput(f"{path}: image is {im.size[0]}x{im.size[1]}, expected {SIZE}x{SIZE}")
    return np.asarray(im, dtype=np.uint8)


def decode_images(paths: Sequence[Path]) -> np.ndarray:
    """(N, 3, 64, 64) uint8. Slow for the full set (the 110k images on one core:
    docs/performance.md, "Behind the code"); it is done once per load and the result stays in
    memory."""
    out = np.empty((len(paths), SIZE, SIZE, 3), dtype=np.uint8)
    for i, path in enumerate(paths):
        out[i] = _decode(path)
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))


def _read_text(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None


def _images_in(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise BadInput(f"tiny-imagenet: no folder {folder}")
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)


def load_tiny_imagenet(data_dir: Optional[str]) -> Dataset:
    root = _find_root(tiny_imagenet_dir(data_dir))
    wnids = [w.strip() for w in _read_text(root / "wnids.txt") if w.strip()]
    if not wnids:
        raise BadInput(f"{root / 'wnids.txt'}: empty, expected one wnid per line")
    if len(set(wnids)) != len(wnids):
        raise BadInput(f"{root / 'wnids.txt'}: a wnid is listed twice")
    index = {w: i for i, w in enumerate(wnids)}

    train_paths, train_y = [], []
    for wnid, label in index.items():
        paths = _images_in(root / "train" / wnid / "images")
        if not paths:
            raise BadInput(f"tiny-imagenet: no images in {root / 'train' / wnid / 'images'}")
        train_paths += paths
        train_y += [label] * len(paths)

    annotations = root / "val" / "val_annotations.txt"
    test_paths, test_y = [], []
    for n, line in enumerate(_read_text(annotations), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise BadInput(f"{annotations}:{n}: expected 'file<TAB>wnid<TAB>bbox' with a wnid"
                           f" from wnids.txt, got {line[:80]!r}")
        path = root / "val" / "images" / fields[0]
        if not path.is_file():
            raise BadInput(f"{annotations}:{n}: no image {path}")
        test_paths.append(path)
        test_y.append(index[fields[1]])
    if not test_paths:
        raise BadInput(f"{annotations}: no validation images listed")

    return image_dataset("tiny-imagenet", len(wnids), decode_images(train_paths),
                         np.array(train_y), decode_images(test_paths), np.array(test_y))
