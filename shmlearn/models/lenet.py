"""The small "2 conv + max-pool" CNN of seed 003 §4-5.

Sized for the CPU target: >= 0.88 Fashion-MNIST test accuracy after 2 epochs with 2 worker
processes of 1 thread each, in under 2 minutes. Of the widths timed on one CPU thread (16/32,
32/32 and the usual 32/64 maps; docs/performance.md, "Behind the code"), 16/32 missed the target at
batch 256 (0.874-0.877 with SGD lr 0.05 momentum 0.9) and only just made it at 128
(0.885-0.890); 32/32 gave 0.886-0.896 in the same runs at two thirds of 32/64's time, so it is
the default.
"""
from __future__ import annotations

from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.models.base import require_image

CONV = (32, 32)
HIDDEN = 128


def build_lenet(spec: DataSpec, linear: type) -> nn.Module:
    """conv 5x5/32 pad 2, ReLU, pool 2; conv 5x5/32 pad 2, ReLU, pool 2; FC 128, ReLU; FC out."""
    c, h, w = require_image(spec, "lenet", halvings=2)
    layers: list = []
    for out in CONV:  # padding 2 keeps H x W; only the pools shrink it
        layers += [nn.Conv2d(c, out, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        c = out
    layers += [nn.Flatten(),
               linear(c * (h // 4) * (w // 4), HIDDEN), nn.ReLU(),
               linear(HIDDEN, spec.num_outputs)]
    return nn.Sequential(*layers)
