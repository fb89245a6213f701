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
[co, ci, ky, kx] read through its strides (no reordered copy: one kernel less per layer). The
reduction runs row by row of the window: for one ky, the kx*cin inputs under an output pixel are
KW*CIN consecutive values of x (kx and ci are adjacent in NHWC), so a row is one contiguous,
coalesced load of ROW = KW*CIN values (masked at the image's left and right edges), cut into
BLOCK_K chunks for tl.dot. For a 3-channel 5x5 conv a row is 15 values: one
16-wide chunk (94% used), where the whole 75-value window padded to a power of two would be 128
(59% used).

Forward, one program per BLOCK_Q pooled pixels x all output channels:
    for each window position i: acc_i[Q, N] = sum_ky sum_chunks x_row[Q, K] @ w_row[K, N] + bias
    y = relu(max_i acc_i), code = argmax_i (first max, as max_pool2d scans) or DEAD, with each
    acc_i rounded to y's dtype first (as the three ops would store it: the same ties)
Weight gradient (input needs no gradient), grid (PROGRAMS, KH * CHUNKS):
    dw[ky, chunk][K, N] += x_row_i[Q, K]^T @ where(code == i, dy, 0)[Q, N]   for the 4 positions
    db[N] += sum_Q where(code < 4, dy, 0)
into fp32 per-program partials, which one more kernel sums in a fixed order (deterministic: no
atomics) into the weight's own layout.

The kernels only; _conv_pool_triton.py chooses their configurations and launches them. Imported
only for CUDA tensors with Triton installed; tests run the same kernels in Triton's interpreter
on the CPU (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import triton
import triton.language as tl

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
def unfold_kernel(x_ptr, xr_ptr, R, H, W, HPAD, WO, C: tl.constexpr, ROW: tl.constexpr, XROW: tl.constexpr,
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
def forward_rows_kernel(xr_ptr, w_ptr, b_ptr, y_ptr, code_ptr, Q, HP, WP, IMG, ROWS, S_CO, S_KY, S_KX, S_CI,
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
def forward_direct_kernel(x_ptr, w_ptr, b_ptr, y_ptr, code_ptr, Q, H, W, HP, WP, S_CO, S_KY, S_KX, S_CI,
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
def weight_grad_rows_kernel(xr_ptr, dy_ptr, code_ptr, dw_ptr, Q, HP, WP, IMG, ROWS, BLOCKS,
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
def sum_partials_kernel(part_ptr, dw_ptr, db_ptr, P, S_CO, S_CI, S_KY, S_KX, CIN: tl.constexpr, N: tl.constexpr,
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
def input_grad_kernel(dy_ptr, code_ptr, w_ptr, dx_ptr, P, H, W, HP, WP, S_CO, S_CI, S_KY, S_KX,
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
def weight_grad_direct_kernel(x_ptr, dy_ptr, code_ptr, dw_ptr, db_ptr, Q, H, W, HP, WP, BLOCKS,
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
