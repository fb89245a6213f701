"""Triton kernels for conv (stride 1) + bias + ReLU + 2x2 max-pool in one pass, and the weight and
bias gradients of such a block whose input needs no gradient (the image's first conv).

Why (shmlearn/nn/conv_pool.py has the measurements): run as three ops, the conv writes its full
output (67 MB for alexnet-small's first conv at batch 1024 in bf16), ReLU and the pool read it back,
the pool writes int64-free positions or indices, and the backward scatters the pooled gradient
into a full-size gradient again before the weight gradient reads it. Here the conv output lives in
registers only: each program computes its pooled pixels' four window positions, keeps the max
and where it was, and writes the pooled output and one uint8 code per value (window position
0-3, or DEAD when the max was <= 0 and ReLU let no gradient through).

Layout: NHWC (channels_last) input x[n, h, w, cin] and output y[n, hp, wp, cout]; the weight
[co, ci, ky, kx] read through its strides (no reordered copy: one kernel less per layer). The reduction runs row by row of the window: for one ky, the kx*cin inputs
under an output pixel are KW*CIN consecutive values of x (kx and ci are adjacent in NHWC), so a
row is one contiguous, coalesced load of ROW = KW*CIN values (masked at the image's left and right
edges), cut into BLOCK_K chunks for tl.dot. For a 3-channel 5x5 conv a row is 15 values: one
16-wide chunk (94% used), where the whole 75-value window padded to a power of two would be 128
(59% used).

Forward, one program per BLOCK_Q pooled pixels x all output channels:
    for each window position i: acc_i[Q, N] = sum_ky sum_chunks x_row[Q, K] @ w_row[K, N]
    y = relu(max_i acc_i + bias), code = argmax_i (first max, as max_pool2d scans) or DEAD
Weight gradient (input needs no gradient), grid (PROGRAMS, KH * CHUNKS):
    dw[ky, chunk][K, N] += x_row_i[Q, K]^T @ where(code == i, dy, 0)[Q, N]   for the 4 positions
    db[N] += sum_Q where(code < 4, dy, 0)
into fp32 per-program partials that torch sums (deterministic: no atomics).

Imported only for CUDA tensors with Triton installed; tests run the same kernels in Triton's
interpreter on the CPU (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

DEAD = 255
"""The code of a pooled value whose window max was <= 0: ReLU passed no gradient."""


@triton.jit
def _row(x_ptr, n, oy, ox, ky, kk, Q_OK, H, W, CIN: tl.constexpr, KW: tl.constexpr,
         PH: tl.constexpr, PW: tl.constexpr):
    """[len(oy), len(kk)]: the inputs of window row ky under conv pixels (oy, ox), at offsets kk
    (flat kx*CIN + ci) along the row; 0 outside the image."""
    iy = oy + ky - PH
    ix = ox[:, None] - PW + (kk // CIN)[None, :]
    ok = (Q_OK & (iy >= 0) & (iy < H))[:, None] & (kk < KW * CIN)[None, :] & (ix >= 0) & (ix < W)
    base = ((n * H + iy) * W + ox - PW) * CIN
    return tl.load(x_ptr + base[:, None] + kk[None, :], mask=ok, other=0.0)


@triton.jit
def _forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, code_ptr, Q, H, W, HP, WP, S_CO, S_CI, S_KY, S_KX,
                    CIN: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                    PH: tl.constexpr, PW: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    q = tl.program_id(0).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q < Q
    n = q // (HP * WP)  # int64 (offsets into x); pixel coordinates in int32 (the 2-D index math)
    r = (q % (HP * WP)).to(tl.int32)
    py = r // WP
    px = r % WP
    kk0 = tl.arange(0, BLOCK_K)
    co = tl.arange(0, BLOCK_N)
    best = tl.full((BLOCK_Q, BLOCK_N), float("-inf"), tl.float32)
    arg = tl.zeros((BLOCK_Q, BLOCK_N), tl.int32)
    for i in tl.static_range(4):
        oy = 2 * py + i // 2
        ox = 2 * px + i % 2
        acc = tl.zeros((BLOCK_Q, BLOCK_N), tl.float32)
        for ky in range(KH):
            for c in tl.static_range((KW * CIN + BLOCK_K - 1) // BLOCK_K):
                kk = c * BLOCK_K + kk0
                a = _row(x_ptr, n, oy, ox, ky, kk, q_ok, H, W, CIN, KW, PH, PW)
                w_at = ky * S_KY + (kk // CIN) * S_KX + (kk % CIN) * S_CI
                wt = tl.load(w_ptr + w_at[:, None] + co[None, :] * S_CO,
                             mask=(kk < KW * CIN)[:, None] & (co < N)[None, :], other=0.0)
                acc = tl.dot(a, wt, acc)
        take = acc > best  # strict: the first maximum in window order keeps it, as max_pool2d
        best = tl.where(take, acc, best)
        arg = tl.where(take, i, arg)
    if HAS_BIAS:
        best += tl.load(b_ptr + co, mask=co < N, other=0.0).to(tl.float32)[None, :]
    dead = best <= 0.0
    out_ok = q_ok[:, None] & (co < N)[None, :]
    at = q[:, None] * N + co[None, :]
    tl.store(y_ptr + at, tl.where(dead, 0.0, best).to(y_ptr.dtype.element_ty), mask=out_ok)
    tl.store(code_ptr + at, tl.where(dead, 255, arg).to(tl.uint8), mask=out_ok)


@triton.jit
def _weight_grad_kernel(x_ptr, dy_ptr, code_ptr, dw_ptr, db_ptr, Q, H, W, HP, WP, BLOCKS,
                        CIN: tl.constexpr, N: tl.constexpr, KW: tl.constexpr,
                        PH: tl.constexpr, PW: tl.constexpr, CHUNKS: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    part = tl.program_id(1)  # which (ky, chunk) of the weight this program sums
    programs = tl.num_programs(0)
    ky = part // CHUNKS
    kk = (part % CHUNKS) * BLOCK_K + tl.arange(0, BLOCK_K)
    co = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    bacc = tl.zeros((BLOCK_N,), tl.float32)
    for blk in range(pid, BLOCKS, programs):
        q = (blk * BLOCK_Q + tl.arange(0, BLOCK_Q)).to(tl.int64)
        q_ok = q < Q
        n = q // (HP * WP)
        r = (q % (HP * WP)).to(tl.int32)
        py = r // WP
        px = r % WP
        at = q[:, None] * N + co[None, :]
        ok = q_ok[:, None] & (co < N)[None, :]
        g = tl.load(dy_ptr + at, mask=ok, other=0.0)
        code = tl.load(code_ptr + at, mask=ok, other=255).to(tl.int32)
        bacc += tl.sum(tl.where(code < 4, g.to(tl.float32), 0.0), axis=0)
        for i in tl.static_range(4):
            gi = tl.where(code == i, g, 0.0).to(g.dtype)
            a = _row(x_ptr, n, 2 * py + i // 2, 2 * px + i % 2, ky, kk, q_ok, H, W, CIN, KW, PH, PW)
            acc = tl.dot(tl.trans(a), gi, acc)
    tl.store(dw_ptr + ((pid * tl.num_programs(1) + part) * BLOCK_K + tl.arange(0, BLOCK_K))[:, None] * BLOCK_N
             + co[None, :], acc)
    if part == 0:  # every program sums the bias gradient; one column of them writes it
        tl.store(db_ptr + pid * BLOCK_N + co, bacc)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_FORWARD_CONFIGS = [triton.Config({"BLOCK_Q": bq, "BLOCK_K": bk}, num_warps=nw, num_stages=ns)
                    for bq, bk, nw, ns in ((64, 16, 4, 2), (128, 16, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2),
                                           (64, 64, 4, 3), (128, 64, 8, 3), (32, 32, 2, 2), (128, 32, 4, 3))]
"""What the autotuner tries on the first call per shape (those with BLOCK_K above the row's
size, rounded up to a power of two, are left out: all masked)."""
_TUNED = {}


def _forward_tuned(row: int):
    """The autotuned forward kernel for rows of `row` values (one autotuner per BLOCK_K limit)."""
    limit = _pow2(row)
    if limit not in _TUNED:
        configs = [c for c in _FORWARD_CONFIGS if c.kwargs["BLOCK_K"] <= limit]
        _TUNED[limit] = triton.autotune(configs, key=["Q", "H", "W", "CIN", "N", "KH", "KW"])(_forward_kernel)
    return _TUNED[limit]


def _geometry(x: torch.Tensor, weight_shape, padding):
    n, h, w, cin = x.shape  # NHWC
    cout, _, kh, kw = weight_shape
    ph, pw = padding
    ho, wo = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    hp, wp = ho // 2, wo // 2
    return dict(Q=n * hp * wp, H=h, W=w, HP=hp, WP=wp, CIN=cin, N=cout, KW=kw, PH=ph, PW=pw), (n, hp, wp, cout)


def forward(x_nhwc: torch.Tensor, weight: torch.Tensor, bias, padding):
    """(y, code): y as an NCHW tensor in channels_last memory, x's dtype; code uint8, the same
    shape and memory. weight: [cout, cin, kh, kw], any strides (read through them: no copy)."""
    weight_shape = tuple(weight.shape)
    geo, (n, hp, wp, cout) = _geometry(x_nhwc, weight_shape, padding)
    y = torch.empty((n, cout, hp, wp), device=x_nhwc.device, dtype=x_nhwc.dtype, memory_format=torch.channels_last)
    code = torch.empty((n, cout, hp, wp), device=x_nhwc.device, dtype=torch.uint8, memory_format=torch.channels_last)
    s_co, s_ci, s_ky, s_kx = weight.stride()
    args = (x_nhwc, weight, bias if bias is not None else weight, y, code)
    kw = dict(geo, S_CO=s_co, S_CI=s_ci, S_KY=s_ky, S_KX=s_kx, KH=weight_shape[2], HAS_BIAS=bias is not None,
              BLOCK_N=_pow2(cout))
    if _interpreted():  # one fixed config, large tiles: the interpreter's cost is per program and op
        bk = min(64, _pow2(geo["KW"] * geo["CIN"]))
        _forward_kernel[(triton.cdiv(geo["Q"], 128),)](*args, **kw, BLOCK_Q=128, BLOCK_K=bk)
    else:
        tuned = _forward_tuned(geo["KW"] * geo["CIN"])
        tuned[lambda meta: (triton.cdiv(geo["Q"], meta["BLOCK_Q"]),)](*args, **kw)
    return y, code


def weight_grad(x_nhwc: torch.Tensor, dy_nhwc: torch.Tensor, code_nhwc: torch.Tensor, weight_shape, padding,
                programs: int = 0):
    """(dw [cout, cin, kh, kw] fp32, db [cout] fp32) from the NHWC image, the pooled output's
    gradient and the forward's codes."""
    geo, _ = _geometry(x_nhwc, weight_shape, padding)
    cout, cin, kh, kw = weight_shape
    row = kw * cin
    block_q = 128
    bk = min(32, _pow2(row))
    chunks = triton.cdiv(row, bk)
    bn = _pow2(cout)
    blocks = triton.cdiv(geo["Q"], block_q)
    if programs <= 0:
        sms = (torch.cuda.get_device_properties(x_nhwc.device).multi_processor_count
               if x_nhwc.device.type == "cuda" else 4)
        programs = max(1, min(blocks, 4 * sms // (kh * chunks)))
    dw = torch.empty(programs, kh, chunks * bk, bn, device=x_nhwc.device, dtype=torch.float32)
    db = torch.empty(programs, bn, device=x_nhwc.device, dtype=torch.float32)
    _weight_grad_kernel[(programs, kh * chunks)](x_nhwc, dy_nhwc, code_nhwc, dw, db, **geo, BLOCKS=blocks,
                                                 CHUNKS=chunks, BLOCK_Q=block_q, BLOCK_K=bk, BLOCK_N=bn,
                                                 num_warps=4)
    dw = dw.sum(0)[:, :row, :cout].reshape(kh, kw, cin, cout).permute(3, 2, 0, 1)
    return dw, db.sum(0)[:cout]
