"""AlexNet-style CNNs for small images.

alexnet-small is seed 001's CIFAR-10 model exactly as written there;
alexnet is the usual CIFAR adaptation of AlexNet (3x3 convs at stride 1, no dropout), used by
the CPU-vs-GPU throughput comparison of seed 004.
"""
from __future__ import annotations

from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.models.base import require_image

SMALL_CONV = (32, 32, 64)
SMALL_FC = (64, 32)


def build_alexnet_small(spec: DataSpec, linear: type) -> nn.Module:
    """Conv0..2 (5x5, stride 1, pad 2; 32, 32, 64 maps), FC 64, FC 32, FC num_outputs.

    Seed 001 does not mention pooling, but without it FC0 would take 64*32*32 = 65,536 inputs
    (4.2M weights in one layer, 28x the rest of the net). Caffe's cifar10_quick, which has the
    same three convs and FC 64, pools (3x3, stride 2) after each conv; we follow each conv with
    ReLU and a 2x2 max-pool, which gives the same 32 -> 16 -> 8 -> 4 sizes.
    FC0's inputs follow the image: 32x32 -> 64*4*4 = 1024; 28x28 -> 64*3*3 = 576; 8x8 -> 64.
    """
    c, h, w = require_image(spec, "alexnet-small", halvings=3)
    layers: list = []
    for out in SMALL_CONV:
        layers += [nn.Conv2d(c, out, 5, stride=1, padding=2), nn.ReLU(inplace=True),
                   nn.MaxPool2d(2)]
        c = out
    layers.append(nn.Flatten())
    width = c * (h // 8) * (w // 8)  # three floor-halvings == one floor division by 8
    for hidden in SMALL_FC:
        layers += [linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(linear(width, spec.num_outputs))  # softmax lives in the loss
    return nn.Sequential(*layers)


# (out_channels, max-pool after?) for the five 3x3 convs
ALEX_CONV = ((64, True), (192, True), (384, False), (256, False), (256, True))
ALEX_FC = (1024, 1024)


def build_alexnet(spec: DataSpec, linear: type) -> nn.Module:
    """Five 3x3 convs (64, pool, 192, pool, 384, 256, 256, pool), adaptive average pool to at
    most 2x2, FC 1024, FC 1024, FC num_outputs.

    The ImageNet original's 11x11 stride-4 stem would leave nothing of a 28x28 image, and its
    4096-wide FC layers would hold ~90% of the weights; 1024 keeps the net convolution-bound, which
    is what a CPU-vs-GPU comparison should measure. No dropout: training stays deterministic.
    """
    c, h, w = require_image(spec, "alexnet", halvings=3)
    layers: list = []
    for out, pool in ALEX_CONV:
        layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU(inplace=True)]
        if pool:
            layers.append(nn.MaxPool2d(2))
        c = out
    # 32x32 -> 4x4 and 64x64 -> 8x8 average down to 2x2; 8x8 inputs reach 1x1 and stay there
    # rather than being copied up to 2x2 (four identical copies would only add weights).
    ph, pw = min(2, h // 8), min(2, w // 8)
    layers += [nn.AdaptiveAvgPool2d((ph, pw)), nn.Flatten()]
    width = c * ph * pw
    for hidden in ALEX_FC:
        layers += [linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(linear(width, spec.num_outputs))
    return nn.Sequential(*layers)
