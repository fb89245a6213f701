"""torch's DistributedDataParallel, unchanged: the reference users know.

DDP all-reduces gradient buckets during backward, overlapped with it, so its communication
cannot be timed apart from compute: this strategy reports `compute` (forward + backward +
overlapped all-reduce) and `update` only.

Noise scale (--noise-scale, noise.py, 2+ workers): a communication hook all-reduces each bucket
with its local squared norm appended (one more float in the collective DDP already makes; the
bucket is copied once into the longer buffer), and sums the bucket's mean local norm and its
averaged gradient's norm; `step` records the sums. On steps that do not measure (`noise.on`,
every --noise-every steps) the hook is torch's own allreduce_hook, what DDP does without one. At 1 worker it is refused: the half batches
are measured in the flat buffer, which DDP does not use.

--accumulate: the step's first N-1 backwards run under DDP's no_sync (`no_sync`), the last one
all-reduces the sum. --clip-grad-norm: torch's clip_grad_norm_ on the averaged .grad (`clip_`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from shmlearn.train.noise import sq_norm
from shmlearn.sync.base import SyncStrategy
from shmlearn.sync.registry import Costs, Entry, register
from shmlearn.record.timing import PhaseTimer

BUCKET_BYTES = 25 << 20  # torch DDP's default bucket_cap_mb


class DDP(SyncStrategy):
    name = "ddp"
    grads_in_flat_buffer = False  # DDP's buckets hold them: --noise-scale at 1 worker is refused (noise.check)
    measures_noise = True

    _ddp = None
    _noise = None

    @property
    def noise(self):
        return self._noise

    @noise.setter
    def noise(self, meter) -> None:
        """train/rank.py sets the run's NoiseMeter after setup: from then on DDP reduces through the hook."""
        self._noise = meter
        self._noise_parts = []
        if meter is not None and self.world_size > 1:
            self._ddp.register_comm_hook(None, self._noise_hook)

    def _noise_hook(self, state, bucket):
        if not self._noise.on:
            return allreduce_hook(self.group, bucket)
        buf = bucket.buffer()
        ext = torch.empty(buf.numel() + 1, dtype=buf.dtype, device=buf.device)
        ext[:-1].copy_(buf)
        sq_norm(buf, out=ext[-1])  # on the device, no host sync
        ext.div_(self.world_size)  # SUM of x / W: the mean (Gloo has no AVG)
        fut = dist.all_reduce(ext, group=self.group, async_op=True).get_future()

        def done(f):
            t = f.value()[0]
            # Buckets may finish on different threads: list.append is atomic, a += on one tensor is not.
            self._noise_parts.append(torch.stack([t[-1], sq_norm(t[:-1])]))
            buf.copy_(t[:-1])
            return buf
        return fut.then(done)

    def setup(self, model, optimizer, group=None, *, channels_last: bool = False) -> None:
        # The flat weight buffer as every strategy has it (replicas are checked on it); DDP's
        # own buckets then hold the gradients (.grad becomes a view of them at the first backward).
        super().setup(model, optimizer, group, channels_last=channels_last)
        device_ids = [model_device(model).index] if model_device(model).type == "cuda" else None
        # DDP broadcasts rank 0's weights and buffers at construction; gradient_as_bucket_view
        # saves the copy between .grad and the communication buckets.
        self._ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=self.group,
                                            gradient_as_bucket_view=True)

    @property
    def module(self) -> torch.nn.Module:
        return self._ddp if self._ddp is not None else self.model

    adopts_grads = False  # .grad lives in DDP's buckets, not in the flat buffer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def sync_buffers(self) -> None:
        pass  # DDP already broadcasts rank 0's buffers before every forward

    def step(self, timer: PhaseTimer) -> None:
        if self._noise is not None and self._noise_parts:
            small, big = torch.stack(self._noise_parts).sum(0)
            self._noise_parts = []
            if self.rank == 0:
                self._noise.record(small, big)
        with timer.phase("update"):
            self.update_params()  # clipped first (--clip-grad-norm): DDP averaged in the backward

    def clip_(self) -> None:
        """--clip-grad-norm on the .grad tensors, which DDP's buckets hold (averaged by the
        backward's all-reduce): torch's clip_grad_norm_, device ops only (no host sync)."""
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._trainable, self.clip_grad_norm)

    def no_sync(self):
        """All but the last backward of a step (--accumulate): DDP's own no_sync, so that its
        buckets all-reduce once a step, the sum of the micro-batches' gradients."""
        return self._ddp.no_sync() if self._ddp is not None else super().no_sync()

    def finish(self) -> None:
        # Drop DDP's reducer now, while its process group is alive: left to the interpreter's
        # exit it may be torn down after the group, which aborts the process.
        self._ddp = None


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def cost(c: Costs, params) -> dict:
    """Backward (bwd_frac of compute) hides the all-reduce, except the last bucket's (not
    validated against measurements)."""
    ar = 0.0
    if c.workers > 1:
        hidden = c.bwd_frac * c.local["compute"]
        ar = max(c.all_reduce(c.workers, min(c.grad_bytes, BUCKET_BYTES)), c.all_reduce(c.workers, c.grad_bytes) - hidden)
    return {"wake": c.wake("all_reduce"), "update": c.local["update"], "allreduce": ar}


ENTRY = register(Entry(name="ddp", cls=DDP, help="torch DistributedDataParallel, unchanged", cost=cost))
