"""Datasets by name: `load_dataset("cifar10", "/data/cifar")` returns a whole `Dataset` in memory.

Built-in datasets (digits, synthetic, step, line) read no files and ignore `data_dir`; the file
datasets ignore `seed` (their split is the one the files define).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from ..errors import BadInput
from . import builtin
from .base import Dataset, DataSpec, check_usable, normalizer
from .cifar import _find_batches, load_cifar10
from .common import require_dir
from .idx import FILES as IDX_FILES, find_idx, load_mnist_like, mnist_folder
from .tiny_imagenet import _find_root, load_tiny_imagenet

__all__ = ["DATASETS", "Dataset", "DataSpec", "check_present", "load_dataset", "normalizer"]

# name -> loader(data_dir, seed)
_LOADERS: Dict[str, Callable[[Optional[str], int], Dataset]] = {
    "digits": lambda data_dir, seed: builtin.digits(),
    "fashion-mnist": lambda data_dir, seed: load_mnist_like("fashion-mnist", data_dir),
    "mnist": lambda data_dir, seed: load_mnist_like("mnist", data_dir),
    "cifar10": lambda data_dir, seed: load_cifar10(data_dir),
    "tiny-imagenet": lambda data_dir, seed: load_tiny_imagenet(data_dir),
    "synthetic": lambda data_dir, seed: builtin.synthetic(seed),
    "step": lambda data_dir, seed: builtin.step(seed),
    "line": lambda data_dir, seed: builtin.line(seed),
    # Noise-free y = -x + 1: the seed's linear-regression data (its MSE at lr 0.1 is 2e-13).
    "line-exact": lambda data_dir, seed: builtin.line(seed, noise=0.0),
    # Synthetic stand-ins with the shapes of MNIST, CIFAR and Tiny ImageNet for throughput
    # studies; a 512-image test set keeps evaluation from dominating short CPU runs.
    "synthetic-28": lambda data_dir, seed: builtin.synthetic(seed, shape=(1, 28, 28), n_test=512),
    "synthetic-32": lambda data_dir, seed: builtin.synthetic(seed, shape=(3, 32, 32), n_test=512),
    "synthetic-64": lambda data_dir, seed: builtin.synthetic(seed, shape=(3, 64, 64), n_test=512),
}

DATASETS = tuple(_LOADERS)


def load_dataset(name: str, data_dir: Optional[str] = None, *, seed: int = 0) -> Dataset:
    """Load dataset `name` whole. Every problem with the name, the folder or a file raises
    BadInput with one line naming it."""
    if name not in _LOADERS:
        raise BadInput(f"--dataset {name}: unknown dataset; choose one of {', '.join(DATASETS)}")
    data_dir = None if data_dir is None else str(data_dir)
    ds = _LOADERS[name](data_dir, seed)
    # Here, where every reader's result passes: an empty split or constant images would
    # otherwise surface later as a ZeroDivisionError in evaluation or NaN "divergence".
    check_usable(ds, f"--data-dir {data_dir}" if data_dir is not None else f"--dataset {name}")
    return ds


def check_present(name: str, data_dir: Optional[str]) -> None:
    """The cheap half of `load_dataset`'s checks, for before any worker starts: the folder and
    the files it needs are there (reading them is each worker's). BadInput with the same line
    load_dataset would give."""
    if name in ("fashion-mnist", "mnist"):
        folder = mnist_folder(name, data_dir)
        for stem in IDX_FILES:
            find_idx(name, folder, stem.removesuffix(".gz"))
    elif name == "cifar10":
        if data_dir is None:
            load_cifar10(None)  # raises its line
        _find_batches(require_dir(data_dir))
    elif name == "tiny-imagenet":
        if data_dir is None:
            load_tiny_imagenet(None)  # raises its line
        _find_root(require_dir(data_dir))
