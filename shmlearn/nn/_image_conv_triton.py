"""Triton kernels for a convolution of few input values per output (the image's first conv),
forward and weight/bias gradients, as implicit GEMMs that never write the gathered inputs.

Why (shmlearn/nn/image_conv.py; the measurements: docs/performance.md, "Behind the code"): cuDNN
ran alexnet-small's 3-channel 5x5 conv far above its memory floor on an H100; an explicit im2col
buffer (168 MB at batch 1024) halves that but is itself most of the remaining traffic. Here each
program gathers its pixels' K = kh*kw*cin inputs straight from the NHWC image into registers (the
image is 6 MB at batch 1024: it stays in L2), so the only large traffic is what the floor counts:
the output written once (forward), the output gradient read once (weight gradient).

Forward: one program per BLOCK_P output pixels x all output channels:
    acc[P, N] = gather(x)[P, K] @ w[K, N]      (tl.dot, fp32 accumulation), + bias, stored NHWC.
Weight gradient: a fixed grid of programs, each walking its share of the pixel blocks:
    dw[K, N] += gather(x)[P, K]^T @ dy[P, N],  db[N] += sum_P dy[P, N]
into fp32 per-program partials, summed by torch afterwards (deterministic: no atomics).
K and N are padded to powers of two (>= 16, tl.dot's minimum) with masked loads.

Imported only for CUDA tensors with Triton installed; tests run the same kernels in Triton's
interpreter on the CPU (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_P = 128
"""Output pixels per program: a [128, K] gather and a [128, N] tile."""


@triton.jit
def _gather(x_ptr, p, kk, P, K, H, W, HO, WO, CIN: tl.constexpr, KW: tl.constexpr,
            SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr):
    """The [len(p), len(kk)] inputs under output pixels p (flat n*HO*WO + oy*WO + ox) at the
    window offsets kk (flat (ky*KW + kx)*CIN + ci) of the NHWC image; 0 outside it."""
    n = p // (HO * WO)
    rem = p % (HO * WO)
    oy = rem // WO
    ox = rem % WO
    ky = kk // (KW * CIN)
    kx = (kk // CIN) % KW
    ci = kk % CIN
    iy = oy[:, None] * SH - PH + ky[None, :]
    ix = ox[:, None] * SW - PW + kx[None, :]
    ok = (p[:, None] < P) & (kk[None, :] < K) & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)
    off = ((n[:, None].to(tl.int64) * H + iy) * W + ix) * CIN + ci[None, :]
    return tl.load(x_ptr + off, mask=ok, other=0.0)


@triton.jit
def _forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, P, K, N, H, W, HO, WO,
                    CIN: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                    PH: tl.constexpr, PW: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    kk = tl.arange(0, BLOCK_K)
    nn = tl.arange(0, BLOCK_N)
    a = _gather(x_ptr, p, kk, P, K, H, W, HO, WO, CIN, KW, SH, SW, PH, PW)
    wt = tl.load(w_ptr + kk[:, None] * N + nn[None, :], mask=(kk[:, None] < K) & (nn[None, :] < N), other=0.0)
    acc = tl.dot(a, wt)
    if HAS_BIAS:
        acc += tl.load(b_ptr + nn, mask=nn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + p[:, None] * N + nn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(p[:, None] < P) & (nn[None, :] < N))


@triton.jit
def _weight_grad_kernel(x_ptr, dy_ptr, dw_ptr, db_ptr, P, K, N, H, W, HO, WO, BLOCKS,
                        CIN: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                        PH: tl.constexpr, PW: tl.constexpr, PROGRAMS: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    nn = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    bacc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for blk in range(pid, BLOCKS, PROGRAMS):
        p = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)  # P < 2^31: blk * BLOCK fits int32
        a = _gather(x_ptr, p, kk, P, K, H, W, HO, WO, CIN, KW, SH, SW, PH, PW)
        g = tl.load(dy_ptr + p[:, None] * N + nn[None, :], mask=(p[:, None] < P) & (nn[None, :] < N), other=0.0)
        acc += tl.dot(tl.trans(a), g)
        bacc += tl.sum(g.to(tl.float32), axis=0)
    tl.store(dw_ptr + pid * BLOCK_K * BLOCK_N + kk[:, None] * BLOCK_N + nn[None, :], acc)
    tl.store(db_ptr + pid * BLOCK_N + nn, bacc)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _geometry(x: torch.Tensor, weight_shape, stride, padding):
    n, h, w, cin = x.shape  # NHWC
    cout, _, kh, kw = weight_shape
    (sh, sw), (ph, pw) = stride, padding
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    return dict(P=n * ho * wo, K=kh * kw * cin, N=cout, H=h, W=w, HO=ho, WO=wo, CIN=cin, KW=kw,
                SH=sh, SW=sw, PH=ph, PW=pw), (n, ho, wo, cout)


def forward(x_nhwc: torch.Tensor, w_kn: torch.Tensor, bias, weight_shape, stride, padding) -> torch.Tensor:
    """y as an NCHW tensor in channels_last memory (NHWC: what the kernel writes; a tensor of its
    own, not a view), x's dtype; w_kn: the weight as [K, cout], (ky, kx, ci) order."""
    geo, (n, ho, wo, cout) = _geometry(x_nhwc, weight_shape, stride, padding)
    y = torch.empty((n, cout, ho, wo), device=x_nhwc.device, dtype=x_nhwc.dtype, memory_format=torch.channels_last)
    grid = (triton.cdiv(geo["P"], BLOCK_P),)
    _forward_kernel[grid](x_nhwc, w_kn, bias if bias is not None else w_kn, y, **geo,
                          HAS_BIAS=bias is not None, BLOCK=BLOCK_P, BLOCK_K=_pow2(geo["K"]),
                          BLOCK_N=_pow2(geo["N"]), num_warps=4)
    return y


def weight_grad(x_nhwc: torch.Tensor, dy_nhwc: torch.Tensor, weight_shape, stride, padding,
                programs: int = 0):
    """(dw as [K, cout] fp32, db [cout] fp32) of the conv, from the NHWC image and output grad."""
    geo, _ = _geometry(x_nhwc, weight_shape, stride, padding)
    blocks = triton.cdiv(geo["P"], BLOCK_P)
    if programs <= 0:
        sms = (torch.cuda.get_device_properties(x_nhwc.device).multi_processor_count
               if x_nhwc.device.type == "cuda" else 4)
        programs = min(blocks, 4 * sms)
    bk, bn = _pow2(geo["K"]), _pow2(geo["N"])
    dw = torch.empty(programs, bk, bn, device=x_nhwc.device, dtype=torch.float32)
    db = torch.empty(programs, bn, device=x_nhwc.device, dtype=torch.float32)
    _weight_grad_kernel[(programs,)](x_nhwc, dy_nhwc.contiguous(), dw, db, **geo, BLOCKS=blocks,
                                     PROGRAMS=programs, BLOCK=BLOCK_P, BLOCK_K=bk, BLOCK_N=bn,
                                     num_warps=4)
    return dw.sum(0)[:geo["K"], :geo["N"]], db.sum(0)[:geo["N"]]
