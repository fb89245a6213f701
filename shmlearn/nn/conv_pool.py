"""Conv + ReLU + 2x2 max-pool as one kernel (--conv-pool off|triton|auto).

Why: a CIFAR-style block, Conv2d (stride 1) -> ReLU -> MaxPool2d(2), run as three ops writes the
conv's full output, reads it back for ReLU and the pool, and writes it again as a gradient in the
backward. For alexnet-small's first conv at batch 1024 (bf16) that output is 67 MB, four times
the pooled one; on one H100 the conv, ReLU and pool kernels of that one block were a large share
of the compiled step (docs/performance.md, "Behind the code"). Here one Triton kernel
(_conv_pool_triton.py) computes the conv output in registers, 2x2 window by 2x2 window, and
writes only the pooled output and a uint8 code per value (where the max was, or that ReLU cut it).
The backward:
* of a block whose input needs no gradient (the image's first conv): one more Triton kernel forms
  each window position's gradient from the pooled gradient and the codes as it goes and sums the
  weight and bias gradients; the full-size gradient is never written;
* otherwise: the full-size gradient from the codes (pointwise: Inductor fuses it) and torch's
  convolution_backward (cuDNN) for the input, weight and bias gradients; or, with
  `BACKWARD = "triton"`, shmlearn's kernels straight from the codes (slower on an H100: below).

Exact where it applies: the same outputs and gradients as the three modules, ties included (the
first maximum in window order gets the gradient, as max_pool2d gives it; a window whose maximum is
<= 0 passes none, as ReLU's gradient at 0). The sums run in another order than cuDNN's, so
results agree to rounding, not bit for bit.

Only where it is exact: a Conv2d (groups 1, dilation 1, stride 1, zero padding given as numbers)
followed directly, in an nn.Sequential, by ReLU and MaxPool2d(2) (stride 2, no padding, floor
mode), with out_channels <= MAX_OUT, and in_channels a multiple of 16 (read in place) or
in_channels x kernel width <= 64 (the image: read through an unfolded copy). `convert` switches
the three modules' classes in place, both ways: parameters, buffers and state_dict stay as they
are; a user's forward that calls F.relu / F.max_pool2d itself is not seen.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from shmlearn.nn._lazy import OnFirstUse
from shmlearn.nn import fit
from shmlearn.nn.conv_overlap import convolution_backward
from shmlearn.nn.conv_pool_limits import MAX_OUT, supported, unfolds
from shmlearn.nn.image_conv import ImageConv2d, triton_usable
from shmlearn.nn.max_pool import ReduceMaxPool2d

MODES = ("off", "triton", "auto")
"""--conv-pool: three ops as torch runs them; shmlearn's fused Triton kernels; auto: triton on
CUDA with Triton installed, off otherwise."""


def _pair(v) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def usable(device: torch.device) -> Optional[str]:
    """None if --conv-pool triton can run on this device, else why not (one line)."""
    return triton_usable(device, "--conv-pool triton", "off")


def resolve(mode: str, device: torch.device) -> str:
    """The mode that runs: auto is triton on CUDA with Triton installed, else off (never the
    interpreter: that is for tests that ask for triton)."""
    if mode != "auto":
        return mode
    return "triton" if device.type == "cuda" and usable(device) is None else "off"


def expand_grad(grad: torch.Tensor, code: torch.Tensor, ho: int, wo: int) -> torch.Tensor:
    """The conv output's gradient [n, c, ho, wo] (channels_last) from the pooled output's
    gradient and the codes: each pooled gradient at its window position, zero elsewhere."""
    n, c, hp, wp = grad.shape
    g = grad.permute(0, 2, 3, 1).reshape(n, hp, 1, wp, 1, c)  # views when channels_last
    k = code.permute(0, 2, 3, 1).reshape(n, hp, 1, wp, 1, c)
    idx = torch.arange(4, device=grad.device, dtype=code.dtype).view(1, 1, 2, 1, 2, 1)  # (dy, dx) -> 2*dy + dx
    full = torch.where(k == idx, g, torch.zeros((), dtype=grad.dtype, device=grad.device))
    full = full.reshape(n, 2 * hp, 2 * wp, c)
    if (2 * hp, 2 * wp) != (ho, wo):  # floor mode: the last odd row/column got no gradient
        full = F.pad(full, (0, 0, 0, wo - 2 * wp, 0, ho - 2 * hp))
    return full.permute(0, 3, 1, 2)


_ops = OnFirstUse(lambda: _define_ops())
"""The custom ops, defined on first use."""


def _define_ops():
    from shmlearn.nn._conv_pool_triton import prepared_shape  # lazy: Triton, on first use

    @torch.library.custom_op("shmlearn::conv_relu_pool2d", mutates_args=())
    def fused(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              padding: List[int], overlap: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y, code, xr): xr, the input as the kernels read it, is what the weight-gradient kernel
        reads again (an output, so that autograd can save it). overlap: the backward's cuDNN
        GEMMs on two streams (conv_overlap.py)."""
        from shmlearn.nn import _conv_pool_triton as kernels  # lazy: Triton, on first use
        xn = x.permute(0, 2, 3, 1).contiguous()  # a view when x is channels_last
        return kernels.forward(xn, weight, bias, tuple(padding))

    @fused.register_fake
    def _(x, weight, bias, padding, overlap):
        n, _, h, w = x.shape
        cout, _, kh, kw = weight.shape
        shape = (n, cout, (h + 2 * padding[0] - kh + 1) // 2, (w + 2 * padding[1] - kw + 1) // 2)
        y = x.new_empty(shape).contiguous(memory_format=torch.channels_last)
        return y, torch.empty_like(y, dtype=torch.uint8), x.new_empty(prepared_shape(x.shape, weight.shape, padding))

    @torch.library.custom_op("shmlearn::conv_relu_pool2d_weight_grad", mutates_args=())
    def weight_grad(xr: torch.Tensor, grad: torch.Tensor, code: torch.Tensor, weight_shape: List[int],
                    channels_last: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """dw (channels_last in memory where asked: the weight's layout, so no copy follows) and db."""
        from shmlearn.nn import _conv_pool_triton as kernels  # lazy: Triton, on first use
        nhwc = lambda t: t.permute(0, 2, 3, 1).contiguous()  # noqa: E731 - views when channels_last
        return kernels.weight_grad(xr, nhwc(grad), nhwc(code), tuple(weight_shape), channels_last=channels_last)

    @weight_grad.register_fake
    def _(xr, grad, code, weight_shape, channels_last):
        dw = xr.new_empty(weight_shape, dtype=torch.float32)
        return (dw.contiguous(memory_format=torch.channels_last) if channels_last else dw,
                xr.new_empty(weight_shape[0], dtype=torch.float32))

    def setup(ctx, inputs, output):
        x, weight, bias, padding, overlap = inputs
        y, code, xr = output
        # The image (no input gradient, read unfolded): the weight gradient reads xr; x is not kept.
        image = not x.requires_grad and xr.numel() > 0
        ctx.save_for_backward(xr if image else x, weight, code)
        ctx.meta = (image, bias is not None, bias.dtype if bias is not None else None, list(padding), overlap)

    def backward(ctx, grad, _grad_code, _grad_xr):
        x, weight, code = ctx.saved_tensors
        image, has_bias, b_dtype, padding, overlap = ctx.meta
        if image:  # the image: weight and bias gradients in one kernel, from xr
            dw, db = weight_grad(x, grad, code, list(weight.shape),
                                 weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous())
            return None, dw.to(weight.dtype), (db.to(b_dtype) if has_bias else None), None, None
        need_dx = bool(ctx.needs_input_grad[0])
        if backward_path(x) == "cudnn":  # plain torch ops here, so that Inductor fuses the expansion
            _, _, kh, kw = weight.shape
            ho, wo = x.shape[2] + 2 * padding[0] - kh + 1, x.shape[3] + 2 * padding[1] - kw + 1
            full = expand_grad(grad, code, ho, wo)
            mask = [need_dx, bool(ctx.needs_input_grad[1]), has_bias]
            if overlap:
                dx, dw, db = convolution_backward(full, x, weight, [1, 1], padding, [1, 1], 1, mask)
            else:
                dx, dw, db = torch.ops.aten.convolution_backward(
                    full, x, weight, [weight.shape[0]] if has_bias else None, [1, 1], padding, [1, 1], False,
                    [0, 0], 1, mask)
            return dx, dw, db, None, None
        dx, dw, db = block_backward(x, weight, grad, code, padding, need_dx, has_bias)
        return (dx if need_dx else None), dw, (db.to(b_dtype) if has_bias else None), None, None

    fused.register_autograd(backward, setup_context=setup)

    @torch.library.custom_op("shmlearn::conv_relu_pool2d_backward", mutates_args=())
    def block_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, code: torch.Tensor,
                       padding: List[int], need_dx: bool, has_bias: bool) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
        """(dx or empty, dw, db or empty) of a block that is not the image's, by shmlearn's kernels."""
        dx, dw, db = _triton_backward(x, weight, grad, code, padding, need_dx)
        return (dx if need_dx else x.new_empty(0)), dw, (db if has_bias else x.new_empty(0))

    @block_backward.register_fake
    def _(x, weight, grad, code, padding, need_dx, has_bias):
        return (torch.empty_like(x) if need_dx else x.new_empty(0), torch.empty_like(weight),
                grad.new_empty(weight.shape[0]) if has_bias else x.new_empty(0))

    # FLOPs for torch.utils.flop_counter (bench/roofline.py): those of the convolution; the
    # weight gradient's are those of a convolution too.
    from torch.utils.flop_counter import conv_flop_count, register_flop_formula

    def conv_out(x_shape, w_shape, padding):
        n, _, h, w = x_shape
        cout, _, kh, kw = w_shape
        return [n, cout, h + 2 * padding[0] - kh + 1, w + 2 * padding[1] - kw + 1]

    @register_flop_formula(torch.ops.shmlearn.conv_relu_pool2d)
    def _(x_shape, w_shape, bias_shape, padding, overlap, *, out_shape=None, **kwargs) -> int:
        return conv_flop_count(x_shape, w_shape, conv_out(x_shape, w_shape, padding))

    @register_flop_formula(torch.ops.shmlearn.conv_relu_pool2d_weight_grad)
    def _(xr_shape, grad_shape, code_shape, weight_shape, *, out_shape=None, **kwargs) -> int:
        n, cout, hp, wp = grad_shape  # the conv's output is (2 hp, 2 wp) where it has a gradient
        return conv_flop_count([n, weight_shape[1], 2 * hp, 2 * wp], list(weight_shape), [n, cout, 2 * hp, 2 * wp])

    return fused, weight_grad


BACKWARD = "cudnn"
"""How a block that is not the image's takes its gradients: cudnn (the full-size gradient from
the codes, one pointwise kernel, then cuDNN's convolution_backward) or triton (shmlearn's
kernels straight from the pooled gradient and the codes, no full-size gradient; in_channels a
multiple of 16). On one H100 shmlearn's were slower for every alexnet-small block measured
(docs/performance.md, "Behind the code"), so cudnn is the default; triton stays for the tests and
for other GPUs and shapes."""


def _triton_backward(x, weight, grad, code, padding, need_dx):
    from shmlearn.nn import _conv_pool_triton as kernels  # lazy: Triton, on first use
    nhwc = lambda t: t.permute(0, 2, 3, 1).contiguous()  # noqa: E731 - views when channels_last
    dxn, dw, db = kernels.input_and_weight_grad(nhwc(x), weight, nhwc(grad), nhwc(code), tuple(padding), need_dx)
    dx = None
    if need_dx:
        dx = dxn.permute(0, 3, 1, 2)  # channels_last memory, as x (the fake's empty_like(x)) when x is
        if not x.is_contiguous(memory_format=torch.channels_last):
            dx = torch.empty_like(x).copy_(dx)
    return dx, torch.empty_like(weight).copy_(dw), db.to(grad.dtype)


def backward_path(x) -> str:
    """`BACKWARD` where shmlearn's kernels apply (in_channels a multiple of 16), else cudnn."""
    return "cudnn" if unfolds(x.shape[1]) else BACKWARD


def conv_relu_pool2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     padding=0, overlap: bool = False) -> torch.Tensor:
    """F.max_pool2d(F.relu(F.conv2d(x, weight, bias, 1, padding)), 2) of a 4-D x, by the fused
    kernels; the result is channels_last. Under autocast the kernels read and write its dtype.
    overlap: the backward's cuDNN GEMMs on two CUDA streams (conv_overlap.py)."""
    dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        y, _, _ = _ops()[0](x.to(dt), weight.to(dt), bias.to(dt) if bias is not None else None, list(_pair(padding)),
                            overlap)
    return y


class ConvReluPool2d(nn.Conv2d):
    """An nn.Conv2d that also applies the ReLU and the 2x2 max-pool that follow it (which then
    pass their input through): one fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Unbatched (C, H, W), or evaluating: torch's ops, the same three steps. Evaluation's
        # batches (1024, and a last one of any size) would each build and autotune kernels of
        # their own, 25.8 s of a cold run's evaluation on an H200 (step/built.py); torch's ops
        # evaluate at once.
        if x.dim() != 4 or not self.training:
            return F.max_pool2d(F.relu(super().forward(x)), 2)
        return conv_relu_pool2d(x, self.weight, self.bias, self.padding, self.__dict__.get("overlap", False))


class FusedReLU(nn.ReLU):
    """A ReLU that the ConvReluPool2d before it has applied."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class FusedMaxPool2d(nn.MaxPool2d):
    """A 2x2 max-pool that the ConvReluPool2d before it has applied."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


_CONVS = (nn.Conv2d, ImageConv2d, ConvReluPool2d)
_POOLS = (nn.MaxPool2d, ReduceMaxPool2d, FusedMaxPool2d)


def _conv_qualifies(m: nn.Module) -> bool:
    if type(m) not in _CONVS:
        return False
    kh, kw = m.kernel_size
    return (m.groups == 1 and _pair(m.dilation) == (1, 1) and _pair(m.stride) == (1, 1)
            and m.padding_mode == "zeros" and not isinstance(m.padding, str)
            and m.out_channels <= MAX_OUT and supported(m.in_channels, kh, kw))


def _pool_qualifies(m: nn.Module) -> bool:
    if type(m) not in _POOLS:
        return False
    stride = m.stride if m.stride is not None else m.kernel_size
    return (_pair(m.kernel_size) == (2, 2) and _pair(stride) == (2, 2) and _pair(m.padding) == (0, 0)
            and _pair(m.dilation) == (1, 1) and not m.ceil_mode and not m.return_indices)


def blocks(model: nn.Module) -> List[Tuple[nn.Module, nn.Module, nn.Module]]:
    """Every (conv, relu, pool) of model this module computes: consecutive children of an
    nn.Sequential."""
    found = []
    for seq in model.modules():
        if not isinstance(seq, nn.Sequential):
            continue
        kids = list(seq)
        for a, b, c in zip(kids, kids[1:], kids[2:]):
            if _conv_qualifies(a) and type(b) in (nn.ReLU, FusedReLU) and _pool_qualifies(c):
                found.append((a, b, c))
    return found


def block_why_not(conv: nn.Module, dtype: torch.dtype, device: torch.device, check_fit: bool = True) -> Optional[str]:
    """None if the fused kernels of this block (its conv; the ReLU and pool qualified) compile
    and fit on device for inputs of dtype, else why not: the device's limits (shared memory a
    block, the architecture) against Triton's compiled metadata of each kernel the block
    launches (fit.py). Always None in Triton's interpreter (the tests). check_fit False: no
    compile, None (a caller that will not run the kernels: step/kernels.py choose)."""
    if fit.interpreted() or device.type != "cuda" or not check_fit:
        return None
    from shmlearn.nn import _conv_pool_triton as kernels  # lazy: Triton, on first use
    lim = fit.limits(device)
    kh, kw = conv.kernel_size
    cin, cout = conv.in_channels, conv.out_channels
    why = kernels.forward_why_not(cin, cout, kh, kw, _pair(conv.padding), conv.bias is not None, dtype, lim)
    if why:
        return f"forward: {why}"
    if unfolds(cin):
        _, why = kernels.wgrad_config(cin, cout, kh, kw, dtype, lim)
        if why:
            return f"weight gradient: {why}"
    return None


def describe(conv: nn.Module) -> str:
    """'conv 3->32 5x5' for notes."""
    kh, kw = conv.kernel_size
    return f"conv {conv.in_channels}->{conv.out_channels} {kh}x{kw}"


def convert(model: nn.Module, mode: str, check=None) -> int:
    """Switch every conv + ReLU + 2x2 max-pool block of model to `mode` (off or triton; resolve
    auto first), in place, both ways; how many blocks run fused. Run it before image_conv.convert
    and max_pool.convert: a fused block's modules are then left alone by them. check: conv ->
    None or why the block cannot run fused (`block_why_not`); such blocks keep torch's ops."""
    if mode not in ("off", "triton"):
        raise ValueError(f"convert: mode {mode!r}: one of off, triton")
    found = blocks(model)
    if mode == "triton" and check is not None:
        found = [b for b in found if check(b[0]) is None]
    if found and mode == "triton":
        # Define the custom ops now: defined while Dynamo traces the first forward, they break
        # the graph there, and a break inside the step's autocast region (fast.py compiles the
        # forward and the loss as one function) leaves the rest of the forward to run eagerly.
        _ops()
    for conv, relu, pool in found:
        if mode == "triton":
            conv.__class__, relu.__class__, pool.__class__ = ConvReluPool2d, FusedReLU, FusedMaxPool2d
        else:
            conv.__class__, relu.__class__, pool.__class__ = nn.Conv2d, nn.ReLU, nn.MaxPool2d
            conv.__dict__.pop("image_conv", None)
            conv.__dict__.pop("overlap", None)
    return len(found) if mode == "triton" else 0


def set_overlap(model: nn.Module, on: bool) -> int:
    """Have every fused block of model take its cuDNN backward on two streams (--conv-overlap
    all: conv_overlap.py) or not; how many fused blocks take it (the image's block has one
    GEMM and no cuDNN backward, and is not counted)."""
    n = 0
    for m in model.modules():
        if type(m) is ConvReluPool2d:
            m.__dict__["overlap"] = on
            n += on and not unfolds(m.in_channels) and BACKWARD == "cudnn"
    return n
