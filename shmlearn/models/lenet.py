"""The small "2 conv + max-pool" CNN of seed 003 §4-5.

Sized to be cheap on one CPU thread (two processes of one thread each are the CPU test
setting): 16 and 32 feature maps instead of the usual 32 and 64 cost about 4x fewer
multiply-adds in the second conv, which is most of the work.
"""
from __future__ import annotations

from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.models.base import require_image

CONV = (16, 32)
HIDDEN = 128


def build_lenet(spec: DataSpec, linear: type) -> nn.Module:
    """conv 5x5/16 pad 2, ReLU, pool 2; conv 5x5/32 pad 2, ReLU, pool 2; FC 128, ReLU; FC out."""
    c, h, w = require_image(spec, "lenet", halvings=2)
    layers: list = []
    for out in CONV:  # padding 2 keeps H x W; only the pools shrink it
        layers += [nn.Conv2d(c, out, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        c = out
    layers += [nn.Flatten(),
               linear(c * (h // 4) * (w // 4), HIDDEN), nn.ReLU(),
               linear(HIDDEN, spec.num_outputs)]
    return nn.Sequential(*layers)
