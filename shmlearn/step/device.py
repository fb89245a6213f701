"""The device work of one step, the same whether it runs eagerly or is captured in a CUDA graph:
the batch read, the forward and backward into the strategy's flat gradient buffer (whole gradients
adopted, the noise meter's two half batches, the convolutions' updates in the backward), the loss
into the device history, and the strategy's gated step.

With --accumulate N (strategy.accumulate) a step reads N micro-batches and runs N forwards and
backwards whose gradients add up in .grad (each loss scaled by 1/N, so the buffer holds their
mean), the first N-1 under the strategy's no_sync; its loss is the micro-batches' mean loss. Its
gradients are then never taken whole (SyncStrategy.adopts_grads is off: no deferred weight GEMMs,
no update in the backward), and the buckets of the average (step/buckets.py) are armed for the
last backward only, when each gradient is complete."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from shmlearn.nn import conv_overlap
from shmlearn.sync.base import check_non_finite
from shmlearn.user.tasks import split_result


def autocast(device: torch.device, precision: str):
    """The forward's autocast for --precision. No weight-cast cache: each weight is cast once per
    forward anyway, and a cache would hold tensors across the boundary of a captured graph."""
    return (torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
            if precision == "bf16" else contextlib.nullcontext())


class DeviceStep:
    """One rank's forward, backward and gated update. choice: the step's KernelChoice (adopted
    gradients, deferred weight GEMMs, the update in the backward, the weight copy). The skip flag
    and the step counter on the device exist once `arm` has run (the fast step)."""

    def __init__(self, *, strategy, loader, loss, device: torch.device, opts, tuning, choice, fault, rank: int, reached,
                 hist: torch.Tensor, compute=None):
        self.strategy, self.loader, self.loss, self.device, self.opts = strategy, loader, loss, device, opts
        self.tuning = tuning
        self.compute = compute
        """The user's compute_loss(model, batch), or None: `loss` on the model's outputs."""
        self.choice, self.fault, self.rank, self.reached, self.hist = choice, fault, rank, reached, hist
        self.train_loss = self.eager_loss
        """(x, y) -> the batch's mean loss, after the forward: `eager_loss`, or its torch.compile'd
        form (--compile), in which Inductor fuses the loss into the model's last kernels."""
        self.next_batch = loader.next_batch if loader is not None else None
        """() -> the batch at the loader's device counter (fast step): its `next_batch`, or that
        compiled (StepTuning.compile_read); None on a rank that computes nothing (no loader)."""
        self.found_inf: Optional[torch.Tensor] = None
        self.t: Optional[torch.Tensor] = None
        self.zero: Optional[torch.Tensor] = None
        self.expected: Optional[int] = None
        """The step the device counter `t` holds next (None: the next step sets it)."""

    def arm(self) -> None:
        """The fast step's device state: the skip flag (found_inf), the step counter and a zero loss."""
        dev = self.device
        self.found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        self.t = torch.zeros(1, dtype=torch.int64, device=dev)
        self.zero = torch.zeros((), dtype=torch.float32, device=dev)

    def autocast(self):
        return autocast(self.device, self.opts.precision)

    def run(self, timer, round_: bool, step: Optional[int] = None) -> None:
        """The fast step's device work (step None: captured or warming up, no fault, no heartbeat)."""
        s = self.strategy
        if s.computes:
            # N micro-batches read at the device counter, which each read advances by one global
            # batch: loader steps t*N .. t*N+N-1 after FastStep's prepare(t*N).
            loss = self.accumulated(timer, lambda k: self.next_batch(), overlap=True)
            if self.fault is not None and step is not None:
                loss = self.fault.fire(self.rank, step, loss)
            self.hist.index_copy_(0, self.t, loss.reshape(1))
        else:
            loss = self.zero
        if self.reached is not None and step is not None:
            self.reached(step)
        s.gated_step(timer, loss, self.found_inf, round_)
        self.t.add_(1)

    def accumulated(self, timer, read, overlap: bool = False) -> torch.Tensor:
        """This rank's gradient of one training step in the strategy's buffer, and the step's mean
        loss: read(k) -> (x, y) of micro-batch k (timed as `data`; forward and backward as
        `compute`, both adding up over the micro-batches) for k < strategy.accumulate. overlap:
        as in `gradients`, for the last micro-batch (the step's average starts with its backward)."""
        s = self.strategy
        n = s.accumulate
        if n == 1:
            with timer.phase("data"):
                x, y = read(0)
            with timer.phase("compute"):
                return self.gradients(x, y, overlap=overlap)
        total = None
        for k in range(n):
            with timer.phase("data"):
                x, y = read(k)
            with timer.phase("compute"):
                if k == 0:
                    s.zero_grad()
                last = k == n - 1
                buckets = s.buckets if overlap and last else None
                with contextlib.nullcontext() if last else s.no_sync():
                    total = self._micro(x, y, n, total, buckets)
        return total / n

    def _micro(self, x, y, n: int, total: Optional[torch.Tensor], buckets) -> torch.Tensor:
        """One of a step's n micro-batches: its forward, and the backward of its loss / n, added
        into .grad; returns `total` plus its mean loss (detached). buckets: the last micro-batch's,
        armed before its backward with the step's mean loss (the control slot's value)."""
        with conv_overlap.weight_copies(self.choice.copy is not None):
            loss = self.train_loss(x, y)
        mean = loss.detach()
        total = mean if total is None else total + mean
        if buckets is not None:
            buckets.begin(total / n, False)
        (loss / n).backward()
        if buckets is not None:
            buckets.end()  # the bucket hooks fired on complete gradients: .grad holds the sum
        return total

    def gradients(self, x, y, overlap: bool = False) -> torch.Tensor:
        """This rank's gradients of the batch, in the strategy's flat buffer; the mean loss.
        overlap (the fast step's gated_step follows): the average starts in buckets during the
        backward where the strategy has them (step/buckets.py), except on a measured noise step."""
        s, k = self.strategy, self.choice
        meter = s.noise
        measured = meter is not None and meter.on
        buckets = s.buckets if overlap and not measured else None
        # Whole gradients are taken, not accumulated, except where the noise meter's two half
        # batches accumulate into the buffer (a measured step at one worker).
        adopt = k.adopts and not (meter is not None and meter.micro and meter.on)
        if adopt:
            s.release_grads()
        else:
            s.zero_grad()
        # Deferred weight GEMMs are joined on leaving (before adopt_grads reads them); never where
        # gradients are added into .grad during the backward.
        early = adopt and k.early_update
        if early:
            self._taken = [0] * len(k.slots)
            self._placed = {}
        with conv_overlap.deferred(self.device, adopt and k.deferred, self.tuning.side_streams,
                                   sink=self._take if early else None):
            loss = self._forward_backward(x, y, gate=early, buckets=buckets, adopt=adopt)
        if early:
            self._check_taken()
            self._check_placeholders()
        if buckets is not None:
            buckets.end()  # the buckets took the gradients into the buffer themselves
        elif adopt:
            s.adopt_grads(s.flat_update.early if early else frozenset())
        return loss

    def _take(self, slot: int, dw, db, placeholders) -> None:
        """The sink of conv_overlap.deferred (update in the backward): convolution `slot`'s
        gradients into the flat buffer and their SGD step, on the stream that made them."""
        w, b, _ = self.choice.slots[slot]
        self._taken[slot] += 1
        for i, t in zip((w, b), placeholders):
            if i is not None and t is not None:
                self._placed[i] = t.data_ptr()
        if dw is not None:
            self.strategy.flat_update.take(w, dw)
        if db is not None and b is not None:
            self.strategy.flat_update.take(b, db)

    def _check_placeholders(self) -> None:
        """After such a backward, on the host: each parameter updated in it must hold the op's
        placeholder as its .grad. Another tensor there means autograd added a gradient from
        elsewhere (the weight used outside its module too), which the update did not see: an
        error, in the warm-up of a captured step (whose updates are skipped) or the first step."""
        s = self.strategy
        for w, b, name in self.choice.slots.values():
            for i in (w, b):
                g = s._trainable[i].grad if i is not None else None
                if g is not None and i in self._placed and g.data_ptr() != self._placed[i]:
                    raise RuntimeError(f"--update-in-backward: {name}'s parameters get gradients from outside "
                                       "the module too; run with --update-in-backward off")

    def _check_taken(self) -> None:
        """After a backward that updated its convolutions (on the host: when a step runs eagerly
        or is captured; a replay repeats the capture): one taken twice is an error (the module is
        called twice per step); one the backward never reached takes its step with a zero
        gradient, as the flat update of a parameter without a gradient does."""
        slots = self.choice.slots
        twice = [slots[k][2] for k, n in enumerate(self._taken) if n > 1]
        if twice:
            raise RuntimeError(f"--update-in-backward: convolution {twice[0]} ran more than once in a step; "
                               "run with --update-in-backward off")
        s = self.strategy
        for k, n in enumerate(self._taken):
            if n == 0:
                w, b, _ = slots[k]
                for i in (w, b):
                    if i is not None:  # the zeros adopt_grads keeps for a parameter without a gradient
                        if i not in s._zeros:
                            s._zeros[i] = torch.zeros_like(s._grad_views[i])
                        s.flat_update.take(i, s._zeros[i])

    def eager_loss(self, x, y) -> torch.Tensor:
        """The batch's mean loss: the forward under autocast (--precision), the loss in fp32."""
        return self.forward_loss(self.strategy.module, x, y)

    def forward_loss(self, module, x, y) -> torch.Tensor:
        """`module`'s mean loss on the batch: the user's compute_loss(module, batch) under autocast
        (batch: the tree, or the (x, y) pair of built-in and array data), or the forward under
        autocast and the loss (outputs, targets) in fp32."""
        if self.compute is not None:
            with self.autocast():
                return split_result(self.compute(module, x if y is None else (x, y)))[0].float()
        with self.autocast():
            out = module(x)
        return self.loss(out.float(), y)

    def _forward_backward(self, x, y, gate: bool = False, buckets=None, adopt: bool = False) -> torch.Tensor:
        """Forward and backward of this rank's batch; its mean loss, detached. With a noise meter
        at one worker, as two half batches (noise.py: their gradients' norms are the measurement).
        gate: a non-finite loss sets the skip flag before the backward (whose updates read it).
        buckets: the average's buckets, armed with the loss before the backward (step/buckets.py)."""
        def fb(xb, yb):
            with conv_overlap.weight_copies(self.choice.copy is not None):
                loss = self.train_loss(xb, yb)
            if gate:
                check_non_finite(loss.detach().reshape(1), self.found_inf, self.strategy._one)
            if buckets is not None:
                buckets.begin(loss.detach(), adopt)
            loss.backward()
            return loss.detach()
        meter = self.strategy.noise
        if meter is not None and meter.micro and meter.on:  # only a measured step splits (--noise-every)
            return meter.two_halves(fb, x, y, self.strategy.grads_flat)
        return fb(x, y)
