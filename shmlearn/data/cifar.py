"""CIFAR-10 in either official distribution.

- python: cifar-10-batches-py/{data_batch_1..5, test_batch}, each a pickled dict with
  b"data" (N, 3072) uint8, rows of 1024 red, 1024 green, 1024 blue bytes, and b"labels" (N ints).
- binary: cifar-10-batches-bin/{data_batch_1..5, test_batch}.bin, records of 1 label byte
  followed by the same 3072 image bytes.
`data_dir` may be the batches folder itself or its parent; the python version wins if both exist.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import BadInput
from .base import Dataset
from .common import check_labels, image_dataset, read_bytes
from .files import cifar_dir, find_batches as _find_batches

NUM_CLASSES = 10
IMAGE_BYTES = 3 * 32 * 32
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickling runs whatever callables a file names. The CIFAR batches only need numpy's
    array reconstruction (and _codecs.encode for bytes pickled by Python 3), so refuse the rest:
    a downloaded file cannot run code."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _field(batch: dict, key: str):
    # The originals are Python 2 pickles: keys come back as bytes with encoding="bytes".
    # Accept str keys too, for batches re-pickled by Python 3 code.
    return batch[key.encode()] if key.encode() in batch else batch.get(key)


def read_pickle_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) int64 from one python-version batch."""
    raw = read_bytes(path)
    try:
        batch = _NumpyOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # a damaged pickle can raise almost anything (EOFError, ValueError, ...)
        raise BadInput(f"{path}: not a CIFAR-10 python batch: cannot unpickle: {e}") from None
    if not isinstance(batch, dict):
        raise BadInput(f"{path}: not a CIFAR-10 python batch: holds a {type(batch).__name__}, not a dict")
    data, labels = _field(batch, "data"), _field(batch, "labels")
    missing = [k for k, v in (("data", data), ("labels", labels)) if v is None]
    if missing:
        raise BadInput(f"{path}: not a CIFAR-10 python batch: no {' or '.join(repr(k) for k in missing)}"
                       f" key (has {', '.join(sorted(map(repr, batch))) or 'no keys'})")
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.shape[1] == IMAGE_BYTES):
        what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise BadInput(f"{path}: 'data' is {what}, expected uint8 (N, {IMAGE_BYTES})")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise BadInput(f"{path}: 'labels' is not a list of integers") from None
    if labels.shape != (len(data),):
        raise BadInput(f"{path}: {labels.size} labels for {len(data)} images")
    check_labels(path, labels, NUM_CLASSES)
    return data.reshape(-1, 3, 32, 32), labels


def read_bin_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) int64 from one binary-version batch."""
    raw = read_bytes(path)
    record = 1 + IMAGE_BYTES
    if len(raw) % record or not raw:
        raise BadInput(f"{path}: {len(raw)} bytes is not a positive multiple of the"
                       f" {record}-byte CIFAR-10 record (1 label byte + {IMAGE_BYTES} image bytes)")
    records = np.frombuffer(raw, dtype=np.uint8).reshape(-1, record)
    labels = records[:, 0].astype(np.int64)
    check_labels(path, labels, NUM_CLASSES)
    return records[:, 1:].reshape(-1, 3, 32, 32), labels


def load_cifar10(data_dir: Optional[str]) -> Dataset:
    folder, suffix = _find_batches(cifar_dir(data_dir))
    read = read_bin_batch if suffix == ".bin" else read_pickle_batch

    def batch(stem: str) -> tuple[np.ndarray, np.ndarray]:
        path = folder / f"{stem}{suffix}"
        if not path.is_file():
            raise BadInput(f"cifar10: no {path.name} in {folder} (expected"
                           f" data_batch_1..5{suffix} and test_batch{suffix})")
        return read(path)

    train = [batch(stem) for stem in TRAIN_BATCHES]
    test_x, test_y = batch(TEST_BATCH)
    train_x = np.concatenate([x for x, _ in train])
    train_y = np.concatenate([y for _, y in train])
    return image_dataset("cifar10", NUM_CLASSES, train_x, train_y, test_x, test_y)
