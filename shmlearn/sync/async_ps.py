"""Asynchronous parameter server with bounded staleness (Downpour SGD, Dean et al. 2012, the
paper's reference [1]; docs/strategies.md).

Rank 0 only serves; ranks 1..W compute, each on its own clock. A worker computes a gradient on
the weights it holds, pushes it (phase `push`), waits for the server's answer (`wait`): the
newest weights, with their version, which it copies in (`pull`); then it computes again.

The server's update u averages W gradients (the global batch of the synchronous server), in the
order they were computed (oldest version first, then by rank), from whichever workers sent them:
a fast worker may give several, a slow one none. Staleness S bounds every gradient's lag, the
updates between the version it was computed on and the update that applies it:
  * the server does update u only once every worker still computing holds version >= u + 1 - S
    (its gradient will be applied with lag <= S); otherwise it waits for that worker (`wait`);
  * it answers a push at once only while fewer than (S + 1) x W gradients are received or being
    computed; else the worker waits for the next update (a fast worker cannot run further ahead);
  * a gradient that would still lag more than S (only after the loop's meetings) is dropped and
    counted (`dropped_gradients`).
With S = 0 every worker gives exactly one gradient per update, on the newest weights, and the
server averages them in rank order with the kernel the synchronous dedicated server uses:
`ps --ps-dedicated` bit for bit. With S >= 1 a slow worker no longer paces the others.

Loop steps are server updates: rank 0 runs update `step` in the loop's step `step`; a worker's
step `step` lasts until it holds version `step + 1`: it computes as many gradients as that takes
(`wants_gradient`; none when the server is already past the step). Where the loop meets in a
collective (its loss reads, evaluation, the end) the server first answers every worker with the
weights of that step (`plan_step(meets=True)`), so no rank waits on a message there.

--clip-grad-norm: the server clips the averaged gradient of each update before applying it (with
S = 0 what `ps --ps-dedicated` clips); --accumulate: each pushed gradient is a worker's mean over
its N micro-batches (the step's FreeRunningStep reads them).

Messages: between the CPU ranks of one host (--shared-memory auto, where sync/shm.py's collectives
would run) through a mailbox per worker in shared memory (sync/shm_mailbox.py: the server takes
pushes in arrival order from its FIFO of signals); else point to point over a Gloo group of their
own, from pinned host buffers: Gloo's receive from any source is what lets the server take
gradients in arrival order (NCCL has no such receive), and the run's main group (NCCL on GPUs)
keeps its collectives. Processes may share a GPU (`--backend gloo`). A worker that dies or hangs
makes the server's wait end after --timeout (a process gone: within a second on shared memory);
the loop then names the rank from its stale heartbeat. Each gradient's lag is
recorded per worker (summary.json `staleness_histogram`).
"""
from __future__ import annotations

import heapq
import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shmlearn.errors import BadInput
from shmlearn.config.limits import MAX_STEPS, mem_available, whole
from shmlearn.sync.base import SyncStrategy, check_non_finite
from shmlearn.sync.shm_mailbox import PUSH, REPLY, ShmMailbox, open_mailbox
from shmlearn.sync.registry import Costs, Entry, param, register
from shmlearn.record.timing import PhaseTimer


@dataclass(frozen=True)
class Params:
    staleness: int = param("staleness", 0)
    """A worker's gradient may lag this many server updates (0: the synchronous dedicated
    parameter server, bit for bit)."""
    staleness_lr: float = param("staleness_lr", 2.0)
    """Staleness-aware learning rate (after Zhang et al. 2016, "Staleness-aware async-SGD", which
    divides a gradient's lr by its staleness): the server weighs each gradient by
    1 / (1 + lag)^P in the update's average, P this value, so a gradient computed on weights L
    updates old moves them with lr / (L + 1)^P; a fresh one (lag 0, every gradient at
    --staleness 0) with the full lr. 0 turns it off; 1 is Zhang et al.'s lr / staleness (staleness
    counted from 1). Default 2: a delayed gradient shrinks momentum SGD's stable lr far more than
    plain SGD's, and on digits (mlp, 2 workers, S=2, lr 0.2, momentum 0.9) P=0 collapsed 5 of 5
    runs to chance, P=1 1 of 5, P=2 none (issue 55). For SGD and momentum; Adam-like optimizers
    normalize the scale away."""

    servers = 1

    def __post_init__(self):
        whole("staleness", self.staleness, 0, MAX_STEPS)
        p = self.staleness_lr
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 8:
            raise BadInput(f"--staleness-lr {p}: expected a power from 0 (off) to 8; 2 is the default")


class AsyncPS(SyncStrategy):
    name = "async-ps"
    gated = True
    free_running = True
    host_collectives = True  # on the CPU, the fast step's read of the losses through shared memory (sync/shm.py)
    _mail: Optional[ShmMailbox] = None
    """The messages' mailbox in shared memory (sync/shm_mailbox.py), or None: Gloo's."""
    _p2p = None
    """Else the messages' Gloo group."""

    def __init__(self, *, rank: int, world_size: int, group=None, staleness: int = 0, staleness_lr: float = 2.0):
        super().__init__(rank=rank, world_size=world_size, group=group)
        if world_size < 2:
            raise ValueError("async-ps needs a server and at least one worker (2 processes)")
        self.staleness = staleness
        self.staleness_lr = staleness_lr
        self.workers = world_size - 1
        self.version = 0
        """Server: updates applied. Worker: the version of the weights it holds."""
        self.lags = {r: Counter() for r in range(1, world_size)}
        """Server: per worker, how many of its gradients were applied with which lag."""
        self.dropped = 0
        """Server: gradients dropped because they would have lagged more than S."""
        self.gradients = 0
        """Worker: gradients computed and pushed."""
        self._step, self._meets = 0, False
        self._step_loss = 0.0
        self._diverged = False

    @property
    def computes(self) -> bool:
        return self.rank != 0

    @property
    def compute_ranks(self) -> int:
        return self.world_size - 1

    def _inbox_size(self, model) -> int:
        """The server's planned gradient buffers, (S + 2) x W + 1, where S is the staleness bounded
        by the run's steps (no gradient can lag more updates than the run has): BadInput, on every
        rank before any collective, where they would not fit in the memory available."""
        s = self.staleness if self.run_steps is None else min(self.staleness, self.run_steps)
        cap = (s + 2) * self.workers + 1
        each = (sum(p.numel() for p in model.parameters() if p.requires_grad) + self.control_slots + 1) * 4
        avail = mem_available()
        if avail is not None and cap * each > avail:
            fits = max(0, (avail // each - 1) // self.workers - 2)
            raise BadInput(f"--staleness {self.staleness}: the server would hold up to {cap} gradients of "
                           f"{each / 2**20:.1f} MB ({cap * each / 2**30:.1f} GB) for {self.workers} workers, more "
                           f"than the {avail / 2**30:.1f} GB available; use --staleness {fits} or less")
        return cap

    def setup(self, model, optimizer, group=None, *, channels_last: bool = False) -> None:
        cap = self._inbox_size(model)
        super().setup(model, optimizer, group, channels_last=channels_last)  # everyone at version 0
        n, m = self.grads_flat.numel(), self.grads_ext.numel()
        dtype = self.grads_flat.dtype
        if self._shm is not None:  # the collectives run through shared memory: the messages too, where they fit
            self._mail, why = open_mailbox(m + 1, n + 1, dtype, self.rank, self.world_size, self.group,
                                           self.timeout_s or 300.0)
            self.comm_note = None if why is None else f"messages run on Gloo, not shared memory: {why}"
        elif self.comm_note:  # they could have, and why not holds for the messages too
            self.comm_note = f"messages and {self.comm_note}"
        if self._mail is None:
            timeout = timedelta(seconds=self.timeout_s) if self.timeout_s else None
            self._p2p = dist.new_group(backend="gloo", timeout=timeout)
        pin = self.params_flat.is_cuda
        host = lambda k: torch.empty(k, dtype=dtype, pin_memory=pin)  # noqa: E731
        mail = lambda kind, r, k: self._mail.slot(kind, r, k, dtype) if self._mail else host(k)  # noqa: E731
        if self.rank == 0:
            # Rows 1..W: the gradients of one update, laid out as the synchronous server's gather.
            self._rows = torch.empty((self.world_size, m), dtype=self.grads_flat.dtype,
                                     device=self.grads_flat.device)
            self._inbox = [host(m + 1) for _ in range(cap)]  # gradient, control slots, its version
            self._free = list(range(cap))
            self._pending: List[Tuple[int, int, int, int]] = []  # (version, rank, arrival, slot)
            self._arrivals = 0
            self._computing: Dict[int, Optional[int]] = {r: 0 for r in range(1, self.world_size)}
            """The version each worker computes on; None while it waits for an answer."""
            self._waiting: List[int] = []
            self._replies = {r: mail(REPLY, r, n + 1) for r in range(1, self.world_size)}
            self._pushes = {r: mail(PUSH, r, m + 1) for r in range(1, self.world_size)} if self._mail else None
            self._replying = {r: None for r in range(1, self.world_size)}
            self._host_weights, self._host_version = None if self._mail else host(n), -1
        else:
            self._out, self._pushing = mail(PUSH, self.rank, m + 1), None
            self._in = mail(REPLY, self.rank, n + 1)

    @property
    def collectives_path(self) -> Optional[str]:
        """How the messages run: shared-memory, or gloo (its own group's, on GPUs too)."""
        return "shared-memory" if self._mail is not None else "gloo"

    def close(self) -> None:
        super().close()
        if self._mail is not None:
            self._mail.close()
            self._mail = None

    # -- the server ------------------------------------------------------------------------------
    def _committed(self) -> int:
        return len(self._pending) + sum(v is not None for v in self._computing.values())

    def _receive(self) -> int:
        """Take the next gradient from any worker (waits; times out after --timeout)."""
        if not self._free:  # more gradients held than planned for: grow, never block
            self._inbox.append(torch.empty_like(self._inbox[0]))
            self._free.append(len(self._inbox) - 1)
        slot = self._free.pop()
        buf = self._inbox[slot]
        if self._mail is not None:  # copied out: r writes its next push there once answered
            src = self._mail.take(r for r, v in self._computing.items() if v is not None)
            buf.copy_(self._pushes[src])
        else:
            src = dist.recv(buf, group=self._p2p)
        self._pending.append((int(buf[-1].item()), src, self._arrivals, slot))
        self._arrivals += 1
        self._computing[src] = None
        return src

    def _answer(self, r: int) -> None:
        """Send worker r the newest weights; from now on it computes on this version."""
        n = self.grads_flat.numel()
        buf = self._replies[r]
        if self._mail is not None:  # r's reply row: r has read the last reply (it pushed since)
            buf[:n].copy_(self.params_flat)
            buf[n] = self.version
            self._mail.post(r)
            self._computing[r] = self.version
            return
        if self._host_version != self.version:
            self._host_weights.copy_(self.params_flat)
            self._host_version = self.version
        if self._replying[r] is not None:
            self._replying[r].wait()  # long done: r has pushed since it received it
        buf[:n].copy_(self._host_weights)
        buf[n] = self.version
        self._replying[r] = dist.isend(buf, dst=r, group=self._p2p)
        self._computing[r] = self.version

    def _answer_if_allowed(self, r: int) -> None:
        if self._committed() < (self.staleness + 1) * self.workers:
            self._answer(r)
        else:
            self._waiting.append(r)

    def _ready(self, u: int) -> bool:
        floor = u + 1 - self.staleness
        return (len(self._pending) >= self.workers
                and all(v is None or v >= floor for v in self._computing.values()))

    def _drop_stale(self, u: int) -> None:
        keep = []
        for item in self._pending:
            if u - item[0] > self.staleness:
                self.dropped += 1
                self._free.append(item[3])
            else:
                keep.append(item)
        self._pending = keep

    def _serve(self, timer, found_inf=None) -> None:
        n, u, w = self.grads_flat.numel(), self.version, self.workers
        with timer.phase("wait"):
            while True:
                self._drop_stale(u)
                if self._ready(u):
                    break
                self._answer_if_allowed(self._receive())
        self._pending.sort()
        chosen, self._pending = self._pending[:w], self._pending[w:]
        with timer.phase("average"):
            for i, (_, _, _, slot) in enumerate(chosen):
                self._rows[1 + i].copy_(self._inbox[slot][:-1])
                self._free.append(slot)
            lags = [u - v for v, _, _, _ in chosen]
            if self.staleness_lr and any(lags):
                # Staleness-aware lr: each gradient counts 1 / (1 + lag)^P (Params.staleness_lr).
                weights = torch.tensor([(1.0 + lag) ** -self.staleness_lr for lag in lags],
                                       dtype=self._rows.dtype, device=self._rows.device)
                torch.mean(self._rows[1:, :n] * weights[:, None], dim=0, out=self.grads_flat)
            else:  # every gradient fresh: the synchronous server's average, bit for bit
                torch.mean(self._rows[1:, :n], dim=0, out=self.grads_flat)
        losses = self._rows[1:, -1]
        total = sum(losses.tolist())  # in float64, in rank order: as the loop sums ps's losses
        if not math.isfinite(total):  # a worker's loss not finite: skip this update and the rest
            self._diverged = True
        if found_inf is not None:  # fused SGD reads the flag (the same skip)
            check_non_finite(losses.sum().reshape(1), found_inf, self._one)
        with timer.phase("update"):
            if not self._diverged:
                self.update_params()  # clips the averaged gradient it applies (--clip-grad-norm)
        self.version += 1
        for v, r, _, _ in chosen:
            self.lags[r][u - v] += 1
        self._step_loss = total if math.isfinite(total) else 0.0
        with timer.phase("pull"):
            waiting, self._waiting = sorted(self._waiting), []
            for r in waiting:
                self._answer_if_allowed(r)
            if self._meets:
                self._meet()

    def _meet(self) -> None:
        """Before the loop's collective: every worker gets this version and waits for the loop.
        Workers still computing finish their gradient first (kept for the next update)."""
        for r in sorted(self._waiting):
            self._answer(r)
        self._waiting = []
        # A worker answered with this version computes no more in this step; the others do.
        while any(v is None or v < self.version for v in self._computing.values()):
            self._answer(self._receive())

    # -- a worker --------------------------------------------------------------------------------
    def _push_pull(self, timer, loss: torch.Tensor) -> None:
        n = self.grads_flat.numel()
        with timer.phase("push"):
            if self._pushing is not None:
                self._pushing.wait()  # done: the server answered it
            self._out[:-1].copy_(self.grads_ext)
            self._out[-2:-1].copy_(loss.reshape(1))
            self._out[-1] = self.version
            if self._mail is not None:
                self._mail.post(0)
            else:
                self._pushing = dist.isend(self._out, dst=0, group=self._p2p)
        with timer.phase("wait"):
            if self._mail is not None:
                self._mail.wait_for(0)
            else:
                dist.recv(self._in, src=0, group=self._p2p)
        with timer.phase("pull"):
            self.params_flat.copy_(self._in[:n])
            self.version = int(self._in[n].item())
        self.gradients += 1
        v = float(self._out[-2])
        if v != v or abs(v) == float("inf"):
            self._step_loss = float("nan")

    # -- the strategy interface ------------------------------------------------------------------
    def plan_step(self, step: int, meets: bool) -> None:
        self._step, self._meets = step, meets
        self._step_loss = 0.0

    def wants_gradient(self) -> bool:
        return self.version <= self._step

    def step_loss(self) -> float:
        """Server: the sum of the losses its update averaged (the loop divides by W). Worker: NaN
        if a loss it computed in this step was not finite (so the loop names it), else 0."""
        return self._step_loss

    def step(self, timer: PhaseTimer) -> None:
        raise NotImplementedError("async-ps runs only in the fast step (fast.py, free running)")

    def gated_step(self, timer, loss, found_inf, round_) -> None:
        if self.rank == 0:
            self._serve(timer, found_inf)
        else:
            self._push_pull(timer, loss)

    @contextmanager
    def eval_weights(self):
        """At a meeting every worker holds the server's weights already; this makes it so
        anyway (a broadcast) and gives each worker its own back after."""
        self.sync_buffers()
        local = self.params_flat.clone() if self.rank != 0 else None
        dist.broadcast(self.params_flat, src=0, group=self.group)
        try:
            yield
        finally:
            if local is not None:
                self.params_flat.copy_(local)

    def finish(self) -> None:
        """The last step met: every worker holds the last version; deliver what is in flight."""
        works = list(self._replying.values()) if self.rank == 0 else [self._pushing]
        for w in works:
            if w is not None:
                w.wait()

    def histogram(self) -> dict:
        """{worker rank: {lag: gradients}} as summary.json holds it (the server's record)."""
        return {str(r): {str(k): c[k] for k in sorted(c)} for r, c in self.lags.items()}

    def summary(self) -> dict:
        if self.rank != 0:
            return {}
        applied = sum(sum(c.values()) for c in self.lags.values())
        return {"staleness_histogram": self.histogram(), "dropped_gradients": self.dropped,
                "gradients_per_worker": {str(r): sum(c.values()) for r, c in self.lags.items()},
                "applied_gradients": applied}



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


def simulate_protocol(cycle_s: Sequence[float], serve_s: float, staleness: int, updates: int):
    """The server's rules above, replayed on a clock: worker r (1..W) pushes cycle_s[r - 1]
    seconds after each answer (its data, compute, push and pull); an update costs the server
    serve_s. Messages are instant and the loop's meetings are left out. Returns (seconds for
    `updates` updates, {rank: Counter(lag: gradients applied)}, gradients dropped)."""
    w, s = len(cycle_s), staleness
    t, version, dropped, arrivals = 0.0, 0, 0, 0
    computing: Dict[int, Optional[int]] = {r: 0 for r in range(1, w + 1)}
    clock = [(cycle_s[r - 1], r) for r in range(1, w + 1)]
    heapq.heapify(clock)
    pending: List[Tuple[int, int, int]] = []
    waiting: List[int] = []
    lags = {r: Counter() for r in range(1, w + 1)}

    def committed() -> int:
        return len(pending) + sum(v is not None for v in computing.values())

    def answer_if_allowed(r: int) -> None:
        if committed() < (s + 1) * w:
            computing[r] = version
            heapq.heappush(clock, (t + cycle_s[r - 1], r))
        else:
            waiting.append(r)

    while version < updates:
        while True:
            kept = [p for p in pending if version - p[0] <= s]
            dropped += len(pending) - len(kept)
            pending = kept
            if len(pending) >= w and all(v is None or v >= version + 1 - s for v in computing.values()):
                break
            at, r = heapq.heappop(clock)
            t = max(t, at)
            pending.append((computing[r], r, arrivals))
            arrivals += 1
            computing[r] = None
            answer_if_allowed(r)
        pending.sort()
        chosen, pending = pending[:w], pending[w:]
        t += serve_s
        for v, r, _ in chosen:
            lags[r][version - v] += 1
        version += 1
        again, waiting = sorted(waiting), []
        for r in again:
            answer_if_allowed(r)
    return t, lags, dropped


def predict_more(c: Costs, params: Params, slow: Optional[Tuple[int, float]] = None) -> dict:
    """simulate's prediction of each worker's staleness histogram: the protocol replayed with the
    cost model's times (equal workers; slow = (rank, k): that worker k times slower)."""
    parts = cost(c, Params(staleness=0))
    cycle = c.local["data"] + c.local["compute"] + c.local.get("other", 0.0) + parts["push"] + parts["pull"]
    cycles = [cycle * (slow[1] if slow and r == slow[0] else 1.0) for r in range(1, c.workers + 1)]
    t, lags, dropped = simulate_protocol(cycles, parts["average"] + parts["update"], params.staleness, 1000)
    return {"seconds_per_update": t / 1000, "dropped_gradients": dropped,
            "staleness_histogram": {str(r): {str(k): n[k] for k in sorted(n)} for r, n in lags.items()}}


ENTRY = register(Entry(name="async-ps", cls=AsyncPS, help="asynchronous parameter server, staleness <= S (Downpour)",
                       params=Params, cost=cost, check=check, summary=lambda s: s.summary(),
                       predict_more=predict_more))
