"""fashion-net: the network of the Fashion-MNIST time-to-accuracy recipes (recipes/fashion-*.yaml).

Four conv3x3-BatchNorm-GELU blocks of 32, 64, 128, 256 channels (convs without bias: BatchNorm's
shift is the bias), a 2x2 max-pool after blocks 2-4, a global max-pool, one fully connected layer
to the classes. 28x28 -> 28 -> 14 -> 7 -> 3 -> 1x1; 0.39M parameters (390,890 at 1 channel and 10
classes), 43.6M multiply-adds per 28x28 image, 99% of them in the convs of blocks 2-4 (14.5M
each: each pool quarters the pixels while the next conv quadruples its channel product).

Why this shape (airbench's style, for 28x28 greyscale): no hidden fully connected layer and a
global max-pool keep the parameters and the work in the convs, which a GPU runs fast in bf16 and
channels_last; BatchNorm is what lets the recipe train at lr 0.2 after a short warmup.
benchmarks/fashion_tta.py holds the original definition (fashion_net); tests/models/
test_fashion.py checks that this builder is the same network, parameter for parameter.
"""
from __future__ import annotations

from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.models.base import require_image

WIDTHS = (32, 64, 128, 256)
"""Channels of the four blocks; a 2x2 max-pool follows blocks 2, 3 and 4."""


def build_fashion_net(spec: DataSpec, linear: type) -> nn.Module:
    """conv3x3-BN-GELU x4 (32, 64, 128, 256; pool after the last three), global max-pool, FC out.

    Any image size of at least 8x8 works (three halvings); the global pool makes the FC layer's
    width 256 whatever the size."""
    c, _, _ = require_image(spec, "fashion-net", halvings=3)
    layers: list = []
    for i, out in enumerate(WIDTHS):
        layers += [nn.Conv2d(c, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.GELU()]
        if i > 0:
            layers.append(nn.MaxPool2d(2))
        c = out
    layers += [nn.AdaptiveMaxPool2d(1), nn.Flatten(), linear(c, spec.num_outputs)]
    return nn.Sequential(*layers)
