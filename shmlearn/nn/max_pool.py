"""Max-pools written as reductions, so that Inductor fuses them (--max-pool aten|reduce|auto).

Why: a non-overlapping max-pool (kernel == stride, the 2x2/2 of alexnet-small, fashion-net and
most CIFAR-style nets) and a global max-pool are a max over a window that a view can expose:

    y = x.view(N, C, H/kh, kh, W/kw, kw).amax(dim=(3, 5))      # 2x2/2 pool
    y = x.amax(dim=(2, 3), keepdim=True)                         # AdaptiveMaxPool2d(1)

torch's own max_pool2d returns the argmax indices and its backward scatters through them: on
one H100 (torch 2.11, bf16, channels_last, fashion-net at batch 512, compiled) the global pool's
backward (atomicAdd) took 82 us for 6 MB (2% of its memory floor) and Inductor's 2x2 pool
backward kernels ran at 30% of the memory bandwidth (benchmarks/results/roofline-fashion-h100/).
Written as amax, the forward is a reduction Inductor fuses into the kernel that produces x, and
the backward (grad * (x == y) / ties) is pointwise and fuses into the next backward kernel:
no indices are stored and no scatter runs.

Same outputs bit for bit. The gradients are the same wherever a window's maximum is unique;
where several inputs tie for it, amax splits the gradient evenly among them and max_pool2d
gives it all to the first (both are subgradients of max). Eagerly the view + amax is slower than
max_pool2d's one kernel (97 vs 66 us at alexnet-small batch 128, benchmarks/results/kernels-h100/),
so `auto` converts only when the step is compiled. `convert` switches qualifying modules in
place (their class only: pools have no parameters or buffers; state_dicts are unchanged).
Functional calls (F.max_pool2d inside a user's forward) are not seen and keep torch's kernel.
"""
from __future__ import annotations

from torch import nn

MODES = ("aten", "reduce", "auto")
"""--max-pool: torch's max_pool2d kernels, the reductions below, or reduce exactly when compiled."""


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


class ReduceMaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d with kernel == stride, no padding or dilation, as a view and an amax."""

    def forward(self, x):
        if x.dim() != 4:  # unbatched (C, H, W): torch's own
            return super().forward(x)
        kh, kw = _pair(self.kernel_size)
        n, c, h, w = x.shape
        ho, wo = h // kh, w // kw
        if (ho * kh, wo * kw) != (h, w):  # floor mode drops the last rows and columns
            x = x[:, :, :ho * kh, :wo * kw]
        # reshape, not view: the slice above (or an odd layout) may not be viewable; for
        # contiguous and channels_last inputs of whole windows it is a view (no copy).
        return x.reshape(n, c, ho, kh, wo, kw).amax(dim=(3, 5))


class ReduceAdaptiveMaxPool2d(nn.AdaptiveMaxPool2d):
    """nn.AdaptiveMaxPool2d(1) (a global max-pool) as an amax over height and width."""

    def forward(self, x):
        if x.dim() != 4:
            return super().forward(x)
        return x.amax(dim=(2, 3), keepdim=True)


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
    """The mode that runs: auto is reduce under torch.compile, aten otherwise."""
    return ("reduce" if compiled else "aten") if mode == "auto" else mode


def convert(model: nn.Module, mode: str) -> int:
    """Switch every qualifying max-pool of model to `mode` (aten or reduce; resolve auto first),
    in place, both ways; how many pools qualify (0 when aten)."""
    if mode not in ("aten", "reduce"):
        raise ValueError(f"convert: mode {mode!r}: resolve auto first")
    n = 0
    for m in model.modules():
        if qualifies(m):
            if isinstance(m, nn.MaxPool2d):
                m.__class__ = ReduceMaxPool2d if mode == "reduce" else nn.MaxPool2d
            else:
                m.__class__ = ReduceAdaptiveMaxPool2d if mode == "reduce" else nn.AdaptiveMaxPool2d
            n += mode == "reduce"
    return n
