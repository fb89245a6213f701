"""Launches conv_pool's Triton kernels (_conv_pool_triton_kernels.py has them and their
algorithm): the unfolded copy of an image's input, the forward, the image block's weight gradient
and the in-place block's input and weight gradients; which tile configurations the autotuners try,
and which of them fit a device (nn/fit.py), asked before a kernel is chosen.

Host code only: shapes, strides, grids and launch options. Imported only for CUDA tensors with
Triton installed; tests run the same launches in Triton's interpreter on the CPU
(TRITON_INTERPRET=1), where one fixed configuration replaces the autotuner.
"""
from __future__ import annotations

import os

import torch
import triton

from shmlearn.nn import fit
from shmlearn.nn._conv_pool_triton_kernels import (forward_direct_kernel, forward_rows_kernel, input_grad_kernel,
                                                  sum_partials_kernel, unfold_kernel, weight_grad_direct_kernel,
                                                  weight_grad_rows_kernel)
from shmlearn.nn.conv_pool_limits import unfolds


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
                forward_rows_kernel)
        else:
            configs = [c for c in _CONFIGS_DIRECT if cin % c.kwargs["BLOCK_K"] == 0]
            _TUNED[key] = triton.autotune(configs, key=["Q", "H", "W", "CIN", "N", "KH", "KW"], **_AUTOTUNE)(
                forward_direct_kernel)
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
    return fit.pick(weight_grad_rows_kernel, {"xr_ptr": dtype, "dy_ptr": dtype, "code_ptr": torch.uint8,
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
        return fit.why_not(forward_rows_kernel, dict(ptrs, xr_ptr=dtype), consts,
                           fit.Candidate.of(4, None, BLOCK_Q=32, STACK=False), lim)
    consts = dict(CIN=cin, N=cout, KH=kh, KW=kw, PH=padding[0], PW=padding[1], HAS_BIAS=has_bias, BLOCK_N=_pow2(cout))
    return fit.why_not(forward_direct_kernel, dict(ptrs, x_ptr=dtype), consts,
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
    unfold_kernel[(triton.cdiv(rows, block),)](x_nhwc, xr, rows, h, w, hpad, wo, C=cin, ROW=weight_shape[3] * cin,
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
            forward_rows_kernel[(triton.cdiv(geo["Q"], bq),)](*args(xr), **kw_, BLOCK_Q=bq, STACK=INTERPRET_STACK)
        else:
            _tuned("rows")[lambda m: (triton.cdiv(geo["Q"], m["BLOCK_Q"]),)](*args(xr), **kw_)
    else:
        q = n * hp * wp
        kw_ = dict(common, Q=q, H=h, W=w, HP=hp, WP=wp, KW=kw, PH=ph, PW=pw)
        if _interpreted():
            bq = 32 if INTERPRET_STACK else 128
            forward_direct_kernel[(triton.cdiv(q, bq),)](*args(x_nhwc), **kw_, BLOCK_Q=bq, BLOCK_K=min(64, cin),
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
    weight_grad_rows_kernel[(programs,)](xr, dy_nhwc, code_nhwc, parts, **geo, BLOCKS=blocks, N=cout, KH=kh,
                                          XROW=xrow, KT=kt, BLOCK_N=bn, **launch)
    dw = torch.empty(weight_shape, device=xr.device, dtype=torch.float32,
                     memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    db = torch.empty(cout, device=xr.device, dtype=torch.float32)
    cols = (kt + 1) * bn
    # 65 programs for alexnet-small's 3 -> 32 5x5 block (256: 17, slower; docs/performance.md)
    block = 128 if _interpreted() else 64
    s_co, s_ci, s_ky, s_kx = dw.stride()
    sum_partials_kernel[(triton.cdiv(cols, block),)](parts, dw, db, programs, s_co, s_ci, s_ky, s_kx, CIN=cin, N=cout,
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
        input_grad_kernel[(triton.cdiv(p_total, bp),)](dy_nhwc, code_nhwc, weight, dx, p_total, h, w, hp, wp,
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
    weight_grad_direct_kernel[(programs, parts)](x_nhwc, dy_nhwc, code_nhwc, dw, db, q, h, w, hp, wp, blocks,
                                                  CIN=cin, N=cout, KW=kw, PH=ph, PW=pw, BLOCK_Q=bq, BLOCK_K=bk,
                                                  BLOCK_N=bn, num_warps=4)
    dw = dw.sum(0).view(kh, kw * cin, bn)[:, :, :cout].reshape(kh, kw, cin, cout).permute(3, 2, 0, 1)
    return dx, dw, db.sum(0)[:cout]
