"""The Triton kernel of flat_sgd.py: SGD (momentum, Nesterov, weight decay) over one flat buffer.

Why a kernel of its own: torch's fused SGD is a multi-tensor kernel that gives each block one
65,536-value chunk of one tensor, so a model of 150k parameters in 10 tensors updates in about 10
blocks, each walking its chunk serially: many times what reading and writing alexnet-small's 3 MB
takes (docs/performance.md, "Behind the code"). Over the flat buffers the update is elementwise
over every value at once: one program per BLOCK values, as many programs as the buffer needs.

Same arithmetic as torch's SGD (fp32, in this order): g += weight_decay * p;
m = momentum * m + (1 - dampening) * g; g = g + momentum * m (Nesterov) or m; p -= lr * g.
A non-zero skip flag (the fast step's found_inf) masks every load and store: no update, and
no NaN can leak in through a multiplication by zero.

Imported only where flat_sgd.bind chose the kernel (CUDA with Triton installed); tests run it
in Triton's interpreter on the CPU (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512
NUM_WARPS = 4
"""The launch's shape: 4 values a thread. Over ResNet-34's 21M parameters it runs at the copy
bandwidth's floor, where 8 values a thread (BLOCK 1024, before) and larger blocks were slower
(docs/performance.md, "Behind the code")."""


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, rounded to nearest even as torch's cast rounds (c10's round_to_nearest_even;
    NaN to a quiet NaN), in integer arithmetic: what tl's own cast gives on a GPU, for Triton's
    interpreter, whose cast truncates. On the GPU the kernel uses the hardware's conversion."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).to(tl.uint16)
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _sgd_kernel(p_ptr, g_ptr, m_ptr, src_ptr, copy_ptr, lr_ptr, skip_ptr, starts_ptr, ends_ptr, N, momentum,
                dampening, weight_decay, HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr, HAS_WD: tl.constexpr,
                HAS_SRC: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_COPY: tl.constexpr, COPY_RNE_INT: tl.constexpr,
                BLOCK: tl.constexpr):
    if HAS_TABLE:  # program i updates [starts[i], ends[i]) of the buffers (at most BLOCK values)
        start = tl.load(starts_ptr + tl.program_id(0))
        offs = start + tl.arange(0, BLOCK)
        inside = offs < tl.load(ends_ptr + tl.program_id(0))
    else:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < N
    ok = inside & (tl.load(skip_ptr + offs * 0) == 0.0)  # the flag, read as a vector (one cached word)
    p = tl.load(p_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_SRC:  # the gradient from src (e.g. bf16, as a convolution made it), kept in g as well
        g = tl.load(src_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=inside)
    else:
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_WD:
        g = g + weight_decay * p
    if HAS_MOM:
        m = tl.load(m_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        m = momentum * m + (1.0 - dampening) * g
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=ok)
        if NESTEROV:
            g = g + momentum * m
        else:
            g = m
    lr = tl.load(lr_ptr).to(tl.float32)
    new = (p - lr * g).to(p_ptr.dtype.element_ty)
    tl.store(p_ptr + offs, new, mask=ok)
    if HAS_COPY:  # the forward's low-precision copy of the new weights
        if COPY_RNE_INT:
            tl.store(copy_ptr + offs, _bf16_rne(new), mask=ok)
        else:  # a GPU's conversion: round to nearest even, as torch's cast on the GPU
            tl.store(copy_ptr + offs, new.to(copy_ptr.dtype.element_ty), mask=ok)


def sgd_(params: torch.Tensor, grads: torch.Tensor, momentum_buf, lr: torch.Tensor, skip: torch.Tensor, *,
         momentum: float, dampening: float, weight_decay: float, nesterov: bool, src=None, table=None,
         copy=None) -> None:
    """params <- one SGD step, in place, unless skip (a 0-dim float tensor) is non-zero.
    params, grads and momentum_buf (None without momentum): contiguous, one length; lr: a
    0-dim tensor on the same device. src: the gradient, read from here (any float dtype, laid
    out as params in memory) and written into grads as it is used (even when skipped: grads then
    holds what the backward made, as without src). table: (starts, ends), int64 tensors on the
    device: update only these ranges of the buffers, one program each (`block_table`). copy: a
    buffer laid out as params (e.g. bf16) that gets each new weight cast to its dtype as it is
    stored (not where skipped): the forward's weights, cast by the update."""
    n = params.numel()
    mom = momentum_buf if momentum_buf is not None else params  # never read without momentum
    if table is None:
        grid, starts, ends = (triton.cdiv(n, BLOCK),), params, params  # starts, ends never read
    else:
        starts, ends = table
        grid = (starts.numel(),)
    _sgd_kernel[grid](params, grads, mom, src if src is not None else grads, copy if copy is not None else params,
                      lr, skip, starts, ends, n, momentum, dampening, weight_decay, HAS_MOM=momentum_buf is not None,
                      NESTEROV=nesterov, HAS_WD=weight_decay != 0, HAS_SRC=src is not None,
                      HAS_TABLE=table is not None, HAS_COPY=copy is not None,
                      COPY_RNE_INT=copy is not None and copy.dtype == torch.bfloat16 and not params.is_cuda,
                      BLOCK=BLOCK, num_warps=NUM_WARPS)


def block_table(ranges, device) -> tuple:
    """(starts, ends) of BLOCK-long pieces covering the given [start, end) ranges: `sgd_`'s table."""
    starts, ends = [], []
    for a, b in ranges:
        for s in range(a, b, BLOCK):
            starts.append(s)
            ends.append(min(s + BLOCK, b))
    return (torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(ends, dtype=torch.int64, device=device))
