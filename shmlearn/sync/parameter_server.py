"""The paper's parameter server (seed 001, paper §6): rank 0 holds the master weights.

Each step: every worker's gradient is gathered to rank 0 (phase `gather`), rank 0 averages them
(`average`), applies the optimizer (`update`) and broadcasts the new weights to all (`broadcast`).
Only rank 0's optimizer state is ever used. With `dedicated=True` rank 0 computes no gradient
and only serves, as in the paper; otherwise it also works as a worker (one process fewer).

Cost: rank 0 receives (N-1) full gradients and sends N-1 weight copies per step, so the server's
link carries 2(N-1)x the model per step against all-reduce's ~2x per rank; this is the scaling
limit the paper's Fig. 6.4-6.6 show.

Fast step (`gated_step`): each worker's loss rides in its gradient's control slot; the server
skips its update if any gathered loss is not finite, and broadcasts the weights as they are.

Noise scale (--noise-scale, noise.py): each worker's |g_local|^2 rides in the slot before its
loss; the server averages the workers' slots and records them with the averaged gradient's norm.
Only on measured steps (`noise.on`, every --noise-every steps); the slot travels unwritten on the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from shmlearn.sync.base import SyncStrategy, check_non_finite
from shmlearn.sync.registry import Costs, Entry, param, register
from shmlearn.record.timing import PhaseTimer


@dataclass(frozen=True)
class Params:
    dedicated: bool = param("ps_dedicated", False)
    """One extra process (rank 0) only serves, as in the paper; default rank 0 also computes."""

    @property
    def servers(self) -> int:
        return int(self.dedicated)


class ParameterServer(SyncStrategy):
    name = "ps"
    gated = True
    host_collectives = True  # on the CPU, gather and broadcast through shared memory (sync/shm.py)
    measures_noise = True
    control_slots = 2  # [-2]: |g_local|^2 (noise scale), [-1]: the loss (fast step)

    def __init__(self, *, rank: int, world_size: int, group=None, dedicated: bool = False):
        super().__init__(rank=rank, world_size=world_size, group=group)
        if dedicated and world_size < 2:
            raise ValueError("a dedicated parameter server needs at least 2 processes")
        self.dedicated = dedicated
        self._gathered = None  # rank 0: (world, n + 1) receive buffer (gradient + control slot)

    @property
    def computes(self) -> bool:
        return not (self.dedicated and self.rank == 0)

    @property
    def compute_ranks(self) -> int:
        return self.world_size - 1 if self.dedicated else self.world_size

    def setup(self, model, optimizer, group=None, *, channels_last: bool = False) -> None:
        super().setup(model, optimizer, group, channels_last=channels_last)
        if self.rank == 0 and self.world_size > 1 and self._shm is None:
            self._gathered = torch.empty((self.world_size, self.grads_ext.numel()),
                                         dtype=self.grads_flat.dtype, device=self.grads_flat.device)

    def _gather_average(self, timer) -> Optional[torch.Tensor]:
        """The server: every rank's gradient with its control slots, as rows (the shared-memory
        slots' view on the CPU, valid until the broadcast; else the receive buffer); None elsewhere."""
        server = self.rank == 0
        measuring = self.noise is not None and self.noise.on
        if measuring and self.computes:
            self.noise.put_local(self.grads_ext[-2], self.grads_flat)
        with timer.phase("gather"):
            if self._shm is not None:
                gathered = self._shm.gather(self.grads_ext)
            else:
                dist.gather(self.grads_ext, list(self._gathered.unbind(0)) if server else None,
                            dst=0, group=self.group)
                gathered = self._gathered
        if server:
            with timer.phase("average"):
                # A dedicated server's own row holds no gradient: average the workers' rows only.
                first = 1 if self.dedicated else 0
                torch.mean(gathered[first:, :-self.control_slots], dim=0, out=self.grads_flat)
            if measuring:
                self.noise.record_grad(gathered[first:, -2].mean(), self.grads_flat)
        return gathered if server else None

    def _broadcast(self, timer) -> None:
        with timer.phase("broadcast"):
            if self._shm is not None:
                self._shm.broadcast_(self.params_flat)
            else:
                dist.broadcast(self.params_flat, src=0, group=self.group)

    def step(self, timer: PhaseTimer) -> None:
        if self.world_size == 1:
            with timer.phase("update"):
                self.update_params()
            return
        self._gather_average(timer)
        if self.rank == 0:
            with timer.phase("update"):
                self.update_params()  # the server clips the averaged gradient (--clip-grad-norm)
        self._broadcast(timer)

    def gated_step(self, timer, loss, found_inf, round_) -> None:
        if self.world_size == 1:
            check_non_finite(loss.reshape(1), found_inf, self._one)
            with timer.phase("update"):
                self.update_params()
            return
        self.grads_ext[-1].copy_(loss)
        gathered = self._gather_average(timer)
        if self.rank == 0:
            check_non_finite(gathered[:, -1].sum().reshape(1), found_inf, self._one)
            with timer.phase("update"):
                self.update_params()
        self._broadcast(timer)
        if self.rank != 0:  # rank 0's update wrote its own copy
            self.params_written()

    def state_dict(self) -> dict:
        return {"dedicated": self.dedicated}


def cost(c: Costs, params: Params) -> dict:
    """The server's link, in the flat form: (P-1) gradients in, (P-1) weight copies out, P the
    processes; it averages W rows and alone updates (idle, not contended)."""
    parts = {"wake": c.wake("gather")}
    if c.processes > 1:
        parts["gather"] = c.gather(c.processes, c.processes * c.grad_bytes)
        parts["average"] = c.average(c.workers, c.grad_bytes)
        parts["broadcast"] = c.broadcast(c.processes, c.grad_bytes)
    parts["update"] = c.update_s
    return parts


ENTRY = register(Entry(name="ps", cls=ParameterServer, help="parameter server (paper §6)", params=Params,
                       cost=cost, variants={"ps": {"dedicated": False}, "ps-dedicated": {"dedicated": True}}))
