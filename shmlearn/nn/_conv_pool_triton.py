"""Triton kernels for conv (stride 1) + bias + ReLU + 2x2 max-pool in one pass, and the weight and
bias gradients of such a block whose input needs no gradient (the image's first conv).

Why (measured in shmlearn/nn/conv_pool.py): as three ops, the conv writes its full output, ReLU and
the pool read it back and the backward scatters the pooled gradient into full size again. Here the
conv output lives in registers only: the pooled output is written with one uint8 code per value
(window position 0-3, or DEAD when the max was <= 0 and ReLU let no gradient through).

Layout: NHWC input x[n, h, w, cin] and output y[n, hp, wp, cout]; the weight [co, ci, ky, kx] read
through its strides. The reduction runs row by row of the window: for one ky, the kx*cin inputs
under an output pixel are ROW = KW*CIN consecutive values of x (one coalesced load, masked at the
image's edges), cut into BLOCK_K chunks for tl.dot (a 3-channel 5x5 conv's row of 15 values is one
16-wide chunk, where its whole 75-value window padded to a power of two would be 128).

Forward, one program per BLOCK_Q pooled pixels x all output channels:
    for each window position i: acc_i[Q, N] = sum_ky sum_chunks x_row[Q, K] @ w_row[K, N] + bias
    y = relu(max_i acc_i), code = argmax_i (first max, as max_pool2d scans) or DEAD, with each
    acc_i rounded to y's dtype first (as the three ops would store it: the same ties)
Weight gradient (input needs no gradient), grid (PROGRAMS, KH * CHUNKS):
    dw[ky, chunk][K, N] += x_row_i[Q, K]^T @ where(code == i, dy, 0)[Q, N]   for the 4 positions
    db[N] += sum_Q where(code < 4, dy, 0)
into fp32 per-program partials that one more kernel sums in a fixed order (no atomics). Imported
only for CUDA tensors; tests run the same kernels in Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shmlearn.nn import fit
from shmlearn.nn.conv_pool import unfolds

DEAD = 255
"""The code of a pooled value whose window max was <= 0: ReLU passed no gradient."""


@triton.jit
def _pool_store(acc_i, i, best, arg):
    """Fold window position i's conv outputs into the running max and its position."""
    # Compared as the conv's output would be stored (rounded to y's dtype by the caller), so that
    # ties in bf16 go where max_pool2d of the stored output sends them; strict: the first maximum
    # in window order keeps it, as max_pool2d.
    take = acc_i > best
    return tl.where(take, acc_i, best), tl.where(take, i, arg)


@triton.jit
def _pool4(v, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """(max, first argmax) over the 4 window positions of v [4 * BLOCK_Q, BLOCK_N], rows i * BLOCK_Q + j."""
    v3 = tl.reshape(v, (4, BLOCK_Q, BLOCK_N))
    return tl.max(v3, axis=0), tl.argmax(v3, axis=0, tie_break_left=True).to(tl.int32)


@triton.jit
def _store(y_ptr, code_ptr, q, q_ok, co, best, arg, N: tl.constexpr, BLOCK_N: tl.constexpr):
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
def _grad_rows(dy_ptr, code_ptr, rows, row_ok, co, N: tl.constexpr, EVEN: tl.constexpr):
    """The pooled gradient and the codes (int32) of pooled pixels `rows` (int64) at channels co;
    0 and DEAD where not row_ok or co >= N. EVEN: co < N throughout, so the mask is constant
    along a row and the loads stay vectorized."""
    at = rows[:, None] * N + co[None, :]
    if EVEN:
        m = row_ok[:, None]
    else:
        m = row_ok[:, None] & (co < N)[None, :]
    return tl.load(dy_ptr + at, mask=m, other=0.0), tl.load(code_ptr + at, mask=m, other=255).to(tl.int32)


@triton.jit
def _unfold_kernel(x_ptr, xr_ptr, R, H, W, HPAD, WO, C: tl.constexpr, ROW: tl.constexpr, XROW: tl.constexpr,
                   PH: tl.constexpr, PW: tl.constexpr, BLOCK_R: tl.constexpr):
    """xr[n, y, ox, kk] = x[n, y - PH, ox - PW + kk // C, kk % C] (0 outside x, and for kk >= ROW)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kk = tl.arange(0, XROW)
    r_ok = r < R
    ox = r % WO
    t = r // WO
    iy = t % HPAD - PH
    n = t // HPAD
    ix = ox[:, None] - PW + (kk // C)[None, :]
    ok = (r_ok & (iy >= 0) & (iy < H))[:, None] & (kk < ROW)[None, :] & (ix >= 0) & (ix < W)
    src = ((n.to(tl.int64) * H + iy) * W)[:, None] * C + ix * C + (kk % C)[None, :]
    v = tl.load(x_ptr + src, mask=ok, other=0.0)
    tl.store(xr_ptr + r.to(tl.int64)[:, None] * XROW + kk[None, :], v, mask=r_ok[:, None])


@triton.jit
def _forward_rows_kernel(xr_ptr, w_ptr, b_ptr, y_ptr, code_ptr, Q, HP, WP, IMG, ROWS, S_CO, S_KY, S_KX, S_CI,
                         CIN: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, ROW: tl.constexpr,
                         XROW: tl.constexpr, KT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, STACK: tl.constexpr):
    """The image's block from the unfolded input: a whole window (KH rows of XROW values) is one
    [BLOCK_Q, KT] tile and one tl.dot per window position."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q < Q
    n = q // (HP * WP)
    r = q % (HP * WP)
    base = n.to(tl.int64) * IMG + (2 * (r // WP)) * ROWS + (2 * (r % WP)) * XROW
    col = tl.arange(0, KT)
    ky = col // XROW
    kk = col % XROW
    col_ok = col < KH * XROW  # constant over each XROW-long (16-multiple) row: vector loads stay
    co = tl.arange(0, BLOCK_N)
    ptrs = xr_ptr + base[:, None] + (ky * ROWS + kk)[None, :]
    w_at = ky * S_KY + (kk // CIN) * S_KX + (kk % CIN) * S_CI
    wt = tl.load(w_ptr + w_at[:, None] + co[None, :] * S_CO,
                 mask=(col_ok & (kk < ROW))[:, None] & (co < N)[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + co, mask=co < N, other=0.0).to(tl.float32)[None, :]
    if STACK:  # the 4 window positions as 4 * BLOCK_Q rows of one tile: one tl.dot
        m = tl.arange(0, 4 * BLOCK_Q)
        i4 = m // BLOCK_Q
        qm = tl.program_id(0) * BLOCK_Q + m % BLOCK_Q
        nm = qm // (HP * WP)
        rm = qm % (HP * WP)
        bm = nm.to(tl.int64) * IMG + (2 * (rm // WP) + i4 // 2) * ROWS + (2 * (rm % WP) + i4 % 2) * XROW
        a = tl.load(xr_ptr + bm[:, None] + (ky * ROWS + kk)[None, :], mask=(qm < Q)[:, None] & col_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, wt)
        if HAS_BIAS:
            acc += bias
        best, arg = _pool4(acc.to(y_ptr.dtype.element_ty).to(tl.float32), BLOCK_Q, BLOCK_N)
    else:
        best = tl.full((BLOCK_Q, BLOCK_N), float("-inf"), tl.float32)
        arg = tl.zeros((BLOCK_Q, BLOCK_N), tl.int32)
        for i in tl.static_range(4):
            a = tl.load(ptrs + ((i // 2) * ROWS + (i % 2) * XROW), mask=q_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, wt)
            if HAS_BIAS:
                acc += bias
            best, arg = _pool_store(acc.to(y_ptr.dtype.element_ty).to(tl.float32), i, best, arg)
    _store(y_ptr, code_ptr, q, q_ok, co, best, arg, N, BLOCK_N)


@triton.jit
def _forward_direct_kernel(x_ptr, w_ptr, b_ptr, y_ptr, code_ptr, Q, H, W, HP, WP, S_CO, S_KY, S_KX, S_CI,
                           CIN: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                           PH: tl.constexpr, PW: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STACK: tl.constexpr):
    """A block whose input has a multiple of 16 channels, read in place (NHWC): chunks of
    BLOCK_K channels of one (ky, kx) tap, masked at the border by a mask constant along the
    chunk (so still vector loads)."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q < Q
    n = q // (HP * WP)
    r = q % (HP * WP)
    py = r // WP
    px = r % WP
    image = n.to(tl.int64) * H
    kk0 = tl.arange(0, BLOCK_K)
    co = tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(b_ptr + co, mask=co < N, other=0.0).to(tl.float32)[None, :]
    if STACK:  # the 4 window positions as 4 * BLOCK_Q rows of one tile: one tl.dot per chunk
        m = tl.arange(0, 4 * BLOCK_Q)
        i4 = m // BLOCK_Q
        qm = tl.program_id(0) * BLOCK_Q + m % BLOCK_Q
        qm_ok = qm < Q
        nm = qm // (HP * WP)
        rm = qm % (HP * WP)
        oym = 2 * (rm // WP) + i4 // 2
        oxm = 2 * (rm % WP) + i4 % 2
        bm = ((nm.to(tl.int64) * H + oym) * W + oxm) * CIN  # the tap (0, 0) at (oy, ox), before padding
        ptrs = x_ptr + bm[:, None] + kk0[None, :]
        acc = tl.zeros((4 * BLOCK_Q, BLOCK_N), tl.float32)
        for ky in range(KH):
            iy = oym + ky - PH
            row_ok = qm_ok & (iy >= 0) & (iy < H)
            for c in tl.static_range(KW * CIN // BLOCK_K):
                kx = (c * BLOCK_K) // CIN  # constexpr: one tap per chunk
                ci0 = (c * BLOCK_K) % CIN
                ix = oxm + kx - PW
                ok = row_ok & (ix >= 0) & (ix < W)
                a = tl.load(ptrs + (((ky - PH) * W + kx - PW) * CIN + ci0), mask=ok[:, None], other=0.0)
                wt = tl.load(w_ptr + (ky * S_KY + kx * S_KX + (ci0 + kk0) * S_CI)[:, None] + co[None, :] * S_CO,
                             mask=(co < N)[None, :], other=0.0)
                acc = tl.dot(a, wt, acc)
        if HAS_BIAS:
            acc += bias
        best, arg = _pool4(acc.to(y_ptr.dtype.element_ty).to(tl.float32), BLOCK_Q, BLOCK_N)
        _store(y_ptr, code_ptr, q, q_ok, co, best, arg, N, BLOCK_N)
        return
    best = tl.full((BLOCK_Q, BLOCK_N), float("-inf"), tl.float32)
    arg = tl.zeros((BLOCK_Q, BLOCK_N), tl.int32)
    for i in tl.static_range(4):
        oy = 2 * py + i // 2
        ox = 2 * px + i % 2
        acc = tl.zeros((BLOCK_Q, BLOCK_N), tl.float32)
        for ky in range(KH):
            iy = oy + ky - PH
            row_ok = q_ok & (iy >= 0) & (iy < H)
            row = (image + iy) * W
            for c in tl.static_range(KW * CIN // BLOCK_K):
                kx = (c * BLOCK_K) // CIN  # constexpr: one tap per chunk
                ci0 = (c * BLOCK_K) % CIN
                ix = ox + kx - PW
                ok = row_ok & (ix >= 0) & (ix < W)
                a = tl.load(x_ptr + ((row + ix) * CIN + ci0)[:, None] + kk0[None, :], mask=ok[:, None], other=0.0)
                wt = tl.load(w_ptr + (ky * S_KY + kx * S_KX + (ci0 + kk0) * S_CI)[:, None] + co[None, :] * S_CO,
                             mask=(co < N)[None, :], other=0.0)
                acc = tl.dot(a, wt, acc)
        if HAS_BIAS:
            acc += bias
        best, arg = _pool_store(acc.to(y_ptr.dtype.element_ty).to(tl.float32), i, best, arg)
    _store(y_ptr, code_ptr, q, q_ok, co, best, arg, N, BLOCK_N)


@triton.jit
def _weight_grad_rows_kernel(xr_ptr, dy_ptr, code_ptr, dw_ptr, Q, HP, WP, IMG, ROWS, BLOCKS,
                             N: tl.constexpr, KH: tl.constexpr, XROW: tl.constexpr, KT: tl.constexpr,
                             BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """The image block's weight and bias gradients: each program walks its share of the pixel
    blocks, reading the pooled gradient and the codes once per block."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    col = tl.arange(0, KT)
    ky = col // XROW
    kk = col % XROW
    col_ok = col < KH * XROW
    co = tl.arange(0, BLOCK_N)
    acc = tl.zeros((KT, BLOCK_N), tl.float32)
    bacc = tl.zeros((BLOCK_N,), tl.float32)
    for blk in range(pid, BLOCKS, programs):
        q = blk * BLOCK_Q + tl.arange(0, BLOCK_Q)
        q_ok = q < Q
        n = q // (HP * WP)
        r = q % (HP * WP)
        base = n.to(tl.int64) * IMG + (2 * (r // WP)) * ROWS + (2 * (r % WP)) * XROW
        ptrs = xr_ptr + base[:, None] + (ky * ROWS + kk)[None, :]
        g, code = _grad_rows(dy_ptr, code_ptr, q.to(tl.int64), q_ok, co, N, N == BLOCK_N)
        bacc += tl.sum(tl.where(code < 4, g.to(tl.float32), 0.0), axis=0)
        for i in tl.static_range(4):
            gi = tl.where(code == i, g, 0.0).to(g.dtype)
            a = tl.load(ptrs + ((i // 2) * ROWS + (i % 2) * XROW), mask=q_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(tl.trans(a), gi, acc)
    tl.store(dw_ptr + (pid * (KT + 1) + col)[:, None] * BLOCK_N + co[None, :], acc)
    tl.store(dw_ptr + (pid * (KT + 1) + KT) * BLOCK_N + co, bacc)  # row KT: the bias


@triton.jit
def _sum_partials_kernel(part_ptr, dw_ptr, db_ptr, P, S_CO, S_CI, S_KY, S_KX, CIN: tl.constexpr, N: tl.constexpr,
                         KH: tl.constexpr, KW: tl.constexpr, XROW: tl.constexpr, KT: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
    """dw and db from the weight-gradient programs' partials [P, KT + 1, BLOCK_N] (rows ky * XROW +
    kx * CIN + ci, then the bias): each program sums BLOCK of the (KT + 1) * BLOCK_N columns over
    the P partials, in a fixed order, and writes them where the weight's gradient keeps them (its
    strides: channels_last or not), the padding rows and columns dropped. One kernel in place of
    two reductions and two copies."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c_ok = c < (KT + 1) * BLOCK_N
    acc = tl.zeros((BLOCK,), tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        v = tl.load(part_ptr + p.to(tl.int64)[:, None] * ((KT + 1) * BLOCK_N) + c[None, :],
                    mask=(p < P)[:, None] & c_ok[None, :], other=0.0)
        acc += tl.sum(v, axis=0)
    row = c // BLOCK_N
    co = c % BLOCK_N
    ky = row // XROW
    kk = row % XROW
    kx = kk // CIN
    ci = kk % CIN
    w_ok = c_ok & (row < KH * XROW) & (kk < KW * CIN) & (co < N)
    tl.store(dw_ptr + co * S_CO + ci * S_CI + ky * S_KY + kx * S_KX, acc, mask=w_ok)
    tl.store(db_ptr + co, acc, mask=c_ok & (row == KT) & (co < N))


@triton.jit
def _input_grad_kernel(dy_ptr, code_ptr, w_ptr, dx_ptr, P, H, W, HP, WP, S_CO, S_CI, S_KY, S_KX,
                       CIN: tl.constexpr, N: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                       PH: tl.constexpr, PW: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx of a block (NHWC), straight from the pooled gradient and the codes: for each input
    pixel and tap, the conv output pixel it fed, that pixel's window and position; its gradient
    is the pooled one where the code names that position, else 0. No full-size gradient."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < P
    n = p // (H * W)
    r = p % (H * W)
    iy = r // W
    ix = r % W
    ci = tl.arange(0, BLOCK_C)
    co0 = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_P, BLOCK_C), tl.float32)
    for ky in range(KH):
        oy = iy + PH - ky
        y_ok = p_ok & (oy >= 0) & (oy < 2 * HP)
        oy = tl.where(y_ok, oy, 0)
        for kx in range(KW):
            ox = ix + PW - kx
            ok = y_ok & (ox >= 0) & (ox < 2 * WP)
            ox = tl.where(ok, ox, 0)
            pos = (oy % 2) * 2 + ox % 2
            pq = ((n * HP + oy // 2) * WP + ox // 2).to(tl.int64)
            for c in tl.static_range((N + BLOCK_N - 1) // BLOCK_N):
                co = c * BLOCK_N + co0
                g, k = _grad_rows(dy_ptr, code_ptr, pq, ok, co, N, N % BLOCK_N == 0)
                gt = tl.where(k == pos[:, None], g, 0.0).to(g.dtype)
                wt = tl.load(w_ptr + co[:, None] * S_CO + ci[None, :] * S_CI + ky * S_KY + kx * S_KX,
                             mask=(co < N)[:, None] & (ci < CIN)[None, :], other=0.0)
                acc = tl.dot(gt, wt, acc)
    at = p.to(tl.int64)[:, None] * CIN + ci[None, :]
    if CIN == BLOCK_C:
        tl.store(dx_ptr + at, acc.to(dx_ptr.dtype.element_ty), mask=p_ok[:, None])
    else:
        tl.store(dx_ptr + at, acc.to(dx_ptr.dtype.element_ty), mask=p_ok[:, None] & (ci < CIN)[None, :])


@triton.jit
def _weight_grad_direct_kernel(x_ptr, dy_ptr, code_ptr, dw_ptr, db_ptr, Q, H, W, HP, WP, BLOCKS,
                               CIN: tl.constexpr, N: tl.constexpr, KW: tl.constexpr, PH: tl.constexpr,
                               PW: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                               BLOCK_N: tl.constexpr):
    """A block's weight and bias gradients with x read in place (in_channels a multiple of 16):
    program (pid, part) sums one BLOCK_K-channel chunk of one tap over its share of the pixel
    blocks, the 4 window positions as one tile of 4 * BLOCK_Q rows."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    programs = tl.num_programs(0)
    chunks = KW * CIN // BLOCK_K
    ky = part // chunks
    c = part % chunks
    kx = (c * BLOCK_K) // CIN
    ci0 = tl.multiple_of((c * BLOCK_K) % CIN, BLOCK_K)
    m = tl.arange(0, 4 * BLOCK_Q)
    i4 = m // BLOCK_Q
    j = m % BLOCK_Q
    kk = tl.arange(0, BLOCK_K)
    co = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    bacc = tl.zeros((BLOCK_N,), tl.float32)
    for blk in range(pid, BLOCKS, programs):
        qm = blk * BLOCK_Q + j
        qm_ok = qm < Q
        nm = qm // (HP * WP)
        rm = qm % (HP * WP)
        iy = 2 * (rm // WP) + i4 // 2 + ky - PH
        ix = 2 * (rm % WP) + i4 % 2 + kx - PW
        ok = qm_ok & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)
        a = tl.load(x_ptr + (((nm.to(tl.int64) * H + iy) * W + ix) * CIN + ci0)[:, None] + kk[None, :],
                    mask=ok[:, None], other=0.0)
        g, k = _grad_rows(dy_ptr, code_ptr, qm.to(tl.int64), qm_ok, co, N, N == BLOCK_N)
        gi = tl.where(k == i4[:, None], g, 0.0).to(g.dtype)
        acc = tl.dot(tl.trans(a), gi, acc)
        bacc += tl.sum(gi.to(tl.float32), axis=0)
    tl.store(dw_ptr + ((pid * tl.num_programs(1) + part) * BLOCK_K + kk)[:, None] * BLOCK_N + co[None, :], acc)
    if part == 0:
        tl.store(db_ptr + pid * BLOCK_N + co, bacc)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_CONFIGS_ROWS = ([triton.Config({"BLOCK_Q": bq, "STACK": False}, num_warps=nw) for bq, nw in ((32, 4), (64, 4), (64, 8), (128, 8))]
                 + [triton.Config({"BLOCK_Q": bq, "STACK": True}, num_warps=nw) for bq, nw in ((16, 4), (32, 4), (32, 8))])
_CONFIGS_DIRECT = ([triton.Config({"BLOCK_Q": bq, "BLOCK_K": bk, "STACK": False}, num_warps=nw, num_stages=ns)
                    for bq, bk, nw, ns in ((32, 32, 4, 2), (64, 16, 4, 2), (64, 32, 4, 2), (64, 32, 4, 3),
                                           (128, 32, 8, 2), (128, 16, 8, 3), (64, 64, 4, 2), (128, 64, 8, 2))]
                   + [triton.Config({"BLOCK_Q": bq, "BLOCK_K": bk, "STACK": True}, num_warps=nw, num_stages=ns)
                      for bq, bk, nw, ns in ((16, 32, 4, 2), (32, 32, 4, 2), (32, 32, 8, 3), (16, 64, 4, 2),
                                             (32, 16, 4, 3), (64, 32, 8, 2))])
"""What the autotuners try on the first call per shape: the 4 window positions one after the
other (STACK False) or as one tile of 4 x BLOCK_Q rows (fewer, larger tl.dots: what a small batch
wants); the direct kernel's BLOCK_K must divide in_channels (a chunk is one tap's channels)."""
_TUNED = {}
INTERPRET_STACK = False
"""Which form the forward kernels take in Triton's interpreter (one fixed config there; the
tests run both)."""


def _autotune_options() -> dict:
    """cache_results where this Triton has it (>= 3.2): the autotuners keep their choice in
    Triton's disk cache, keyed by the kernel's source, the configs, the GPU and the shape, so a
    later run or process skips timing every config of a shape it has seen (seconds of a warm
    setup; docs/performance.md, "Behind the code").
    SHMLEARN_AUTOTUNE_CACHE=0 turns it off (to measure what it saves)."""
    import inspect
    if ("cache_results" in inspect.signature(triton.autotune).parameters
            and os.environ.get("SHMLEARN_AUTOTUNE_CACHE", "1") != "0"):
        return {"cache_results": True}
    return {}


_AUTOTUNE = _autotune_options()


def _tuned(kind: str, cin: int = 0):
    key = (kind, cin)
    if key not in _TUNED:
        if kind == "rows":
            _TUNED[key] = triton.autotune(_CONFIGS_ROWS, key=["Q", "HP", "WP", "IMG", "N", "KT"], **_AUTOTUNE)(
                _forward_rows_kernel)
        else:
            configs = [c for c in _CONFIGS_DIRECT if cin % c.kwargs["BLOCK_K"] == 0]
            _TUNED[key] = triton.autotune(configs, key=["Q", "H", "W", "CIN", "N", "KH", "KW"], **_AUTOTUNE)(
                _forward_direct_kernel)
    return _TUNED[key]


WGRAD_ROWS = (fit.Candidate.of(4, None, BLOCK_Q=64), fit.Candidate.of(4, 2, BLOCK_Q=64),
              fit.Candidate.of(4, 1, BLOCK_Q=64), fit.Candidate.of(4, 1, BLOCK_Q=32))
"""The image block's weight-gradient kernel, in the order tried: Triton's default pipelining
first (bf16: 20 KB of shared memory a block), then fewer stages and smaller tiles. fp32 tiles
pipelined over 3 stages need 408 KB, over 2 272 KB (an H100 block has 227 KB); unpipelined 40 KB."""


def _rows_constexprs(cin: int, cout: int, kh: int, kw: int) -> dict:
    xrow = _pow2(kw * cin)
    return dict(N=cout, KH=kh, XROW=xrow, KT=_pow2(kh * xrow), BLOCK_N=_pow2(cout))


def wgrad_config(cin: int, cout: int, kh: int, kw: int, dtype: torch.dtype, lim: fit.DeviceLimits):
    """(the image block weight-gradient kernel's configuration that runs on a device with limits
    lim, None) or (None, why none does)."""
    return fit.pick(_weight_grad_rows_kernel, {"xr_ptr": dtype, "dy_ptr": dtype, "code_ptr": torch.uint8,
                                               "dw_ptr": torch.float32},
                    _rows_constexprs(cin, cout, kh, kw), WGRAD_ROWS, lim)


def forward_why_not(cin: int, cout: int, kh: int, kw: int, padding, has_bias: bool, dtype: torch.dtype,
                    lim: fit.DeviceLimits):
    """None if the forward kernel's smallest tile runs on a device with limits lim (the autotuner
    then skips the configurations that do not: Triton times those as infinite), else why not."""
    ptrs = {"w_ptr": dtype, "b_ptr": dtype, "y_ptr": dtype, "code_ptr": torch.uint8}
    if unfolds(cin):
        consts = dict(_rows_constexprs(cin, cout, kh, kw), CIN=cin, ROW=kw * cin, HAS_BIAS=has_bias)
        consts["KT"] = _pow2(kh * consts["XROW"])
        return fit.why_not(_forward_rows_kernel, dict(ptrs, xr_ptr=dtype), consts,
                           fit.Candidate.of(4, None, BLOCK_Q=32, STACK=False), lim)
    consts = dict(CIN=cin, N=cout, KH=kh, KW=kw, PH=padding[0], PW=padding[1], HAS_BIAS=has_bias, BLOCK_N=_pow2(cout))
    return fit.why_not(_forward_direct_kernel, dict(ptrs, x_ptr=dtype), consts,
                       fit.Candidate.of(4, 2, BLOCK_Q=32, BLOCK_K=16, STACK=False), lim)


def prepared_shape(x_shape, weight_shape, padding):
    """The shape of `prepare`'s result for an NCHW x_shape ((0,) where the block reads x itself)."""
    n, cin, h, w = x_shape
    _, _, kh, kw = weight_shape
    if not unfolds(cin):
        return (0,)
    return (n, h + 2 * padding[0], w + 2 * padding[1] - kw + 1, _pow2(kw * cin))


def prepare(x_nhwc: torch.Tensor, weight_shape, padding) -> torch.Tensor:
    """Where `unfolds`: the input with each output column's window row written out,
    xr[n, y, ox, kx*cin + ci] = x_padded[n, y, ox + kx, ci], zero-filled to a power of two (16 for
    a 3-channel 5x5 conv: 5x the image, where a full im2col is 27x), zero border rows included,
    so that the kernels read every row as aligned vectors without masks. One Triton kernel."""
    shape = prepared_shape((x_nhwc.shape[0], x_nhwc.shape[3], x_nhwc.shape[1], x_nhwc.shape[2]), weight_shape, padding)
    if len(shape) == 1:
        return x_nhwc.new_empty(0)
    n, hpad, wo, xrow = shape
    _, h, w, cin = x_nhwc.shape
    xr = torch.empty(shape, device=x_nhwc.device, dtype=x_nhwc.dtype)
    rows = n * hpad * wo
    block = 64
    _unfold_kernel[(triton.cdiv(rows, block),)](x_nhwc, xr, rows, h, w, hpad, wo, C=cin, ROW=weight_shape[3] * cin,
                                                XROW=xrow, PH=padding[0], PW=padding[1], BLOCK_R=block)
    return xr


def _rows_geometry(xr: torch.Tensor, weight_shape):
    n, hpad, wo, xrow = xr.shape
    cout, cin, kh, kw = weight_shape
    hp, wp = (hpad - kh + 1) // 2, wo // 2
    return dict(Q=n * hp * wp, HP=hp, WP=wp, IMG=hpad * wo * xrow, ROWS=wo * xrow), (n, hp, wp)


def forward(x_nhwc: torch.Tensor, weight: torch.Tensor, bias, padding):
    """(y, code, xr): y as an NCHW tensor in channels_last memory, x's dtype; code uint8, the same
    shape and memory; xr `prepare`'s unfolded input (empty where the block reads x itself; the
    weight-gradient kernel reads it). weight: [cout, cin, kh, kw], any strides (read through
    them: no copy)."""
    weight_shape = tuple(weight.shape)
    cout, cin, kh, kw = weight_shape
    n, h, w, _ = x_nhwc.shape
    ph, pw = padding
    hp, wp = (h + 2 * ph - kh + 1) // 2, (w + 2 * pw - kw + 1) // 2
    y = torch.empty((n, cout, hp, wp), device=x_nhwc.device, dtype=x_nhwc.dtype, memory_format=torch.channels_last)
    code = torch.empty((n, cout, hp, wp), device=x_nhwc.device, dtype=torch.uint8, memory_format=torch.channels_last)
    s_co, s_ci, s_ky, s_kx = weight.stride()
    common = dict(S_CO=s_co, S_KY=s_ky, S_KX=s_kx, S_CI=s_ci, CIN=cin, N=cout, KH=kh, HAS_BIAS=bias is not None,
                  BLOCK_N=_pow2(cout))
    args = lambda src: (src, weight, bias if bias is not None else weight, y, code)  # noqa: E731
    xr = prepare(x_nhwc, weight_shape, padding)
    if unfolds(cin):
        geo, _ = _rows_geometry(xr, weight_shape)
        xrow = xr.shape[3]
        kw_ = dict(geo, **common, ROW=kw * cin, XROW=xrow, KT=_pow2(kh * xrow))
        if _interpreted():  # one fixed config, large tiles: the interpreter's cost is per program and op
            bq = 32 if INTERPRET_STACK else 128
            _forward_rows_kernel[(triton.cdiv(geo["Q"], bq),)](*args(xr), **kw_, BLOCK_Q=bq, STACK=INTERPRET_STACK)
        else:
            _tuned("rows")[lambda m: (triton.cdiv(geo["Q"], m["BLOCK_Q"]),)](*args(xr), **kw_)
    else:
        q = n * hp * wp
        kw_ = dict(common, Q=q, H=h, W=w, HP=hp, WP=wp, KW=kw, PH=ph, PW=pw)
        if _interpreted():
            bq = 32 if INTERPRET_STACK else 128
            _forward_direct_kernel[(triton.cdiv(q, bq),)](*args(x_nhwc), **kw_, BLOCK_Q=bq, BLOCK_K=min(64, cin),
                                                          STACK=INTERPRET_STACK)
        else:
            _tuned("direct", cin)[lambda m: (triton.cdiv(q, m["BLOCK_Q"]),)](*args(x_nhwc), **kw_)
    return y, code, xr


def weight_grad(xr: torch.Tensor, dy_nhwc: torch.Tensor, code_nhwc: torch.Tensor, weight_shape,
                programs: int = 0, channels_last: bool = False):
    """(dw [cout, cin, kh, kw] fp32, db [cout] fp32) of an image block (one that `unfolds`) from
    `forward`'s xr, the pooled output's gradient and the codes, both NHWC; dw channels_last in
    memory where asked (as a channels_last weight's gradient: no copy after)."""
    geo, _ = _rows_geometry(xr, weight_shape)
    cout, cin, kh, kw = weight_shape
    xrow = xr.shape[3]
    kt, bn = _pow2(kh * xrow), _pow2(cout)
    if _interpreted():
        launch = dict(BLOCK_Q=128, num_warps=4)
    else:
        cand, why = wgrad_config(cin, cout, kh, kw, xr.dtype, fit.limits(xr.device))
        if cand is None:  # conv_pool.plan checked this before choosing the kernel
            raise RuntimeError(f"conv-pool weight gradient ({cin} -> {cout}, {kh}x{kw}, {xr.dtype}): {why}")
        launch = cand.launch()
    block_q = launch["BLOCK_Q"]
    blocks = triton.cdiv(geo["Q"], block_q)
    if programs <= 0:
        sms = (torch.cuda.get_device_properties(xr.device).multi_processor_count
               if xr.device.type == "cuda" else 4)
        programs = max(1, min(blocks, 2 * sms))
    parts = torch.empty(programs, kt + 1, bn, device=xr.device, dtype=torch.float32)
    _weight_grad_rows_kernel[(programs,)](xr, dy_nhwc, code_nhwc, parts, **geo, BLOCKS=blocks, N=cout, KH=kh,
                                          XROW=xrow, KT=kt, BLOCK_N=bn, **launch)
    dw = torch.empty(weight_shape, device=xr.device, dtype=torch.float32,
                     memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    db = torch.empty(cout, device=xr.device, dtype=torch.float32)
    cols = (kt + 1) * bn
    # 65 programs for alexnet-small's 3 -> 32 5x5 block (256: 17, slower; docs/performance.md)
    block = 128 if _interpreted() else 64
    s_co, s_ci, s_ky, s_kx = dw.stride()
    _sum_partials_kernel[(triton.cdiv(cols, block),)](parts, dw, db, programs, s_co, s_ci, s_ky, s_kx, CIN=cin, N=cout,
                                                      KH=kh, KW=kw, XROW=xrow, KT=kt, BLOCK_N=bn, BLOCK_P=32,
                                                      BLOCK=block, num_warps=4)
    return dw, db


def input_and_weight_grad(x_nhwc: torch.Tensor, weight: torch.Tensor, dy_nhwc: torch.Tensor,
                          code_nhwc: torch.Tensor, padding, need_dx: bool = True):
    """(dx NHWC in x's dtype or None, dw [cout, cin, kh, kw] fp32, db [cout] fp32) of a block
    that reads x in place (in_channels a multiple of 16), from the pooled gradient and the codes."""
    n, h, w, cin = x_nhwc.shape
    cout, _, kh, kw = weight.shape
    hp, wp = dy_nhwc.shape[1], dy_nhwc.shape[2]
    ph, pw = padding
    interp = _interpreted()
    dx = None
    if need_dx:
        dx = torch.empty_like(x_nhwc)
        p_total = n * h * w
        bp = 64 if interp else 32
        s_co, s_ci, s_ky, s_kx = weight.stride()
        _input_grad_kernel[(triton.cdiv(p_total, bp),)](dy_nhwc, code_nhwc, weight, dx, p_total, h, w, hp, wp,
                                                       s_co, s_ci, s_ky, s_kx, CIN=cin, N=cout, KH=kh, KW=kw, PH=ph,
                                                       PW=pw, BLOCK_P=bp, BLOCK_C=_pow2(cin),
                                                       BLOCK_N=min(64, _pow2(cout)), num_warps=4)
    bk = 32 if cin % 32 == 0 else 16
    bq = 32 if interp else 16
    parts = kh * kw * cin // bk
    q = n * hp * wp
    blocks = triton.cdiv(q, bq)
    sms = torch.cuda.get_device_properties(x_nhwc.device).multi_processor_count if x_nhwc.device.type == "cuda" else 4
    programs = max(1, min(blocks, 4 * sms // parts))
    bn = _pow2(cout)
    dw = torch.empty(programs, parts, bk, bn, device=x_nhwc.device, dtype=torch.float32)
    db = torch.empty(programs, bn, device=x_nhwc.device, dtype=torch.float32)
    _weight_grad_direct_kernel[(programs, parts)](x_nhwc, dy_nhwc, code_nhwc, dw, db, q, h, w, hp, wp, blocks,
                                                  CIN=cin, N=cout, KW=kw, PH=ph, PW=pw, BLOCK_Q=bq, BLOCK_K=bk,
                                                  BLOCK_N=bn, num_warps=4)
    dw = dw.sum(0).view(kh, kw * cin, bn)[:, :, :cout].reshape(kh, kw, cin, cout).permute(3, 2, 0, 1)
    return dx, dw, db.sum(0)[:cout]
