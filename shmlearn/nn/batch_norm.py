"""Training-mode BatchNorm whose batch statistics are one kernel (--batch-norm aten|triton|auto).

Why: under torch.compile, Inductor lowers a training-mode BatchNorm to a chain of kernels on
the step's critical path: partial Welford sums over chunks of rows, their combination (for
large maps a second partial pass), a kernel that finishes the statistics and copies the
running statistics, then the normalize (with the ReLU and the residual add fused into it). At
batch 128 on 32x32 images the maps of ResNet's later stages are small (16x16 to 4x4: 1-8 MB),
and each of those kernels is a launch of 1.5-6 us that mostly waits: in ResNet-34's replayed
step on an H100 the forward's 36 BatchNorms took 628 us of its 1580, against about 250 us
to read and write their activations at the copy bandwidth (benchmarks/results/memset-h100/,
`timeline-34m`).

Here the statistics are one kernel (_batch_norm_triton.py: every program reduces a chunk of
rows, the last one to finish combines the chunks in order and updates the running
statistics), and the normalize and the backward are torch arithmetic in an autograd Function
(`_BatchNorm`), which Dynamo inlines so that Inductor fuses them as before: the normalize with
the ReLU or residual add after it, the backward (BatchNorm's usual formula) into one reduction
and one pointwise kernel with the ReLU's mask. Only BatchNorms over at most MAX_ROWS rows take
the kernel; above that Inductor's own kernels already run at the copy bandwidth.

Same results as torch's BatchNorm to fp32 rounding: mean, biased variance for the normalize,
unbiased for the running variance, the running statistics' momentum update, num_batches_tracked.
What stays torch's own: eval mode, momentum=None (a cumulative average), modules without
running statistics, inputs that are not channels_last 4-D or N x C 2-D (BatchNorm1d over
sequences), one value per channel (torch refuses it) and more than MAX_ROWS rows. `convert`
switches the classes of nn.BatchNorm1d/2d modules in place, both ways (parameters, buffers and
state_dict unchanged).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch
from torch import nn

from shmlearn.nn._lazy import OnFirstUse

MODES = ("aten", "triton", "auto")
"""--batch-norm: torch's BatchNorm; the statistics as one Triton kernel; auto: triton where the
step is compiled on CUDA (Inductor fuses the normalize that follows), else aten."""

MAX_ROWS = 65536
"""The kernel takes BatchNorms over at most this many rows (batch x height x width); larger ones
stay torch's, which Inductor lowers to kernels that already run at the copy bandwidth (ResNet's
first stage at batch 128: 131,072 rows of 64 channels, 16.8 MB, read in 8 us). Below it
Inductor's chain is launch-bound, which is what the one kernel saves."""

_COUNTER_PAGE = 4096
_pages: List[torch.Tensor] = []
_next = [0]
"""The kernels' tickets: int32 zeros that each launch leaves zero, in pages that are never freed
(CUDA graphs keep their addresses). Every converted module owns a slice of a page."""


def usable(device: torch.device) -> Optional[str]:
    """None if --batch-norm triton can run on this device, else why not (one line)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"--batch-norm triton needs a CUDA device (this run is on {device.type}); use aten or auto"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "--batch-norm triton needs Triton, which is not installed"
    return None


def resolve(mode: str, compiled: bool, device: torch.device) -> str:
    """The mode that runs: auto is triton when the step is compiled on CUDA with Triton, else aten."""
    if mode != "auto":
        return mode
    return "triton" if compiled and device.type == "cuda" and usable(device) is None else "aten"


def _slot(channels: int, device: torch.device) -> Tuple[int, int]:
    """(page, offset) of `channels` tickets' worth of counters on `device` (one per channel block)."""
    from shmlearn.nn._batch_norm_triton import block_c
    need = -(-channels // block_c(channels))
    for i, page in enumerate(_pages):
        if page.device == device and getattr(page, "_used", 0) + need <= _COUNTER_PAGE:
            off = page._used
            page._used += need
            return i, off
    page = torch.zeros(_COUNTER_PAGE, dtype=torch.int32, device=device)
    page._used = need
    _pages.append(page)
    return len(_pages) - 1, 0


def _define_ops():
    @torch.library.custom_op("shmlearn::batch_norm_stats", mutates_args=("running_mean", "running_var"))
    def batch_stats(x: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                    page: int, offset: int, momentum: float, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """(mean, invstd) fp32 per channel of a training batch (channels_last 4-D or N x C), the
        running statistics updated in place (when given)."""
        from shmlearn.nn import _batch_norm_triton as kernels
        c = x.shape[1]
        x2d = (x.permute(0, 2, 3, 1) if x.dim() == 4 else x).contiguous().view(-1, c)  # views when channels_last
        return kernels.stats(x2d, _pages[page][offset:], running_mean, running_var, momentum, eps)

    @batch_stats.register_fake
    def _(x, running_mean, running_var, page, offset, momentum, eps):
        c = x.shape[1]
        return x.new_empty(c, dtype=torch.float32), x.new_empty(c, dtype=torch.float32)

    return batch_stats


_ops = OnFirstUse(_define_ops)


def _channel_shape(x: torch.Tensor) -> List[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _BatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm: the statistics by the kernel, the normalize and the backward in
    torch arithmetic, which Dynamo inlines into the step's graphs for Inductor to fuse (the
    normalize with the ReLU or residual add after it; the backward's two reductions with the
    ReLU's mask before it). The backward is BatchNorm's usual one (as aten's decomposition):
    db = sum dy, dw = sum dy xhat, dx = w invstd (dy - db / N - xhat dw / N). A custom op that
    mutates (the running statistics) cannot carry an autograd formula itself, hence a Function."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, page: int, offset: int, momentum: float,
                eps: float):
        mean, invstd = _ops()(x, running_mean, running_var, page, offset, momentum, eps)
        shape = _channel_shape(x)
        scale = invstd if weight is None else invstd * weight.float()
        y = (x.float() - mean.view(shape)) * scale.view(shape)
        if bias is not None:
            y = y + bias.float().view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        shape = _channel_shape(x)
        dims = [0] + list(range(2, x.dim()))
        n = x.numel() // x.shape[1]
        xhat = (x.float() - mean.view(shape)) * invstd.view(shape)
        g = dy.float()
        db = g.sum(dims)
        dw = (g * xhat).sum(dims)
        scale = invstd if weight is None else invstd * weight.float()
        dx = (g - (db / n).view(shape) - xhat * (dw / n).view(shape)) * scale.view(shape)
        return (dx.to(x.dtype), None if weight is None else dw.to(weight.dtype),
                None if ctx.bias_dtype is None else db.to(ctx.bias_dtype),
                None, None, None, None, None, None)


def batch_norm(x: torch.Tensor, m: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
    """m(x) in training mode, the statistics by the kernel (the caller checked `_fits`)."""
    m.num_batches_tracked.add_(1)
    page, offset = m._stats_slot
    return _BatchNorm.apply(x, m.weight, m.bias, m.running_mean, m.running_var, page, offset, float(m.momentum),
                            float(m.eps))


def _fits(m: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> bool:
    """Whether this call is one the kernel computes (else torch's BatchNorm runs)."""
    if not (m.training and m.track_running_stats and m.momentum is not None and m.running_mean is not None):
        return False
    if _pages[m._stats_slot[0]].device != x.device:  # moved since convert: torch's, until converted again
        return False
    if x.dim() == 4:
        laid = x.is_contiguous(memory_format=torch.channels_last)
    else:
        laid = x.dim() == 2 and x.is_contiguous()
    rows = x.numel() // max(x.shape[1], 1)
    return laid and 1 < rows <= MAX_ROWS and x.is_floating_point() and x.shape[1] > 0


class StatsBatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d whose training-mode statistics are one kernel (module docstring)."""

    def forward(self, x):
        return batch_norm(x, self) if _fits(self, x) else super().forward(x)


class StatsBatchNorm1d(nn.BatchNorm1d):
    """nn.BatchNorm1d over N x C inputs, as StatsBatchNorm2d."""

    def forward(self, x):
        return batch_norm(x, self) if _fits(self, x) else super().forward(x)


_CLASSES = {nn.BatchNorm2d: StatsBatchNorm2d, nn.BatchNorm1d: StatsBatchNorm1d}
_BACK = {v: k for k, v in _CLASSES.items()}


def convert(model: nn.Module, mode: str) -> int:
    """Switch every nn.BatchNorm1d/2d of model to `mode` (aten or triton; resolve auto first), in
    place, both ways; how many run their statistics as one kernel."""
    if mode not in ("aten", "triton"):
        raise ValueError(f"convert: mode {mode!r}: resolve auto first")
    n = 0
    for m in model.modules():
        base = _BACK.get(type(m), type(m))
        if base not in _CLASSES:
            continue
        if mode == "triton":
            device = m.running_mean.device if m.running_mean is not None else torch.device("cpu")
            if getattr(m, "_stats_slot", None) is None or _pages[m._stats_slot[0]].device != device:
                m._stats_slot = _slot(m.num_features, device)
            m.__class__ = _CLASSES[base]
            n += 1
        else:
            m.__class__ = base
    if n:
        _ops()  # defined now, not first while Dynamo traces a forward (a graph break)
    return n
