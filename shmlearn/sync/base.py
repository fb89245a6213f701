"""The one interface every synchronization strategy implements (DESIGN.md, "The strategy interface").

A strategy owns everything between `loss.backward()` and the next forward pass: making replicas
identical at the start, communicating, and applying the optimizer. The training loop never calls
a collective for the model itself.

Gradients live in one flat buffer and the parameters' `.grad` are views into it (and parameters
are views into one flat weight buffer), so a sync is one collective, not one call per tensor.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist

from shmlearn.timing import PhaseTimer


def flatten_parameters(model: torch.nn.Module):
    """Move every trainable parameter (and its gradient) into one contiguous buffer.

    Returns (params_flat, grads_flat). Parameter objects keep their identity (only `.data` is
    re-pointed), so an optimizer built before this call still holds the right tensors.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    dtype, device = params[0].dtype, params[0].device
    if any(p.dtype != dtype or p.device != device for p in params):
        raise ValueError("flat buffers need every parameter on one device with one dtype")
    total = sum(p.numel() for p in params)
    pflat = torch.empty(total, dtype=dtype, device=device)
    gflat = torch.zeros(total, dtype=dtype, device=device)
    offset = 0
    for p in params:
        n = p.numel()
        pflat[offset:offset + n].copy_(p.data.reshape(-1))
        p.data = pflat[offset:offset + n].view_as(p)
        p.grad = gflat[offset:offset + n].view_as(p)
        offset += n
    return pflat, gflat


class SyncStrategy(ABC):
    """Base class: flat buffers, the initial broadcast, and what every strategy shares."""

    name: str = "base"

    def __init__(self, *, rank: int, world_size: int, group: Optional[dist.ProcessGroup] = None):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.model: Optional[torch.nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.params_flat: Optional[torch.Tensor] = None
        self.grads_flat: Optional[torch.Tensor] = None

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              group: Optional[dist.ProcessGroup] = None) -> None:
        """Flatten, then make every replica equal to rank 0's (weights and buffers)."""
        self.model, self.optimizer = model, optimizer
        if group is not None:
            self.group = group
        self.params_flat, self.grads_flat = flatten_parameters(model)
        if self.world_size > 1:
            dist.broadcast(self.params_flat, src=0, group=self.group)
            for b in model.buffers():
                dist.broadcast(b, src=0, group=self.group)

    @property
    def module(self) -> torch.nn.Module:
        """What the loop calls forward on (DDP wraps the model; the others use it as is)."""
        return self.model

    @property
    def computes(self) -> bool:
        """Whether this rank computes gradients (a dedicated parameter server does not)."""
        return True

    @property
    def compute_ranks(self) -> int:
        return self.world_size

    def zero_grad(self) -> None:
        # Zero in place: set_to_none would cut the .grad views out of the flat buffer.
        self.grads_flat.zero_()

    @abstractmethod
    def step(self, timer: PhaseTimer) -> None:
        """Synchronize and update after backward; time each phase under DESIGN.md's names."""

    # -- evaluation and the end of training ----------------------------------------------------
    def sync_buffers(self) -> None:
        """Average floating-point buffers (BatchNorm running stats) so every rank evaluates the
        same model. Costs one small collective per buffer; only called before evaluation."""
        if self.world_size == 1:
            return
        for b in self.model.buffers():
            if b.is_floating_point():
                dist.all_reduce(b, group=self.group)
                b.div_(self.world_size)

    @contextmanager
    def eval_weights(self):
        """Weights that evaluation should see. Every replica already holds them, except in
        weight averaging between rounds (weight_averaging.py overrides this)."""
        self.sync_buffers()
        yield

    def finish(self) -> None:
        """Called once after the last step; replicas must be identical afterwards."""

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass
