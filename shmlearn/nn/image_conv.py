"""How the convolutions of the input image run: few input values per output, so far from the
limits on cuDNN (--image-conv cudnn|im2col|triton).

Why: the first convolution of an image model has 1 or 3 input channels. Its GEMM's inner dimension
(in_channels x kernel area: 75 for alexnet-small's 5x5 on RGB, 27 for a 3x3 stem) is far below
what cuDNN's implicit-GEMM kernels are built for, and on one H100 cuDNN ran alexnet-small's first
conv forward and weight gradient far above their memory floors, a large share of the whole
compiled step (docs/performance.md, "Behind the code").

* im2col: the same conv written out,

      cols[n*ho*wo, K] = the K = kh*kw*cin inputs under each output position (a gather)
      out = cols @ W^T + bias          (cuBLAS; the output lands in channels_last order)
      dW  = dout^T @ cols              (autograd: one more GEMM, over the saved cols)

  with K padded with zero columns to a multiple of 8 (16-byte rows: cuBLAS's aligned kernels).
  Both GEMMs stream their operands once; the price is the cols buffer (K/cin times the input:
  168 MB at batch 1024 for alexnet-small, kept for the backward). Measured in the whole step
  (one H100; docs/performance.md, "Behind the code"): with --compile (Inductor fuses the
  gather and the zero padding) alexnet-small's and resnet18's steps at batch 1024 gained; at
  batch 128 it is even; run eagerly the gather and the padding are separate kernels and the
  step is slower.
* triton: shmlearn's own kernels (_image_conv_triton.py), implicit GEMMs that gather each tile's
  inputs into registers and never write cols: forward and weight/bias gradient, CUDA only. Not
  yet measured on a GPU (tested against F.conv2d in Triton's interpreter).

Only where it is exact: groups 1, dilation 1, zero padding, K <= MAX_K, and an input that needs
no gradient (the image: no data gradient to compute, so nothing flows back through the
gather). Anything else runs nn.Conv2d's own forward. `convert` switches qualifying modules in
place (their class only: parameters, buffers and state_dict stay as they are).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from shmlearn.nn._lazy import OnFirstUse

MODES = ("cudnn", "im2col", "triton", "auto")
"""--image-conv: torch's own conv (cuDNN on GPUs), im2col + GEMMs, shmlearn's Triton kernels, or
auto: im2col where it was measured faster (a compiled step on CUDA), else cudnn."""
MAX_K = 128
"""Largest in_channels x kernel area converted: beyond it cuDNN's kernels are efficient and the
cols buffer (K/cin times the input) stops being cheap."""


def _pair(v) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def qualifies(conv: nn.Module) -> bool:
    """Whether a module is a Conv2d this module computes exactly (whatever its input)."""
    if not isinstance(conv, nn.Conv2d) or type(conv) not in (nn.Conv2d, ImageConv2d):
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


def triton_usable(device: torch.device, flag: str = "--image-conv triton",
                  instead: str = "im2col or cudnn") -> Optional[str]:
    """None if shmlearn's Triton kernels (flag) can run on this device, else why not (one line,
    naming `instead`)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the tests: Triton's interpreter on the CPU
    if device.type != "cuda" and not interpreted:
        return f"{flag}: Triton's kernels run on CUDA devices, not {device.type}; use {instead}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return f"{flag}: Triton is not installed (pip install triton); use {instead}"
    return None


# The custom ops (forward, weight gradient), defined on first use: runs that do not ask for
# --image-conv triton need not import Triton for them. (A training process imports Triton anyway,
# through torch._dynamo, which launch.py imports before the process group: the DataLoader fork
# hang this was first blamed on is handled where loader workers start, data/stream.py `_context`.)
_ops = OnFirstUse(lambda: _define_ops())


def _define_ops():
    @torch.library.custom_op("shmlearn::image_conv2d", mutates_args=())
    def conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: List[int],
             padding: List[int]) -> torch.Tensor:
        from shmlearn.nn import _image_conv_triton as kernels  # lazy: Triton, on first use
        cout = weight.shape[0]
        xn = x.permute(0, 2, 3, 1).contiguous()  # a view when x is channels_last
        w_kn = weight.permute(2, 3, 1, 0).reshape(-1, cout).contiguous()  # [(ky, kx, ci), cout]
        return kernels.forward(xn, w_kn, bias, tuple(weight.shape), tuple(stride), tuple(padding))

    @conv.register_fake
    def _(x, weight, bias, stride, padding):
        n, _, h, w = x.shape
        cout, _, kh, kw = weight.shape
        shape = (n, cout, (h + 2 * padding[0] - kh) // stride[0] + 1, (w + 2 * padding[1] - kw) // stride[1] + 1)
        return x.new_empty(shape).contiguous(memory_format=torch.channels_last)

    @torch.library.custom_op("shmlearn::image_conv2d_weight_grad", mutates_args=())
    def weight_grad(x: torch.Tensor, grad_out: torch.Tensor, weight_shape: List[int], stride: List[int],
                    padding: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        from shmlearn.nn import _image_conv_triton as kernels  # lazy: Triton, on first use
        cout, cin, kh, kw = weight_shape
        dw, db = kernels.weight_grad(x.permute(0, 2, 3, 1).contiguous(), grad_out.permute(0, 2, 3, 1).contiguous(),
                                     tuple(weight_shape), tuple(stride), tuple(padding))
        return dw.t().reshape(cout, kh, kw, cin).permute(0, 3, 1, 2).contiguous(), db.clone()

    @weight_grad.register_fake
    def _(x, grad_out, weight_shape, stride, padding):
        return (x.new_empty(weight_shape, dtype=torch.float32), x.new_empty(weight_shape[0], dtype=torch.float32))

    def setup(ctx, inputs, output):
        x, weight, bias, stride, padding = inputs
        ctx.save_for_backward(x)
        ctx.meta = (list(weight.shape), weight.dtype, bias is not None, bias.dtype if bias is not None else None,
                    stride, padding)

    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        shape, w_dtype, has_bias, b_dtype, stride, padding = ctx.meta
        dw, db = weight_grad(x, grad_out, shape, stride, padding)
        return None, dw.to(w_dtype), (db.to(b_dtype) if has_bias else None), None, None

    conv.register_autograd(backward, setup_context=setup)

    # The conv's FLOPs for torch.utils.flop_counter (FlopCounterMode, bench/roofline.py): the
    # forward's and the weight gradient's are each those of the convolution.
    from torch.utils.flop_counter import conv_flop_count, register_flop_formula

    @register_flop_formula(torch.ops.shmlearn.image_conv2d)
    def _(x_shape, w_shape, bias_shape, stride, padding, *, out_shape=None, **kwargs) -> int:
        return conv_flop_count(x_shape, w_shape, out_shape)

    @register_flop_formula(torch.ops.shmlearn.image_conv2d_weight_grad)
    def _(x_shape, grad_shape, weight_shape, stride, padding, *, out_shape=None, **kwargs) -> int:
        return conv_flop_count(x_shape, list(weight_shape), grad_shape)

    return conv, weight_grad


def triton_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  stride=1, padding=0) -> torch.Tensor:
    """F.conv2d for groups 1 and dilation 1 by shmlearn's Triton kernels (x needs no gradient);
    the result is channels_last. Under autocast the kernels read and write the autocast dtype."""
    dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        return _ops()[0](x.to(dt), weight.to(dt), bias.to(dt) if bias is not None else None,
                         list(_pair(stride)), list(_pair(padding)))


class ImageConv2d(nn.Conv2d):
    """nn.Conv2d that, when its input needs no gradient, runs as `image_conv` says."""
    image_conv = "im2col"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad or x.dim() != 4:
            return super().forward(x)
        if self.image_conv == "triton":
            return triton_conv2d(x, self.weight, self.bias, self.stride, self.padding)
        return im2col_conv2d(x, self.weight, self.bias, self.stride, self.padding)


def resolve(mode: str, compiled: bool, device_type: str) -> str:
    """The mode that runs. auto: im2col in a compiled step on CUDA (Inductor fuses the gather; one
    H100, compiled: faster or even on every model measured, docs/performance.md), cudnn otherwise
    (eagerly the gather is its own kernels and the step is slower)."""
    if mode != "auto":
        return mode
    return "im2col" if compiled and device_type == "cuda" else "cudnn"


def convert(model: nn.Module, mode: str = "im2col") -> int:
    """Switch every qualifying nn.Conv2d of model to run as `mode` (cudnn, im2col or triton;
    resolve auto first), in place, both ways; how many run other than on cudnn."""
    if mode not in MODES or mode == "auto":
        raise ValueError(f"convert: mode {mode!r}: one of cudnn, im2col, triton")
    n = 0
    for m in model.modules():
        if type(m) in (nn.Conv2d, ImageConv2d) and qualifies(m):
            if mode == "cudnn":
                m.__class__ = nn.Conv2d
                m.__dict__.pop("image_conv", None)
                continue
            m.__class__ = ImageConv2d
            m.image_conv = mode
            n += 1
    if n and mode == "triton":
        _ops()  # defined now, not while Dynamo traces the first forward (a graph break: see conv_pool.convert)
    return n
