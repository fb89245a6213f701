"""Two-hidden-layer perceptron; runs on any input shape by flattening it first."""
from __future__ import annotations

from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.models.base import flat_features

HIDDEN = (256, 128)


def build_mlp(spec: DataSpec, linear: type) -> nn.Module:
    """flatten -> 256 -> ReLU -> 128 -> ReLU -> num_outputs."""
    layers: list = [nn.Flatten()]
    width = flat_features(spec)
    for hidden in HIDDEN:
        layers += [linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(linear(width, spec.num_outputs))
    return nn.Sequential(*layers)
