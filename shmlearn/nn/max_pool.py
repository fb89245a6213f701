"""Max-pools written as reductions, so that Inductor fuses them (--max-pool aten|global|reduce|auto).

Why: a non-overlapping max-pool (kernel == stride, the 2x2/2 of alexnet-small, fashion-net and
most CIFAR-style nets) and a global max-pool are a max over windows that a view exposes:
x.view(N, C, H/kh, kh, W/kw, kw), or x.flatten(2). torch's max_pool2d stores int64 argmax indices
and its backward scatters through them: on one H100 the global pool's backward (atomicAdd) and
Inductor's 2x2 pool backward kernels ran far below the memory bandwidth (docs/performance.md,
"Behind the code").

Here the forward is a max over the window's last dimension (values and the position within
the window, kept as uint8 for a 2x2 window), which Inductor fuses into the kernel that produces
x; the backward is pointwise, where(position == i, grad, 0), and fuses into the next backward
kernel: no int64 indices, no scatter.

Why not x.amax(...), whose backward is grad * (x == y) / (number of ties): under torch.compile
the partitioner may recompute x in the backward (BatchNorm + GELU, cheap pointwise work) in a
different precision from the forward's, then no input equals the saved maximum, the count is 0
and the gradient 0/0 = NaN (fashion-net diverged at step 1 on an H100 and on the CPU). The
positions saved here do not depend on recomputing anything.

Same outputs and the same gradients as max_pool2d and adaptive_max_pool2d, ties included (the
first maximum in row-major window order gets the gradient, as torch's kernels give it). Measured
in the compiled step on one H100 (docs/performance.md, "Behind the code"): the global pool as a
reduction made fashion-net's step faster, but the 2x2 pools as reductions too made it slower
(Inductor's reduction over the permuted window is slower than its own max_pool2d lowering).
Eagerly the window view + max is slower than max_pool2d's one kernel. So `auto` is `global` when
the step is compiled, else aten; `reduce` converts every qualifying pool. `convert` switches
qualifying modules in place (their class only: pools have no parameters or buffers; state_dicts
are unchanged). Functional calls (F.max_pool2d inside a user's forward) are not seen and keep
torch's kernel.
"""
from __future__ import annotations

import torch
from torch import nn

MODES = ("aten", "global", "reduce", "auto")
"""--max-pool: torch's kernels for every pool; the global pools as reductions; every qualifying
pool as a reduction; auto: global when the step is compiled, else aten."""


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


class _WindowMax(torch.autograd.Function):
    """max over the last dimension of windows (..., K); backward through the saved positions."""

    @staticmethod
    def forward(ctx, windows: torch.Tensor):
        values, pos = windows.max(dim=-1)
        k = windows.shape[-1]
        pos = pos.to(torch.uint8 if k <= 256 else torch.int32 if k < 2 ** 31 else torch.int64)
        ctx.save_for_backward(pos)
        ctx.k = k
        return values

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        i = torch.arange(ctx.k, device=grad.device, dtype=pos.dtype)
        return torch.where(pos.unsqueeze(-1) == i, grad.unsqueeze(-1), torch.zeros((), dtype=grad.dtype,
                                                                                   device=grad.device))


def window_max_pool2d(x: torch.Tensor, kernel) -> torch.Tensor:
    """F.max_pool2d(x, kernel) (stride = kernel, no padding, floor mode) of a 4-D x."""
    kh, kw = _pair(kernel)
    n, c, h, w = x.shape
    ho, wo = h // kh, w // kw
    crop = x[:, :, :ho * kh, :wo * kw] if (ho * kh, wo * kw) != (h, w) else x
    # (N, C, Ho, kh, Wo, kw) -> (N, C, Ho, Wo, kh*kw): row-major window order, as max_pool2d scans
    windows = crop.reshape(n, c, ho, kh, wo, kw).permute(0, 1, 2, 4, 3, 5).reshape(n, c, ho, wo, kh * kw)
    return _WindowMax.apply(windows)


def global_max_pool2d(x: torch.Tensor) -> torch.Tensor:
    """F.adaptive_max_pool2d(x, 1) of a 4-D x."""
    return _WindowMax.apply(x.flatten(2)).unsqueeze(-1).unsqueeze(-1)


class ReduceMaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d with kernel == stride, no padding or dilation, as a window reduction."""

    def forward(self, x):
        if x.dim() != 4:  # unbatched (C, H, W): torch's own
            return super().forward(x)
        return window_max_pool2d(x, self.kernel_size)


class ReduceAdaptiveMaxPool2d(nn.AdaptiveMaxPool2d):
    """nn.AdaptiveMaxPool2d(1) (a global max-pool) as a reduction over height and width."""

    def forward(self, x):
        if x.dim() != 4:
            return super().forward(x)
        return global_max_pool2d(x)


def qualifies(m: nn.Module) -> bool:
    """Whether a module is a max-pool this module computes exactly as a reduction."""
    if type(m) in (nn.MaxPool2d, ReduceMaxPool2d):
        stride = m.stride if m.stride is not None else m.kernel_size
        return (_pair(m.kernel_size) == _pair(stride) and _pair(m.padding) == (0, 0)
                and _pair(m.dilation) == (1, 1) and not m.ceil_mode and not m.return_indices)
    if type(m) in (nn.AdaptiveMaxPool2d, ReduceAdaptiveMaxPool2d):
        return _pair(m.output_size) == (1, 1) and not m.return_indices
    return False


def resolve(mode: str, compiled: bool) -> str:
    """The mode that runs: auto is global under torch.compile, aten otherwise."""
    return ("global" if compiled else "aten") if mode == "auto" else mode


def convert(model: nn.Module, mode: str) -> int:
    """Switch every qualifying max-pool of model to `mode` (aten, global or reduce; resolve auto
    first), in place, both ways; how many pools run as reductions."""
    if mode not in ("aten", "global", "reduce"):
        raise ValueError(f"convert: mode {mode!r}: resolve auto first")
    n = 0
    for m in model.modules():
        if qualifies(m):
            if isinstance(m, nn.MaxPool2d):
                on = mode == "reduce"
                m.__class__ = ReduceMaxPool2d if on else nn.MaxPool2d
            else:
                on = mode in ("global", "reduce")
                m.__class__ = ReduceAdaptiveMaxPool2d if on else nn.AdaptiveMaxPool2d
            n += on
    return n
