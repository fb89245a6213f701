"""Bias-folded fully connected layer and the in-place ShiftRight / ShiftLeft realignment
(paper 002, section 4; docs/folded_linear.md).

The paper keeps a layer's bias as column 0 of its weight matrix, Wf = [b | W] (out x in+1), and
its input as [1 | X] (n x in+1), so the forward pass is one product [1 | X] Wf^T and the bias
gradient falls out of dWf = dY^T [1 | X]. Two in-place transforms move a row-major matrix
between the plain and the augmented layout:

    shift_right_: [a0 a1; a2 a3] -> [1 a0 a1; 1 a2 a3]   memory [a0 a1 a2 a3] -> [1 a0 a1 1 a2 a3]
    shift_left_:  [1 a0 a1; 1 a2 a3] -> [a0 a1; a2 a3]

Write-after-read hazard: element (i, j) moves by i+1 places (forward for ShiftRight, back for
ShiftLeft), so its new home holds an element of a later (ShiftRight) or earlier (ShiftLeft)
position that may not have been read yet; a plain overlapping copy destroys data. Every scheme
here first saves, in a helper buffer, exactly the elements that a write can reach before they
are read, then moves:
  * CUDA (Triton, shmlearn/nn/_shift_triton.py): rows run in parallel in any order, so the
    helper holds the elements that other rows' writes cover (the paper's triangle of
    rows(rows-1)/2 elements), filled by a first launch; a second launch moves every row,
    taking those elements from the helper.
  * CPU (or CUDA without Triton), torch ops: rows are moved in blocks in a fixed order (last
    block first for ShiftRight, first block first for ShiftLeft), so the only data a block's
    writes can reach before it is read is the block's own; the helper is a staging buffer of
    one block (about HELPER_ELEMS elements), so the extra memory stays bounded.

FoldedLinear does not call the shifts in its forward pass. In PyTorch the previous layer's
output is a fresh tensor with no room for the extra column, so an in-place ShiftRight would need
a copy into a larger buffer first: torch.cat([1, X]) is that copy and the shift in one kernel.
And ShiftLeft of Wf before dX = dY W is unnecessary: W = Wf[:, 1:] is a strided view with
leading dimension in+1, which cuBLAS takes as it is.

Measured on an H100 (docs/folded_linear.md): folding removes the bias-gradient reduction
kernel, so in fp32 the GPU work of a small layer's step is less than nn.Linear's, and equal at
large ones; but in bf16 the odd leading dimension in+1 breaks the 16-byte alignment that
Hopper's tensor-core GEMMs need, cuBLAS falls back to sm75 'align1' kernels, and a step is
several times slower. In eager mode at these layer
sizes every variant is bound by host launch overhead and nn.Linear (fewest Python ops) wins.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

HELPER_ELEMS = 1 << 18  # CPU scheme's staging buffer: 1 MiB of fp32, at least one row

__all__ = ["shift_right_", "shift_left_", "helper_size", "triton_available", "folded_matmul",
           "FoldedLinear", "fold_linears"]


# ---------------------------------------------------------------------------------------------
# In-place realignment
# ---------------------------------------------------------------------------------------------

_TRITON = None  # the _shift_triton module once imported; False when Triton is missing


def _triton():
    global _TRITON
    if _TRITON is None:
        try:
            from shmlearn.nn import _shift_triton  # lazy: Triton, on first use
            _TRITON = _shift_triton
        except ImportError:  # no Triton (CPU-only torch): the torch scheme serves CUDA too
            _TRITON = False
    return _TRITON


def triton_available() -> bool:
    """True when the Triton kernels can be imported (Triton installed)."""
    return bool(_triton())


def helper_size(rows: int, cols: int) -> int:
    """Elements of the helper the CUDA kernels need: sum over rows r of min(r, cols), which is
    rows*(rows-1)/2 when rows <= cols+1 (the paper's size)."""
    if rows <= cols + 1:
        return rows * (rows - 1) // 2
    return cols * (cols + 1) // 2 + (rows - cols - 1) * cols


def _check(buf: torch.Tensor, rows: int, cols: int) -> None:
    if rows < 0 or cols < 0:
        raise ValueError(f"rows and cols must be >= 0, got {rows} x {cols}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"buf must be a contiguous 1-D tensor, got shape {tuple(buf.shape)}")
    if buf.numel() < rows * (cols + 1):
        raise ValueError(f"buf holds {buf.numel()} elements; a {rows} x {cols} matrix needs "
                         f"{rows * (cols + 1)} (rows * (cols + 1)) to be shifted in place")


def _use_triton(buf: torch.Tensor, backend: str) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return False
    ok = buf.is_cuda and triton_available()
    if backend == "triton" and not ok:
        raise RuntimeError("backend='triton' needs a CUDA tensor and Triton installed")
    return ok


def _staging(buf, cols, helper):
    """The CPU scheme's helper: `rows_per_block` rows of `cols` elements."""
    if helper is not None and helper.numel() >= max(cols, 1):
        staging = helper
    else:
        staging = buf.new_empty(max(HELPER_ELEMS, cols, 1))
    return staging, max(1, staging.numel() // max(cols, 1))


def shift_right_(buf: torch.Tensor, rows: int, cols: int, *,
                 helper: Optional[torch.Tensor] = None, backend: str = "auto") -> torch.Tensor:
    """In place: the row-major rows x cols matrix in buf[:rows*cols] becomes the rows x (cols+1)
    matrix [1 | A] in buf[:rows*(cols+1)]. Returns buf.

    helper: optional scratch of buf's dtype and device, to avoid an allocation per call; the CUDA
    kernels need helper_size(rows, cols) elements, the torch scheme any number >= cols.
    backend: 'auto' (Triton for CUDA tensors when installed, else torch), 'torch' or 'triton'.
    """
    _check(buf, rows, cols)
    if _use_triton(buf, backend):
        return _triton().shift_right(buf, rows, cols, helper)
    staging, step = _staging(buf, cols, helper)
    for r1 in range(rows, 0, -step):  # last block first: later blocks' writes start at r1*(cols+1)
        r0 = max(0, r1 - step)        # >= r1*cols, past this block's data, so it is still intact
        n = r1 - r0
        block = staging[:n * cols].view(n, cols)
        block.copy_(buf[r0 * cols:r1 * cols].view(n, cols))  # save before overwriting
        out = buf[r0 * (cols + 1):r1 * (cols + 1)].view(n, cols + 1)
        out[:, 1:].copy_(block)
        out[:, 0] = 1
    return buf


def shift_left_(buf: torch.Tensor, rows: int, cols: int, *,
                helper: Optional[torch.Tensor] = None, backend: str = "auto") -> torch.Tensor:
    """In place: the row-major rows x (cols+1) matrix in buf[:rows*(cols+1)] loses its first
    column and becomes rows x cols in buf[:rows*cols] (buf[rows*cols:] is left unspecified).
    The inverse of shift_right_. Arguments as for shift_right_."""
    _check(buf, rows, cols)
    if _use_triton(buf, backend):
        return _triton().shift_left(buf, rows, cols, helper)
    staging, step = _staging(buf, cols, helper)
    for r0 in range(0, rows, step):  # first block first: earlier blocks wrote only below r0*cols
        r1 = min(rows, r0 + step)
        n = r1 - r0
        block = staging[:n * cols].view(n, cols)
        block.copy_(buf[r0 * (cols + 1):r1 * (cols + 1)].view(n, cols + 1)[:, 1:])
        buf[r0 * cols:r1 * cols].view(n, cols).copy_(block)
    return buf


# ---------------------------------------------------------------------------------------------
# Folded linear layer
# ---------------------------------------------------------------------------------------------

_ONES: dict = {}  # (device, dtype) -> 1-D ones, grown on demand: the [1 | X] column costs no fill


def _ones_column(n: int, like: torch.Tensor) -> torch.Tensor:
    key = (like.device, like.dtype)
    ones = _ONES.get(key)
    if ones is None or ones.numel() < n:
        ones = torch.ones(max(n, 256), device=like.device, dtype=like.dtype)
        _ONES[key] = ones
    return ones[:n].unsqueeze(1)


def _augment(x: torch.Tensor) -> torch.Tensor:
    """[1 | X]: the out-of-place ShiftRight, one cat kernel."""
    return torch.cat([_ones_column(x.shape[0], x), x], dim=1)


class _FoldedMatmul(torch.autograd.Function):
    """Y = [1 | X] Wf^T with one matrix product forward and one each for dX and dWf backward."""

    @staticmethod
    def forward(ctx, x, folded):
        x1 = _augment(x)
        ctx.save_for_backward(x1, folded)
        return x1.mm(folded.t())

    @staticmethod
    def backward(ctx, dy):
        x1, folded = ctx.saved_tensors
        dx = dfolded = None
        # Under autocast the forward product ran in a lower precision than x1 and folded hold;
        # do the backward products in dy's dtype too and hand back grads in the inputs' dtypes.
        if ctx.needs_input_grad[0]:
            # W = Wf[:, 1:] is a strided view (leading dimension in+1) that cuBLAS reads as it
            # is: this is where the paper needs ShiftLeft, and here it costs nothing.
            dx = dy.mm(folded[:, 1:].to(dy.dtype)).to(x1.dtype)
        if ctx.needs_input_grad[1]:
            dfolded = dy.t().mm(x1.to(dy.dtype)).to(folded.dtype)  # column 0 is the bias grad
        return dx, dfolded


def folded_matmul(x: torch.Tensor, folded: torch.Tensor, impl: str = "autograd") -> torch.Tensor:
    """y = [1 | x] folded^T for x of shape (*, in) and folded = [b | W] of shape (out, in+1).

    impl: 'autograd' (autograd differentiates the cat and the product: backward is two
    products, dX sliced out of an n x (in+1) one as a strided view) or 'function' (a custom
    autograd.Function: dX from the strided view W = folded[:, 1:]). Both launch the same
    kernels; 'autograd' is the default because it measured as fast on the GPU and faster in
    eager mode (less Python per call): docs/folded_linear.md, docs/performance.md.
    """
    flat = x.dim() != 2  # (*, in) -> (n, in); the 2-D case skips two view ops (host time)
    x2 = x.reshape(-1, x.shape[-1]) if flat else x
    if impl == "autograd":
        y = _augment(x2).mm(folded.t())
    elif impl == "function":
        y = _FoldedMatmul.apply(x2, folded)
    else:
        raise ValueError(f"impl must be 'function' or 'autograd', got {impl!r}")
    return y.reshape(*x.shape[:-1], folded.shape[0]) if flat else y


class FoldedLinear(nn.Linear):
    """Drop-in for nn.Linear (same constructor) that stores [b | W] in one parameter `folded` of
    shape (out_features, in_features + 1) and computes y = [1 | x] folded^T.

    `.weight` and `.bias` are views into `folded` (so nn.init and code that reads or writes them
    in place work, and isinstance(m, nn.Linear) holds for init code), but they are not
    parameters themselves: parameters() yields `folded` only, so an optimizer applies the same
    settings (weight decay too) to the bias as to the weights, and weight tying is refused.
    A state dict with nn.Linear's `weight`/`bias` keys loads too. With bias=False nothing is
    folded: `folded` is W and the forward is F.linear.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None, *, impl: str = "autograd") -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would register weight and bias
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bool(bias)
        self.impl = impl  # 'function' or 'autograd', see folded_matmul()
        self.folded = nn.Parameter(torch.empty(out_features, in_features + self.has_bias,
                                               device=device, dtype=dtype))
        self.reset_parameters()  # nn.Linear's own init, through the views below

    @property
    def weight(self) -> torch.Tensor:
        return self.folded[:, 1:] if self.has_bias else self.folded

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.folded[:, 0] if self.has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.has_bias:
            return F.linear(x, self.folded)
        return folded_matmul(x, self.folded, self.impl)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, impl: str = "autograd") -> "FoldedLinear":
        """A FoldedLinear with `linear`'s weights, device and dtype (copied, not shared)."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=w.device, dtype=w.dtype, impl=impl)
        with torch.no_grad():
            out.weight.copy_(w)
            if linear.bias is not None:
                out.bias.copy_(linear.bias)
        return out

    def to_linear(self) -> nn.Linear:
        """An nn.Linear with this layer's weights (copied)."""
        w = self.weight
        out = nn.Linear(self.in_features, self.out_features, self.has_bias,
                        device=w.device, dtype=w.dtype)
        with torch.no_grad():
            out.weight.copy_(w)
            if self.has_bias:
                out.bias.copy_(self.bias)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        w, b, f = prefix + "weight", prefix + "bias", prefix + "folded"
        if w in state_dict and f not in state_dict:  # an nn.Linear's state dict
            weight = state_dict.pop(w)
            bias = state_dict.pop(b, None)
            state_dict[f] = weight if bias is None else torch.cat([bias[:, None], weight], 1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.has_bias}, folded"


def fold_linears(module: nn.Module, *, impl: str = "autograd") -> nn.Module:
    """Replace every plain nn.Linear inside `module` (in place) by a FoldedLinear with the same
    weights; returns `module`. A bare nn.Linear is returned converted."""
    if type(module) is nn.Linear:
        return FoldedLinear.from_linear(module, impl=impl)
    for name, child in module.named_children():
        setattr(module, name, fold_linears(child, impl=impl))
    return module
