"""Triton kernels for a classifier head of 2 or 3 Linear layers with ReLU between them
(mlp_head.py), forward and backward, in fp16 or bf16 with fp32 accumulation.

Layers: x [B, K] -> relu(x W1^T + b1) = h1 [B, N1] -> (relu(h1 W2^T + b2) = h2 [B, N2] ->)
h_last W_L^T + b_L = out [B, N_L]. Widths N1..N3 <= 128: a program holds a whole row block's
activations, padded to powers of two P1..P3 (masked loads read zeros there, so padding adds
nothing). Each layer's pre-activation is rounded to the input dtype before ReLU, as autocast's
Linear stores it.

Forward, one program per BLOCK_M rows: h1 over chunks of K, then the small layers in registers;
writes out and the hidden activations (the backward's inputs).
Backward, two kernels:
  rows (one program per BLOCK_M rows): dh_(L-1) = (g W_L) * [h > 0], ..., dh1; writes dh1 and
  per-program fp32 partials of the small layers' weight and bias gradients (dW3, db3, dW2, db2, db1);
  columns (one program per BLOCK_K columns of K, plus one per partial segment): dW1[:, cols] =
  dh1^T x[:, cols] and dx[:, cols] = dh1 W1[:, cols] over every row block; the segment programs sum
  the partials in a fixed order (deterministic: no atomics) into the small gradients.

Imported only for CUDA tensors with Triton installed; tests run the same kernels in Triton's
interpreter on the CPU (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from shmlearn.nn import fit
SEGMENTS = 5
"""Partial segments of the rows kernel, in order: dW3, db3, dW2, db2, db1 (for 2 layers: dW2, db2
of the last layer in the first two, then unused, unused, db1)."""


@triton.jit
def _relu_rounded(acc, DT: tl.constexpr):
    """relu of acc rounded to DT, as autocast's Linear output then ReLU (NaN stays NaN)."""
    h = acc.to(DT).to(tl.float32)
    return tl.where(h < 0.0, 0.0, h).to(DT)


@triton.jit
def _load_w(w_ptr, r, c, R, C, ld):
    """W[r, c] of a row-major [R, ld] weight as a tile indexed [r, c] (zeros outside R x C)."""
    return tl.load(w_ptr + r[:, None] * ld + c[None, :], mask=(r < R)[:, None] & (c < C)[None, :], other=0.0)


@triton.jit
def _load_wt(w_ptr, k, n, K, N, ld):
    """W[n, k]^T as a tile indexed [k, n] (W row-major [N, ld])."""
    return tl.load(w_ptr + n[None, :] * ld + k[:, None], mask=(n < N)[None, :] & (k < K)[:, None], other=0.0)


@triton.jit
def _head_forward_kernel(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr, b3_ptr, out_ptr, h1_ptr, h2_ptr, B, K,
                         N1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                         P3: tl.constexpr, NL: tl.constexpr, HB1: tl.constexpr, HB2: tl.constexpr,
                         HB3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    DT = x_ptr.dtype.element_ty
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < B
    n1 = tl.arange(0, P1)
    n2 = tl.arange(0, P2)
    acc = tl.zeros((BLOCK_M, P1), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(a, _load_wt(w1_ptr, k, n1, K, N1, K), acc)
    if HB1:
        acc += tl.load(b1_ptr + n1, mask=n1 < N1, other=0.0).to(tl.float32)[None, :]
    h1 = _relu_rounded(acc, DT)
    tl.store(h1_ptr + m.to(tl.int64)[:, None] * N1 + n1[None, :], h1, mask=m_ok[:, None] & (n1 < N1)[None, :])
    acc2 = tl.dot(h1, _load_wt(w2_ptr, n1, n2, N1, N2, N1))
    if HB2:
        acc2 += tl.load(b2_ptr + n2, mask=n2 < N2, other=0.0).to(tl.float32)[None, :]
    if NL == 2:
        tl.store(out_ptr + m.to(tl.int64)[:, None] * N2 + n2[None, :], acc2.to(DT),
                 mask=m_ok[:, None] & (n2 < N2)[None, :])
    else:
        h2 = _relu_rounded(acc2, DT)
        tl.store(h2_ptr + m.to(tl.int64)[:, None] * N2 + n2[None, :], h2, mask=m_ok[:, None] & (n2 < N2)[None, :])
        n3 = tl.arange(0, P3)
        acc3 = tl.dot(h2, _load_wt(w3_ptr, n2, n3, N2, N3, N2))
        if HB3:
            acc3 += tl.load(b3_ptr + n3, mask=n3 < N3, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m.to(tl.int64)[:, None] * N3 + n3[None, :], acc3.to(DT),
                 mask=m_ok[:, None] & (n3 < N3)[None, :])


@triton.jit
def _head_backward_rows_kernel(g_ptr, h1_ptr, h2_ptr, w2_ptr, w3_ptr, dh1_ptr, part_ptr, B,
                               N1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr, P1: tl.constexpr,
                               P2: tl.constexpr, P3: tl.constexpr, NL: tl.constexpr, BLOCK_M: tl.constexpr):
    DT = g_ptr.dtype.element_ty
    pid = tl.program_id(0)
    m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < B
    mm = m.to(tl.int64)[:, None]
    n1 = tl.arange(0, P1)
    n2 = tl.arange(0, P2)
    # the partials' row of this program: [dW3 P3*P2 | db3 P3 | dW2 P2*P1 | db2 P2 | db1 P1]
    row = part_ptr + pid.to(tl.int64) * (P3 * P2 + P3 + P2 * P1 + P2 + P1)
    h1 = tl.load(h1_ptr + mm * N1 + n1[None, :], mask=m_ok[:, None] & (n1 < N1)[None, :], other=0.0)
    if NL == 3:
        n3 = tl.arange(0, P3)
        g3 = tl.load(g_ptr + mm * N3 + n3[None, :], mask=m_ok[:, None] & (n3 < N3)[None, :], other=0.0)
        h2 = tl.load(h2_ptr + mm * N2 + n2[None, :], mask=m_ok[:, None] & (n2 < N2)[None, :], other=0.0)
        dw3 = tl.dot(tl.trans(g3), h2)  # [P3, P2]
        tl.store(row + n3[:, None] * P2 + n2[None, :], dw3)
        tl.store(row + P3 * P2 + n3, tl.sum(g3.to(tl.float32), axis=0))
        d = tl.dot(g3, _load_w(w3_ptr, n3, n2, N3, N2, N2))  # [BLOCK_M, P2]
        g2 = tl.where(h2 > 0, d.to(DT), 0.0).to(DT)
    else:
        g2 = tl.load(g_ptr + mm * N2 + n2[None, :], mask=m_ok[:, None] & (n2 < N2)[None, :], other=0.0)
    seg = P3 * P2 + P3
    dw2 = tl.dot(tl.trans(g2), h1)  # [P2, P1]
    tl.store(row + seg + n2[:, None] * P1 + n1[None, :], dw2)
    tl.store(row + seg + P2 * P1 + n2, tl.sum(g2.to(tl.float32), axis=0))
    d1 = tl.dot(g2, _load_w(w2_ptr, n2, n1, N2, N1, N1))  # [BLOCK_M, P1]
    dh1 = tl.where(h1 > 0, d1.to(DT), 0.0).to(DT)
    tl.store(row + seg + P2 * P1 + P2 + n1, tl.sum(dh1.to(tl.float32), axis=0))
    tl.store(dh1_ptr + mm * N1 + n1[None, :], dh1, mask=m_ok[:, None] & (n1 < N1)[None, :])


@triton.jit
def _sum_segment(part_ptr, out_ptr, PARTS, STRIDE, OFF: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                 RN, CN):
    """out[:RN, :CN] <- the sum over PARTS rows of part[:, OFF:OFF + R*C] seen as [R, C]."""
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    acc = tl.zeros((R, C), tl.float32)
    for p in range(0, PARTS):
        acc += tl.load(part_ptr + p * STRIDE + OFF + r[:, None] * C + c[None, :])
    tl.store(out_ptr + r[:, None] * CN + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(r < RN)[:, None] & (c < CN)[None, :])


@triton.jit
def _head_backward_cols_kernel(x_ptr, w1_ptr, dh1_ptr, dx_ptr, dw1_ptr, part_ptr, dw3_ptr, db3_ptr, dw2_ptr,
                               db2_ptr, db1_ptr, B, K, PARTS, CHUNKS,
                               N1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr, P1: tl.constexpr,
                               P2: tl.constexpr, P3: tl.constexpr, NL: tl.constexpr, NEED_DX: tl.constexpr,
                               HB1: tl.constexpr, HB2: tl.constexpr, HB3: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n1 = tl.arange(0, P1)
    if pid < CHUNKS:  # dW1[:, cols] and dx[:, cols] over every row block
        k = pid * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w1 = _load_w(w1_ptr, n1, k, N1, K, K)  # [P1, BLOCK_K]
        acc = tl.zeros((P1, BLOCK_K), tl.float32)
        for m0 in range(0, B, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            m_ok = m < B
            mm = m.to(tl.int64)[:, None]
            dh1 = tl.load(dh1_ptr + mm * N1 + n1[None, :], mask=m_ok[:, None] & (n1 < N1)[None, :], other=0.0)
            x = tl.load(x_ptr + mm * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(tl.trans(dh1), x, acc)
            if NEED_DX:
                dx = tl.dot(dh1, w1)
                tl.store(dx_ptr + mm * K + k[None, :], dx.to(dx_ptr.dtype.element_ty),
                         mask=m_ok[:, None] & k_ok[None, :])
        tl.store(dw1_ptr + n1[:, None] * K + k[None, :], acc.to(dw1_ptr.dtype.element_ty),
                 mask=(n1 < N1)[:, None] & k_ok[None, :])
    else:  # one partial segment each (SEGMENTS)
        stride = P3 * P2 + P3 + P2 * P1 + P2 + P1
        seg = pid - CHUNKS
        if NL == 3:
            if seg == 0:
                _sum_segment(part_ptr, dw3_ptr, PARTS, stride, 0, P3, P2, N3, N2)
            if HB3:
                if seg == 1:
                    _sum_segment(part_ptr, db3_ptr, PARTS, stride, P3 * P2, 1, P3, 1, N3)
        if seg == 2:
            _sum_segment(part_ptr, dw2_ptr, PARTS, stride, P3 * P2 + P3, P2, P1, N2, N1)
        if HB2:
            if seg == 3:
                _sum_segment(part_ptr, db2_ptr, PARTS, stride, P3 * P2 + P3 + P2 * P1, 1, P2, 1, N2)
        if HB1:
            if seg == 4:
                _sum_segment(part_ptr, db1_ptr, PARTS, stride, P3 * P2 + P3 + P2 * P1 + P2, 1, P1, 1, N1)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _geometry(weights):
    ns = [w.shape[0] for w in weights]
    ps = [_pow2(n) for n in ns]
    nl = len(weights)
    if nl == 2:  # layer 3 absent: its sizes are the smallest tiles, never read or written
        ns, ps = ns + [1], ps + [16]
    wide = max(ps[0] * ps[1], ps[1] * ps[2])
    return dict(N1=ns[0], N2=ns[1], N3=ns[2], P1=ps[0], P2=ps[1], P3=ps[2], NL=nl), (8 if wide > 4096 else 4)


def forward(x: torch.Tensor, weights, biases):
    """(out [B, N_L], h1 [B, N1], h2 [B, N2] or empty) in x's dtype; x [B, K] contiguous, weights
    [N_i, N_(i-1)] contiguous, biases [N_i] or None, all x's dtype."""
    b, k = x.shape
    geo, warps = _geometry(weights)
    nl = geo["NL"]
    out = x.new_empty(b, weights[-1].shape[0])
    h1 = x.new_empty(b, geo["N1"])
    h2 = x.new_empty(b, geo["N2"]) if nl == 3 else x.new_empty(0)
    w = list(weights) + [weights[-1]] * (3 - nl)
    bs = [t if t is not None else w[0] for t in list(biases) + [None] * (3 - nl)]
    flags = {f"HB{i + 1}": (i < nl and biases[i] is not None) for i in range(3)}
    block_m = 16
    _head_forward_kernel[(triton.cdiv(b, block_m),)](x, w[0], bs[0], w[1], bs[1], w[2], bs[2], out, h1,
                                                       h2 if nl == 3 else h1, b, k, **geo, **flags, BLOCK_M=block_m,
                                                       BLOCK_K=64, num_warps=warps)
    return out, h1, h2


def backward(grad: torch.Tensor, x: torch.Tensor, h1: torch.Tensor, h2: torch.Tensor, weights, has_bias,
             need_dx: bool):
    """(dx or None, [dW_i], [db_i or None]) in x's dtype, from the output's gradient [B, N_L] and
    `forward`'s saved x, h1, h2."""
    b, k = x.shape
    geo, warps = _geometry(weights)
    nl = geo["NL"]
    w = list(weights) + [weights[-1]] * (3 - nl)
    block_m = 16
    parts = triton.cdiv(b, block_m)
    stride = geo["P3"] * geo["P2"] + geo["P3"] + geo["P2"] * geo["P1"] + geo["P2"] + geo["P1"]
    part = torch.empty(parts, stride, device=x.device, dtype=torch.float32)
    dh1 = x.new_empty(b, geo["N1"])
    _head_backward_rows_kernel[(parts,)](grad, h1, h2 if nl == 3 else h1, w[1], w[2], dh1, part, b, **geo,
                                         BLOCK_M=block_m, num_warps=warps)
    dx = torch.empty_like(x) if need_dx else None
    dws = [torch.empty_like(t) for t in weights]
    dbs = [x.new_empty(t.shape[0]) if hb else None for t, hb in zip(weights, has_bias)]
    # layer order in the kernel: dW3/db3 are the last layer's when there are 3, dW2/db2 the second's
    d3w, d3b = (dws[2], dbs[2]) if nl == 3 else (dws[1], dbs[1])
    flags = {f"HB{i + 1}": (i < nl and has_bias[i]) for i in range(3)}
    spare = dws[0]
    block_k = 64
    chunks = triton.cdiv(k, block_k)
    _head_backward_cols_kernel[(chunks + SEGMENTS,)](
        x, w[0], dh1, dx if dx is not None else x, dws[0], part, d3w, d3b if d3b is not None else spare,
        dws[1], dbs[1] if dbs[1] is not None else spare, dbs[0] if dbs[0] is not None else spare,
        b, k, parts, chunks, **geo, NEED_DX=need_dx, **flags, BLOCK_M=64 if not _interpreted() else 32,
        BLOCK_K=block_k, num_warps=4)
    return dx, dws, dbs


def head_why_not(widths, has_bias, dtype: torch.dtype, lim) -> Optional[str]:
    """None if the three kernels of a head with these out_features (2 or 3 layers) and bias flags
    compile and fit on a device with limits lim (fit.py) for inputs of dtype, else why not."""
    geo, warps = _geometry([torch.empty(n, 0) for n in widths])
    nl = geo["NL"]
    flags = {f"HB{i + 1}": (i < nl and bool(has_bias[i])) for i in range(3)}
    names = {"forward": _head_forward_kernel, "backward rows": _head_backward_rows_kernel,
             "backward columns": _head_backward_cols_kernel}
    consts = {"forward": dict(geo, **flags), "backward rows": dict(geo),
              "backward columns": dict(geo, **flags, NEED_DX=True)}
    cands = {"forward": fit.Candidate.of(warps, BLOCK_M=16, BLOCK_K=64),
             "backward rows": fit.Candidate.of(warps, BLOCK_M=16),
             "backward columns": fit.Candidate.of(4, BLOCK_M=64, BLOCK_K=64)}
    for what, fn in names.items():
        ptrs = {a: (torch.float32 if a == "part_ptr" else dtype) for a in fn.arg_names if a.endswith("_ptr")}
        why = fit.why_not(fn, ptrs, consts[what], cands[what], lim)
        if why:
            return f"{what}: {why}"
    return None
