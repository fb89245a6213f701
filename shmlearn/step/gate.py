"""The fast step's skip for an optimizer whose torch class has no fused implementation that reads
the skip flag (options.implementation "foreach": RMSprop, NAdam, RAdam, Adamax, Adadelta, ASGD,
Rprop, Adafactor; Adagrad where torch has no fused Adagrad on the device).

The fast step never reads a loss on the host between two reads, so a step whose loss is not finite
(and capture's warm-up steps, graphs.py `_no_update`) must leave the weights and the optimizer's
state as they were with no host sync. torch's fused step does that itself (it reads `found_inf`);
for the others `FlagGate` wraps the optimizer's step(): it copies the weights and every state
tensor aside, calls step() (hooks, scheduler wrappers and all), then writes the copies back where
the flag is set (`torch.where`, so a NaN in what step() wrote is never kept). Device work only, so
it is captured with the rest of the step in the CUDA graph.

Cost: the weights and the state sit in a few flat buffers (one per device and dtype; the state's
tensors are made views into them), so the gate is two copies and two selects a buffer: for Adam-
like state (2 tensors a parameter) about 4x the parameters' bytes read and 3x written on top of
step() itself (a ViT-tiny's 2.7 M fp32 parameters: ~140 MB, ~50 us at an H200's bandwidth).
The memory: one more copy of the weights and the state."""
from __future__ import annotations

import copy
import inspect
import types
from typing import Dict, List, Tuple

import torch


def make_state(optimizer) -> None:
    """The state the first step() would create lazily, created now with the values torch gives
    it, so that the gate (and a CUDA graph) sees tensors that stay. By the class's own code: one
    step() with zero gradients, whose `_init_group` (torch's lazy initialisation, called once a
    param group before its update) is watched to take the state as it is before the update; the
    weights, gradients and that state are then put back. Existing state (a resumed run) keeps its
    values. Step hooks do not run (the step under torch's wrappers is called)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    weights = [p.detach().clone() for p in params]
    before: Dict[torch.Tensor, dict] = {}
    init = optimizer._init_group

    def watched(group, *args, **kwargs):
        out = init(group, *args, **kwargs)
        for p in group["params"]:
            if p not in before:
                before[p] = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                             for k, v in optimizer.state[p].items()}
        return out

    optimizer._init_group = watched
    try:
        with torch.no_grad():
            for p in params:
                p.grad = torch.zeros_like(p)
            inspect.unwrap(type(optimizer).step)(optimizer)
    finally:
        del optimizer._init_group  # the instance's attribute: the class's method again
        with torch.no_grad():
            for p, g, w in zip(params, grads, weights):
                p.copy_(w)
                p.grad = g
        for p, st in before.items():
            optimizer.state[p] = st


def _dense_view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of flat[offset : offset + like.numel()] with like's shape, and its strides where they
    are dense (channels_last state of a channels_last weight), else contiguous ones."""
    strides = like.stride()
    if not like.is_contiguous() and not like.is_contiguous(memory_format=torch.channels_last):
        strides = torch.empty(like.shape, device="meta").stride()
    return flat.as_strided(like.shape, strides, flat.storage_offset() + offset)


def flatten_state(optimizer) -> List[torch.Tensor]:
    """Every tensor of the optimizer's state moved into one flat buffer a (device, dtype), each
    state entry now a view into it with the same values; returns the buffers. None entries
    (SGD's momentum_buffer at momentum 0) stay None. A value that is not a tensor cannot be put
    back on the device: RuntimeError (torch's foreach optimizers keep none)."""
    entries: Dict[Tuple[torch.device, torch.dtype], List[Tuple[dict, str, torch.Tensor]]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if v is None:
                    continue
                if not isinstance(v, torch.Tensor):
                    raise RuntimeError(f"optimizer {type(optimizer).__name__}: state {k!r} is a "
                                       f"{type(v).__name__}, not a tensor: the fast step cannot put it back on the device")
                entries.setdefault((v.device, v.dtype), []).append((optimizer.state[p], k, v))
    flats = []
    for (dev, dtype), items in entries.items():
        flat = torch.empty(sum(v.numel() for _, _, v in items), dtype=dtype, device=dev)
        at = 0
        for st, k, v in items:
            view = _dense_view(flat, at, v)
            view.copy_(v)
            st[k] = view
            at += v.numel()
        flats.append(flat)
    return flats


def state_on(optimizer, device: torch.device) -> None:
    """State tensors kept elsewhere (a CPU step count loaded from a checkpoint) moved to `device`,
    where a capturable step() asks for them (torch's load_state_dict does so only for groups that
    were capturable when saved)."""
    for st in optimizer.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.device != device:
                st[k] = v.to(device)


class FlagGate:
    """optimizer.step() made to leave the weights and the state as they were while `found_inf`
    is non-zero (the module docstring). params_flat: the strategy's flat weights, which hold the
    optimizer's parameters (any that lie outside it are gated one by one)."""

    def __init__(self, optimizer, found_inf: torch.Tensor, params_flat: torch.Tensor):
        dev = found_inf.device
        if dev.type == "cuda":
            state_on(optimizer, dev)
        make_state(optimizer)
        self.optimizer = optimizer
        self.flats = flatten_state(optimizer)
        base = params_flat.untyped_storage().data_ptr()
        outside = [p for g in optimizer.param_groups for p in g["params"]
                   if p.requires_grad and p.untyped_storage().data_ptr() != base]
        live = [params_flat.detach()] + [p.detach() for p in outside] + self.flats
        self.pairs = [(t, torch.empty_like(t)) for t in live]
        """(what step() writes, where it is kept during the step)."""
        self.found_inf = found_inf
        self.skip = torch.zeros((), dtype=torch.bool, device=dev)
        self._views = [(st, k, v) for st in optimizer.state.values() for k, v in st.items() if v is not None]
        self._checked = False
        self._own = optimizer.__dict__.get("step")  # a scheduler's wrapper of step(), or None
        inner = optimizer.step  # bound: the class's step with its hooks, or that wrapper
        gate = self

        def step(opt, *args, **kwargs):
            return gate.run(inner, *args, **kwargs)

        # A bound method, as torch's LR schedulers expect of optimizer.step (they wrap its __func__),
        # marked as theirs where their wrapper is inside (else their first step() warns of an override).
        if hasattr(inner, "_wrapped_by_lr_sched"):
            step._wrapped_by_lr_sched = True
        optimizer.step = types.MethodType(step, optimizer)

    def run(self, inner, *args, **kwargs):
        with torch.no_grad():
            for live, kept in self.pairs:
                kept.copy_(live)
        out = inner(*args, **kwargs)
        with torch.no_grad():
            torch.gt(self.found_inf, 0, out=self.skip)
            for live, kept in self.pairs:
                torch.where(self.skip, kept, live, out=live)
        if not self._checked:  # once, on the host: step() updated the state in place, as torch's do
            self._checked = True
            for st, k, v in self._views:
                if st.get(k) is not v:
                    raise RuntimeError(f"optimizer {type(self.optimizer).__name__} replaced its state {k!r} in step() "
                                       "instead of updating it: the fast step cannot put it back")
        return out

    def remove(self) -> None:
        """optimizer.step is what it was before (its state stays in the flat buffers, as views)."""
        if self._own is not None:
            self.optimizer.step = self._own
        else:
            self.optimizer.__dict__.pop("step", None)
