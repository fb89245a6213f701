"""Shape checks shared by the model builders.

Each builder validates the data shape once, before it allocates anything, so a mismatch is one
BadInput line naming --model and --dataset (docs/architecture.md, Style 4) instead of a shape error deep
inside the first forward pass.
"""
from __future__ import annotations

from math import prod
from typing import Tuple

from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput


def flat_features(spec: DataSpec) -> int:
    """Number of inputs a fully connected first layer sees once the sample is flattened."""
    return prod(spec.input_shape)


def require_image(spec: DataSpec, model: str, halvings: int) -> Tuple[int, int, int]:
    """Return (C, H, W), or raise BadInput when `model` cannot run on `spec`.

    halvings: how many stride-2 poolings the net applies before its fully connected layers; each
    floors the size, so H and W must be at least 2**halvings or a feature map reaches zero.
    """
    if not spec.is_image:
        raise BadInput(
            f"--model {model}: needs images (C, H, W), but --dataset {spec.name} has feature "
            f"vectors of shape {tuple(spec.input_shape)}; use neuron, linreg, softmax or mlp")
    c, h, w = spec.input_shape
    least = 2 ** halvings
    if h < least or w < least:
        raise BadInput(
            f"--model {model}: --dataset {spec.name} has {h}x{w} images, but the net halves "
            f"them {halvings} times and needs at least {least}x{least}")
    return c, h, w
