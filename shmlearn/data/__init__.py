"""Datasets by name: `load_dataset("cifar10", "/data/cifar")` returns a whole `Dataset` in memory.

Built-in datasets (digits, synthetic, step, line) read no files and ignore `data_dir`; the file
datasets ignore `seed` (their split is the one the files define).
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional

from ..errors import BadInput
from .files import check_present

__all__ = ["DATASETS", "Dataset", "DataSpec", "check_present", "load_dataset", "normalizer"]


def _reader(module: str):
    """A reader module, imported when its dataset is loaded (they import torch: see __getattr__)."""
    return importlib.import_module(f"{__name__}.{module}")


def _builtin():
    return _reader("builtin")


# name -> loader(data_dir, seed)
_LOADERS: Dict[str, Callable[[Optional[str], int], Dataset]] = {
    "digits": lambda data_dir, seed: _builtin().digits(),
    "fashion-mnist": lambda data_dir, seed: _reader("idx").load_mnist_like("fashion-mnist", data_dir),
    "mnist": lambda data_dir, seed: _reader("idx").load_mnist_like("mnist", data_dir),
    "cifar10": lambda data_dir, seed: _reader("cifar").load_cifar10(data_dir),
    "tiny-imagenet": lambda data_dir, seed: _reader("tiny_imagenet").load_tiny_imagenet(data_dir),
    "synthetic": lambda data_dir, seed: _builtin().synthetic(seed),
    "step": lambda data_dir, seed: _builtin().step(seed),
    "line": lambda data_dir, seed: _builtin().line(seed),
    # Noise-free y = -x + 1: the seed's linear-regression data (its MSE at lr 0.1 is 2e-13).
    "line-exact": lambda data_dir, seed: _builtin().line(seed, noise=0.0),
    # Synthetic stand-ins with the shapes of MNIST, CIFAR and Tiny ImageNet for throughput
    # studies; a 512-image test set keeps evaluation from dominating short CPU runs.
    "synthetic-28": lambda data_dir, seed: _builtin().synthetic(seed, shape=(1, 28, 28), n_test=512),
    "synthetic-32": lambda data_dir, seed: _builtin().synthetic(seed, shape=(3, 32, 32), n_test=512),
    "synthetic-64": lambda data_dir, seed: _builtin().synthetic(seed, shape=(3, 64, 64), n_test=512),
}

DATASETS = tuple(_LOADERS)


def __getattr__(name: str):
    """Dataset, DataSpec, normalizer and the readers come with torch; they are imported on first
    use so that `shmlearn.data.files` (and with it the CLI's check of --data-dir, cli.precheck)
    runs before torch is imported."""
    if name in ("Dataset", "DataSpec", "normalizer"):
        from . import base  # lazy: torch, after the CLI's cheap checks
        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_dataset(name: str, data_dir: Optional[str] = None, *, seed: int = 0) -> Dataset:
    """Load dataset `name` whole. Every problem with the name, the folder or a file raises
    BadInput with one line naming it."""
    if name not in _LOADERS:
        raise BadInput(f"--dataset {name}: unknown dataset; choose one of {', '.join(DATASETS)}")
    data_dir = None if data_dir is None else str(data_dir)
    ds = _LOADERS[name](data_dir, seed)
    # Here, where every reader's result passes: an empty split or constant images would
    # otherwise surface later as a ZeroDivisionError in evaluation or NaN "divergence".
    from .base import check_usable  # lazy: torch, after the CLI's cheap checks
    check_usable(ds, f"--data-dir {data_dir}" if data_dir is not None else f"--dataset {name}")
    return ds

