"""SGD as one kernel over a strategy's flat buffers (the fast step's update on CUDA).

Parameters and gradients already live in one flat buffer each (sync/base.py); `bind` puts the
momentum buffers in a third, laid out the same way, each parameter's `momentum_buffer` in the
optimizer's state a view of it. The update is then elementwise over three flat tensors: one
Triton kernel (_flat_sgd_triton.py) with as many programs as the buffer needs, where torch's
fused SGD gives each tensor's 65,536-value chunk to one block (10 blocks for alexnet-small's
150k parameters: 15.6 us on an H100, for 3 MB of traffic). The optimizer stays torch's SGD: its
state_dict, checkpoints and schedule are unchanged, and every other path still calls its step().
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional, Tuple

import torch


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
    if params_flat.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the kernel runs on CUDA, not {params_flat.device.type}"
    if not params_flat.is_floating_point():
        return "parameters are not floating point"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def _same_layout(flat: torch.Tensor, like: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The view of `flat` at `like`'s offset in `base` with `like`'s sizes and strides."""
    return flat.as_strided(like.size(), like.stride(),
                           flat.storage_offset() + like.storage_offset() - base.storage_offset())


def bind(optimizer: torch.optim.SGD, trainable: List[torch.nn.Parameter], params_flat: torch.Tensor,
         grads_flat: torch.Tensor, found_inf: torch.Tensor) -> Tuple[Optional[Callable[[], None]], Optional[str]]:
    """(update, None): `update()` applies one SGD step of `optimizer`'s hyperparameters to
    params_flat from grads_flat, skipped while found_inf is non-zero, and the momentum buffers
    are now views of one flat buffer (their values kept). (None, why) where it cannot (why_not).
    Call after any optimizer.load_state_dict: loading replaces the state's tensors."""
    why = why_not(optimizer, trainable, params_flat)
    if why is not None:
        return None, why
    from shmlearn import _flat_sgd_triton as kernel

    group = optimizer.param_groups[0]
    momentum = float(group["momentum"])
    mom_flat = None
    if momentum:
        mom_flat = torch.zeros_like(params_flat)
        for p in trainable:
            view = _same_layout(mom_flat, p.data, params_flat)
            old = optimizer.state[p].get("momentum_buffer")
            if old is not None:
                view.copy_(old)
            optimizer.state[p]["momentum_buffer"] = view
    lr_cache: dict = {}

    def update() -> None:
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor):  # a schedule that assigns floats (fast.py keeps tensors)
            t = lr_cache.setdefault("t", torch.zeros((), dtype=torch.float32, device=params_flat.device))
            lr = t.fill_(float(lr))
        kernel.sgd_(params_flat, grads_flat, mom_flat, lr, found_inf, momentum=momentum,
                    dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
                    nesterov=bool(group["nesterov"]))

    return update, None
