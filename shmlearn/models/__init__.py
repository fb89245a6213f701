"""Model builders, looked up by name (docs/architecture.md: Style 6, "How to add a model").

Models know nothing about distribution, losses or devices: they take a float batch shaped
(N, *spec.input_shape) and return raw scores, (N, num_outputs) logits for classification and an
(N, 1) logit or value for binary and regression. Every fully connected layer is built by the
`linear` class, so the bias-folded layer of seed 002 §4 (nn/folded_linear.py) can replace
nn.Linear without touching the models. ReLUs after a `linear` layer are not in-place, because
a substituted layer may save its output for backward; those after convolutions are.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Dict

import torch
from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput
from shmlearn.models.alexnet import build_alexnet, build_alexnet_small
from shmlearn.models.fashion import build_fashion_net
from shmlearn.models.lenet import build_lenet
from shmlearn.models.linear import build_single_layer
from shmlearn.models.mlp import build_mlp
from shmlearn.models.resnet import build_resnet

_BUILDERS: Dict[str, Callable[[DataSpec, type], nn.Module]] = {
    "neuron": build_single_layer,   # seed 002 §3: the sigmoid lives in the loss
    "linreg": build_single_layer,   # seed 003 §2: y = Wx + b
    "softmax": build_single_layer,  # seed 003 §3: the softmax lives in the loss
    "mlp": build_mlp,
    "lenet": build_lenet,
    "alexnet-small": build_alexnet_small,
    "alexnet": build_alexnet,
    "resnet18": partial(build_resnet, name="resnet18"),
    "resnet34": partial(build_resnet, name="resnet34"),
    "fashion-net": build_fashion_net,  # the Fashion-MNIST time-to-accuracy recipes (recipes/)
}

MODELS = tuple(_BUILDERS)
INITS = ("default", "uniform:A")


def build_model(name: str, spec: DataSpec, *, linear: type = nn.Linear) -> nn.Module:
    """Build model `name` for data shaped like `spec`, on the CPU with torch's default init.

    linear: class used for every fully connected layer, called as linear(in_features,
    out_features). Raises BadInput for an unknown name or a model that cannot run on `spec`.
    """
    if name not in _BUILDERS:
        raise BadInput(f"--model {name}: unknown model; choose one of {', '.join(MODELS)}")
    return _BUILDERS[name](spec, linear)


def parse_init(init: str) -> float | None:
    """None for "default", A for "uniform:A"; BadInput otherwise. Split out so a config can be
    validated before any model exists."""
    if init == "default":
        return None
    kind, _, value = init.partition(":")
    try:
        bound = float(value)
    except ValueError:
        bound = math.nan
    if kind != "uniform" or not (0 < bound < math.inf):
        raise BadInput(f"--init {init}: expected 'default' or 'uniform:A' with A > 0")
    return bound


def apply_init(model: nn.Module, init: str) -> nn.Module:
    """Re-initialize `model` in place and return it.

    "default" keeps torch's per-layer init. "uniform:A" draws every parameter, weights and
    biases alike (BatchNorm scales and shifts included), from U[-A, A]: seed 001 used A = 0.05
    to stop the early exploding gradients that turned its CIFAR-10 loss into NaN. Buffers
    (BatchNorm running statistics) are left alone. Draws from torch's global generator, so
    seed it first for reproducible weights.
    """
    bound = parse_init(init)
    if bound is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-bound, bound)
    return model


__all__ = ["MODELS", "INITS", "build_model", "apply_init", "parse_init"]
