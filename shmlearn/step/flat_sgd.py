"""SGD as one kernel over a strategy's flat buffers (the fast step's update on CUDA and the CPU).

Parameters and gradients already live in one flat buffer each (sync/base.py); `bind` puts the
momentum buffers in a third, laid out the same way, each parameter's `momentum_buffer` in the
optimizer's state a view of it. The update is then elementwise over three flat tensors: one Triton
kernel (_flat_sgd_triton.py) with as many programs as the buffer needs, where torch's fused SGD
gives each tensor's 65,536-value chunk to one block (10 blocks for alexnet-small's 150k
parameters, far slower than its 3 MB of traffic needs; docs/performance.md, "Behind the code").
The optimizer stays torch's SGD: its state_dict, checkpoints and schedule are unchanged, and every
other path still calls its step(). On the CPU the same contract is one call of torch's fused SGD
over the flat buffers (_flat_sgd_torch.py), which spares the optimizer's step() its Python around
the kernel.

With a weight copy (`bind(copy=...)`, fast.py's --weight-copy), the kernel also stores each new
weight cast to bf16 into a second flat buffer laid out as the parameters: the convolutions'
forward reads its weights there (conv_overlap.weight_copies) instead of casting every weight at
the start of every forward under autocast, a pass of 6 bytes a parameter on the forward's critical
path (ResNet-34: four kernels; their share of the step: docs/performance.md, "Behind the code").
The cast then costs 2 bytes a parameter inside the update, which the update in the backward runs
on a side stream. Whatever else writes the parameters (weight averaging, a parameter server's
broadcast, putting weights back) must call `refresh` after.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch

from shmlearn.step import _flat_sgd_torch


def why_not(optimizer, trainable: List[torch.nn.Parameter], params_flat: torch.Tensor) -> Optional[str]:
    """None if `bind` can take over this optimizer's update, else why not (one line)."""
    if type(optimizer) is not torch.optim.SGD:
        return f"optimizer {type(optimizer).__name__} is not SGD"
    if len(optimizer.param_groups) != 1:
        return "more than one parameter group"
    g = optimizer.param_groups[0]
    if len(g["params"]) != len(trainable) or any(a is not b for a, b in zip(g["params"], trainable)):
        return "the optimizer's parameters are not the model's trainable ones, in order"
    if g.get("maximize") or (g["momentum"] and g["dampening"]):
        return "maximize or dampening (torch's SGD keeps those)"
    if not params_flat.is_floating_point():
        return "parameters are not floating point"
    if _backend(params_flat.device) == "torch":
        return None if params_flat.device.type == "cpu" else \
            f"the update runs on CUDA and the CPU, not {params_flat.device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def backends(device: torch.device) -> Tuple[str, ...]:
    """The update's implementations that run on `device`, the default first: on CUDA the Triton
    kernel and torch's fused SGD over the same flat buffers (what a run takes while the kernel is
    not built on the machine: step/kernels.py), on the CPU torch's alone."""
    return ("triton", "torch") if _backend(device) == "triton" else ("torch",)


def _backend(device: torch.device) -> str:
    """triton (_flat_sgd_triton.py: CUDA, and Triton's interpreter, where its tests run it on the
    CPU) or torch (_flat_sgd_torch.py: torch's fused SGD over the flat buffers, on the CPU)."""
    return "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"


def _same_layout(flat: torch.Tensor, like: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The view of `flat` at `like`'s offset in `base` with `like`'s sizes and strides."""
    return flat.as_strided(like.size(), like.stride(),
                           flat.storage_offset() + like.storage_offset() - base.storage_offset())


class FlatUpdate:
    """SGD over the flat buffers (`bind`): calling it updates every parameter but the early ones;
    `take(i, grad)` updates early parameter i from its gradient alone, as soon as it exists (the
    update in the backward, fast.py)."""

    def __init__(self, kernel, group: dict, params_flat: torch.Tensor, grads_flat: torch.Tensor,
                 mom_flat: Optional[torch.Tensor], found_inf: torch.Tensor, trainable: List[torch.nn.Parameter],
                 early: Sequence[int], copy: Optional[torch.Tensor] = None):
        self._kernel, self._group = kernel, group
        self._p, self._g, self._m, self._skip = params_flat, grads_flat, mom_flat, found_inf
        self.copy = copy
        """The weights cast to a lower precision, laid out as params_flat (`bind`), or None."""
        self._lr_cache: Optional[torch.Tensor] = None
        self.ran = False
        """Whether the kernel was launched (so built, where it is Triton's: step/built.py)."""
        self.early = frozenset(early)
        base = params_flat.data_ptr()
        size = params_flat.element_size()
        # Each parameter's [start, end) in the buffers (they are views in model order, sync/base.py).
        self._ranges = [((p.data_ptr() - base) // size, (p.data_ptr() - base) // size + p.numel()) for p in trainable]
        self._views = [p.data for p in trainable]
        rest = [r for i, r in enumerate(self._ranges) if i not in self.early]
        merged: List[Tuple[int, int]] = []
        for a, b in rest:  # neighbours as one range: fewer, fuller programs
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        whole = merged == [(0, params_flat.numel())]
        self._table = None if whole or not merged else kernel.block_table(merged, params_flat.device)
        self._nothing = not merged

    def refresh(self) -> None:
        """The weight copy cast again from the parameters (after anything but this update wrote
        them); nothing without a copy."""
        if self.copy is not None:
            self.copy.copy_(self._p)

    def _sgd(self, p, g, m, **where) -> None:
        """The kernel over (p, g, m) with the optimizer's hyperparameters as they are now."""
        group = self._group
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor):  # a schedule that assigns floats (fast.py keeps tensors)
            if self._lr_cache is None:
                self._lr_cache = torch.zeros((), dtype=torch.float32, device=self._p.device)
            lr = self._lr_cache.fill_(float(lr))
        if not torch.compiler.is_compiling():  # Dynamo traces this update in a compiled step: no side effect there
            self.ran = True
        self._kernel.sgd_(p, g, m, lr, self._skip, momentum=float(group["momentum"]),
                          dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
                          nesterov=bool(group["nesterov"]), **where)

    def __call__(self) -> None:
        """One SGD step of every parameter not in `early`, from grads_flat, skipped while
        found_inf is non-zero."""
        if not self._nothing:
            self._sgd(self._p, self._g, self._m, table=self._table, copy=self.copy)

    def take(self, i: int, grad: torch.Tensor) -> None:
        """Parameter i's gradient (any float dtype, its parameter's shape) into its part of
        grads_flat and its SGD step, at once (skipped while found_inf is non-zero, as the rest):
        one kernel where grad is laid out as the parameter in memory, else a copy first."""
        a, b = self._ranges[i]
        m = self._m[a:b] if self._m is not None else None
        src = None
        view = self._views[i]
        if grad.shape == view.shape and grad.stride() == view.stride():  # dense, as the view is
            src = grad
        else:  # cuDNN chose another layout: copy it in as the parameter is laid out
            _same_layout(self._g, view, self._p).copy_(grad)
        self._sgd(self._p[a:b], self._g[a:b], m, src=src, copy=self.copy[a:b] if self.copy is not None else None)


def bind(optimizer: torch.optim.SGD, trainable: List[torch.nn.Parameter], params_flat: torch.Tensor,
         grads_flat: torch.Tensor, found_inf: torch.Tensor,
         early: Sequence[int] = (), copy: Optional[torch.Tensor] = None,
         backend: Optional[str] = None) -> Tuple[Optional[FlatUpdate], Optional[str]]:
    """(update, None): `update()` applies one SGD step of `optimizer`'s hyperparameters to
    params_flat from grads_flat, skipped while found_inf is non-zero, and the momentum buffers
    are now views of one flat buffer (their values kept). early: indices (into trainable) of
    parameters that `update.take` updates instead, each from its own gradient (update() leaves
    them alone). copy: a flat buffer of params_flat's length (`weight_copy`) that every update
    writes its new weights into, cast to the copy's dtype; filled from params_flat here. (None, why)
    where it cannot (why_not). backend: triton or torch (`backends`); None: the device's default
    (`_backend`). Call after any optimizer.load_state_dict: loading replaces the state's tensors."""
    why = why_not(optimizer, trainable, params_flat)
    if why is not None:
        return None, why
    if (backend or _backend(params_flat.device)) == "triton":
        from shmlearn.step import _flat_sgd_triton as kernel  # lazy: Triton, on first use
    else:
        kernel = _flat_sgd_torch

    group = optimizer.param_groups[0]
    mom_flat = None
    if float(group["momentum"]):
        mom_flat = torch.zeros_like(params_flat)
        for p in trainable:
            view = _same_layout(mom_flat, p.data, params_flat)
            old = optimizer.state[p].get("momentum_buffer")
            if old is not None:
                view.copy_(old)
            optimizer.state[p]["momentum_buffer"] = view
    if copy is not None:
        if copy.numel() != params_flat.numel() or not copy.is_contiguous() or copy.device != params_flat.device:
            raise ValueError("bind: copy must be a contiguous buffer of params_flat's length, on its device")
        copy.copy_(params_flat)
    return FlatUpdate(kernel, group, params_flat, grads_flat, mom_flat, found_inf, trainable, early, copy), None


def weight_copy(params_flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of params_flat's length in `dtype`, holding params_flat cast (`bind`'s copy)."""
    out = torch.empty(params_flat.numel(), dtype=dtype, device=params_flat.device)
    return out.copy_(params_flat.detach())


def copy_view(copy: torch.Tensor, param: torch.Tensor, params_flat: torch.Tensor) -> torch.Tensor:
    """The view of `copy` (`weight_copy`) that holds `param`'s values, laid out as `param` (which
    must be a view of params_flat: sync/base.py's flatten_parameters)."""
    return _same_layout(copy, param.data, params_flat)
