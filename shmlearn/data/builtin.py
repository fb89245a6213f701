"""Datasets that need no files: scikit-learn's digits and three generated ones.

The generated ones draw everything from one numpy Generator seeded by `seed`, so a seed names
exactly one dataset, on every machine and every rank.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch

from ..errors import BadInput

from .base import Dataset, DataSpec
from .common import image_dataset


DIGITS_SPLIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits_split.npz")
"""The 1797 images' indices in the file: `train` (1437) and `test` (360), each in the order the
runs read them. It is the stratified 80/20 split that scikit-learn 1.9.1's train_test_split(test_size=0.2,
stratify=target, random_state=0) makes, stored so that every install trains and tests on the
same images."""


def _sklearn_file(name: str) -> str:
    """A data file bundled with scikit-learn, found without importing it (its import takes about a
    second: every worker process would pay it)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise BadInput("--dataset digits: reads scikit-learn's bundled digits; pip install scikit-learn")
    return os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", name)


def digits() -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images, no download) as uint8 (N, 1, 8, 8) with
    values 0..16. The 80/20 stratified split is fixed (DIGITS_SPLIT), not seeded, so every run
    tests on the same 360 images; train has 1437. The file is read as load_digits reads it (one
    row per image: 64 pixels, then the label)."""
    data = np.loadtxt(_sklearn_file("digits.csv.gz"), delimiter=",")
    x = data[:, :-1].astype(np.uint8).reshape(-1, 1, 8, 8)  # stored as 0..16, all whole numbers
    y = data[:, -1].astype(np.int64)
    with np.load(DIGITS_SPLIT) as split:
        train, test = split["train"].astype(np.int64), split["test"].astype(np.int64)
    return image_dataset("digits", 10, x[train], y[train], x[test], y[test])


def synthetic(seed: int = 0, *, n_train: int = 10000, n_test: int = 2000,
              num_classes: int = 10, shape: tuple = (3, 32, 32)) -> Dataset:
    """Noisy uint8 images with a learnable, seeded rule, CIFAR-shaped by default, for timing
    and testing models without files. Each image is a hidden 16-number code z drawn through a
    fixed random blocky pattern (a 4x4 grid per channel, so convolutions see it too) plus
    pixel noise; its class is argmax(z @ P) for a fixed random P. The class is therefore a
    linear function of the pixels up to the noise. (Labelling pure noise by a projection of all
    its pixels was tried first: a linear model memorized 10k images and reached 46% on test.)"""
    c, h, w = shape
    if h % 4 or w % 4:
        raise ValueError(f"synthetic: image height and width must be multiples of 4, got {shape}")
    rng = np.random.default_rng(seed)
    n, code = n_train + n_test, 16
    z = rng.standard_normal((n, code)).astype(np.float32)
    basis = rng.standard_normal((code, c * 16)).astype(np.float32) / np.sqrt(code)
    rule = rng.standard_normal((code, num_classes)).astype(np.float32)
    # Block values have std 40 (in 0..255 units), the uniform pixel noise +-48 (std 28).
    # Integer arithmetic: a third of float noise's time (docs/performance.md, "Behind the code").
    blocks = np.rint(128 + 40 * (z @ basis)).astype(np.int16).reshape(n, c, 4, 1, 4, 1)
    noise = rng.integers(-48, 49, size=(n, c, 4, h // 4, 4, w // 4), dtype=np.int16)
    x = np.clip(blocks + noise, 0, 255).astype(np.uint8).reshape(n, c, h, w)
    y = (z @ rule).argmax(axis=1)
    return image_dataset("synthetic", num_classes, x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def _vectors(name: str, task: str, x: np.ndarray, y: np.ndarray, n_train: int) -> Dataset:
    x = torch.from_numpy(x.astype(np.float32).reshape(-1, 1))
    y = torch.from_numpy(y.astype(np.float32).reshape(-1, 1))
    spec = DataSpec(name=name, task=task, input_shape=(1,), num_outputs=1)
    return Dataset(spec, x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def step(seed: int = 0, *, n_train: int = 10000, n_test: int = 1000) -> Dataset:
    """The paper's single-neuron experiment (seed 002, section 3): x ~ U[0, 1), target 1 where
    x >= 0.5 else 0. Binary (one logit), inputs left unnormalized (mean None)."""
    # float32 before comparing, so the rule holds for the stored inputs exactly.
    x = np.random.default_rng(seed).random(n_train + n_test, dtype=np.float32)
    return _vectors("step", "binary", x, x >= 0.5, n_train)


def line(seed: int = 0, *, n_train: int = 1000, n_test: int = 200, noise: float = 0.1) -> Dataset:
    """Linear regression (seed 003, section 2): x ~ U[-1, 1), y = -x + 1 + N(0, noise^2).
    The least-squares fit should come out near W = -1, b = 1."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, n_train + n_test)
    y = -x + 1.0 + noise * rng.standard_normal(n_train + n_test)
    return _vectors("line", "regression", x, y, n_train)
