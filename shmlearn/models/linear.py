"""One-layer models: flatten, then one fully connected layer to spec.num_outputs.

neuron, linreg and softmax are the same structure under three names because the seeds use them
as three different experiments (002 §3 sigmoid neuron, 003 §2 y = Wx + b, 003 §3 softmax
classifier); the difference lives in the loss chosen from spec.task, not in the layer.
"""
from __future__ import annotations

from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.models.base import flat_features


def build_single_layer(spec: DataSpec, linear: type) -> nn.Module:
    """Raw scores: (N, num_outputs) logits, or the (N, 1) logit/value of binary/regression."""
    return nn.Sequential(nn.Flatten(), linear(flat_features(spec), spec.num_outputs))
