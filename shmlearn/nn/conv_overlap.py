"""A convolution's two backward GEMMs on two CUDA streams at once, and the weight's GEMM left
running until the backward ends (--conv-overlap off|small|all|auto).

Why: a convolution's backward is two independent GEMMs, the input's gradient and the weight's,
and torch runs them one after the other on one stream. At a small batch neither fills a large
GPU: ResNet-18's last stage at batch 128 on 32x32 images (4x4 maps, 512 channels) makes a
2048 x 512 input gradient, 64 tiles of 128 x 128 for 132 SMs, which cuDNN splits along K and
then sums (the workspace zeroing in the profile). Only the input's gradient is on the backward's
critical path: the layer before needs it at once, while no one reads the weight's gradient until
the update. So the weight's GEMM goes to a side stream and, where the step allows it
(`deferred`), is not waited for when the op returns: the main stream goes on with the layers
before it (their input gradients and BatchNorm backwards, which leave SMs idle at small
batches) while the side stream works through the weight GEMMs; the step joins the streams once,
when the backward ends, before it reads the gradients. Inside the step's CUDA graph the forks
and the join are edges of the graph, not launches.

Measured on one H100 (bf16, channels_last, the compiled fast step; docs/performance.md, "Behind
the code"):
* joined in each op (sixth round): one large convolution alone gained, but the whole step gained
  little with small GEMMs overlapped, and lost with all of them at batch 1024;
* deferred (seventh round): every convolution, resnet18 and resnet34 gained at batch 128 and
  1024, and `all` beat `small` everywhere.
Hence the modes:
* auto (the default): on CUDA every plain nn.Conv2d where the step defers (fast.py: a strategy
  that adopts its gradients whole), small where it cannot; off on the CPU;
* small: plain nn.Conv2d layers whose input-gradient GEMM has at most SMALL_ROWS rows (batch x
  output height x width), decided per shape inside the op;
* all: every plain nn.Conv2d, and conv_pool's fused blocks' cuDNN backward (always joined in
  the op: their weights are cast outside it);
* off: torch's one call.

Exact: the same cuDNN calls with the same arguments (convolution_backward, once for the input's
gradient and once for the weight's and the bias's), so the same results as torch's one call
wherever cuDNN picks the same algorithms (bit for bit in the tests on the CPU; on the GPU
benchmarks/step_agreement.py trains resnet18 and resnet34 30 steps with deterministic cuDNN,
off, joined and deferred, eager and compiled, to the same bits).

`convert` switches the modules' classes in place, both ways (parameters, buffers and state_dict
unchanged); the forward stays torch's F.conv2d, so Inductor sees it as before (layout choices,
max-autotune's templates). Under autocast the parameters are cast inside the op's Function and
their gradients cast back by the op on the stream that made them, so nothing on the main stream
reads a weight gradient before the join. What a deferred GEMM still reads after the op returns
(the output gradient, the input, the weight) is kept from reuse: by the allocator through
record_stream, and by Inductor through INDUCTOR_OPTIONS (fast.py compiles with them when it
defers).

Weight copies (`set_weight_copies`, `weight_copies`; fast.py's --weight-copy): within
`weight_copies`, a convolution given a copy of its weight in autocast's dtype convolves with that
copy instead of casting its fp32 weight, which autocast does at the start of every forward (a
pass over every weight on the forward's critical path). The fast step's update writes the copy as
it writes the weights (flat_sgd.py), so the copy always holds the weight cast; outside the
context (evaluation, a user's own calls) the module casts as before, so a copy that another
writer of the weights has made stale is never read there.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from shmlearn.nn._lazy import OnFirstUse

MODES = ("off", "small", "all", "auto")
"""--conv-overlap: torch's one call; two streams for small GEMMs; for every convolution; auto:
small on CUDA, off elsewhere."""
SMALL_ROWS = 128 * 8 * 8
"""small: the largest batch x output height x width overlapped (a CIFAR ResNet's stages 3 and 4
at batch 128; none of its convolutions at batch 1024)."""
ALL_ROWS = 1 << 62

_SIDE: Dict[Tuple[int, int], "torch.cuda.Stream"] = {}
"""(device index, i) -> the i-th side stream of that device."""
_DEFER = {"on": False, "streams": 1, "next": 0, "sink": None}
"""Inside `deferred`: a split backward leaves its weight GEMM on the side stream, and hands the
weight's gradient to the sink if one is given. A module global, not thread-local: autograd runs a
CUDA backward on a thread of its own."""
_COPIES = {"on": False}
"""Inside `weight_copies`: convolutions read their weights from the copy they were given."""
_PENDING: Set[Tuple[int, int]] = set()
"""Side streams (device index, i) holding weight GEMMs not yet joined (`join`)."""
INDUCTOR_OPTIONS = {"allow_buffer_reuse": False, "inplace_buffers": False}
"""torch.compile options for a graph whose backward may be deferred: Inductor then never writes a
new result into a buffer it has seen die (the gradient and the input that a deferred weight GEMM
still reads on the side stream); buffers freed to the allocator are safe (record_stream)."""


def usable(device: torch.device) -> Optional[str]:
    """None if --conv-overlap small or all can run on this device, else why not (one line)."""
    if device.type != "cuda":
        return f"--conv-overlap small|all needs a CUDA device (this run is on {device.type}); use off or auto"
    return None


def resolve(mode: str, device: torch.device, deferred: bool = False) -> str:
    """The mode that runs: auto is all on CUDA where the step defers the weight GEMMs (`deferred`),
    small on CUDA where it cannot, else off."""
    if mode != "auto":
        return mode
    if usable(device) is not None:
        return "off"
    return "all" if deferred else "small"


def max_rows(mode: str) -> int:
    """The largest input-gradient GEMM (rows) a resolved mode overlaps."""
    return {"off": 0, "small": SMALL_ROWS, "all": ALL_ROWS}[mode]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _side_stream(device: torch.device, i: int = 0) -> "torch.cuda.Stream":
    key = (_index(device), i)
    if key not in _SIDE:
        # The default priority is the lowest: in a step captured at a higher one (fast.py's
        # high_priority_capture) the weight GEMMs yield SMs to the critical path.
        _SIDE[key] = torch.cuda.Stream(device=key[0])
    return _SIDE[key]


Sink = Callable[[int, Optional[torch.Tensor], Optional[torch.Tensor], tuple], None]
"""sink(slot, dw, db, placeholders): takes a convolution's weight (and bias) gradient for good
(`deferred`); placeholders: the (dw, db) tensors the op returns in their place, so that the
caller can tell them from a gradient that autograd summed with another."""


@contextlib.contextmanager
def deferred(device: torch.device, on: bool = True, streams: int = 1, sink: Optional[Sink] = None):
    """Within: a convolution whose backward is split (the modes above) leaves its weight's (and
    bias's) GEMM running on the side stream when the op returns; the backward goes on with the
    layers before it meanwhile, and the side stream works through the weight GEMMs as the main
    stream's chain of input gradients and BatchNorm backwards leaves SMs idle. On exit the
    caller's stream waits for them (`join`). Only where nothing reads a weight gradient before
    the exit: the fast step's adopted gradients (fast.py), compiled with INDUCTOR_OPTIONS; never
    with gradients accumulated into .grad (AccumulateGrad's add would read them early).
    streams: how many side streams take the deferred GEMMs in turn (more than one lets the weight
    GEMMs, which do not depend on each other, run side by side when the main stream is done).
    sink: a convolution with a `slot` (`set_slots`) hands it its weight's and bias's gradients
    as the op's backward makes them, in the GEMM's own dtype, on the stream that made them (the
    side stream where split), instead of returning them: the op returns uninitialized tensors
    in their place, which the caller must not read (fast.py's update in the backward writes them
    into the flat buffer and applies their SGD step there). On the CPU too, in line."""
    cuda = device.type == "cuda"
    if not (on and cuda) and sink is None:
        yield
        return
    before = dict(_DEFER)
    _DEFER.update(on=on and cuda, streams=max(1, int(streams)), next=0, sink=sink)
    try:
        yield
    finally:
        _DEFER.update(before)
        if cuda:
            join(device)


def pending_streams(device: torch.device) -> list:
    """The side streams with weight GEMMs deferred and not yet joined on this device (what a
    reader of those gradients before `join` must wait for: step/buckets.py's all-reduces)."""
    if device.type != "cuda":
        return []
    index = _index(device)
    return [_SIDE[k] for k in sorted(k for k in _PENDING if k[0] == index)]


def join(device: torch.device) -> None:
    """The caller's current stream waits for the weight GEMMs left on the side stream."""
    index = _index(device)
    main = torch.cuda.current_stream(index)
    for key in sorted(k for k in _PENDING if k[0] == index):
        _PENDING.discard(key)
        main.wait_stream(_SIDE[key])


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """t laid out as empty_like(ref) (what the fake op says), copied only where cuDNN chose
    another layout (the layout is read off a meta tensor: no allocation in the step)."""
    if t.stride() == torch.empty_like(ref, device="meta").stride():
        return t
    return torch.empty_like(ref, dtype=t.dtype).copy_(t)


def backward_impl(grad, x, weight, stride, padding, dilation, groups, mask, rows, grad_dtype, may_defer, slot=-1,
                  weight_is_copy=False):
    """(dx, dw, db) of F.conv2d, dw and db in grad_dtype (the parameters' own: autocast's cast
    back, done where the GEMM ran); an empty tensor for each one mask does not ask for. rows: the
    largest batch x output height x width whose two GEMMs run apart (max_rows). may_defer: inside
    `deferred`, leave the weight's GEMM running on the side stream (the caller's parameters are
    nn.Conv2d's; conv_pool's blocks cast their weights outside and pass False). slot: this
    convolution's number for the sink of `deferred` (-1: none): where a sink is set, dw and db go
    to it and the op returns uninitialized tensors for them. weight_is_copy: weight is the
    parameter's copy (`weight_copies`), which the sink's update writes."""
    need_dx, need_dw, need_db = mask
    sink = _DEFER["sink"] if (may_defer and slot >= 0 and (need_dw or need_db)) else None
    split = need_dx and (need_dw or need_db) and grad.numel() // grad.shape[1] <= rows
    bias_sizes = [weight.shape[0]] if need_db else None

    def half(m):
        return torch.ops.aten.convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation,
                                                   False, [0, 0], groups, m)

    def params(dw, db):  # as the parameters are laid out (the fake's empty_like) and typed
        return (_like(dw, weight).to(grad_dtype) if need_dw else None,
                db.to(grad_dtype) if need_db else None)

    if sink is not None:  # what the op returns for dw and db (made here, on the caller's stream)
        placeholders = (torch.empty_like(weight, dtype=grad_dtype) if need_dw else None,
                        weight.new_empty(weight.shape[0], dtype=grad_dtype) if need_db else None)

    def hand_over(dw, db):  # to the sink, on the current stream; the placeholders in their place
        sink(slot, _like(dw, weight) if need_dw else None, db if need_db else None, placeholders)
        return placeholders

    if not split:
        dx, dw, db = half([need_dx, need_dw, need_db])
        dw, db = hand_over(dw, db) if sink is not None else params(dw, db)
    else:  # on the CPU the same split, one after the other (torch.cuda.stream(None) does nothing)
        defer = may_defer and _DEFER["on"]
        i = 0
        if defer:  # the side streams in turn
            i = _DEFER["next"]
            _DEFER["next"] = (i + 1) % _DEFER["streams"]
        main = torch.cuda.current_stream(grad.device) if grad.is_cuda else None
        side = _side_stream(grad.device, i) if grad.is_cuda else None
        if side is not None:
            side.wait_stream(main)  # the fork: grad, x and weight are ready
        with torch.cuda.stream(side):
            dw, db = half([False, need_dw, need_db])[1:]
            if sink is None:
                dw, db = params(dw, db)
        dx, _, _ = half([True, False, False])
        if sink is not None:
            if side is not None and (weight.dtype == grad_dtype or weight_is_copy):
                # No autocast cast: weight may be the parameter itself (or its copy, which the
                # update writes too), which the input gradient's GEMM (just queued on main)
                # reads and the sink is about to update.
                side.wait_stream(main)
            with torch.cuda.stream(side):
                dw, db = hand_over(dw, db)
        if side is not None and defer:
            # Left running: the allocator must not hand out what the side stream still reads
            # (it waits for the side stream's work before reusing grad's, x's and weight's
            # blocks; in a capture, until the capture ends), nor reuse dw's and db's blocks
            # (made on the side stream) while main reads them after the join.
            for t in (grad, x, weight):
                t.record_stream(side)
            for t in (dw, db):
                if t is not None:
                    t.record_stream(main)
            _PENDING.add((_index(grad.device), i))
        elif side is not None:
            # The join, before returning: Inductor may free or reuse grad's and x's buffers
            # once this op returns, and dw, db are read on main from here on.
            main.wait_stream(side)
    empty = grad.new_empty  # a new one each: outputs may not alias each other
    return (_like(dx, x) if need_dx else empty(0), dw if need_dw else empty(0),
            db if need_db else empty(0))


_ops = OnFirstUse(lambda: _define_ops())
"""The custom op (the backward), defined on first use."""


def _define_ops():
    @torch.library.custom_op("shmlearn::conv2d_backward_overlap", mutates_args=())
    def backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: List[int],
                    padding: List[int], dilation: List[int], groups: int, mask: List[bool],
                    rows: int, grad_dtype: torch.dtype, may_defer: bool, slot: int,
                    weight_is_copy: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward_impl(grad, x, weight, stride, padding, dilation, groups, mask, rows, grad_dtype, may_defer,
                             slot, weight_is_copy)

    @backward_op.register_fake
    def _(grad, x, weight, stride, padding, dilation, groups, mask, rows, grad_dtype, may_defer, slot,
          weight_is_copy):
        empty = grad.new_empty
        return (torch.empty_like(x) if mask[0] else empty(0),
                torch.empty_like(weight, dtype=grad_dtype) if mask[1] else empty(0),
                empty(weight.shape[0], dtype=grad_dtype) if mask[2] else empty(0))

    from torch.utils.flop_counter import conv_backward_flop, register_flop_formula

    @register_flop_formula(torch.ops.shmlearn.conv2d_backward_overlap)
    def _(grad_shape, x_shape, w_shape, stride, padding, dilation, groups, mask, rows, grad_dtype, may_defer, slot,
          weight_is_copy, *, out_shape=None, **kwargs):
        return conv_backward_flop(grad_shape, x_shape, w_shape, None, stride, padding, dilation, False,
                                  [0, 0], groups, mask, out_val=out_shape)

    return backward_op


def convolution_backward(grad, x, weight, stride, padding, dilation, groups, mask, rows=ALL_ROWS,
                         grad_dtype: Optional[torch.dtype] = None, may_defer: bool = False, slot: int = -1,
                         weight_is_copy: bool = False):
    """(dx, dw, db) as torch.ops.aten.convolution_backward gives them for a 2-D convolution (None
    where mask says no), the two GEMMs on two streams on CUDA where the GEMM has at most `rows`
    rows (max_rows); dw and db in grad_dtype (default: weight's). may_defer, slot,
    weight_is_copy: see backward_impl."""
    dx, dw, db = _ops()(grad, x, weight, list(stride), list(padding), list(dilation), groups,
                        [bool(m) for m in mask], rows, grad_dtype or weight.dtype, may_defer, slot, weight_is_copy)
    return dx if mask[0] else None, dw if mask[1] else None, db if mask[2] else None


class _Conv2d(torch.autograd.Function):
    """F.conv2d of x and the parameters cast to `dtype` (autocast's cast, inside: the backward
    returns the parameters' gradients in their own dtype straight from the op, so that nothing
    on the main stream reads a gradient the side stream may still be computing, `deferred`).
    copy: the weight already cast (`weight_copies`), read instead of casting it; its gradient is
    still the weight's."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, rows, dtype, slot, copy=None):
        w = copy if copy is not None else weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        ctx.save_for_backward(x, w)
        ctx.conv = (stride, padding, dilation, groups, rows, slot, copy is not None)
        ctx.grad_dtype = weight.dtype
        return F.conv2d(x, w, b, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, rows, slot, is_copy = ctx.conv
        mask = ctx.needs_input_grad[:3]
        dx, dw, db = convolution_backward(grad, x, weight, stride, padding, dilation, groups, mask, rows,
                                          ctx.grad_dtype, True, slot, is_copy)
        return dx, dw, db, None, None, None, None, None, None, None, None


def conv2d(x, weight, bias=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1,
           rows: int = ALL_ROWS, slot: int = -1, copy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.conv2d with the backward of this module (numeric padding, 4-D x): the two GEMMs apart
    where batch x output height x width <= rows; slot: its number for `deferred`'s sink; copy:
    weight cast to autocast's dtype already (read instead of casting it, under autocast of that
    dtype only)."""
    args = (tuple(stride), tuple(padding), tuple(dilation), groups, rows)
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return _Conv2d.apply(x, weight, bias, *args, weight.dtype, slot)
    # Cast as autocast casts conv2d's inputs: x outside the Function (its cast's backward runs on
    # the main stream, where dx is made), the parameters inside (above).
    dt = torch.get_autocast_dtype(dev)
    if copy is not None and copy.dtype != dt:
        copy = None
    with torch.autocast(dev, enabled=False):
        return _Conv2d.apply(x.to(dt), weight, bias, *args, dt, slot, copy)


class OverlapConv2d(nn.Conv2d):
    """An nn.Conv2d whose backward runs its two GEMMs on two streams (up to its overlap_rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:  # unbatched (C, H, W): torch's module
            return super().forward(x)
        copy = self.__dict__.get("weight_copy") if _COPIES["on"] else None
        return conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups,
                      self.overlap_rows, self.grad_slot, copy)  # attributes: Dynamo guards on their values


def _qualifies(m: nn.Module) -> bool:
    return type(m) in (nn.Conv2d, OverlapConv2d) and m.padding_mode == "zeros" and not isinstance(m.padding, str)


def convert(model: nn.Module, mode: str) -> int:
    """Switch every plain nn.Conv2d of model to `mode` (off, small or all; resolve auto first), in
    place, both ways; how many may run overlapped (small: decided per shape, in the op). Run it
    after conv_pool.convert and image_conv.convert: the convolutions they switched are theirs."""
    if mode not in ("off", "small", "all"):
        raise ValueError(f"convert: mode {mode!r}: one of off, small, all")
    found = [m for m in model.modules() if _qualifies(m)]
    if found and mode != "off":
        _ops()  # now, not while Dynamo traces the first forward (a graph break: see conv_pool.convert)
    for m in found:
        if mode == "off":
            m.__class__ = nn.Conv2d
            m.__dict__.pop("overlap_rows", None)
            m.__dict__.pop("grad_slot", None)
            m.__dict__.pop("weight_copy", None)
        else:
            m.__class__ = OverlapConv2d
            m.__dict__["overlap_rows"] = max_rows(mode)
            m.__dict__.setdefault("grad_slot", -1)
    return len(found) if mode != "off" else 0


def set_slots(model: nn.Module, trainable: List[nn.Parameter]) -> Dict[int, Tuple[int, Optional[int], str]]:
    """Number the overlapped convolutions (`convert`) whose parameters a sink may take (`deferred`):
    slot -> (index in `trainable` of the weight, of the bias or None, the module's name). Only trainable weights
    held in one place (a shared weight or module gets its gradient from two places; autograd
    would add the returned placeholder to the other; fast.py also checks that each slot is
    taken once per backward). Clears the slots of every other
    convolution. A weight that a model also uses outside its module (F.conv2d(x, conv.weight))
    must not be given a slot: the sink would see only this module's part of its gradient."""
    where = {id(p): i for i, p in enumerate(trainable)}
    holders: Dict[int, int] = {}  # parameter -> how many places in the model hold it
    for _, m in model.named_modules(remove_duplicate=False):  # a module at two places counts twice
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    slots: Dict[int, Tuple[int, Optional[int], str]] = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Conv2d):
            continue
        m.__dict__.pop("grad_slot", None)
        if type(m) is not OverlapConv2d:
            continue
        m.__dict__["grad_slot"] = -1
        w, b = m.weight, m.bias
        if id(w) not in where or holders[id(w)] > 1 or (b is not None and b.requires_grad
                                                         and (id(b) not in where or holders[id(b)] > 1)):
            continue
        slot = len(slots)
        slots[slot] = (where[id(w)], where[id(b)] if b is not None and id(b) in where else None, name)
        m.__dict__["grad_slot"] = slot
    return slots


def clear_slots(model: nn.Module) -> None:
    """No convolution of model hands its gradients to a sink any more."""
    for m in model.modules():
        if type(m) is OverlapConv2d:
            m.__dict__["grad_slot"] = -1


@contextlib.contextmanager
def weight_copies(on: bool = True):
    """Within: each convolution given a weight copy (`set_weight_copies`) reads it under autocast
    of its dtype, instead of casting its weight. Only where the copy is known to hold the weight
    cast: the fast step's forward, whose update writes it (fast.py)."""
    before = _COPIES["on"]
    _COPIES["on"] = bool(on)
    try:
        yield
    finally:
        _COPIES["on"] = before


def set_weight_copies(model: nn.Module, view_of: Callable[[nn.Parameter], Optional[torch.Tensor]]) -> int:
    """Give each overlapped convolution (`convert`) the copy of its weight that view_of returns
    (None: none); how many got one. view_of=lambda p: None clears them all."""
    n = 0
    for m in model.modules():
        if type(m) is not OverlapConv2d:
            continue
        v = view_of(m.weight)
        if v is None:
            m.__dict__.pop("weight_copy", None)
            continue
        if v.shape != m.weight.shape or v.stride() != m.weight.stride():
            raise ValueError("set_weight_copies: a copy must be laid out as its weight")
        m.__dict__["weight_copy"] = v
        n += 1
    return n
