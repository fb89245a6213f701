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
import torch.nn.functional as F
import triton
import triton.language as tl

DEAD = 255
"""The code of a pooled value whose window max was <= 0: ReLU passed no gradient."""


@triton.jit
def _forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, code_ptr, Q, HP, WP, IMG, ROWS, S_CO, S_KY,
                    COLS: tl.constexpr, ROW: tl.constexpr, XROW: tl.constexpr, CIN: tl.constexpr,
                    N: tl.constexpr, KH: tl.constexpr, W_CL: tl.constexpr, S_CI: tl.constexpr, S_KX: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q < Q
    n = q // (HP * WP)
    r = q % (HP * WP)
    # the window's top-left input under pooled pixel (py, px): row 2*py, column 2*px of the prepared input
    base = n.to(tl.int64) * IMG + (2 * (r // WP)) * ROWS + (2 * (r % WP)) * COLS
    kk0 = tl.arange(0, BLOCK_K)
    co = tl.arange(0, BLOCK_N)
    ptrs = x_ptr + base[:, None] + kk0[None, :]  # every load below is these plus one scalar
    best = tl.full((BLOCK_Q, BLOCK_N), float("-inf"), tl.float32)
    arg = tl.zeros((BLOCK_Q, BLOCK_N), tl.int32)
    # Masks that vary along a row would stop vector loads: rows are loaded whole (XROW values,
    # zero-filled past ROW where unfolded) and only the weight is masked past ROW.
    for i in tl.static_range(4):
        acc = tl.zeros((BLOCK_Q, BLOCK_N), tl.float32)
        for ky in range(KH):
            for c in tl.static_range((XROW + BLOCK_K - 1) // BLOCK_K):
                kk = c * BLOCK_K + kk0
                k_ok = kk < ROW
                if XROW % BLOCK_K == 0:
                    a = tl.load(ptrs + ((i // 2 + ky) * ROWS + (i % 2) * COLS + c * BLOCK_K), mask=q_ok[:, None],
                                other=0.0)
                else:
                    a = tl.load(ptrs + ((i // 2 + ky) * ROWS + (i % 2) * COLS + c * BLOCK_K),
                                mask=q_ok[:, None] & (kk < XROW)[None, :], other=0.0)
                if W_CL:  # channels_last weight: (kx, ci) of a row are consecutive
                    w_at = ky * S_KY + kk
                else:
                    w_at = ky * S_KY + (kk // CIN) * S_KX + (kk % CIN) * S_CI
                wt = tl.load(w_ptr + w_at[:, None] + co[None, :] * S_CO,
                             mask=k_ok[:, None] & (co < N)[None, :], other=0.0)
                acc = tl.dot(a, wt, acc)
        take = acc > best  # strict: the first maximum in window order keeps it, as max_pool2d
        best = tl.where(take, acc, best)
        arg = tl.where(take, i, arg)
    if HAS_BIAS:
        best += tl.load(b_ptr + co, mask=co < N, other=0.0).to(tl.float32)[None, :]
    dead = best <= 0.0
    at = q.to(tl.int64)[:, None] * N + co[None, :]
    yv = tl.where(dead, 0.0, best).to(y_ptr.dtype.element_ty)
    cv = tl.where(dead, 255, arg).to(tl.uint8)
    if N == BLOCK_N:  # a mask constant along the row keeps the stores vectorized
        tl.store(y_ptr + at, yv, mask=q_ok[:, None])
        tl.store(code_ptr + at, cv, mask=q_ok[:, None])
    else:
        out_ok = q_ok[:, None] & (co < N)[None, :]
        tl.store(y_ptr + at, yv, mask=out_ok)
        tl.store(code_ptr + at, cv, mask=out_ok)


@triton.jit
def _weight_grad_kernel(x_ptr, dy_ptr, code_ptr, dw_ptr, db_ptr, Q, HP, WP, IMG, ROWS, BLOCKS,
                        COLS: tl.constexpr, ROW: tl.constexpr, XROW: tl.constexpr, N: tl.constexpr,
                        CHUNKS: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    part = tl.program_id(1)  # which (ky, chunk) of the weight this program sums
    programs = tl.num_programs(0)
    ky = part // CHUNKS
    c = part % CHUNKS
    kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kk < XROW
    co = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    bacc = tl.zeros((BLOCK_N,), tl.float32)
    for blk in range(pid, BLOCKS, programs):
        q = blk * BLOCK_Q + tl.arange(0, BLOCK_Q)
        q_ok = q < Q
        n = q // (HP * WP)
        r = q % (HP * WP)
        base = n.to(tl.int64) * IMG + (2 * (r // WP) + ky) * ROWS + (2 * (r % WP)) * COLS + c * BLOCK_K
        ptrs = x_ptr + base[:, None] + tl.arange(0, BLOCK_K)[None, :]
        at = q.to(tl.int64)[:, None] * N + co[None, :]
        if N == BLOCK_N:  # a mask constant along the row keeps the loads vectorized
            g = tl.load(dy_ptr + at, mask=q_ok[:, None], other=0.0)
            code = tl.load(code_ptr + at, mask=q_ok[:, None], other=255).to(tl.int32)
        else:
            ok = q_ok[:, None] & (co < N)[None, :]
            g = tl.load(dy_ptr + at, mask=ok, other=0.0)
            code = tl.load(code_ptr + at, mask=ok, other=255).to(tl.int32)
        bacc += tl.sum(tl.where(code < 4, g.to(tl.float32), 0.0), axis=0)
        for i in tl.static_range(4):
            gi = tl.where(code == i, g, 0.0).to(g.dtype)
            if XROW % BLOCK_K == 0:
                a = tl.load(ptrs + ((i // 2) * ROWS + (i % 2) * COLS), mask=q_ok[:, None], other=0.0)
            else:
                a = tl.load(ptrs + ((i // 2) * ROWS + (i % 2) * COLS), mask=q_ok[:, None] & k_ok[None, :], other=0.0)
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


def _forward_tuned(xrow: int):
    """The autotuned forward kernel for rows of `xrow` values: the configs whose BLOCK_K divides
    a row (unmasked, vector loads), or all of them if none does."""
    if xrow not in _TUNED:
        configs = [c for c in _FORWARD_CONFIGS if xrow % c.kwargs["BLOCK_K"] == 0] or _FORWARD_CONFIGS
        _TUNED[xrow] = triton.autotune(configs, key=["Q", "HP", "WP", "IMG", "CIN", "N", "KH"])(_forward_kernel)
    return _TUNED[xrow]


def unfolds(cin: int) -> bool:
    """Whether a conv with cin input channels reads a row-unfolded input (`prepare`): when a
    pixel's channels are not a whole number of 16-byte vectors (the image's 1 or 3)."""
    return cin % 8 != 0


def prepared_shape(x_shape, weight_shape, padding):
    """The shape of `prepare`'s result for an NCHW x_shape."""
    n, cin, h, w = x_shape
    _, _, kh, kw = weight_shape
    hp, wp = h + 2 * padding[0], w + 2 * padding[1]
    if unfolds(cin):
        return (n, hp, wp - kw + 1, _row_padded(kw * cin))
    return (n, hp, wp, cin)


def _row_padded(row: int) -> int:
    return _pow2(row) if row <= 64 else -(-row // 16) * 16


def prepare(x_nhwc: torch.Tensor, weight_shape, padding) -> torch.Tensor:
    """The input as the kernels read it, with the zero border written out (no masks in the
    kernels' loads): x padded, NHWC; or, where `unfolds`, each output column's window row
    written out: xr[n, y, ox, kx*cin + ci] = x_padded[n, y, ox + kx, ci], zero-filled to a power
    of two (16 for a 3-channel 5x5 conv: 5x the image, where a full im2col is 27x), so that every
    row the kernels read is one aligned vector load."""
    n, h, w, cin = x_nhwc.shape
    _, _, kh, kw = weight_shape
    ph, pw = padding
    xp = F.pad(x_nhwc, (0, 0, pw, pw, ph, ph)) if (ph or pw) else x_nhwc.contiguous()
    if not unfolds(cin):
        return xp
    hp, wp = h + 2 * ph, w + 2 * pw
    row = kw * cin
    rows = xp.as_strided((n, hp, wp - kw + 1, row), (hp * wp * cin, wp * cin, cin, 1))
    return F.pad(rows, (0, _row_padded(row) - row)).contiguous()


def _geometry(xr: torch.Tensor, weight_shape):
    """The kernels' arguments for the prepared input xr."""
    n, hr, wr, cols = xr.shape
    cout, cin, kh, kw = weight_shape
    ho, wo = hr - kh + 1, (wr if unfolds(cin) else wr - kw + 1)
    hp, wp = ho // 2, wo // 2
    xrow = cols if unfolds(cin) else kw * cin  # values loaded per row (zeros past kw*cin where unfolded)
    return dict(Q=n * hp * wp, HP=hp, WP=wp, IMG=hr * wr * cols, ROWS=wr * cols, COLS=cols, ROW=kw * cin,
                XROW=xrow), (n, hp, wp)


def forward(x_nhwc: torch.Tensor, weight: torch.Tensor, bias, padding):
    """(y, code, xr): y as an NCHW tensor in channels_last memory, x's dtype; code uint8, the same
    shape and memory; xr the prepared input (`prepare`; the weight gradient reads it). weight:
    [cout, cin, kh, kw], any strides (read through them: no copy)."""
    weight_shape = tuple(weight.shape)
    cout, cin, kh, kw = weight_shape
    xr = prepare(x_nhwc, weight_shape, padding)
    geo, (n, hp, wp) = _geometry(xr, weight_shape)
    y = torch.empty((n, cout, hp, wp), device=x_nhwc.device, dtype=x_nhwc.dtype, memory_format=torch.channels_last)
    code = torch.empty((n, cout, hp, wp), device=x_nhwc.device, dtype=torch.uint8, memory_format=torch.channels_last)
    s_co, s_ci, s_ky, s_kx = weight.stride()
    args = (xr, weight, bias if bias is not None else weight, y, code)
    kw_ = dict(geo, S_CO=s_co, S_KY=s_ky, CIN=cin, N=cout, KH=kh, W_CL=(s_ci == 1 and s_kx == cin),
               S_CI=s_ci, S_KX=s_kx, HAS_BIAS=bias is not None, BLOCK_N=_pow2(cout))
    if _interpreted():  # one fixed config, large tiles: the interpreter's cost is per program and op
        bk = min(64, _pow2(geo["XROW"]))
        _forward_kernel[(triton.cdiv(geo["Q"], 128),)](*args, **kw_, BLOCK_Q=128, BLOCK_K=bk)
    else:
        tuned = _forward_tuned(geo["XROW"])
        tuned[lambda meta: (triton.cdiv(geo["Q"], meta["BLOCK_Q"]),)](*args, **kw_)
    return y, code, xr


def weight_grad(xr: torch.Tensor, dy_nhwc: torch.Tensor, code_nhwc: torch.Tensor, weight_shape,
                programs: int = 0):
    """(dw [cout, cin, kh, kw] fp32, db [cout] fp32) from the prepared input (`forward`'s xr),
    the pooled output's gradient and the forward's codes, both NHWC."""
    geo, _ = _geometry(xr, weight_shape)
    cout, cin, kh, kw = weight_shape
    row = geo["ROW"]
    block_q = 128 if _interpreted() else 64
    bk = min(64 if _interpreted() else 32, _pow2(geo["XROW"]))
    chunks = triton.cdiv(geo["XROW"], bk)
    bn = _pow2(cout)
    blocks = triton.cdiv(geo["Q"], block_q)
    if programs <= 0:
        sms = (torch.cuda.get_device_properties(xr.device).multi_processor_count
               if xr.device.type == "cuda" else 4)
        programs = max(1, min(blocks, 8 * sms // (kh * chunks)))
    dw = torch.empty(programs, kh, chunks * bk, bn, device=xr.device, dtype=torch.float32)
    db = torch.empty(programs, bn, device=xr.device, dtype=torch.float32)
    _weight_grad_kernel[(programs, kh * chunks)](xr, dy_nhwc, code_nhwc, dw, db, **geo, BLOCKS=blocks, N=cout,
                                                 CHUNKS=chunks, BLOCK_Q=block_q, BLOCK_K=bk, BLOCK_N=bn,
                                                 num_warps=4)
    dw = dw.sum(0)[:, :row, :cout].reshape(kh, kw, cin, cout).permute(3, 2, 0, 1)
    return dw, db.sum(0)[:cout]
