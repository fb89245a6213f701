"""IDX files (the MNIST format, also Fashion-MNIST's) and the datasets made of four of them.

Layout: magic = two zero bytes, a dtype code, the number of dimensions; then each dimension as a
big-endian uint32; then the values, big-endian, row-major. Images are magic 0x00000803
(uint8, 3 dims: N, rows, cols), labels 0x00000801 (uint8, 1 dim: N).
"""
from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import BadInput
from .base import Dataset
from .common import check_labels, image_dataset, read_bytes
from .files import FASHION_MNIST_DIR, IDX_FILES as FILES, find_idx, mnist_folder  # noqa: F401 - re-exported

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801

# IDX dtype codes; multi-byte values are big-endian in the file.
_DTYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
           0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

def parse_idx(raw: bytes, name: str, *, magic: Optional[int] = None) -> np.ndarray:
    """Decode IDX bytes into a native-endian array. `magic`, when given, must match exactly
    (dtype and dimension count); otherwise any valid IDX dtype is accepted. `name` is the file
    named in errors."""
    if len(raw) < 4:
        raise BadInput(f"{name}: not an IDX file: {len(raw)} bytes, shorter than the 4-byte magic")
    (got,) = struct.unpack(">I", raw[:4])
    code, ndim = (got >> 8) & 0xFF, got & 0xFF
    if magic is not None and got != magic:
        raise BadInput(f"{name}: wrong magic 0x{got:08X}, expected 0x{magic:08X}"
                       f" (IDX, {_DTYPES[(magic >> 8) & 0xFF]}, {magic & 0xFF} dims)")
    if got >> 16 != 0 or code not in _DTYPES or ndim == 0:
        raise BadInput(f"{name}: not an IDX file: magic 0x{got:08X}, expected 0x0000TTNN with a"
                       f" dtype code TT in {sorted(f'{c:02X}' for c in _DTYPES)} and NN >= 1 dims")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise BadInput(f"{name}: truncated: {ndim} dims need a {header}-byte header,"
                       f" file has {len(raw)} bytes")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = _DTYPES[code]
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        what = (f"{dims[0]} values" if ndim == 1 else
                f"{dims[0]} items of {'x'.join(map(str, dims[1:]))}")
        problem = "truncated" if len(raw) < expected else "trailing bytes"
        raise BadInput(f"{name}: {problem}: header says {what} {dtype.name} = {expected} bytes"
                       f" with the {header}-byte header, file has {len(raw)}")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="))  # a writable copy in native byte order


def read_idx(path: Path, *, magic: Optional[int] = None) -> np.ndarray:
    """Read one IDX file, gzipped or not (by the .gz suffix)."""
    return parse_idx(read_bytes(path), str(path), magic=magic)


def load_idx_pair(name: str, folder: Path, split: str, *, shape=(28, 28), num_classes=10):
    """Images (N, 1, rows, cols) uint8 and labels (N,) of one split ("train" or "t10k")."""
    images_path = find_idx(name, folder, f"{split}-images-idx3-ubyte")
    labels_path = find_idx(name, folder, f"{split}-labels-idx1-ubyte")
    images = read_idx(images_path, magic=IMAGES_MAGIC)
    labels = read_idx(labels_path, magic=LABELS_MAGIC)
    if images.shape[1:] != shape:
        raise BadInput(f"{images_path}: images are {images.shape[1]}x{images.shape[2]},"
                       f" {name} expects {shape[0]}x{shape[1]}")
    if len(images) != len(labels):
        raise BadInput(f"{labels_path}: {len(labels)} labels for the {len(images)} images"
                       f" in {images_path.name}")
    check_labels(labels_path, labels, num_classes)
    return images[:, None], labels


def load_mnist_like(name: str, data_dir: Optional[str]) -> Dataset:
    """MNIST or Fashion-MNIST from the four IDX files in `data_dir` (gzipped or not). The mean
    and std come from the train set (for MNIST 33.3/78.6, Fashion-MNIST 72.9/90.0 in 0..255)."""
    folder = mnist_folder(name, data_dir)
    train_x, train_y = load_idx_pair(name, folder, "train")
    test_x, test_y = load_idx_pair(name, folder, "t10k")
    return image_dataset(name, 10, train_x, train_y, test_x, test_y)
