"""A convolution that reads few input values per output, as one im2col gather and one GEMM.

Why: the first convolution of an image model has 1 or 3 input channels. Its GEMM's inner
dimension (in_channels x kernel area: 75 for alexnet-small's 5x5 on RGB, 27 for a 3x3 stem) is
far below what cuDNN's implicit-GEMM kernels are built for, and on one H100 (torch 2.11, cuDNN 9,
bf16, channels_last) cuDNN ran alexnet-small's first conv forward in 292 us and its weight
gradient in 175 us at batch 1024: 13x and 8x their memory floors, a third of the whole compiled
step (benchmarks/results/kernels-h100/, the roofline profile). Written out, the same conv is

    cols[n*ho*wo, K] = the K = kh*kw*cin inputs under each output position (a gather)
    out = cols @ W^T + bias          (cuBLAS; the output lands in channels_last order)
    dW  = dout^T @ cols              (autograd: one more GEMM, over the saved cols)

with K padded with zero columns to a multiple of 8 (16-byte rows: cuBLAS's aligned kernels).
Both GEMMs stream their operands once; the price is the cols buffer (K/cin times the input:
168 MB at batch 1024 for alexnet-small, kept for the backward).

Measured in the whole step (one H100, benchmarks/results/throughput-im2col-h100/): with
--compile (Inductor fuses the gather and the zero padding) alexnet-small's step at batch 1024
went from 1.382 to 1.322 ms and resnet18's from 12.45 to 12.31 ms; at batch 128 it is even; run
eagerly the gather and the padding are separate kernels and the step is slower (2.20 -> 2.46 ms).
So it is a flag, off by default.

Only where it is exact: groups 1, dilation 1, zero padding, K <= MAX_K, and an input
that needs no gradient (the image: no data gradient to compute, so nothing flows back through
the gather). Anything else runs nn.Conv2d's own forward. `convert` switches qualifying modules
in place (their class only: parameters, buffers and state_dict stay as they are).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

MAX_K = 128
"""Largest in_channels x kernel area converted: beyond it cuDNN's kernels are efficient and the
cols buffer (K/cin times the input) stops being cheap."""


def _pair(v) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def qualifies(conv: nn.Module) -> bool:
    """Whether a module is a Conv2d this module computes exactly (whatever its input)."""
    if not isinstance(conv, nn.Conv2d) or type(conv) not in (nn.Conv2d, Im2colConv2d):
        return False
    kh, kw = conv.kernel_size
    return (conv.groups == 1 and _pair(conv.dilation) == (1, 1) and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str) and conv.in_channels * kh * kw <= MAX_K)


def im2col_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  stride=1, padding=0) -> torch.Tensor:
    """F.conv2d(x, weight, bias, stride, padding) for groups 1 and dilation 1, as a gather and a
    GEMM; the result is channels_last. Under autocast the gather moves the autocast dtype."""
    n, c, h, w = x.shape
    cout, cin, kh, kw = weight.shape
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    xp = F.pad(x.permute(0, 2, 3, 1), (0, 0, pw, pw, ph, ph))  # NHWC, zero border; contiguous
    k = kh * kw * cin
    kp = -(-k // 8) * 8
    s = xp.stride()
    windows = xp.as_strided((n, ho, wo, kh, kw, cin), (s[0], s[1] * sh, s[2] * sw, s[1], s[2], s[3]))
    cols = torch.empty(n * ho * wo, kp, device=x.device, dtype=x.dtype)
    if kp != k:
        cols[:, k:].zero_()
    cols[:, :k].view(n, ho, wo, kh, kw, cin).copy_(windows)  # the one gather
    wm = weight.permute(0, 2, 3, 1).reshape(cout, k)  # (kh, kw, cin) order, as the cols
    if kp != k:
        wm = F.pad(wm, (0, kp - k))
    out = F.linear(cols, wm, bias)  # [n*ho*wo, cout]: NHWC order
    return out.view(n, ho, wo, cout).permute(0, 3, 1, 2)


class Im2colConv2d(nn.Conv2d):
    """nn.Conv2d whose forward takes the im2col path when its input needs no gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad or x.dim() != 4:
            return super().forward(x)
        return im2col_conv2d(x, self.weight, self.bias, self.stride, self.padding)


def convert(model: nn.Module) -> int:
    """Switch every qualifying nn.Conv2d of model to Im2colConv2d in place; how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Conv2d and qualifies(m):
            m.__class__ = Im2colConv2d
            n += 1
    return n
