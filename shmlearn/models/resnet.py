"""ResNet-18 and ResNet-34 (He et al. 2016, BasicBlock) for images of any size >= 1x1.

Stem: images up to 32x32 get the CIFAR stem (one 3x3 conv at stride 1, no max-pool), because the
ImageNet stem would shrink 32x32 to 8x8 (28x28 to 7x7) before the first block, and stages
3-4 would run on 2x2 and 1x1 maps. Larger images (64x64 Tiny-ImageNet and up) get
the ImageNet stem (7x7 stride 2 + 3x3 max-pool stride 2): 64x64 enters the blocks at 16x16 and
leaves at 2x2, as 224x224 leaves at 7x7, at 1/16 of the cost of running stage 1 at 64x64.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.models.base import require_image

WIDTHS = (64, 128, 256, 512)
CIFAR_STEM_MAX = 32  # largest H and W that get the 3x3 stride-1 stem
BLOCKS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


def conv_bn(cin: int, cout: int, kernel: int, stride: int) -> nn.Sequential:
    """Conv without bias (the BatchNorm shift after it makes a bias redundant) + BatchNorm."""
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False),
                         nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """relu(conv_bn(relu(conv_bn(x))) + shortcut(x)); the shortcut is a 1x1 conv_bn only when the
    block changes the stride or the width (projection shortcut, option B of the paper)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = conv_bn(cin, cout, 3, stride)
        self.conv2 = conv_bn(cout, cout, 3, 1)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = (conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout
                         else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.relu(self.conv1(x)))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, in_channels: int, num_outputs: int, blocks: Sequence[int],
                 imagenet_stem: bool, linear: type):
        super().__init__()
        if imagenet_stem:
            self.stem = nn.Sequential(conv_bn(in_channels, WIDTHS[0], 7, 2), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(3, stride=2, padding=1))
        else:
            self.stem = nn.Sequential(conv_bn(in_channels, WIDTHS[0], 3, 1), nn.ReLU(inplace=True))
        stages = []
        cin = WIDTHS[0]
        for i, (width, n) in enumerate(zip(WIDTHS, blocks)):
            stride = 1 if i == 0 else 2  # stages 2-4 halve H and W in their first block
            stages += [BasicBlock(cin, width, stride)] + [BasicBlock(width, width, 1)
                                                          for _ in range(n - 1)]
            cin = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = linear(cin, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def build_resnet(spec: DataSpec, linear: type, *, name: str) -> nn.Module:
    """name: "resnet18" or "resnet34". Padded stride-2 convs never shrink a side below 1, so
    any image size works; only vector inputs are refused."""
    c, h, w = require_image(spec, name, halvings=0)
    imagenet_stem = max(h, w) > CIFAR_STEM_MAX
    return ResNet(c, spec.num_outputs, BLOCKS[name], imagenet_stem, linear)
