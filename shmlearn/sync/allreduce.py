"""Gradient-averaged data parallelism (paper Eq. 2.1) by one all-reduce of the flat gradient buffer.

    w <- w - lr * (1/N) sum_i g_i

Every rank holds the full optimizer state and applies the same averaged gradient, so replicas
stay bit-identical without ever sending weights.

Fast step (`gated_step`): the step's loss rides in the buffer's control slot, so the one
all-reduce also tells every rank whether any rank's loss was NaN or inf (a sum with a non-finite
term is non-finite); every rank then skips the same update, with no extra collective.

Buckets (--grad-buckets, step/buckets.py): the same all-reduce cut into buckets that start during
the backward, the loss riding in the first; gated_step then waits for what is still in flight.

Noise scale (--noise-scale, noise.py): each rank's |g_local|^2 rides in the slot before the loss,
so after the same all-reduce the slot holds its mean over the ranks; rank 0 records it with the
averaged gradient's squared norm (one norm over the gradient, on the device). Only on measured
steps (`noise.on`, every --noise-every steps); the others all-reduce as without the meter.
"""
from __future__ import annotations

from shmlearn.sync.base import SyncStrategy, check_non_finite
from shmlearn.sync.registry import Costs, Entry, register
from shmlearn.record.timing import PhaseTimer


class AllReduce(SyncStrategy):
    name = "allreduce"
    gated = True
    host_collectives = True
    measures_noise = True
    control_slots = 2  # [-2]: |g_local|^2 (noise scale), [-1]: the loss (fast step)

    @property
    def own_gradient(self) -> bool:  # one worker: the average is its own gradient
        return self.world_size == 1

    def step(self, timer: PhaseTimer) -> None:
        if self.world_size > 1:
            with timer.phase("allreduce"):
                if not self._measuring:
                    self._average_(self.grads_flat)
                else:
                    buf = self.grads_ext
                    self.noise.put_local(buf[-2], self.grads_flat)
                    self._average_(buf)
            self._record_noise()
        with timer.phase("update"):
            self.update_params()  # clipped after the average (--clip-grad-norm)

    averages_in_buckets = True

    def gated_step(self, timer, loss, found_inf, round_) -> None:
        buf = self.grads_ext
        if self.world_size > 1:
            with timer.phase("allreduce"):
                if self.buckets is not None and self.buckets.pending:
                    # Under way since the backward, the loss with it (step/buckets.py): what is
                    # left in flight is this phase's time.
                    self.buckets.wait()
                else:
                    if self._measuring:
                        self.noise.put_local(buf[-2], self.grads_flat)
                    buf[-1].copy_(loss)
                    self._average_(buf)
            check_non_finite(buf[-1:], found_inf, self._one)
            self._record_noise()
        else:
            check_non_finite(loss.reshape(1), found_inf, self._one)
        with timer.phase("update"):
            self.update_params()

    @property
    def _measuring(self) -> bool:
        return self.noise is not None and self.noise.on

    def _record_noise(self) -> None:
        # Rank 0 alone reads the estimates: the others skip the pass over the gradient.
        if self._measuring and self.rank == 0:
            self.noise.record_grad(self.grads_ext[-2], self.grads_flat)


def cost(c: Costs, params) -> dict:
    """Every rank updates; one all-reduce of the gradient (S bytes) per step."""
    return {"wake": c.wake("all_reduce"), "update": c.local["update"],
            "allreduce": c.all_reduce(c.workers, c.grad_bytes)}


ENTRY = register(Entry(name="allreduce", cls=AllReduce, help="gradient all-reduce (paper Eq. 2.1)", cost=cost))
