"""The sharded, device-resident training loader.

The whole training set sits on the worker's device. Every epoch all ranks draw the same global
permutation (seeded by seed and epoch, never communicated); global step t of an epoch takes the
slice perm[t*W*B : (t+1)*W*B] and rank r takes its r-th block of B. So:
  * ranks read disjoint samples within an epoch, and the union of their batches at a step is
    exactly the batch of W*B a single process would read with the same seed (which is what the
    strategy-equivalence tests rely on);
  * the batch at a step is a pure function of (seed, step), so a resumed run reads the same data;
  * the W*B-remainder of each epoch is skipped, a different one each epoch.
Indexing a uint8 tensor and converting one batch costs one gather kernel; no DataLoader, no host.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch

from shmlearn.errors import BadInput


class ShardedLoader:
    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, shard: int,
                 num_shards: int, seed: int, normalize: Callable[[torch.Tensor], torch.Tensor]):
        n = len(x)
        self.x, self.y, self.normalize = x, y, normalize
        self.batch_size, self.shard, self.num_shards, self.seed = batch_size, shard, num_shards, seed
        self.global_batch = batch_size * num_shards
        self.steps_per_epoch = n // self.global_batch
        if self.steps_per_epoch == 0:
            raise BadInput(f"--batch-size {batch_size}: larger than a worker's shard "
                           f"({n} training samples / {num_shards} workers = {n // num_shards}); "
                           f"expected at most {n // num_shards}")
        self._epoch = -1
        self._perm = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(len(self.x), generator=g).to(self.x.device)
            self._epoch = epoch
        return self._perm

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, targets) this shard trains on at global step `step`."""
        epoch, i = divmod(step, self.steps_per_epoch)
        start = i * self.global_batch + self.shard * self.batch_size
        idx = self._permutation(epoch)[start:start + self.batch_size]
        return self.normalize(self.x[idx]), self.y[idx]
