"""One class per step mode, behind one interface (fast.py's module docstring says what each does):

    run(step, meets, measuring)  training step `step` (meets: the loop meets in a collective after
                                 it; measuring: it measures the noise scale)
    update()                     after the loop has read a finite loss (classic: sync and update)

ClassicStep (data and compute; the loop reads, then updates), FastStep (the whole step on the
device: eager, or CUDA-graph replays with one eager step in `sample_every`) and FreeRunningStep
(async-ps: each rank's own gradients, eagerly). `arm_fast` readies the optimizer and the update
kernel for the last two."""
from __future__ import annotations

from typing import List, Optional

import torch

from shmlearn.step.gate import FlagGate
from shmlearn.step.options import IMPLEMENTATION_FLAGS, implementation, torch_class


def hyperparameters(cls: type) -> tuple:
    """The param-group values besides lr that `cls.step()` reads: the keywords its constructor
    takes, less the ones that choose an implementation (options.IMPLEMENTATION_FLAGS)."""
    import inspect
    try:
        names = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(k for k in names if k not in ("self", "params", "lr", "defaults") + IMPLEMENTATION_FLAGS)


class GroupValues:
    """The learning rates the fast step reads and the other hyperparameters it was armed with.
    lr: one device tensor per param group (None: the group keeps a float, which its step() reads
    each time: Adam, AdamW and Adagrad on the CPU, where nothing is captured)."""

    def __init__(self, optimizer, lr: List[Optional[torch.Tensor]], gate: Optional[FlagGate] = None):
        self.lr = lr
        self.gate = gate
        """The skip of an optimizer without a fused step (step/gate.py), or None."""
        self._names = hyperparameters(torch_class(optimizer))
        self._armed = [self._others(g) for g in optimizer.param_groups]

    def _others(self, group: dict) -> dict:
        return {k: group[k] for k in self._names if k in group}

    def __iter__(self):
        return iter(self.lr)

    def __len__(self) -> int:
        return len(self.lr)

    def changed(self, optimizer) -> List[str]:
        """The hyperparameters besides lr that differ from those armed (a scheduler's momentum or
        betas: OneCycleLR cycles them), each once: the armed values then follow."""
        out = []
        for i, g in enumerate(optimizer.param_groups):
            now = self._others(g)
            out += [k for k in now if now[k] != self._armed[i].get(k) and k not in out]
            self._armed[i] = now
        return out


def _device_state(optimizer, cls: type, dev: torch.device) -> None:
    """The state the first step() would create lazily, created now on the device (zeros, and
    the step count a float32 device tensor, as torch's fused path keeps it), so that a CUDA graph
    captures tensors that stay. Existing state (a resumed run) keeps its values."""
    adam = issubclass(cls, torch.optim.Adam) or cls is torch.optim.AdamW
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state[p]
            if cls is torch.optim.SGD:
                # Zero buffers give the first step buf = 0*m + g = g, as torch's first-step
                # clone does.
                if g["momentum"] != 0 and st.get("momentum_buffer") is None:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                continue
            step = st.get("step", 0.0)
            if not (isinstance(step, torch.Tensor) and step.device == p.device and step.dtype == torch.float32):
                st["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
            keys = (("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g.get("amsgrad") else ())) if adam else ()
            for k in keys:
                if st.get(k) is None:
                    st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)


def arm_fast(*, optimizer, strategy, choice, dstep, fused: bool) -> GroupValues:
    """The fast step's device state (dstep.arm) and, fused: the optimizer's update made to read
    its learning rate from the device and skip on the flag, then the update kernel
    (choice.bind_update). How, by what the installed torch has (options.implementation): torch's
    fused implementation of the class, which reads the flag itself (fused, no foreach; capturable
    on CUDA, which a CUDA graph's capture asks of Adam), or its foreach one (capturable on CUDA)
    behind step/gate.py's FlagGate. The user's hyperparameters stay as they are; only the
    implementation changes. fused=False (a free-running strategy with an optimizer the fast step
    cannot update): the flags only; the strategy then skips the update itself (async-ps's server
    sees the losses on the host). Returns what `keep_lr_tensors` keeps."""
    dstep.arm()
    if not fused:
        return GroupValues(optimizer, [])
    dev = dstep.device
    cls = torch_class(optimizer)
    kind = implementation(optimizer, dev)
    lr: List[Optional[torch.Tensor]] = []
    for g in optimizer.param_groups:
        # One kernel for all parameters (fused) or a few (foreach), a learning rate read from the
        # device (the schedule fills it in place), and found_inf to skip a step without a host sync.
        if kind == "fused":
            g["fused"], g["foreach"] = True, False
        else:
            g["foreach"] = True
            if "fused" in g:
                g["fused"] = False
        if "capturable" in g and dev.type == "cuda":
            g["capturable"] = True
        # A tensor lr where a graph may read it (CUDA) and for SGD everywhere (flat_sgd reads it);
        # the others on the CPU keep the float their step() reads each time (torch's foreach step
        # takes a tensor lr only when capturable).
        if (dev.type == "cuda" or cls is torch.optim.SGD) and not isinstance(g["lr"], torch.Tensor):
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=dev)
        lr.append(g["lr"] if isinstance(g["lr"], torch.Tensor) else None)
    gate = None
    if kind == "fused":
        _device_state(optimizer, cls, dev)
        optimizer.found_inf = dstep.found_inf
    else:
        gate = FlagGate(optimizer, dstep.found_inf, strategy.params_flat)
    choice.bind_update(dstep.found_inf, kind)
    if strategy.noise is not None:
        strategy.noise.bind(dstep.t)  # its history is indexed by the step, as the losses are
    return GroupValues(optimizer, lr, gate)


def step_schedule(optimizer, schedule) -> None:
    # This step's update has happened, but not always through this rank's optimizer.step(),
    # whose wrapper is what torch's scheduler checks before its first step: fused SGD runs
    # inside the step (or its graph), and under ps only the server updates. Without the flag
    # torch warns of a wrong call order (a schedule off by one) that did not happen.
    optimizer._opt_called = True
    schedule.step()


def keep_lr_tensors(optimizer, lr: GroupValues) -> List[str]:
    """Recent torch schedulers fill a tensor learning rate in place; older ones assign a
    float. Either way the value ends up in the tensor the graph and the fused step read. Returns
    the other hyperparameters a scheduler changed since the last call (GroupValues.changed): an
    eager step reads them at its next step(), a CUDA graph keeps the values it captured."""
    for g, t in zip(optimizer.param_groups, lr):
        v = g["lr"]
        if t is not None and v is not t:
            if isinstance(v, torch.Tensor):
                t.copy_(v)
            else:
                t.fill_(float(v))
            g["lr"] = t
    return lr.changed(optimizer) if isinstance(lr, GroupValues) else []


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

    def __init__(self, *, strategy, optimizer, schedule, loader, timer, dstep, graphs, lr: GroupValues):
        self.strategy, self.optimizer, self.schedule, self.loader, self.timer = (strategy, optimizer, schedule,
                                                                                 loader, timer)
        self.dstep, self.graphs, self.lr = dstep, graphs, lr

    def run(self, step: int, meets: bool, measuring: bool) -> None:
        d, g = self.dstep, self.graphs
        # Before the step: what the scheduler (after the last step) or anything between steps (a
        # metric-based scheduler at evaluation) changed reaches this step's update.
        changed = keep_lr_tensors(self.optimizer, self.lr)
        if changed and g.graphs is not None:  # a graph would step on with the captured values
            g.release(f"{', '.join(changed)} changed before step {step} (a scheduler?): the rest runs eagerly")
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
        self.timer.step_done(timed=sampled)

    def update(self) -> None:
        pass


class FreeRunningStep:
    """A free-running strategy's step (async-ps): as many gradients as it asks for, each from the
    next batch of this rank's own sequence (its gradients, not the loop's steps, count the
    batches; with --accumulate N a gradient reads N micro-batches), eagerly; free_hist[step]
    takes the strategy's step_loss()."""

    def __init__(self, *, strategy, optimizer, schedule, loader, timer, dstep, fault, rank: int, reached,
                 free_hist, lr: GroupValues):
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
