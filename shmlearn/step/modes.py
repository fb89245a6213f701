"""One class per step mode, behind one interface (fast.py's module docstring says what each does):

    run(step, meets, measuring)  training step `step` (meets: the loop meets in a collective after
                                 it; measuring: it measures the noise scale)
    update()                     after the loop has read a finite loss (classic: sync and update)

ClassicStep (data and compute; the loop reads, then updates), FastStep (the whole step on the
device: eager, or CUDA-graph replays with one eager step in `sample_every`) and FreeRunningStep
(async-ps: each rank's own gradients, eagerly). `arm_fast` readies the optimizer and the update
kernel for the last two."""
from __future__ import annotations

from typing import List

import torch


def arm_fast(*, optimizer, strategy, choice, dstep, fused: bool) -> List[torch.Tensor]:
    """The fast step's device state (dstep.arm) and, fused: torch's fused SGD reading its learning
    rate from the device and skipping on the flag, then the update kernel (choice.bind_update).
    fused=False (a free-running strategy with another optimizer): the flags only; the strategy
    then skips the update itself (async-ps's server sees the losses on the host). Returns the
    learning-rate tensors the step reads (`keep_lr_tensors`)."""
    dstep.arm()
    if not fused:
        return []
    dev = dstep.device
    for g in optimizer.param_groups:
        # fused SGD: one kernel for all parameters, a learning rate read from the device (the
        # schedule fills it in place), and found_inf to skip a step without a host sync.
        g["fused"], g["foreach"] = True, False
        if not isinstance(g["lr"], torch.Tensor):
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=dev)
        if g["momentum"] != 0:
            for p in g["params"]:
                # Zero buffers give the first step buf = 0*m + g = g, as torch's first-step
                # clone does, and keep the tensors fixed for the graph.
                st = optimizer.state[p]
                if st.get("momentum_buffer") is None:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    lr = [g["lr"] for g in optimizer.param_groups]
    optimizer.found_inf = dstep.found_inf
    choice.bind_update(dstep.found_inf)
    if strategy.noise is not None:
        strategy.noise.bind(dstep.t)  # its history is indexed by the step, as the losses are
    return lr


def step_schedule(optimizer, schedule) -> None:
    # This step's update has happened, but not always through this rank's optimizer.step(),
    # whose wrapper is what torch's scheduler checks before its first step: fused SGD runs
    # inside the step (or its graph), and under ps only the server updates. Without the flag
    # torch warns of a wrong call order (a schedule off by one) that did not happen.
    optimizer._opt_called = True
    schedule.step()


def keep_lr_tensors(optimizer, lr: List[torch.Tensor]) -> None:
    """Recent torch schedulers fill a tensor learning rate in place; older ones assign a
    float. Either way the value ends up in the tensor the graph and fused SGD read."""
    for g, t in zip(optimizer.param_groups, lr):
        v = g["lr"]
        if v is not t:
            if isinstance(v, torch.Tensor):
                t.copy_(v)
            else:
                t.fill_(float(v))
            g["lr"] = t


class ClassicStep:
    """Data and compute only in run() (--accumulate N: N micro-batches, DeviceStep.accumulated); the
    loop reads the loss now, then update() syncs, clips and updates (the strategy's step). A NaN is
    caught before any update. Every strategy and optimizer."""

    def __init__(self, *, strategy, optimizer, schedule, loader, timer, dstep, fault, rank: int, hist):
        self.strategy, self.optimizer, self.schedule, self.loader, self.timer = (strategy, optimizer, schedule,
                                                                                 loader, timer)
        self.dstep, self.fault, self.rank, self.hist = dstep, fault, rank, hist

    def run(self, step: int, meets: bool, measuring: bool) -> None:
        s = self.strategy
        loss = None
        if s.computes:
            # Micro-batch k of step `step` is loader step step*N + k (--accumulate N; data/loader.py).
            n = s.accumulate
            loss = self.dstep.accumulated(self.timer, lambda k: self.loader.batch(step * n + k))
        if self.fault is not None:
            loss = self.fault.fire(self.rank, step, loss)
        if loss is not None:
            self.hist[step:step + 1].copy_(loss.reshape(1))

    def update(self) -> None:
        self.strategy.step(self.timer)
        step_schedule(self.optimizer, self.schedule)
        self.timer.step_done()


class FastStep:
    """The whole step on the device with no host sync: a replay of its CUDA graph (graphs.graphs,
    when captured) or, one step in graphs.sample_every and without a graph, the same device work
    eagerly with its phases timed. update() has nothing left to do."""

    def __init__(self, *, strategy, optimizer, schedule, loader, timer, dstep, graphs, lr: List[torch.Tensor]):
        self.strategy, self.optimizer, self.schedule, self.loader, self.timer = (strategy, optimizer, schedule,
                                                                                 loader, timer)
        self.dstep, self.graphs, self.lr = dstep, graphs, lr

    def run(self, step: int, meets: bool, measuring: bool) -> None:
        d, g = self.dstep, self.graphs
        if step != d.expected:
            d.t.fill_(step)
        d.expected = step + 1
        if self.strategy.computes:
            self.loader.prepare(step * self.strategy.accumulate)  # its N micro-batches follow (data/loader.py)
        round_ = self.strategy.next_round()
        sampled = g.graphs is None or step % g.sample_every == 0
        if sampled:
            d.run(self.timer, round_, step)
        else:
            g.graphs[g.key(round_, measuring)].replay()
        self.strategy.host_step(round_)
        step_schedule(self.optimizer, self.schedule)
        keep_lr_tensors(self.optimizer, self.lr)
        self.timer.step_done(timed=sampled)

    def update(self) -> None:
        pass


class FreeRunningStep:
    """A free-running strategy's step (async-ps): as many gradients as it asks for, each from the
    next batch of this rank's own sequence (its gradients, not the loop's steps, count the
    batches; with --accumulate N a gradient reads N micro-batches), eagerly; free_hist[step]
    takes the strategy's step_loss()."""

    def __init__(self, *, strategy, optimizer, schedule, loader, timer, dstep, fault, rank: int, reached,
                 free_hist, lr: List[torch.Tensor]):
        self.strategy, self.optimizer, self.schedule, self.loader, self.timer = (strategy, optimizer, schedule,
                                                                                 loader, timer)
        self.dstep, self.fault, self.rank, self.reached, self.free_hist, self.lr = (dstep, fault, rank, reached,
                                                                                    free_hist, lr)
        self.batches = 0
        """Batches this rank has trained on (its own count, not the loop's steps)."""

    def run(self, step: int, meets: bool, measuring: bool) -> None:
        s, d = self.strategy, self.dstep
        s.plan_step(step, meets)
        if not s.computes:
            if self.reached is not None:
                self.reached(step)
            s.gated_step(self.timer, d.zero, d.found_inf, False)
        while s.computes and s.wants_gradient():
            self.loader.prepare(self.batches * s.accumulate)  # this gradient's N micro-batches
            self.batches += 1
            loss = d.accumulated(self.timer, lambda k: self.loader.next_batch())
            if self.fault is not None:
                # A free-running worker may compute no gradient in a given loop step (it ran ahead
                # earlier), so a fault counts this rank's gradients, which reach every number.
                loss = self.fault.fire(self.rank, self.batches - 1, loss)
            if self.reached is not None:
                self.reached(step)
            s.gated_step(self.timer, loss, d.found_inf, False)
        self.free_hist[step] = s.step_loss()
        step_schedule(self.optimizer, self.schedule)
        keep_lr_tensors(self.optimizer, self.lr)
        self.timer.step_done()

    def update(self) -> None:
        pass
