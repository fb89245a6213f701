"""flat_sgd.py's update without Triton (the CPU): torch's fused SGD called on the flat buffers.

Why: the fast step on the CPU updated through optimizer.step(), whose Python (param groups, state
lookups, grouping tensors by device and dtype) costs several times the fused kernel it wraps, a
noticeable share of a small model's step (docs/performance.md, "Behind the code"). Here the update
is one call of the same fused kernel, torch._fused_sgd_, over one flat tensor per buffer (or its
few ranges), with the same arithmetic, the learning rate read from its tensor and the step skipped
while the skip flag is 1, as the Triton kernel does (_flat_sgd_triton.py has the same interface:
`sgd_` and `block_table`).
"""
from __future__ import annotations

import contextlib
from typing import List, Tuple

import torch


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor as the 1-D view of its memory, in memory order (channels_last included)."""
    return t if t.dim() == 1 else t.as_strided((t.numel(),), (1,))


def sgd_(params: torch.Tensor, grads: torch.Tensor, momentum_buf, lr: torch.Tensor, skip: torch.Tensor, *,
         momentum: float, dampening: float, weight_decay: float, nesterov: bool, src=None, table=None,
         copy=None) -> None:
    """_flat_sgd_triton.sgd_'s contract, on any device torch's fused SGD runs on. table: the
    [start, end) ranges of `block_table`."""
    # The weights and their copy are written as the Triton kernel writes them: without moving their
    # autograd version. The update in the backward (fast.py) steps a convolution's weight, and
    # writes its copy, once that convolution's backward is done with them, while the step's graph
    # still holds them as saved tensors; a version bump there failed the backward ("modified by an
    # inplace operation", bf16 cells of the GPU matrix, 4 H200s, 2026-11-28).
    with contextlib.ExitStack() as keep:
        for t in (params, copy):
            if t is not None:
                keep.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
        _sgd(params, grads, momentum_buf, lr, skip, momentum=momentum, dampening=dampening,
             weight_decay=weight_decay, nesterov=nesterov, src=src, table=table, copy=copy)


def _sgd(params, grads, momentum_buf, lr, skip, *, momentum, dampening, weight_decay, nesterov, src, table,
         copy) -> None:
    if src is not None:  # the gradient kept in grads, also where the step is skipped (as the kernel)
        grads.copy_(_flat(src))
    bufs = [params, grads, momentum_buf, copy]
    if table is not None:
        bufs = [None if b is None else [b[a:e] for a, e in table] for b in bufs]
    else:
        bufs = [None if b is None else [b] for b in bufs]
    p, g, m, c = bufs
    # is_first_step False: the momentum buffers start at zero, so the first step's m = 0 * m + g is
    # torch's first-step copy of g (bind refuses dampening, the one case where they would differ).
    torch._fused_sgd_(p, g, m or [], weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                      nesterov=nesterov, maximize=False, is_first_step=False, found_inf=skip)
    if c is not None:  # where skipped the weights are unchanged, so this writes their copy again
        torch._foreach_copy_(c, p)


def block_table(ranges, device) -> List[Tuple[int, int]]:
    """The ranges themselves: `sgd_` updates each as one tensor of the fused call."""
    return [(int(a), int(b)) for a, b in ranges]
