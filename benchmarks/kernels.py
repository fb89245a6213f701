"""The kernels issue 18 names as far from their limit, each alone, against the alternatives a
generic change could use, and against its own memory floor.

    PYTHONPATH=. python benchmarks/kernels.py --device cuda --batch-sizes 128,1024 --out kernels.json

Each case is one layer's forward and backward in bf16 and channels_last, as the fast step runs
them (alexnet-small and the ResNet CIFAR stem, 3x32x32 images):

* first-conv: the convolution of the 3-channel image (weight and bias gradients; the image needs
  none). Variants: as is; the image and the weight zero-padded to 4 or 8 channels once (what a
  data-side pad would give: the extra weights get zero gradients and stay zero, so the model is
  the same); padded to 8 inside the step (F.pad each step); the same conv in NCHW; as an im2col
  gather plus GEMMs (--image-conv im2col), eager and torch.compile'd; by shmlearn's Triton
  implicit-GEMM kernels (--image-conv triton); all in shmlearn/nn/image_conv.py.
* max-pool: 2x2 max-pool forward and backward of the first conv's output. Variants: aten in
  channels_last, aten in NCHW, torch.compile'd (Inductor), and a reshape + amax (same forward;
  the backward splits a tie's gradient where max-pool gives it to one input, so ties aside).
* bias-grad: a conv bias's gradient, the sum of the output gradient over N, H, W. Variants: aten
  sum, torch.compile'd, and a matmul with a ones vector (the reduction on tensor cores).
* mlp-head: alexnet-small's head (1024 -> 64 -> 32 -> 10, ReLU between), forward and backward:
  torch's ops, Inductor's, and the fused kernels of --mlp-head triton (their GPU check, too);
* conv-pool-1/2/3: alexnet-small's three conv 5x5 + ReLU + 2x2 max-pool blocks, forward and
  backward. Variants: aten's three ops in channels_last, torch.compile'd, and shmlearn's fused
  Triton kernels (--conv-pool triton, shmlearn/nn/conv_pool.py; for blocks 2 and 3 also with
  each backward forced: shmlearn's kernels, cuDNN's). Floor: the fused block's bytes.
* batch-gather: the loader's read of a batch from a device-resident CIFAR-sized uint8 dataset:
  index_select against advanced indexing x[idx], from NCHW and from the NHWC copy.
* conv-overlap-1/3/4: a ResNet 3x3 convolution of stage 1, 3 and 4 at 32x32 input (64 channels
  at 32x32, 256 at 8x8, 512 at 4x4), forward and backward (input and weight gradients): torch's
  one convolution_backward, and its two GEMMs on two streams (--conv-overlap all,
  shmlearn/nn/conv_overlap.py); also conv-pool-2's fused block with the overlapped backward.
  Floor: bytes, as the others (these are GEMMs, so read it against the FLOP rate too).

Every variant is captured in a CUDA graph (as the step is) and timed by CUDA events: 5 runs of
200 replays after warm-up, the median, with p25-p75. Inputs are random, never zeros. The floor is
the bytes the case must move (read once, written once) over this device's measured copy bandwidth
(shmlearn/bench/roofline.py). --device cpu runs each variant eagerly and only checks that they
agree (tests/bench/test_kernels.py); with --cpu-time it also times them (perf_counter, 5 runs
of 200 calls), which means something only for the cases that run on the CPU in training
(batch-gather).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BF16 = torch.bfloat16


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def first_conv_cases(batch: int, device, *, cout: int = 32, k: int = 5) -> Dict[str, Callable]:
    """name -> step(); each step computes the weight and bias gradients into .grad."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x3 = torch.randn(batch, 3, 32, 32, generator=g).to(device, BF16)
    w3 = torch.randn(cout, 3, k, k, generator=g).to(device, BF16) * 0.1
    bias = torch.randn(cout, generator=g).to(device, BF16)
    gy = torch.randn(batch, cout, 32, 32, generator=g).to(device, BF16)

    def padded(c):
        return F.pad(x3, (0, 0, 0, 0, 0, c - 3)), F.pad(w3, (0, 0, 0, 0, 0, c - 3))

    def case(x, w, fmt, pad_to=None):
        x = _cl(x) if fmt == "cl" else x.contiguous()
        w = (_cl(w) if fmt == "cl" else w.contiguous()).clone().requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        gy_ = _cl(gy) if fmt == "cl" else gy.contiguous()

        def step():
            w.grad = b.grad = None
            xin = F.pad(x, (0, 0, 0, 0, 0, pad_to - x.shape[1])) if pad_to else x
            wk = F.pad(w, (0, 0, 0, 0, 0, pad_to - w.shape[1])) if pad_to else w
            F.conv2d(xin, wk, b, padding=k // 2).backward(gy_)
            return w.grad, b.grad
        return step

    def im2col_case(compiled: bool, triton: bool = False):
        from shmlearn.nn.image_conv import im2col_conv2d, triton_conv2d
        x = _cl(x3)
        w = _cl(w3).clone().requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        gy_ = _cl(gy)
        fn = triton_conv2d if triton else im2col_conv2d
        fn = torch.compile(fn, dynamic=False) if compiled else fn

        def step():
            w.grad = b.grad = None
            fn(x, w, b, 1, k // 2).backward(gy_)
            return w.grad, b.grad
        return step

    x4, w4 = padded(4)
    x8, w8 = padded(8)
    cases = {"c3 channels_last": case(x3, w3, "cl"), "c4 padded once": case(x4, w4, "cl"),
             "c8 padded once": case(x8, w8, "cl"), "c8 padded each step": case(x3, w3, "cl", pad_to=8),
             "c3 nchw": case(x3, w3, "nchw"), "im2col + GEMM (--image-conv im2col)": im2col_case(False)}
    if device.type == "cuda":
        cases["im2col + GEMM, compiled"] = im2col_case(True)
        cases["Triton implicit GEMM (--image-conv triton)"] = im2col_case(False, triton=True)
    return cases


def first_conv_bytes(batch: int, cout: int = 32, k: int = 5) -> int:
    """Read the image, the weight and the output gradient, write the output (forward) and the
    weight and bias gradients: bf16, each once."""
    return 2 * (batch * 3 * 32 * 32 + cout * 3 * k * k + 2 * batch * cout * 32 * 32 + cout * 3 * k * k + cout)


def max_pool_cases(batch: int, device, *, c: int = 32, hw: int = 32) -> Dict[str, Callable]:
    g = torch.Generator(device="cpu").manual_seed(1)
    x0 = torch.randn(batch, c, hw, hw, generator=g).to(device, BF16)
    gy0 = torch.randn(batch, c, hw // 2, hw // 2, generator=g).to(device, BF16)

    def amax_pool(x):  # channels_last memory is (N, H, W, C): pool over a view of it
        n, ch, h, w = x.shape
        y = x.permute(0, 2, 3, 1).reshape(n, h // 2, 2, w // 2, 2, ch).amax(dim=(2, 4))
        return y.permute(0, 3, 1, 2)

    def case(fmt, fn):
        x = (_cl(x0) if fmt == "cl" else x0.contiguous()).clone().requires_grad_(True)
        gy = _cl(gy0) if fmt == "cl" else gy0.contiguous()

        def step():
            x.grad = None
            y = fn(x)
            y.backward(gy)
            return y.detach(), x.grad
        return step

    pool = lambda t: F.max_pool2d(t, 2)  # noqa: E731
    cases = {"aten channels_last": case("cl", pool), "aten nchw": case("nchw", pool),
             "reshape+amax channels_last": case("cl", amax_pool)}
    if device.type == "cuda":
        cases["compiled channels_last"] = case("cl", torch.compile(pool, dynamic=False))
    return cases


def max_pool_bytes(batch: int, c: int = 32, hw: int = 32) -> int:
    """Forward: read x, write y; backward: read the output gradient (and the argmax or x), write
    the input gradient: bf16."""
    big, small = batch * c * hw * hw, batch * c * (hw // 2) ** 2
    return 2 * (big + small + small + big + big)


def bias_grad_cases(batch: int, device, *, c: int = 32, hw: int = 32) -> Dict[str, Callable]:
    g = torch.Generator(device="cpu").manual_seed(2)
    gy = _cl(torch.randn(batch, c, hw, hw, generator=g).to(device, BF16))
    ones = torch.ones(1, batch * hw * hw, device=device, dtype=BF16)
    rows = gy.permute(0, 2, 3, 1).reshape(-1, c)  # a view: channels_last is (N*H*W, C) row-major

    def aten():
        return gy.sum(dim=(0, 2, 3), dtype=torch.float32)

    def mm():
        return torch.mm(ones, rows).reshape(c).float()

    cases = {"aten sum": aten, "ones @ grad (tensor cores)": mm}
    if device.type == "cuda":
        cases["compiled sum"] = torch.compile(aten, dynamic=False)
    return cases


def bias_grad_bytes(batch: int, c: int = 32, hw: int = 32) -> int:
    return 2 * batch * c * hw * hw + 4 * c


CONV_POOL_BLOCKS = {"conv-pool-1": (3, 32, 32), "conv-pool-2": (32, 32, 16), "conv-pool-3": (32, 64, 8)}
"""alexnet-small's three conv (5x5) + ReLU + 2x2 max-pool blocks: (in, out channels, image side)."""


def conv_pool_cases(block: str):
    cin, cout, hw = CONV_POOL_BLOCKS[block]

    def build(batch: int, device) -> Dict[str, Callable]:
        """Forward and backward of the block from a random pooled gradient: weight and bias
        gradients, and the input's after the first block (as in the step)."""
        g = torch.Generator(device="cpu").manual_seed(3)
        x0 = _cl(torch.randn(batch, cin, hw, hw, generator=g).to(device, BF16))
        w0 = _cl(torch.randn(cout, cin, 5, 5, generator=g).to(device, BF16) * (cin * 25) ** -0.5)
        b0 = torch.randn(cout, generator=g).to(device, BF16) * 0.1
        gy = _cl(torch.randn(batch, cout, hw // 2, hw // 2, generator=g).to(device, BF16))
        x_grad = cin != 3

        def aten(x, w, b):
            return F.max_pool2d(F.relu(F.conv2d(x, w, b, 1, 2)), 2)

        def fused(x, w, b, overlap=False):
            from shmlearn.nn.conv_pool import conv_relu_pool2d
            return conv_relu_pool2d(x, w, b, 2, overlap)

        def case(fn, backward="cudnn"):
            x = x0.clone().requires_grad_(x_grad)
            w = w0.clone().requires_grad_(True)
            b = b0.clone().requires_grad_(True)

            def step():
                from shmlearn.nn import conv_pool
                conv_pool.BACKWARD, before = backward, conv_pool.BACKWARD
                try:
                    w.grad = b.grad = x.grad = None
                    fn(x, w, b).backward(gy)
                finally:
                    conv_pool.BACKWARD = before
                return (w.grad, b.grad) + ((x.grad,) if x_grad else ())
            return step

        cases = {"conv + relu + max_pool2d (aten, channels_last)": case(aten)}
        if device.type == "cuda":
            cases["compiled (Inductor)"] = case(torch.compile(aten, dynamic=False))
            cases["fused Triton (--conv-pool triton)"] = case(fused)
            if x_grad:  # the later blocks' two backwards, each forced
                cases["fused, backward by shmlearn's kernels"] = case(fused, "triton")
                cases["fused, backward by cuDNN"] = case(fused, "cudnn")
                cases["fused, cuDNN backward on two streams (--conv-overlap)"] = case(
                    lambda x, w, b: fused(x, w, b, overlap=True))
        return cases

    def nbytes(batch: int) -> int:
        """The fused block's traffic, bf16: read x, write y (+ uint8 codes); backward: read the
        pooled gradient, the codes and x (write the input gradient after the first block)."""
        x, y = batch * cin * hw * hw, batch * cout * (hw // 2) ** 2
        return 2 * x + 2 * y + y + 2 * y + y + 2 * x + (2 * x if cin != 3 else 0)
    return build, nbytes


MLP_HEAD = (1024, 64, 32, 10)
"""alexnet-small's classifier head: 1024 -> 64 -> 32 -> 10, ReLU between."""


def mlp_head_cases(batch: int, device) -> Dict[str, Callable]:
    """The head forward and backward from a random output gradient (bf16 autocast, fp32 weights
    as in training): the input's gradient and every weight and bias gradient; torch's ops,
    Inductor's, and the fused kernels (--mlp-head triton)."""
    from torch import nn
    from shmlearn.nn import mlp_head
    g = torch.Generator(device="cpu").manual_seed(5)
    torch.manual_seed(5)
    layers = []
    for a, b in zip(MLP_HEAD, MLP_HEAD[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    base = nn.Sequential(*layers[:-1]).to(device)
    x0 = torch.randn(batch, MLP_HEAD[0], generator=g).to(device, BF16)
    gy = torch.randn(batch, MLP_HEAD[-1], generator=g).to(device, BF16)

    def case(net):
        x = x0.clone().requires_grad_(True)

        def step():
            x.grad = None
            for p in base.parameters():
                p.grad = None
            with torch.autocast(device.type, dtype=BF16):
                out = net(x)
            out.backward(gy)
            return (out, x.grad) + tuple(p.grad for p in base.parameters())
        return step

    cases = {"linear + relu x3 (aten)": case(base)}
    if device.type == "cuda":
        cases["compiled (Inductor)"] = case(torch.compile(base, dynamic=False))
        fused = copy.deepcopy(base)
        mlp_head.convert(fused, "triton")
        for a, b in zip(fused.parameters(), base.parameters()):  # one set of parameters and .grads
            a.data = b.data
        fused_params = list(fused.parameters())

        def fused_step(step=case(fused)):
            for a, b in zip(fused_params, base.parameters()):
                a.grad = None
            out, xg, *_ = step()
            return (out, xg) + tuple(a.grad for a in fused_params)
        cases["fused Triton (--mlp-head triton)"] = fused_step
    return cases


def mlp_head_bytes(batch: int) -> int:
    """bf16: read x and the weights, write the output; backward: read the output's gradient, x
    and the weights again, write x's gradient and the weights' (the small activations left out)."""
    w = sum(a * b for a, b in zip(MLP_HEAD, MLP_HEAD[1:]))
    return 2 * (batch * MLP_HEAD[0] * 3 + 3 * w)


CONV_OVERLAP_STAGES = {"conv-overlap-1": (64, 32), "conv-overlap-3": (256, 8), "conv-overlap-4": (512, 4)}
"""ResNet (CIFAR stem, 32x32 input) 3x3 convolutions: (channels, map side) of stages 1, 3 and 4."""


def conv_overlap_cases(stage: str):
    c, hw = CONV_OVERLAP_STAGES[stage]

    def build(batch: int, device) -> Dict[str, Callable]:
        """A 3x3 convolution (no bias, as in a ResNet) forward and backward from a random output
        gradient: the input's and the weight's gradients; torch's and two streams."""
        from shmlearn.nn.conv_overlap import conv2d
        g = torch.Generator(device="cpu").manual_seed(4)
        x0 = _cl(torch.randn(batch, c, hw, hw, generator=g).to(device, BF16))
        w0 = _cl(torch.randn(c, c, 3, 3, generator=g).to(device, BF16) * (c * 9) ** -0.5)
        gy = _cl(torch.randn(batch, c, hw, hw, generator=g).to(device, BF16))

        def case(fn):
            x = x0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)

            def step():
                w.grad = x.grad = None
                fn(x, w).backward(gy)
                return w.grad, x.grad
            return step

        # On the CPU the two halves run one after the other: the split is what the test checks.
        return {"aten conv2d (one convolution_backward)": case(lambda x, w: F.conv2d(x, w, None, 1, 1)),
                "two streams (--conv-overlap all)": case(lambda x, w: conv2d(x, w, None, (1, 1), (1, 1)))}

    def nbytes(batch: int) -> int:
        """bf16: forward reads x and w, writes y; backward reads the gradient, x and w, writes the
        input's and the weight's gradients."""
        act, w = batch * c * hw * hw, c * c * 9
        return 2 * (act + w + act + act + act + w + act + w)
    return build, nbytes


FLAT_SGD_PARAMS = 21_282_122
"""flat-sgd-copy: ResNet-34's (CIFAR, 10 classes) parameter count; the batch size is not used."""


def flat_sgd_copy_cases(batch: int, device) -> Dict[str, Callable]:
    """One flat SGD step (momentum, Nesterov, weight decay) over ResNet-34's parameter count, as the
    fast step's update (flat_sgd.py): without the weight copy, with it (--weight-copy: the kernel
    also stores each new weight in bf16), and the step followed by torch's cast into the copy;
    the same from a bf16 gradient (`take`, the update in the backward). Each variant on its own
    buffers from the same random start: its output is the new weights (and copy)."""
    n = FLAT_SGD_PARAMS
    g = torch.Generator(device="cpu").manual_seed(7)
    p0, g0, m0 = (torch.randn(n, generator=g).to(device) for _ in range(3))
    lr = torch.tensor(1e-3, device=device)
    skip = torch.zeros((), device=device)
    cases: Dict[str, Callable] = {}
    if device.type != "cuda":
        return {"torch cast only (no kernel on the CPU)": lambda: (p0.to(BF16),)}
    from shmlearn.step import _flat_sgd_triton as k

    def case(with_copy: bool, torch_cast: bool, src_bf16: bool, block: int = k.BLOCK, warps: int = k.NUM_WARPS):
        p, gr, m = p0.clone(), g0.clone(), m0.clone()
        src = g0.to(BF16) if src_bf16 else None
        cp = torch.empty(n, dtype=BF16, device=device)

        def step():
            saved = k.BLOCK, k.NUM_WARPS  # the launch's shape (a whole-buffer step has no block table)
            k.BLOCK, k.NUM_WARPS = block, warps
            try:
                k.sgd_(p, gr, m, lr, skip, momentum=0.9, dampening=0.0, weight_decay=5e-4, nesterov=True, src=src,
                       copy=cp if with_copy else None)
            finally:
                k.BLOCK, k.NUM_WARPS = saved
            if torch_cast:
                cp.copy_(p)
            return (p, cp) if (with_copy or torch_cast) else (p,)
        return step

    for src_bf16 in (False, True):
        tail = ", bf16 gradient (take)" if src_bf16 else ""
        cases[f"sgd + copy in the kernel{tail}"] = case(True, False, src_bf16)  # first: the reference
        cases[f"sgd{tail}"] = case(False, False, src_bf16)
        cases[f"sgd, then torch's cast{tail}"] = case(False, True, src_bf16)
    for block, warps in ((512, 4), (2048, 4), (2048, 8), (4096, 8), (1024, 8)):  # the launch's shape
        for with_copy in (True, False):
            cases[f"sgd{' + copy' if with_copy else ''}, BLOCK {block}, {warps} warps"] = case(with_copy, False, False,
                                                                                             block, warps)
    return cases


def flat_sgd_copy_bytes(batch: int) -> int:
    """Read weights, gradient and momentum, write weights and momentum (fp32): the step without a copy."""
    return 20 * FLAT_SGD_PARAMS


GATHER_IMAGES = 50_000  # a CIFAR-10-sized training set, device-resident as the loader keeps it


def batch_gather_cases(batch: int, device) -> Dict[str, Callable]:
    """The loader's read of one batch (shmlearn/data/loader.py `_read`): the rows of a random
    permutation's slice out of the uint8 image tensor, as index_select (what the loader does) and
    as advanced indexing x[idx] (what it did), from NCHW storage and from the NHWC copy that
    --channels-last reads (the result permuted to NCHW, as the loader returns it)."""
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randint(0, 256, (GATHER_IMAGES, 3, 32, 32), dtype=torch.uint8, generator=g).to(device)
    nhwc = x.permute(0, 2, 3, 1).contiguous()
    idx = torch.randperm(GATHER_IMAGES, generator=g)[:batch].to(device)
    return {
        "index_select": lambda: (x.index_select(0, idx),),  # first: the reference
        "x[idx]": lambda: (x[idx],),
        "index_select, NHWC": lambda: (nhwc.index_select(0, idx).permute(0, 3, 1, 2),),
        "x[idx], NHWC": lambda: (nhwc[idx].permute(0, 3, 1, 2),),
    }


def batch_gather_bytes(batch: int) -> int:
    """Read the batch's images and indices, write the images."""
    return batch * (2 * 3 * 32 * 32 + 8)


CASES = {"first-conv": (first_conv_cases, first_conv_bytes), "max-pool": (max_pool_cases, max_pool_bytes),
         "batch-gather": (batch_gather_cases, batch_gather_bytes),
         "bias-grad": (bias_grad_cases, bias_grad_bytes), "mlp-head": (mlp_head_cases, mlp_head_bytes),
         "flat-sgd-copy": (flat_sgd_copy_cases, flat_sgd_copy_bytes),
         **{name: conv_pool_cases(name) for name in CONV_POOL_BLOCKS},
         **{name: conv_overlap_cases(name) for name in CONV_OVERLAP_STAGES}}


def time_graph(step: Callable, device, replays: int = 200) -> List[float]:
    """Microseconds per call of step, captured in a CUDA graph: 5 runs of `replays` replays."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        graph.replay()
    from shmlearn.bench.common import replay_us
    return replay_us(graph, replays)


def time_cpu(step: Callable, calls: int = 200) -> List[float]:
    """Microseconds per call of step on the CPU, by perf_counter: 5 runs of `calls` calls after
    warm-up (--cpu-time)."""
    for _ in range(10):
        step()
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    return out


def agree(results: List, rtol: float = 0.05, windows: bool = False) -> bool:
    """Whether every variant's outputs match the first's (the padded conv's weight gradient on
    its first 3 channels, with zeros on the rest). windows: compare input gradients summed over
    each 2x2 pooling window (where a tie's gradient went may differ, not how much there was)."""
    def norm(i, t):
        t = t.float()
        return F.avg_pool2d(t, 2) if windows and i == 1 else t
    ref = [norm(i, t) for i, t in enumerate(results[0])]
    for res in results[1:]:
        for i, (r, t) in enumerate(zip(ref, res)):
            t = norm(i, t)
            if t.shape != r.shape:
                if t[:, 3:].abs().max() != 0:
                    return False
                t = t[:, :3]
            if not torch.allclose(t, r.reshape(t.shape), rtol=rtol, atol=rtol * r.abs().max().item()):
                return False
    return True


def run_case(name: str, batch: int, device, bandwidth: float = None, cpu_time: bool = False) -> dict:
    build, nbytes = CASES[name]
    cases = build(batch, device)
    outs = [[t.detach().clone() for t in (r if isinstance(r, tuple) else (r,))] for r in (f() for f in cases.values())]
    res = {"case": name, "batch": batch, "outputs_agree": agree(outs, windows=name == "max-pool"),
           "bytes": nbytes(batch), "variants": []}
    if bandwidth:
        res["floor_us"] = nbytes(batch) / bandwidth * 1e6
    if device.type == "cuda" or cpu_time:
        for v, step in cases.items():
            us = time_graph(step, device) if device.type == "cuda" else time_cpu(step)
            q = statistics.quantiles(us, n=4)
            row = {"variant": v, "us": statistics.median(us), "p25": q[0], "p75": q[2], "n": len(us)}
            if bandwidth:
                row["of_floor"] = res["floor_us"] / row["us"]
            res["variants"].append(row)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch-sizes", default="128,1024")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default="kernels.json")
    p.add_argument("--cpu-time", action="store_true",
                   help="--device cpu: time each variant too (perf_counter), not only check that they agree")
    a = p.parse_args(argv)
    from shmlearn.bench.common import environment
    from shmlearn.bench.roofline import measure_limits
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    limits = measure_limits(device, copy_mib=1024 if device.type == "cuda" else 64,
                            matmul_n=8192 if device.type == "cuda" else 256)
    doc = {"env": environment("nccl" if device.type == "cuda" else "gloo"), "limits": vars(limits),
           "method": __doc__, "results": []}
    for b in (int(v) for v in a.batch_sizes.split(",")):
        for name in a.cases.split(","):
            r = run_case(name, b, device, limits.bandwidth, a.cpu_time)
            doc["results"].append(r)
            print(f"{name} B={b}: floor {r['floor_us']:.1f} us, outputs agree: {r['outputs_agree']}", flush=True)
            for v in r["variants"]:
                print(f"    {v['us']:9.1f} us ({v['p25']:.1f}-{v['p75']:.1f}) {v['of_floor']:6.1%} of floor  {v['variant']}")
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
