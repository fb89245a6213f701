"""The Triton kernel of batch_norm.py: a batch's per-channel mean and 1/std in ONE launch.

Layout: x as rows of C channels (a channels_last N x C x H x W tensor is N*H*W rows; an N x C
one is N rows). The grid is (chunks of rows) x (blocks of channels). Each program reduces its
chunk to (mean, M2) per channel with the shifted-data formula (sums of x - s and (x - s)^2,
s = the chunk's first row: no cancellation when the values sit far from zero), writes them to a
partials buffer and takes a ticket from its channel block's counter. The program that takes
the last ticket combines every chunk's partials in chunk order (Chan et al.'s pairwise update
as one sum: M2 = sum M2_i + sum n_i (mean_i - mean)^2), so the result does not depend on which
program finished last; it writes mean and 1/sqrt(var + eps), updates the running statistics
(momentum, unbiased variance) and puts the counter back to zero for the next launch. No
program waits on another, so nothing needs the grid to be resident at once, and Triton's
interpreter (which runs programs one after the other) computes the same thing.

Inductor's own lowering of training-mode BatchNorm makes two or three kernels of this (partial
Welford sums, their combination, the running-statistics copy), each a launch on the step's
critical path: see batch_norm.py for what that costs and what this one saves.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
"""Rows a program loads at once (x BLOCK_C channels: 4096 values, 32 per thread of 4 warps)."""
PROGRAMS_PER_SM = 2
"""Programs aimed for per SM over all channel blocks: each has BLOCK_M x BLOCK_C loads in flight,
and the last one's combination reads every chunk's partials, so not many more chunks than that."""
BLOCK_P = 128
"""Chunks the last program combines per load (a chunk count up to this: one pass)."""
_SMS = {}


@triton.jit
def _stats_kernel(x_ptr, part_ptr, count_ptr, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, M, C, rows_per_chunk,
                  num_chunks, eps, momentum, UPDATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    start = pid_m * rows_per_chunk
    shift = tl.load(x_ptr + start.to(tl.int64) * C + cols, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, rows_per_chunk, BLOCK_M):  # sums across rows at the end: one reduction per chunk
        rows = start + r0 + tl.arange(0, BLOCK_M)
        m = (rows < M)[:, None] & cmask[None, :]
        v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        d = tl.where(m, v - shift[None, :], 0.0)
        s1 += d
        s2 += d * d
    t1 = tl.sum(s1, axis=0)
    t2 = tl.sum(s2, axis=0)
    n = tl.minimum(rows_per_chunk, M - start) * 1.0
    mean_i = shift + t1 / n
    m2_i = tl.maximum(t2 - t1 * t1 / n, 0.0)
    # partials: [2, num_chunks, C] (mean, M2); every chunk but the last has rows_per_chunk rows
    tl.store(part_ptr + pid_m * C + cols, mean_i, mask=cmask)
    tl.store(part_ptr + (num_chunks + pid_m) * C + cols, m2_i, mask=cmask)
    tl.debug_barrier()  # every thread's partials are written before the ticket (release, GPU scope)
    ticket = tl.atomic_add(count_ptr + pid_c, 1, sem="acq_rel", scope="gpu")
    if ticket == num_chunks - 1:
        # One pass over the chunks, in chunk order, in float64: sum n_i mean_i and
        # sum (M2_i + n_i mean_i^2); then M2 = that - N mean^2 (float64 keeps the difference exact
        # enough for means far from zero).
        full = rows_per_chunk * 1.0
        last_n = (M - (num_chunks - 1) * rows_per_chunk) * 1.0
        acc_s = tl.zeros([BLOCK_C], dtype=tl.float64)
        acc_q = tl.zeros([BLOCK_C], dtype=tl.float64)
        for p0 in range(0, num_chunks, BLOCK_P):
            ps = p0 + tl.arange(0, BLOCK_P)
            pm = (ps < num_chunks)[:, None] & cmask[None, :]
            mi = tl.load(part_ptr + ps[:, None] * C + cols[None, :], mask=pm, other=0.0,
                         cache_modifier=".cg").to(tl.float64)
            qi = tl.load(part_ptr + (num_chunks + ps[:, None]) * C + cols[None, :], mask=pm, other=0.0,
                         cache_modifier=".cg").to(tl.float64)
            ni = tl.where(ps == num_chunks - 1, last_n, full).to(tl.float64)[:, None]
            acc_s += tl.sum(tl.where(pm, ni * mi, 0.0), axis=0)
            acc_q += tl.sum(tl.where(pm, qi + ni * mi * mi, 0.0), axis=0)
        total = M * 1.0
        mean64 = acc_s / total
        m2 = tl.maximum(acc_q - total * mean64 * mean64, 0.0).to(tl.float32)
        mean = mean64.to(tl.float32)
        var = m2 / total
        tl.store(mean_ptr + cols, mean, mask=cmask)
        tl.store(invstd_ptr + cols, 1.0 / tl.sqrt(var + eps), mask=cmask)
        if UPDATE:
            unbiased = m2 / tl.maximum(total - 1.0, 1.0)
            rm = tl.load(rmean_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            rv = tl.load(rvar_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            tl.store(rmean_ptr + cols, (rm + momentum * (mean - rm)).to(rmean_ptr.dtype.element_ty), mask=cmask)
            tl.store(rvar_ptr + cols, (rv + momentum * (unbiased - rv)).to(rvar_ptr.dtype.element_ty), mask=cmask)
        tl.atomic_xchg(count_ptr + pid_c, 0, sem="relaxed", scope="gpu")


def block_c(C: int) -> int:
    """Channels per program: a row segment of at least 64 bytes where C allows (bf16: 32+)."""
    return min(64, triton.next_power_of_2(max(C, 1)))


def plan(M: int, C: int, device: torch.device):
    """(rows_per_chunk, num_chunks, channel blocks) for M rows of C channels on `device`."""
    bc = block_c(C)
    cblocks = triton.cdiv(C, bc)
    if device.type == "cuda":
        if device not in _SMS:
            _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
        sms = _SMS[device]
    else:  # the interpreter: a few chunks, enough to test the combination
        sms = 2
    want = max(1, min(BLOCK_P, PROGRAMS_PER_SM * sms // cblocks))
    chunks = max(1, min(want, triton.cdiv(M, BLOCK_M)))
    rows = triton.cdiv(triton.cdiv(M, chunks), BLOCK_M) * BLOCK_M
    return rows, triton.cdiv(M, rows), cblocks


def stats(x2d: torch.Tensor, counter: torch.Tensor, running_mean, running_var, momentum: float, eps: float):
    """(mean, invstd), fp32 [C], of x2d's M x C rows (contiguous), in one launch; the running
    statistics updated in place when given. counter: int32, at least C / block_c(C) zeros (the
    kernel leaves them zero)."""
    M, C = x2d.shape
    rows, chunks, cblocks = plan(M, C, x2d.device)
    part = torch.empty(2 * chunks * C, device=x2d.device, dtype=torch.float32)
    mean = torch.empty(C, device=x2d.device, dtype=torch.float32)
    invstd = torch.empty_like(mean)
    update = running_mean is not None
    _stats_kernel[(chunks, cblocks)](
        x2d, part, counter, mean, invstd, running_mean if update else mean, running_var if update else mean, M, C,
        rows, chunks, eps, momentum, UPDATE=update, BLOCK_M=BLOCK_M, BLOCK_C=block_c(C),
        BLOCK_P=min(BLOCK_P, triton.next_power_of_2(chunks)), num_warps=4)
    return mean, invstd
