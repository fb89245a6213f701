"""Gradient-averaged data parallelism (paper Eq. 2.1) by one all-reduce of the flat gradient buffer.

    w <- w - lr * (1/N) sum_i g_i

Every rank holds the full optimizer state and applies the same averaged gradient, so replicas
stay bit-identical without ever sending weights.

Fast step (`gated_step`): the step's loss rides in the buffer's control slot, so the one
all-reduce also tells every rank whether any rank's loss was NaN or inf (a sum with a non-finite
term is non-finite); every rank then skips the same update, with no extra collective.
"""
from __future__ import annotations

from shmlearn.sync.base import SyncStrategy, check_non_finite
from shmlearn.sync.registry import Costs, Entry, register
from shmlearn.timing import PhaseTimer


class AllReduce(SyncStrategy):
    name = "allreduce"
    gated = True

    def step(self, timer: PhaseTimer) -> None:
        if self.world_size > 1:
            with timer.phase("allreduce"):
                self._average_(self.grads_flat)
        with timer.phase("update"):
            self.optimizer.step()

    def gated_step(self, timer, loss, found_inf, round_) -> None:
        buf = self.grads_ext
        if self.world_size > 1:
            with timer.phase("allreduce"):
                buf[-1].copy_(loss)
                self._average_(buf)
            check_non_finite(buf[-1:], found_inf, self._one)
        else:
            check_non_finite(loss.reshape(1), found_inf, self._one)
        with timer.phase("update"):
            self.optimizer.step()


def cost(c: Costs, params) -> dict:
    """Every rank updates; one all-reduce of the gradient (S bytes) per step."""
    return {"wake": c.wake("all_reduce"), "update": c.local["update"],
            "allreduce": c.all_reduce(c.workers, c.grad_bytes)}


ENTRY = register(Entry(name="allreduce", cls=AllReduce, help="gradient all-reduce (paper Eq. 2.1)", cost=cost))
