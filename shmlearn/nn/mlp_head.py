"""A classifier head of 2 or 3 Linear layers with ReLU between them as three kernels, forward and
backward (--mlp-head off|triton|auto).

Why: small CNNs end in a few narrow Linear layers (alexnet-small: 1024 -> 64 -> 32 -> 10). Run by
torch, each layer is a cuBLAS GEMM forward and two backward, plus the bias gradient and ReLU's
mask: about 15 launches, each a few microseconds on a GPU, for work that takes well under one
(at batch 128: 17 MFLOP). The step of a small net at a small batch is bound by those launches.
Here one Triton kernel (_mlp_head_triton.py) runs the forward, and two the backward: one over row
blocks (the small layers' gradients and the first hidden layer's), one over the input's columns
(the first layer's weight gradient and the input's gradient).

Only in fp16 or bf16 (under autocast, or half inputs): each layer's output is rounded to that
dtype before ReLU and each gradient once, as autocast's Linear does; the sums run in another order
than cuBLAS's, so results agree to rounding, not bit for bit. In fp32, or for inputs with more
than 2 dimensions, the same layers run as torch's ops.

What qualifies: plain nn.Linear layers, consecutive children of an nn.Sequential with nn.ReLU
between each two, the chain ending with a Linear (the last 3 Linears of a longer chain), every
out_features <= MAX_WIDTH. `convert` switches the modules' classes in place, both ways: the first
Linear runs the head (MLPHead), the ReLUs and later Linears pass their input through; parameters,
buffers and state_dict stay as they are.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from shmlearn.nn._lazy import OnFirstUse
from shmlearn.nn import fit
from shmlearn.nn.image_conv import triton_usable

MODES = ("off", "triton", "auto")
"""--mlp-head: torch's ops; shmlearn's Triton kernels; auto: triton on CUDA with Triton installed."""
MAX_WIDTH = 128
"""Largest out_features of a fused layer: a program holds a row block's whole activations."""
MAX_LAYERS = 3


def usable(device: torch.device) -> Optional[str]:
    """None if --mlp-head triton can run on this device, else why not (one line)."""
    return triton_usable(device, "--mlp-head triton", "off")


def resolve(mode: str, device: torch.device) -> str:
    """The mode that runs: auto is triton on CUDA with Triton installed, else off."""
    if mode != "auto":
        return mode
    return "triton" if device.type == "cuda" and usable(device) is None else "off"


_ops = OnFirstUse(lambda: _define_ops())
"""The custom ops (forward, backward), defined on first use."""


def _define_ops():
    @torch.library.custom_op("shmlearn::mlp_head", mutates_args=())
    def head(x: torch.Tensor, weights: List[torch.Tensor],
             biases: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """biases: an empty tensor where a layer has none (a list of optional tensors does not
        round-trip through the op's autograd)."""
        from shmlearn.nn import _mlp_head_triton as kernels  # lazy: Triton, on first use
        return kernels.forward(x, weights, [b if b.numel() else None for b in biases])

    @head.register_fake
    def _(x, weights, biases):
        b = x.shape[0]
        h2 = x.new_empty(b, weights[1].shape[0]) if len(weights) == 3 else x.new_empty(0)
        return x.new_empty(b, weights[-1].shape[0]), x.new_empty(b, weights[0].shape[0]), h2

    @torch.library.custom_op("shmlearn::mlp_head_backward", mutates_args=())
    def head_backward(grad: torch.Tensor, x: torch.Tensor, h1: torch.Tensor, h2: torch.Tensor,
                      weights: List[torch.Tensor], has_bias: List[bool], need_dx: bool) -> List[torch.Tensor]:
        """[dx (empty when not needed), dW_1..L, db_1..L (empty where no bias)]."""
        from shmlearn.nn import _mlp_head_triton as kernels  # lazy: Triton, on first use
        dx, dws, dbs = kernels.backward(grad.contiguous(), x, h1, h2, weights, has_bias, need_dx)
        return ([dx if dx is not None else x.new_empty(0)] + dws
                + [d if d is not None else x.new_empty(0) for d in dbs])

    @head_backward.register_fake
    def _(grad, x, h1, h2, weights, has_bias, need_dx):
        return ([torch.empty_like(x) if need_dx else x.new_empty(0)] + [torch.empty_like(w) for w in weights]
                + [x.new_empty(w.shape[0]) if hb else x.new_empty(0) for w, hb in zip(weights, has_bias)])

    def setup(ctx, inputs, output):
        x, weights, biases = inputs
        _, h1, h2 = output
        ctx.save_for_backward(x, h1, h2, *weights)
        ctx.has_bias = [b.numel() > 0 for b in biases]

    def backward(ctx, grad, _g_h1, _g_h2):
        x, h1, h2, *weights = ctx.saved_tensors
        n = len(weights)
        need_dx = bool(ctx.needs_input_grad[0])
        got = head_backward(grad, x, h1, h2, weights, ctx.has_bias, need_dx)
        dbs = [d if hb else None for d, hb in zip(got[1 + n:], ctx.has_bias)]
        return (got[0] if need_dx else None), got[1:1 + n], dbs

    head.register_autograd(backward, setup_context=setup)
    return head, head_backward


def mlp_head(x: torch.Tensor, weights: List[torch.Tensor], biases: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """linear(relu(linear(x, W1, b1)), W2, b2) (and a third layer where given) of a 2-D x by the
    fused kernels, in the autocast dtype (or x's, fp16 or bf16)."""
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    with torch.autocast(dev, enabled=False):
        return _ops()[0](x.to(dt).contiguous(), [w.to(dt).contiguous() for w in weights],
                         [b.to(dt) if b is not None else x.new_empty(0, dtype=dt) for b in biases])[0]


class MLPHead(nn.Linear):
    """An nn.Linear that also runs the ReLUs and Linears after it in its nn.Sequential (which
    then pass their input through): the fused head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = [self] + self.__dict__["_fused_rest"]
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        # torch's ops, the same layers: inputs the kernels do not take, and evaluation (whose batch
        # sizes would each build kernels of their own; conv_pool.ConvReluPool2d says what it cost)
        if x.dim() != 2 or dt not in (torch.float16, torch.bfloat16) or not self.training:
            h = F.linear(x, self.weight, self.bias)
            for layer in layers[1:]:
                h = F.linear(F.relu(h), layer.weight, layer.bias)
            return h
        return mlp_head(x, [m.weight for m in layers], [m.bias for m in layers])


class FusedHeadLinear(nn.Linear):
    """A Linear that the MLPHead before it has applied."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class FusedHeadReLU(nn.ReLU):
    """A ReLU that the MLPHead before it has applied."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


_LINEARS = (nn.Linear, MLPHead, FusedHeadLinear)
_RELUS = (nn.ReLU, FusedHeadReLU)


def heads(model: nn.Module) -> List[List[nn.Module]]:
    """Every head of model this module computes, as [linear, relu, linear(, relu, linear)]:
    consecutive children of an nn.Sequential."""
    found = []
    for seq in model.modules():
        if not isinstance(seq, nn.Sequential):
            continue
        kids = list(seq)
        i = 0
        while i < len(kids):
            j = i  # the longest Linear (ReLU Linear)* run from i whose layers all qualify
            if type(kids[i]) in _LINEARS and kids[i].out_features <= MAX_WIDTH:
                while (j + 2 < len(kids) and type(kids[j + 1]) in _RELUS and type(kids[j + 2]) in _LINEARS
                       and kids[j + 2].out_features <= MAX_WIDTH):
                    j += 2
            if j > i:
                first = max(i, j - 2 * (MAX_LAYERS - 1))  # the last MAX_LAYERS Linears
                found.append(kids[first:j + 1])
            i = j + 1
    return found


def head_why_not(chain: List[nn.Module], dtype: torch.dtype, device: torch.device,
                 check_fit: bool = True) -> Optional[str]:
    """None if the fused kernels run this head ([linear, relu, linear, ...]) on device for
    inputs of dtype, else why not: fp32 (the kernels are bf16/fp16 only; torch's ops run it), or
    the device's limits against Triton's compiled metadata of the three kernels (fit.py). The
    dtype check holds in Triton's interpreter too; the limits do not apply there, nor where
    check_fit is False (no compile: a caller that will not run the kernels)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{str(dtype).replace('torch.', '')}: the fused head runs in bf16 or fp16 only"
    if fit.interpreted() or device.type != "cuda" or not check_fit:
        return None
    from shmlearn.nn import _mlp_head_triton as kernels  # lazy: Triton, on first use
    linears = chain[0::2]
    return kernels.head_why_not([m.out_features for m in linears], [m.bias is not None for m in linears], dtype,
                                fit.limits(device))


def describe(chain: List[nn.Module]) -> str:
    """'head 1024->64->32->10' for notes."""
    linears = chain[0::2]
    return "head " + "->".join(str(n) for n in [linears[0].in_features] + [m.out_features for m in linears])


def convert(model: nn.Module, mode: str, check=None) -> int:
    """Switch every qualifying head of model to `mode` (off or triton; resolve auto first), in
    place, both ways; how many heads run fused. check: chain -> None or why the head cannot run
    fused (`head_why_not`); such heads keep torch's ops."""
    if mode not in ("off", "triton"):
        raise ValueError(f"convert: mode {mode!r}: one of off, triton")
    found = heads(model)
    if mode == "triton" and check is not None:
        found = [c for c in found if check(c) is None]
    if found and mode == "triton":
        _ops()  # now, not while Dynamo traces the first forward (a graph break: see conv_pool.convert)
    for chain in found:
        first, rest = chain[0], chain[2::2]
        if mode == "triton":
            first.__class__ = MLPHead
            first.__dict__["_fused_rest"] = rest  # not a submodule: they stay registered where they are
            for m in chain[1:]:
                m.__class__ = FusedHeadReLU if isinstance(m, nn.ReLU) else FusedHeadLinear
        else:
            first.__dict__.pop("_fused_rest", None)
            for m in chain:
                m.__class__ = nn.ReLU if isinstance(m, nn.ReLU) else nn.Linear
    return len(found) if mode == "triton" else 0
