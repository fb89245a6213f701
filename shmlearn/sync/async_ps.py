"""Asynchronous parameter server with bounded staleness (Downpour SGD, Dean et al. 2012, the
paper's reference [1]; DESIGN.md X3).

Rank 0 only serves; ranks 1..W compute. A worker pushes each gradient to the server (phase
`push`) and goes on computing on the weights it holds; it pulls new weights (`wait` for them,
then `pull`: copy them in) only when its weights would otherwise lag more than `staleness` server
updates behind the gradient it is about to compute. The server's update t averages gradient t of
every worker (`wait` for them, `average`, `update`) and sends the new weights, version t + 1, to
every worker (`pull`, the server's side of it) without waiting for them to be taken.

    worker, step t: compute on weights of version v >= t - S; push; pull until v >= t + 1 - S

With S = 0 every worker pulls version t + 1 before step t + 1, which is the synchronous dedicated
parameter server (`ps --ps-dedicated`) bit for bit: the same rows averaged in the same order by
the same kernel, the same optimizer on the server. With S >= 1 a worker's compute overlaps the
server's average, update and send; it pulls only when it must (Downpour's n_fetch = S), so every
gradient after the first S lags exactly S updates: deterministic, reproducible runs. Each worker's
staleness histogram goes to summary.json (`staleness_histogram`).

Messages are point-to-point (isend/irecv) on the run's group, beside the loop's collectives.
Buffers: S + 1 gradient buffers per worker and S + 1 weight versions on the server, reused only
once the message they held was taken; at most S of them are in flight. A worker that dies or
hangs makes the server's receive time out (--timeout); the loop then names the rank.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shmlearn.errors import BadInput
from shmlearn.sync.base import SyncStrategy, check_non_finite
from shmlearn.sync.registry import Costs, Entry, param, register
from shmlearn.timing import PhaseTimer


@dataclass(frozen=True)
class Params:
    staleness: int = param("staleness", 0)
    """async-ps: a worker's gradient may lag this many server updates (0: the synchronous
    dedicated parameter server, bit for bit)."""

    servers = 1

    def __post_init__(self):
        from shmlearn.config import MAX_STEPS, _whole
        _whole("staleness", self.staleness, 0, MAX_STEPS)


class AsyncPS(SyncStrategy):
    name = "async-ps"
    gated = True

    def __init__(self, *, rank: int, world_size: int, group=None, staleness: int = 0):
        super().__init__(rank=rank, world_size=world_size, group=group)
        if world_size < 2:
            raise ValueError("async-ps needs a server and at least one worker (2 processes)")
        self.staleness = staleness
        self.version = 0
        """Server: updates applied. Worker: the version of the weights it holds."""
        self.pushed = 0
        """Worker: gradients pushed (its steps)."""
        self.lags = {r: Counter() for r in range(1, world_size)}
        """Server: per worker, how many of its gradients lagged by how many updates."""

    @property
    def computes(self) -> bool:
        return self.rank != 0

    @property
    def compute_ranks(self) -> int:
        return self.world_size - 1

    def setup(self, model, optimizer, group=None, *, channels_last: bool = False) -> None:
        super().setup(model, optimizer, group, channels_last=channels_last)  # everyone at version 0
        n, k = self.grads_flat.numel(), self.staleness + 1
        like = dict(dtype=self.grads_flat.dtype, device=self.grads_flat.device)
        if self.rank == 0:
            # Row r: worker r's gradient, its loss, its lag. The weight versions go out from a
            # ring of S + 1 copies, each with its sends to every worker.
            self._rows = torch.empty((self.world_size, n + 2), **like)
            self._versions = [torch.empty(n, **like) for _ in range(k)]
            self._sent = [[] for _ in range(k)]
        else:
            self._out = [torch.empty(n + 2, **like) for _ in range(k)]
            self._pushes = [None] * k
            self._in = torch.empty(n, **like)
            self._pulling = None  # the posted receive of weights version + 1

    # -- the server ------------------------------------------------------------------------------
    def _serve(self, timer, found_inf=None) -> None:
        n = self.grads_flat.numel()
        with timer.phase("wait"):
            works = [dist.irecv(self._rows[r], src=r, group=self.group) for r in range(1, self.world_size)]
            for w in works:
                w.wait()
        with timer.phase("average"):
            torch.mean(self._rows[1:, :n], dim=0, out=self.grads_flat)
        if found_inf is not None:  # any worker's loss not finite: skip this update and the rest
            check_non_finite(self._rows[1:, n].sum().reshape(1), found_inf, self._one)
        with timer.phase("update"):
            self.optimizer.step()
        self.version += 1
        for r, lag in enumerate(self._rows[1:, n + 1].tolist(), 1):
            self.lags[r][int(lag)] += 1
        slot = self.version % len(self._versions)
        with timer.phase("pull"):
            for w in self._sent[slot]:  # version - S - 1: every worker has taken it (see the docstring)
                w.wait()
            self._versions[slot].copy_(self.params_flat)
            self._sent[slot] = [dist.isend(self._versions[slot], dst=r, group=self.group)
                                for r in range(1, self.world_size)]

    # -- a worker --------------------------------------------------------------------------------
    def _push(self, timer, loss) -> None:
        n, t = self.grads_flat.numel(), self.pushed
        i = t % len(self._out)
        buf = self._out[i]
        with timer.phase("push"):
            if self._pushes[i] is not None:
                self._pushes[i].wait()  # gradient t - S - 1: the server took it before update t - S
            buf[:n].copy_(self.grads_flat)
            buf[n] = loss
            buf[n + 1] = t - self.version
            self._pushes[i] = dist.isend(buf, dst=0, group=self.group)
        self.pushed += 1
        self._pull(timer, self.pushed - self.staleness)

    def _pull(self, timer, need: int) -> None:
        """Take new weights until this worker holds version >= need; keep the next receive posted
        (for versions the server can have made: up to the gradients pushed)."""
        while True:
            if self._pulling is None and self.version < self.pushed:
                self._pulling = dist.irecv(self._in, src=0, group=self.group)
            if self._pulling is None or self.version >= need:
                return
            with timer.phase("wait"):
                self._pulling.wait()
            with timer.phase("pull"):
                self.params_flat.copy_(self._in)
            self._pulling, self.version = None, self.version + 1

    # -- the strategy interface ------------------------------------------------------------------
    def step(self, timer: PhaseTimer) -> None:
        if self.rank == 0:
            self._serve(timer)
        else:
            self._push(timer, 0.0)

    def gated_step(self, timer, loss, found_inf, round_) -> None:
        if self.params_flat.is_cuda and torch.cuda.is_current_stream_capturing():
            # Which messages a step waits for depends on the step: one graph cannot replay it.
            raise RuntimeError("async-ps: a step's messages vary from step to step; not capturable")
        if self.rank == 0:
            self._serve(timer, found_inf)
        else:
            self._push(timer, loss)

    @contextmanager
    def eval_weights(self):
        """Workers may hold older weights than the server: evaluate the server's, then give each
        worker its own back."""
        self.sync_buffers()
        local = self.params_flat.clone() if self.rank != 0 else None
        dist.broadcast(self.params_flat, src=0, group=self.group)
        try:
            yield
        finally:
            if local is not None:
                self.params_flat.copy_(local)

    def finish(self) -> None:
        """Every worker takes the last version; every message is delivered: replicas equal."""
        if self.rank == 0:
            for sent in self._sent:
                for w in sent:
                    w.wait()
        else:
            self._pull(PhaseTimer(self.params_flat.device, self.rank), self.pushed)
            for w in self._pushes:
                if w is not None:
                    w.wait()

    def histogram(self) -> dict:
        """{worker rank: {lag: gradients}} as summary.json holds it (the server's record)."""
        return {str(r): {str(k): c[k] for k in sorted(c)} for r, c in self.lags.items()}


def check(cfg) -> None:
    for flag, given in (("--checkpoint-every", cfg.checkpoint_every is not None), ("--resume", cfg.resume)):
        if given:
            raise BadInput(f"{flag}: not supported with --strategy async-ps yet (messages in flight "
                           f"are not part of a checkpoint)")


def cost(c: Costs, params: Params) -> dict:
    """The dedicated server's link as ps has it (push = the gather, pull = the broadcast); with
    S >= 1 the server's average, update and send run under the workers' next compute, so only
    what exceeds that compute stays on the step. Not validated against measurements yet."""
    parts = {"wake": c.wake("gather")}
    parts["push"] = c.gather(c.processes, c.processes * c.grad_bytes)
    server = {"average": c.average(c.workers, c.grad_bytes), "update": c.update_s,
              "pull": c.broadcast(c.processes, c.grad_bytes)}
    if params.staleness >= 1:
        total = sum(server.values())
        keep = max(0.0, total - c.local["compute"]) / total if total > 0 else 0.0
        server = {k: v * keep for k, v in server.items()}
    parts.update(server)
    return parts


ENTRY = register(Entry(name="async-ps", cls=AsyncPS, help="asynchronous parameter server, staleness <= S (Downpour)",
                       params=Params, cost=cost, check=check,
                       summary=lambda s: {"staleness_histogram": s.histogram()} if s.rank == 0 else {}))
