"""Gradient-averaged data parallelism (paper Eq. 2.1) by one all-reduce of the flat gradient buffer.

    w <- w - lr * (1/N) sum_i g_i

Every rank holds the full optimizer state and applies the same averaged gradient, so replicas
stay bit-identical without ever sending weights.
"""
from __future__ import annotations

import torch.distributed as dist

from shmlearn.sync.base import SyncStrategy
from shmlearn.timing import PhaseTimer


class AllReduce(SyncStrategy):
    name = "allreduce"

    def step(self, timer: PhaseTimer) -> None:
        if self.world_size > 1:
            with timer.phase("allreduce"):
                # SUM then scale: Gloo has no AVG op, and the scale is one pass over the buffer.
                dist.all_reduce(self.grads_flat, group=self.group)
                self.grads_flat.div_(self.world_size)
        with timer.phase("update"):
            self.optimizer.step()
