"""Training batches of the general contract (data/tree.py) fed from host memory, for a train split
the device cannot hold and for an IterableDataset with no length (an endless stream).

    HostTreeLoader     the collated train tree stays in host memory (DataOptions.loader: stream,
                       or auto when it takes more than half of the device's free memory); each
                       batch is gathered there, copied into pinned memory on CUDA and from
                       there to the device asynchronously. The same batches as TreeLoader's (it computes them:
                       the same permutation or sampler, shards and --accumulate), so the same run.
    StreamTreeLoader   the train split is an IterableDataset without __len__: it is never read
                       whole. Every rank iterates it in order; loader step L is the items
                       [L*G, (L+1)*G) of the stream (G = W x --batch-size), rank r collates the
                       r-th block of B of them, so the W ranks' batches of a step are the batch of
                       G that one process reading the stream in order takes. A stream that ends is
                       iterated again (a new pass). Its epochs cannot be counted: the run's budget
                       is --samples (data/iterable.py `check_budget`). Each rank reads every item (and collates
                       its own): a stream that is costly to produce pays that W times.

Both give the fast step what StreamLoader (data/stream.py) gives it: `prepare(step)` (host side)
copies a training step's micro-batches into fixed device buffers, and `next_batch()` (inside a
captured CUDA graph too) returns them in turn.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

from shmlearn.data import user as user_data
from shmlearn.data.iterable import TrainStream
from shmlearn.data.tree import TreeLoader
from shmlearn.errors import BadInput


def tree_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0])


def keeps_on_host(loader: str, nbytes: int, device: torch.device) -> bool:
    """Whether a train tree of `nbytes` stays in host memory (DataOptions.loader): stream always,
    resident never, auto when it takes more than data/user.py's RESIDENT_FRACTION of the device's
    free memory (the rule by which the (x, y) Datasets' path reads resident or streams)."""
    if loader != "auto":
        return loader == "stream"
    return nbytes > user_data.RESIDENT_FRACTION * user_data._free_bytes(device)


class _HostFed:
    """batch / prepare / next_batch / invalidate (ShardedLoader's interface) over `_host_batch(step)`,
    the host tree of loader step `step`: copied to the device without waiting (from pinned
    memory on CUDA), into fixed buffers for the fast step."""

    device: torch.device
    accumulate: int

    def _host_batch(self, step: int):
        raise NotImplementedError

    def _pinned(self, tree):
        """A host tree in pinned memory on CUDA (the copy to the device is then asynchronous; the
        caching host allocator keeps the block until that copy is done)."""
        if self.device.type != "cuda":
            return tree
        return tree_map(lambda t: t if t.is_pinned() else t.pin_memory(), tree)

    def batch(self, step: int):
        """(this rank's batch of loader step `step` on the device, None)."""
        host = self._pinned(self._host_batch(step))
        return tree_map(lambda t: t.to(self.device, non_blocking=True), host), None

    def prepare(self, step: int) -> None:
        """Host side: loader steps step .. step + accumulate - 1 into the buffers the next
        `accumulate` next_batch() calls return, in order."""
        if not hasattr(self, "_bufs"):
            self._bufs: List[Any] = []
        for k in range(self.accumulate):
            host = self._pinned(self._host_batch(step + k))
            if len(self._bufs) <= k:
                self._bufs.append(tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device), host))
            leaves, _ = tree_flatten(self._bufs[k])
            src, _ = tree_flatten(host)
            if [tuple(t.shape) for t in leaves] != [tuple(t.shape) for t in src]:
                raise BadInput(f"data=: the train batch of step {step + k} has tensors of shapes "
                               f"{[tuple(t.shape) for t in src]}, the first batch's were "
                               f"{[tuple(t.shape) for t in leaves]}; every item needs tensors of one shape")
            for dst, s in zip(leaves, src):
                dst.copy_(s, non_blocking=True)
        self._k = 0

    def next_batch(self):
        """The next prepared micro-batch (a host counter: a captured step's calls read buffers
        0 .. accumulate - 1, as every eager step's do)."""
        tree = self._bufs[self._k]
        self._k = (self._k + 1) % len(self._bufs)
        return tree, None

    def invalidate(self) -> None:
        """Nothing to forget: every prepare() fills the buffers anew."""


class HostTreeLoader(_HostFed):
    """TreeLoader's batches of a train tree kept in host memory (the module docstring)."""

    def __init__(self, tree, *, device: torch.device, batch_size: int, shard: int, num_shards: int, seed: int,
                 sampler=None, accumulate: int = 1, lazy=None):
        self.device, self.accumulate = device, accumulate
        self.host = TreeLoader(tree, batch_size=batch_size, shard=shard, num_shards=num_shards, seed=seed,
                               sampler=sampler, accumulate=accumulate, lazy=lazy)
        """The same loader over the host tree: its batch(step) is the gather on the host."""

    def _host_batch(self, step: int):
        return self.host.batch(step)[0]


class StreamTreeLoader(_HostFed):
    """This rank's batches of a TrainStream (the module docstring). Loader steps are read in order;
    a step further on skips the items before it, an earlier one (capture's warm-up read ahead, a
    compiled read's trial) starts the stream again from its first item."""

    def __init__(self, stream: TrainStream, *, device: torch.device, batch_size: int, shard: int, num_shards: int,
                 accumulate: int = 1):
        self.stream, self.device, self.accumulate = stream, device, accumulate
        self.batch_size, self.shard, self.global_batch = batch_size, shard, batch_size * num_shards
        self._it = None
        self._step: Optional[int] = None  # the loader step the iterator is at
        self.passes = 0
        """Passes over the stream begun (a finite stream is iterated again when it ends)."""

    def _next_item(self):
        for _ in range(2):
            try:
                return next(self._it)
            except StopIteration:  # a new pass; one that gives nothing at all would spin forever
                self._it = self.stream.items()
                self.passes += 1
        raise BadInput(f"{self.stream.what}: the train IterableDataset gave no items on pass {self.passes}")

    def _global(self) -> list:
        return [self._next_item() for _ in range(self.global_batch)]

    def _host_batch(self, step: int):
        if self._it is None or self._step is None or step < self._step:
            self._it, self._step, self.passes = self.stream.items(), 0, 1
        while self._step < step:
            self._global()
            self._step += 1
        lo = self.shard * self.batch_size
        items = self._global()[lo:lo + self.batch_size]
        self._step += 1
        return self.stream.collated(items, step * self.global_batch + lo)


__all__ = ["HostTreeLoader", "StreamTreeLoader", "keeps_on_host", "tree_bytes"]
