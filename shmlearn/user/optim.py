"""Optimizer registry: the ten optimizers of seed 003 §3, by name, all from torch.optim."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional

import torch

from shmlearn.errors import BadInput


def _sgd(params, lr, momentum, wd, nesterov=False):
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd, nesterov=nesterov)


# Each builder takes (params, lr, momentum or None, weight_decay). Momentum defaults follow the
# names: "momentum" and "nesterov" mean heavy-ball 0.9 unless --momentum says otherwise.
_BUILDERS: Dict[str, Callable] = {
    "sgd": lambda p, lr, m, wd: _sgd(p, lr, m or 0.0, wd),
    "momentum": lambda p, lr, m, wd: _sgd(p, lr, 0.9 if m is None else m, wd),
    "nesterov": lambda p, lr, m, wd: _sgd(p, lr, 0.9 if not m else m, wd, nesterov=True),
    "adagrad": lambda p, lr, m, wd: torch.optim.Adagrad(p, lr=lr, weight_decay=wd),
    "rmsprop": lambda p, lr, m, wd: torch.optim.RMSprop(p, lr=lr, momentum=m or 0.0, weight_decay=wd),
    "adam": lambda p, lr, m, wd: torch.optim.Adam(p, lr=lr, weight_decay=wd),
    "adamax": lambda p, lr, m, wd: torch.optim.Adamax(p, lr=lr, weight_decay=wd),
    "adadelta": lambda p, lr, m, wd: torch.optim.Adadelta(p, lr=lr, weight_decay=wd),
    "nadam": lambda p, lr, m, wd: torch.optim.NAdam(p, lr=lr, weight_decay=wd),
    "adamw": lambda p, lr, m, wd: torch.optim.AdamW(p, lr=lr, weight_decay=wd),
}
OPTIMIZERS = tuple(_BUILDERS)


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float,
                    momentum: Optional[float] = None, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    if name not in _BUILDERS:
        raise BadInput(f"--optimizer {name}: choose one of {', '.join(OPTIMIZERS)}")
    # foreach=False is not forced: torch picks the multi-tensor path on CUDA, which is the fast one.
    return _BUILDERS[name](list(params), lr, momentum, weight_decay)


SCHEDULES = ("constant", "linear", "cosine")


def build_schedule(name: str, optimizer: torch.optim.Optimizer, total_steps: int,
                   warmup_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Learning-rate multiplier per step: `constant` (the paper's), or a linear or cosine decay
    to zero at the last step, after an optional linear warmup. Decaying to zero is the cheapest
    way to a better final model at a fixed sample budget."""
    import math

    if name not in SCHEDULES:
        raise BadInput(f"--lr-schedule {name}: choose one of {', '.join(SCHEDULES)}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if name == "constant":
            return 1.0
        frac = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - frac if name == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
