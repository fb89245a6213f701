"""The sharded, device-resident training loader.

The whole training set sits on the worker's device. Every epoch all ranks draw the same global
permutation (seeded by seed and epoch, never communicated); global step t of an epoch takes the
slice perm[t*W*B : (t+1)*W*B] and rank r takes its r-th block of B. So:
  * ranks read disjoint samples within an epoch, and the union of their batches at a step is
    exactly the batch of W*B a single process would read with the same seed (which is what the
    strategy-equivalence tests rely on);
  * the batch at a step is a pure function of (seed, step), so a resumed run reads the same data;
  * the W*B-remainder of each epoch is skipped, a different one each epoch.
With gradient accumulation (N micro-batches a training step, --accumulate) training step s reads
loader steps s*N .. s*N+N-1, and an epoch holds a whole number of training steps (its loader steps
a multiple of N, the W*N*B-remainder skipped): so the N micro-batches of step s on every rank are
the slice perm[j*W*N*B : (j+1)*W*N*B] (j = s within its epoch), exactly the batch of W*N*B one
process reads at step s, also past an epoch's end.
Indexing a uint8 tensor and converting one batch costs one gather kernel; no DataLoader, no host.

Two ways to read the same batches:
  * `batch(step)`: the host computes the slice (the eager loop);
  * `prepare(step)` on the host, then `next_batch()`: the position lives in a device counter
    that `next_batch` advances, so a captured CUDA graph can replay it. `prepare` does host work
    (a new permutation, copied without a sync) only at an epoch boundary or a jump.
Augmentation (`augment.py`) is chosen per (epoch, position) and is the same in both.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from shmlearn.data.augment import Augment
from shmlearn.errors import BadInput


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The global order of epoch `epoch`, the same on every rank (and in the streaming loader,
    data/stream.py, which must read exactly these batches)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def too_few(batch_size: int, n: int, num_shards: int, accumulate: int = 1) -> BadInput:
    if accumulate > 1:
        fit = n // (num_shards * accumulate)
        return BadInput(f"--batch-size {batch_size} x --accumulate {accumulate}: more than a worker's shard "
                        f"({n} training samples / {num_shards} workers = {n // num_shards}); expected a "
                        f"batch size of at most {fit} at --accumulate {accumulate}")
    return BadInput(f"--batch-size {batch_size}: larger than a worker's shard "
                    f"({n} training samples / {num_shards} workers = {n // num_shards}); "
                    f"expected at most {n // num_shards}")


def epoch_steps(n: int, global_batch: int, accumulate: int = 1) -> int:
    """Loader steps in an epoch of n samples: whole training steps of `accumulate` loader steps
    of `global_batch` samples each (the module docstring)."""
    return n // (global_batch * accumulate) * accumulate


class ShardedLoader:
    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, shard: int,
                 num_shards: int, seed: int, normalize: Callable[[torch.Tensor], torch.Tensor],
                 augment: Optional[Augment] = None, channels_last: bool = False, accumulate: int = 1):
        n = len(x)
        self.x, self.y, self.normalize = x, y, normalize
        self.batch_size, self.shard, self.num_shards, self.seed = batch_size, shard, num_shards, seed
        self.global_batch = batch_size * num_shards
        self.accumulate = accumulate
        """Micro-batches a training step reads (--accumulate): next_batch() calls after a prepare()."""
        self.order_len = n
        """Samples an epoch's order holds: the training set's (data/tree.py's loader may hold a
        sampler's order of another length)."""
        self.steps_per_epoch = epoch_steps(n, self.global_batch, accumulate)
        if self.steps_per_epoch == 0:
            raise too_few(batch_size, n, num_shards, accumulate)
        self.augment = augment if augment is not None and augment.active else None
        if self.augment is not None:
            self.xp = self.augment.pad(x)  # uint8, padded once
            self.height, self.width = x.shape[2], x.shape[3]
        # channels_last without augmentation: keep an NHWC copy so a gather yields channels_last
        # batches directly (the augmenting gather already does).
        self._nhwc = (x.permute(0, 2, 3, 1).contiguous()
                      if channels_last and self.augment is None and x.dim() == 4 else None)
        self._epoch = -1
        self._perm = None
        self._table = None
        # device-counter state (prepare / next_batch), allocated on first prepare()
        self._dev = None
        self._next_step = None

    # -- one permutation (and augmentation table) per epoch -----------------------------------
    def _permutation_cpu(self, epoch: int) -> torch.Tensor:
        return epoch_permutation(len(self.x), self.seed, epoch)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            self._perm = self._permutation_cpu(epoch).to(self.x.device)
            self._table = (self.augment.epoch_table(self.seed, epoch, len(self.x), self.x.device)
                           if self.augment is not None else None)
            self._epoch = epoch
        return self._perm

    def _read(self, idx: torch.Tensor, table: Optional[torch.Tensor]) -> torch.Tensor:
        if self.augment is not None:
            return self.augment.gather(self.xp, idx, table, self.height, self.width)
        # index_select, not x[idx]: the same gather, but advanced indexing's general kernel is
        # an order of magnitude slower on the CPU and no faster on a GPU (results/
        # gather/; docs/performance.md, "Behind the code").
        if self._nhwc is not None:
            return self._nhwc.index_select(0, idx).permute(0, 3, 1, 2)
        return self.x.index_select(0, idx)

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, targets) this shard trains on at global step `step`."""
        epoch, i = divmod(step, self.steps_per_epoch)
        start = i * self.global_batch + self.shard * self.batch_size
        idx = self._permutation(epoch)[start:start + self.batch_size]
        table = self._table[start:start + self.batch_size] if self._table is not None else None
        return self._gather(idx, table)

    def _gather(self, idx: torch.Tensor, table: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The samples `idx`: (normalized inputs, targets). Fixed-shape device ops only (the
        device-counter read runs it inside a CUDA graph); data/tree.py's loader gathers a tree."""
        return self.normalize(self._read(idx, table)), self.y.index_select(0, idx)

    # -- the same batches from a device counter (CUDA-graph friendly) -------------------------
    def prepare(self, step: int) -> None:
        """Host side, before the training step that will call next_batch() `accumulate` times,
        reading loader steps step, step + 1, ...: at an epoch boundary (or when steps were
        skipped) load the epoch's permutation into the fixed device buffer and set the position
        counter. Issues copies and fills only; never waits for the device."""
        epoch, i = divmod(step, self.steps_per_epoch)
        if step == self._next_step and i != 0:
            self._next_step = step + self.accumulate
            return
        dev = self.x.device
        if self._dev is None:
            self._dev = {"perm": torch.empty(self.order_len, dtype=torch.int64, device=dev),
                         "pos": torch.zeros((), dtype=torch.int64, device=dev),
                         "ar": torch.arange(self.batch_size, dtype=torch.int64, device=dev),
                         "table": (torch.empty(len(self.x), dtype=torch.int64, device=dev)
                                   if self.augment is not None else None)}
        d = self._dev
        perm = self._permutation_cpu(epoch)
        if dev.type == "cuda":
            perm = perm.pin_memory()  # the pinned copy is asynchronous; the allocator keeps it alive
        d["perm"].copy_(perm, non_blocking=True)
        if d["table"] is not None:
            d["table"].copy_(self.augment.epoch_table(self.seed, epoch, len(self.x), dev))
        d["pos"].fill_(i * self.global_batch + self.shard * self.batch_size)
        self._next_step = step + self.accumulate

    def invalidate(self) -> None:
        """Forget the device counter (after warm-up steps moved it): the next prepare() resets it."""
        self._next_step = None

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Device side: the batch at the counter, then advance it by one global batch. Only
        fixed-shape device ops: safe inside a captured CUDA graph."""
        d = self._dev
        pos = d["pos"] + d["ar"]
        idx = d["perm"].index_select(0, pos)
        table = d["table"].index_select(0, pos) if d["table"] is not None else None
        batch = self._gather(idx, table)
        d["pos"].add_(self.global_batch)
        return batch
