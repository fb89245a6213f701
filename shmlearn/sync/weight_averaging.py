"""Weight-averaged data parallelism (paper Eq. 2.2), generalized to "average every K local steps".

Each worker applies its own gradient with its own optimizer; every K steps the weights are
averaged by one all-reduce of the flat weight buffer:

    w <- (1/N) sum_i (w_i - lr * g_i)

K=1 is the paper's scheme: with plain SGD it equals gradient averaging exactly (Eq. 2.3).
K>1 is local SGD: N-fold less communication, at the price of replicas drifting between rounds.

--clip-grad-norm: there is no averaged gradient, so each worker clips its own gradient before its
local update (with SGD and K=1 that is not the same as clipping the average of the gradients).

Optimizer state (momentum, Adam moments) stays local and is NOT averaged: averaging it would
double the traffic of every round, and momentum is linear in the gradients, so with heavy-ball
SGD and K=1 the averaged weights still follow gradient-averaged momentum SGD exactly. Adaptive
optimizers' per-worker state does diverge; that is part of what this mode studies.

Fast step (`gated_step`): a worker skips its own update once its own loss is not finite; a
round carries each worker's skip flag in the weight buffer's control slot (as log(1 - flag):
0, or -inf, which no average can make finite), so after a round every worker knows. Between
rounds the other workers do not know yet: they go on with their local steps until the round
or the loop's next read of the losses stops the run (fast.py says what that changes).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from shmlearn.config.limits import MAX_STEPS, whole
from shmlearn.sync.base import SyncStrategy, check_non_finite
from shmlearn.sync.registry import Costs, Entry, param, register
from shmlearn.record.timing import PhaseTimer


@dataclass(frozen=True)
class Params:
    period: int = param("avg_period", 1)
    """Average the weights every K local steps (K=1 is the paper's Eq. 2.2)."""

    servers = 0

    def __post_init__(self):
        whole("avg-period", self.period, 1, MAX_STEPS)


class WeightAveraging(SyncStrategy):
    name = "weight-avg"
    gated = True
    host_collectives = True
    own_gradient = True  # each replica steps on its own gradient; the weights are averaged after

    def __init__(self, *, rank: int, world_size: int, group=None, period: int = 1):
        super().__init__(rank=rank, world_size=world_size, group=group)
        if period < 1:
            raise ValueError("averaging period must be >= 1")
        self.period = period
        self.local_steps = 0
        self.rounds = 0

    @property
    def in_sync(self) -> bool:
        return self.local_steps % self.period == 0

    def _average(self) -> None:
        self._average_(self.params_flat)
        self.rounds += 1

    def step(self, timer: PhaseTimer) -> None:
        with timer.phase("update"):
            self.update_params()  # --clip-grad-norm clips this worker's own gradient: there is no average
        self.local_steps += 1
        if self.world_size > 1 and self.in_sync:
            with timer.phase("allreduce"):
                self._average()

    def round_kinds(self) -> list:
        if self.world_size == 1:
            return [False]
        return [True] if self.period == 1 else [False, True]

    def next_round(self) -> bool:
        return self.world_size > 1 and (self.local_steps + 1) % self.period == 0

    def gated_step(self, timer, loss, found_inf, round_) -> None:
        check_non_finite(loss.reshape(1), found_inf, self._one)
        with timer.phase("update"):
            self.update_params()
        if round_:
            buf = self.params_ext
            with timer.phase("allreduce"):
                torch.log(1 - found_inf, out=buf[-1])
                self._average_(buf)
            check_non_finite(buf[-1:], found_inf, self._one)
            self.params_written()

    def host_step(self, round_: bool) -> None:
        self.local_steps += 1
        self.rounds += int(round_)

    @contextmanager
    def eval_weights(self):
        """Between rounds the replicas differ: evaluate their average (what training would
        produce at the next round), then give each worker its own weights back."""
        self.sync_buffers()
        if self.world_size == 1 or self.in_sync:
            yield
            return
        local = self.params_flat.clone()
        self._average_(self.params_flat)
        try:
            yield
        finally:
            self.params_flat.copy_(local)

    def finish(self) -> None:
        # A run whose step count is not a multiple of K ends between rounds: one last average so
        # the final model is one model.
        if self.world_size > 1 and not self.in_sync:
            self._average()

    def state_dict(self) -> dict:
        return {"period": self.period, "local_steps": self.local_steps, "rounds": self.rounds}

    def load_state_dict(self, d: dict) -> None:
        self.local_steps, self.rounds = d["local_steps"], d["rounds"]


def cost(c: Costs, params: Params) -> dict:
    """Every rank updates; one all-reduce of the weights (S bytes) every K steps."""
    k = params.period
    return {"wake": c.wake("all_reduce") / k, "update": c.local["update"],
            "allreduce": c.all_reduce(c.workers, c.grad_bytes) / k}


ENTRY = register(Entry(name="weight-avg", cls=WeightAveraging, help="weight averaging every K steps (paper Eq. 2.2)",
                       params=Params, rounds=True, period=lambda p: p.period, cost=cost))
