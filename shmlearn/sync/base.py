"""The one interface every synchronization strategy implements (docs/architecture.md, "How to
add a strategy").

A strategy owns everything between `loss.backward()` and the next forward pass: making replicas
identical at the start, communicating, and applying the optimizer. The training loop never calls
a collective for the model itself.

Gradients live in one flat buffer and the parameters' `.grad` are views into it (and parameters
are views into one flat weight buffer), so a sync is one collective, not one call per tensor.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from shmlearn.record.timing import PhaseTimer
from shmlearn.sync.shm import HostCollectives


def flatten_parameters(model: torch.nn.Module, *, channels_last: bool = False, extra: int = 0):
    """Move every trainable parameter (and its gradient) into one contiguous buffer.

    Returns (params_flat, grads_flat). Parameter objects keep their identity (only `.data` is
    re-pointed), so an optimizer built before this call still holds the right tensors.
    channels_last: 4-D parameters (conv weights) become channels_last views of the buffer, so
    convolutions on channels_last inputs need no layout copies. extra: the buffers have this
    many more elements after the parameters (`params_flat._base` / `grads_flat._base` hold them):
    control values that ride along with a collective of the whole buffer (fast step, fast.py).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    dtype, device = params[0].dtype, params[0].device
    if any(p.dtype != dtype or p.device != device for p in params):
        raise ValueError("flat buffers need every parameter on one device with one dtype")
    total = sum(p.numel() for p in params)
    pext = torch.empty(total + extra, dtype=dtype, device=device)
    gext = torch.zeros(total + extra, dtype=dtype, device=device)
    pflat, gflat = pext[:total], gext[:total]
    offset = 0
    for p in params:
        n = p.numel()
        pv, gv = _view(pflat, offset, p, channels_last), _view(gflat, offset, p, channels_last)
        pv.copy_(p.data)
        p.data = pv
        p.grad = gv
        offset += n
    return pflat, gflat


def _view(flat: torch.Tensor, offset: int, p: torch.Tensor, channels_last: bool) -> torch.Tensor:
    chunk = flat[offset:offset + p.numel()]
    if channels_last and p.dim() == 4:
        o, i, h, w = p.shape  # stored (O, H, W, I), seen as (O, I, H, W) with channels_last strides
        return chunk.view(o, h, w, i).permute(0, 3, 1, 2)
    return chunk.view_as(p)


def by_kind(tensors: Iterable[torch.Tensor]) -> List[List[torch.Tensor]]:
    """The tensors grouped by dtype and device, each group in the order given (the model's, the
    same on every rank): what one flat collective each can carry."""
    kinds: Dict[tuple, List[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    return list(kinds.values())


def through_flat(tensors: List[torch.Tensor], op: Callable[[torch.Tensor], None]) -> None:
    """op on one flat copy of the tensors (of one dtype and device), then each takes its part
    back: one collective for a model's BatchNorm buffers, not three a layer."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    op(flat)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def check_non_finite(values: torch.Tensor, found_inf: torch.Tensor, one: torch.Tensor) -> None:
    """found_inf <- 1.0 if `values` holds a NaN or inf (else unchanged): one kernel, no host
    sync. It is AMP's gradient check (which also scales by `one`, i.e. leaves values alone)."""
    torch._amp_foreach_non_finite_check_and_unscale_([values], found_inf, one)


def clip_norm_(g: torch.Tensor, max_norm: float) -> None:
    """g <- g * min(1, max_norm / (|g| + 1e-6)), |g| its L2 norm, as torch.nn.utils.clip_grad_norm_
    scales. Device ops only (no host sync: capturable in the fast step's CUDA graph); one pass to
    reduce and one to scale."""
    norm = torch.linalg.vector_norm(g, dtype=torch.float32)
    g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(g.dtype))


class GradientRules:
    """What the run's --accumulate and --clip-grad-norm ask of every strategy (SyncStrategy's
    concern apart from communication): train/rank.py sets both before setup."""

    accumulate: int = 1
    """Backwards whose gradients add up in .grad before each step (--accumulate; the step, step/,
    runs them, `no_sync` around all but the last)."""
    clip_grad_norm: Optional[float] = None
    """--clip-grad-norm: `update_params` clips the gradient it applies to this global L2 norm first
    (`clip_`)."""

    @property
    def adopts_grads(self) -> bool:
        """Whether `release_grads` / `adopt_grads` may stand in for `zero_grad` around a backward:
        not where several backwards add up in .grad (--accumulate), nor where .grad is not this
        class's flat buffer (DDP's buckets: a class attribute there)."""
        return self.accumulate == 1

    def no_sync(self):
        """Around a backward whose gradient adds up with the next ones' (--accumulate, all but the
        last of a step): nothing here, since strategies sync in `step`; DDP, which starts its
        all-reduce in the backward, keeps those local."""
        return nullcontext()

    def clip_(self) -> None:
        """--clip-grad-norm on the flat gradient buffer (its control slots left out): `clip_norm_`.
        `update_params` calls it on the gradient it applies: after the average, so the clipped
        gradient is one process's clipped gradient of the whole batch."""
        if self.clip_grad_norm is not None:
            clip_norm_(self.grads_flat, self.clip_grad_norm)


class SyncStrategy(GradientRules, HostCollectives, ABC):
    """Base class: flat buffers, the initial broadcast, and what every strategy shares."""

    name: str = "base"

    def __init__(self, *, rank: int, world_size: int, group: Optional[dist.ProcessGroup] = None):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.model: Optional[torch.nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.params_flat: Optional[torch.Tensor] = None
        self.grads_flat: Optional[torch.Tensor] = None
        self._one: Optional[torch.Tensor] = None

    gated: bool = False
    """Whether `gated_step` is implemented (the fast step in fast.py needs it)."""

    free_running: bool = False
    """Whether computing ranks run on their own clock (async-ps): in the fast step a rank then
    computes as many gradients per loop step as `wants_gradient` asks (none, one or several),
    after `plan_step`, and its loss of the step is `step_loss()`. Not capturable in a graph."""

    timeout_s = None
    """The run's --timeout, for groups a strategy makes itself (set by train/rank.py before setup)."""
    run_steps = None
    """The run's loop steps, for buffers a strategy sizes by them (set by train/rank.py before setup)."""

    measures_noise: bool = False
    """Whether the strategy measures the gradient noise scale at 2+ workers (noise.py): it adds
    `noise.put_local` to its gradient collective and records the averaged gradient's norm."""
    control_slots: int = 1
    """Elements after the gradients and weights in the flat buffers: the loss of the fast step,
    and, for strategies that measure the noise scale, |g_local|^2 before it."""
    noise = None
    """The run's NoiseMeter (noise.py) when --noise-scale is on, set by train/rank.py after setup."""

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              group: Optional[dist.ProcessGroup] = None, *, channels_last: bool = False) -> None:
        """Flatten, then make every replica equal to rank 0's (weights and buffers). Both flat
        buffers get `control_slots` extra elements: control values for the fast step (`gated_step`)
        and the noise scale."""
        self.model, self.optimizer = model, optimizer
        if group is not None:
            self.group = group
        self.params_flat, self.grads_flat = flatten_parameters(model, channels_last=channels_last,
                                                               extra=self.control_slots)
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._grad_views = [p.grad for p in self._trainable]
        # Each view's dimensions from outermost to innermost in the buffer (a channels_last conv
        # weight is stored O, H, W, I): what `adopt_grads` permutes a gradient by before flattening.
        self._flat_orders = [sorted(range(v.dim()), key=lambda d, v=v: -v.stride(d)) for v in self._grad_views]
        self._zeros: Dict[int, torch.Tensor] = {}  # index -> zeros, for parameters a backward gave no gradient
        # The control slots after the gradients, with the zeros `adopt_grads` copies into them.
        tail = self.grads_flat._base[self.grads_flat.numel():]
        self._tail = [tail] if tail.numel() else []
        self._tail_zeros = [torch.zeros_like(tail)] if tail.numel() else []
        self._one = torch.ones((), dtype=torch.float32, device=self.params_flat.device)
        # NCCL averages in the collective; Gloo has no AVG op: SUM, then one pass to scale.
        self._avg_op = (dist.ReduceOp.AVG if self.world_size > 1
                        and dist.get_backend(self.group) == "nccl" else None)
        if self.world_size > 1:
            dist.broadcast(self.params_flat, src=0, group=self.group)
            for bufs in by_kind(model.buffers()):  # one broadcast per dtype, not one per buffer
                through_flat(bufs, lambda flat: dist.broadcast(flat, src=0, group=self.group))
        self.open_host_collectives()

    @property
    def module(self) -> torch.nn.Module:
        """What the loop calls forward on (DDP wraps the model; the others use it as is)."""
        return self.model

    @property
    def computes(self) -> bool:
        """Whether this rank computes gradients (a dedicated parameter server does not)."""
        return True

    @property
    def compute_ranks(self) -> int:
        return self.world_size

    def zero_grad(self) -> None:
        # Zero in place: set_to_none would cut the .grad views out of the flat buffer.
        self.grads_flat.zero_()

    def release_grads(self) -> None:
        """Before a backward whose gradients the step takes whole (no accumulation over several
        backwards): unset .grad, so that autograd's AccumulateGrad keeps the gradient tensor it
        made (no kernel) instead of adding it into the zeroed flat buffer (one memset, then one
        add kernel per parameter: 62 of 403 kernels in resnet18's compiled step at batch 128; their
        time: docs/performance.md, "Behind the code"). `adopt_grads` must follow the backward."""
        for p in self._trainable:
            p.grad = None

    CAT_MAX = 1 << 22
    """Models with at most this many parameters adopt their gradients with one cat, larger ones
    with one multi-tensor copy. torch's multi-tensor kernels give each tensor's 65,536-value chunk
    to one block, so a small model's copy runs in a dozen blocks and is slower than cat; cat's
    grid does not grow with large inputs, where the multi-tensor copy runs at the copy bandwidth
    and cat falls far behind (alexnet-small and resnet18: docs/performance.md, "Behind the
    code")."""

    own_gradient: bool = False
    """Whether this step's update reads this rank's own gradient alone (no collective before it)."""

    @property
    def updates_locally(self) -> bool:
        """Whether a parameter may be updated as soon as the backward has made its gradient (the
        fast step's update in the backward, fast.py): the update reads this rank's own gradient
        (`own_gradient`) and no clipping waits for the whole gradient's norm."""
        return self.own_gradient and self.clip_grad_norm is None

    def adopt_grads(self, taken=frozenset()) -> None:
        """After the backward: write every gradient into the flat buffer in one kernel (zeros
        for a parameter that got none, and for the control slots, as `zero_grad` leaves them)
        and point .grad at its views again: one cat or one multi-tensor copy (CAT_MAX). taken:
        indices of parameters whose gradients are in the buffer already (the update in the
        backward, fast.py); what their .grad holds now is dropped."""
        src, dst = [], []
        for i, (p, view) in enumerate(zip(self._trainable, self._grad_views)):
            g = p.grad
            p.grad = view
            if i in taken:
                continue
            if g is None:
                g = self._zeros.get(i)
                if g is None:
                    g = self._zeros[i] = torch.zeros_like(view)
            src.append(g)
            dst.append(view)
        if taken or self.grads_flat.numel() > self.CAT_MAX:
            torch._foreach_copy_(dst + self._tail, src + self._tail_zeros)
            return
        # In the buffer's order: a view where g is laid out as its flat view (a copy if not).
        flat = [g.permute(order).reshape(-1) for g, order in zip(src, self._flat_orders)]
        torch.cat(flat + self._tail_zeros, out=self.grads_flat._base)

    @abstractmethod
    def step(self, timer: PhaseTimer) -> None:
        """Synchronize and update after backward; time each phase under the shared phase names
        (docs/architecture.md, "The output contract")."""

    # -- the fast step (fast.py): device work only, no host sync, capturable in a CUDA graph ---
    def gated_step(self, timer, loss: torch.Tensor, found_inf: torch.Tensor, round_: bool) -> None:
        """Like `step`, but on the device only: `loss` is this rank's loss of the step (a 0-dim
        tensor; 0 on a rank that computes nothing) and `found_inf` the optimizer's skip flag
        (fused SGD skips its update while it is 1.0). A strategy sets found_inf to 1 when a loss
        it must trust is not finite, before the update; the flag then stays 1, so no non-finite
        gradient is ever applied and the weights stay as they were before that step. round_:
        whether this step averages (weight averaging; from `next_round()`, decided on the host)."""
        raise NotImplementedError(f"{self.name}: no fast step")

    averages_in_buckets: bool = False
    """Whether gated_step averages the flat gradient buffer (with its control slots) and nothing
    else before the update, so that the average may run in buckets during the backward
    (step/buckets.py): it then calls `buckets.wait()` instead of averaging."""
    buckets = None
    """The fast step's GradBuckets (step/buckets.py) when the average runs during the backward,
    else None (`average_in_buckets` sets it)."""

    flat_update = None
    """The fast step's update as one kernel over the flat buffers (flat_sgd.bind), else None
    (`update_with` sets it)."""

    # -- what the fast step hands over (step/kernels.py): the strategy's only inputs from step/ ---
    def average_in_buckets(self, buckets) -> None:
        """The GradBuckets that start the gradient average during the backward (step/buckets.py),
        or None to take them back: gated_step then waits for them instead of averaging. Only a
        strategy that `averages_in_buckets` takes them."""
        if buckets is not None and not self.averages_in_buckets:
            raise ValueError(f"strategy {self.name} does not average its gradient in buckets")
        self.buckets = buckets

    def update_with(self, flat_update) -> None:
        """The fast step's update as one kernel over the flat buffers (flat_sgd.bind), which
        `update_params` then runs instead of the optimizer's step()."""
        self.flat_update = flat_update

    def update_params(self) -> None:
        """Every strategy's update (step and gated_step): the gradient clipped (`clip_`), then the
        flat kernel where bound (the fast step), else the optimizer's step()."""
        self.clip_()
        if self.flat_update is not None:
            self.flat_update()
        else:
            self.optimizer.step()

    def params_written(self) -> None:
        """gated_step wrote params_flat other than through `update_params` (an average, a
        broadcast): the flat update's weight copy, which the next forward reads, is cast again
        (flat_sgd.FlatUpdate.refresh; nothing without one)."""
        if self.flat_update is not None:
            self.flat_update.refresh()

    def round_kinds(self) -> list:
        """The values of `round_` that gated_step is called with in this run (fast.py captures
        one CUDA graph for each): [False] unless the strategy communicates in rounds."""
        return [False]

    def next_round(self) -> bool:
        """Whether the coming step communicates weights (weight averaging every K steps)."""
        return False

    def plan_step(self, step: int, meets: bool) -> None:
        """Free running only: loop step `step` comes next; `meets`: the loop meets in a
        collective after it (a read, an evaluation, the end), so no message may be left waiting."""

    def wants_gradient(self) -> bool:
        """Free running only: whether this rank computes another gradient in the planned step."""
        raise NotImplementedError

    def step_loss(self) -> float:
        """Free running only: this rank's entry in the loss history for the planned step."""
        raise NotImplementedError

    def host_step(self, round_: bool) -> None:
        """Host bookkeeping after a fast step (the device work may have been a graph replay)."""

    def _average_(self, buf: torch.Tensor) -> None:
        """buf <- mean of buf over the ranks: through shared memory where setup made it (a CPU
        run's ranks on one host: sync/shm.py), else one all-reduce."""
        if self._shm is not None and self._shm.fits(buf):
            self._shm.sum_(buf)
            buf.div_(self.world_size)
        elif self._avg_op is not None:
            dist.all_reduce(buf, op=self._avg_op, group=self.group)
        else:
            dist.all_reduce(buf, group=self.group)
            buf.div_(self.world_size)

    @property
    def grads_ext(self) -> torch.Tensor:
        """The flat gradient buffer plus its control slots (the loss is the last element)."""
        return self.grads_flat._base

    @property
    def params_ext(self) -> torch.Tensor:
        return self.params_flat._base

    # -- evaluation and the end of training ----------------------------------------------------
    def sync_buffers(self) -> None:
        """Average floating-point buffers (BatchNorm running stats) so every rank evaluates the
        same model: one average (`_average_`) of them all, flattened, per dtype and device; only
        called before evaluation. A ResNet-18's 60 BatchNorm buffers were 60 collectives."""
        if self.world_size == 1:
            return
        for bufs in by_kind(b for b in self.model.buffers() if b.is_floating_point()):
            through_flat(bufs, self._average_)

    @contextmanager
    def eval_weights(self):
        """Weights that evaluation should see. Every replica already holds them, except in
        weight averaging between rounds (weight_averaging.py overrides this)."""
        self.sync_buffers()
        yield

    def finish(self) -> None:
        """Called once after the last step; replicas must be identical afterwards."""

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass
