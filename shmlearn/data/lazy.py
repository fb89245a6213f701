"""Splits of the general contract's data whose rows are read when training first needs them
(DataOptions.loader auto or stream; data/tree.py builds them, its TreeLoader and evaluation fill
them).

Where: --loader stream (the train tree in host memory: data/host.py), and auto on the CPU; on a
GPU auto reads a split whole before the first step, so that the captured step never waits for
Python reading items (the test split of stream is lazy on the GPU too: evaluation waits anyway).

Why: a DDP rank starts stepping once it has read its first batch through a DataLoader. Collating
a split whole before the first step (data/tree.py collate_part, then the ranks' all-gather) cost
the VAE port 1.1-2 s of its time to first step on 2 CPU workers: 30,000 `__getitem__` calls of
Fashion-MNIST a rank (14 us each) and 188 MB of float32 images gathered over Gloo.

Here a split of SHARD_MIN items or more is a tree of (N, ...) tensors allocated from item 0's
layout on the training device (or in host memory: data/host.py), beside a mask of the rows read.
Its first rows (HEAD) are read at once: the checks before training (the compute_loss check's two
samples, the ranks' fingerprint) read them. The train loader reads, before each step, the rows of
the batches that step gathers (TreeLoader.batch / prepare: exactly the rows any read after them
takes, data/loader.py), and evaluation a rank's own slice of the split before each of its
batches. A row is read once and kept, so a rank reads only what it trains on: in the first epoch
1/W of the split (a DDP rank reads as much), later epochs the rows of its batches that it has not
read yet, until the tree is complete and reading stops. A batch's rows are collated with torch's
default_collate, as the whole split's chunks are, so the tensors are the same and so is the run.

Cost: a step of the first epoch reads its B items (the VAE: 2 ms against a 13 ms step), the cost
the up-front collation paid before the first step. Over E epochs a rank of W reads up to
N (1 - (1 - 1/W)^E) items instead of N/W and the gather. What cannot be checked before the first
step: a batch whose items collate to another structure, shape or dtype than item 0's is one line
(BadInput) when it is first read, as with a stream (data/host.py). (default_collate promotes a
batch of mixed dtypes, int32 and int64 ids say, to the wider one, as it does to the whole split's
chunks when they are collated up front.)
"""
from __future__ import annotations

from typing import Any, List

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import default_collate

from shmlearn.errors import BadInput
from shmlearn.user.refs import call_user

HEAD = 2
"""Rows read when the split is made: the model check's two training samples (train/inputs.py
two_batch) and the fingerprint the ranks compare (train/guard.py) read them."""


def wanted(loader: str, device: torch.device) -> bool:
    """Whether large splits are read lazily under DataOptions.loader `loader` on `device` (Where:)."""
    return loader == "stream" or (loader == "auto" and torch.device(device).type != "cuda")


def read_items(ds, ids: List[int], what: str, split: str) -> list:
    """The Dataset's items `ids`: through its `__getitems__` where it has one (as a DataLoader's
    fetcher reads a batch), else one `__getitem__` each; what the user's code raises is one line."""
    many = getattr(ds, "__getitems__", None)
    if many:
        items = call_user(many, (ids,), f"{what} ({split} Dataset.__getitems__)")
        if len(items) != len(ids):
            raise BadInput(f"{what}: the {split} Dataset's __getitems__ gave {len(items)} items for {len(ids)} indices")
        return list(items)
    return [call_user(ds.__getitem__, (i,), f"{what} ({split} Dataset[{i}])") for i in ids]


def collated(items: list, ids: List[int], what: str, split: str):
    """(leaves, structure) of default_collate(items); BadInput naming the items where they cannot
    be batched or hold something that is not a tensor."""
    try:
        batch = default_collate(items)
    except Exception as e:  # noqa: BLE001 - default_collate's refusal
        raise BadInput(f"{what}: the {split} Dataset's items {_ids(ids)} cannot be batched "
                       f"({str(e).splitlines()[0][:200]}); every item needs the same structure, tensors of "
                       f"one shape") from None
    return tensor_leaves(batch, what, split)


def tensor_leaves(batch, what: str, split: str):
    """(leaves, structure) of a collated batch; BadInput where a leaf is not a tensor."""
    leaves, spec = tree_flatten(batch)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise BadInput(f"{what}: the {split} Dataset's items hold a {type(leaf).__name__}; only tensors, "
                           f"numbers and numpy arrays can be batched on the device (drop it from the item)")
    return leaves, spec


def _ids(ids: List[int]) -> str:
    return ", ".join(map(str, ids[:3])) + (f", ... ({len(ids)} items)" if len(ids) > 3 else "")


class LazySplit:
    """One split of n items read into its preallocated tree as rows are asked for (the module
    docstring). `tree` is what TreeData holds for the split; `fill(rows)` / `fill_range(lo, hi)`
    read the rows not read yet."""

    def __init__(self, ds, n: int, what: str, split: str, *, device: torch.device = torch.device("cpu")):
        self.ds, self.n, self.what, self.split = ds, n, what, split
        head = list(range(min(HEAD, n)))
        leaves, self.spec = collated(read_items(ds, head, what, split), head, what, split)
        self.leaves = [_alloc((n, *t.shape[1:]), t.dtype, device) for t in leaves]
        self.filled = torch.zeros(n, dtype=torch.bool)
        """Rows read (host memory: the loader tests it before each step without a device sync)."""
        self.count = 0
        self.complete = False
        self._write(torch.tensor(head, dtype=torch.int64), leaves)

    @property
    def tree(self) -> Any:
        return tree_unflatten(self.leaves, self.spec)

    @property
    def device(self) -> torch.device:
        return self.leaves[0].device

    def to(self, device: torch.device) -> "LazySplit":
        """This split on `device`: itself where it is there already, else a new tree there with
        the rows read so far (the same Dataset, mask and count)."""
        if self.leaves[0].device == torch.empty(0, device=device).device:
            return self
        moved = object.__new__(LazySplit)
        moved.__dict__.update(self.__dict__)
        rows = self.filled.nonzero().reshape(-1)
        moved.leaves = [_alloc(t.shape, t.dtype, device) for t in self.leaves]
        for dst, src in zip(moved.leaves, self.leaves):
            dst.index_copy_(0, rows.to(device), src.index_select(0, rows).to(device))
        moved.filled = self.filled.clone()
        return moved

    def fill(self, rows: torch.Tensor) -> None:
        """Read the rows (CPU int64 indices, repeats allowed) that have not been read."""
        if self.complete:
            return
        need = rows[~self.filled[rows]]
        if len(need):
            self._read(torch.unique(need))  # a sampler drawing with replacement repeats rows

    def fill_range(self, lo: int, hi: int) -> None:
        """Read the rows lo .. hi - 1 that have not been read."""
        if self.complete or hi <= lo:
            return
        need = torch.arange(lo, hi)[~self.filled[lo:hi]]
        if len(need):
            self._read(need)

    def _read(self, rows: torch.Tensor) -> None:
        ids = rows.tolist()
        leaves, spec = collated(read_items(self.ds, ids, self.what, self.split), ids, self.what, self.split)
        if spec != self.spec or any(a.shape[1:] != b.shape[1:] or a.dtype != b.dtype
                                    for a, b in zip(leaves, self.leaves)):
            got = [(tuple(t.shape[1:]), str(t.dtype)) for t in leaves]
            want = [(tuple(t.shape[1:]), str(t.dtype)) for t in self.leaves]
            raise BadInput(f"{self.what}: the {self.split} Dataset's items {_ids(ids)} are {got} (shape, dtype a "
                           f"tensor) where item 0's are {want}; every item needs the same structure and tensors of "
                           f"one shape and dtype")
        self._write(rows, leaves)

    def _write(self, rows: torch.Tensor, leaves: List[torch.Tensor]) -> None:
        dev_rows = _to(rows, self.device)
        for dst, src in zip(self.leaves, leaves):
            dst.index_copy_(0, dev_rows, _to(src, self.device))
        self.filled[rows] = True
        self.count += len(rows)
        self.complete = self.count == self.n

    def head(self) -> List[torch.Tensor]:
        """The tensors of the rows read at the start (HEAD): what the ranks compare (guard.py)."""
        return [t[:min(HEAD, self.n)] for t in self.leaves]


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on the device; to a GPU from pinned memory without waiting (a blocking copy would wait for
    every step queued before it; the caching host allocator keeps the pinned block until the copy
    is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The split's tensor: zeros on a GPU (a captured step's warm-up reads a few batches past the
    one prepared: data/loader.py next_batch; costs nothing there); uninitialized in host memory,
    where zeroing 188 MB took 0.13 s and every read goes through fill first (pages are touched
    only as rows are written)."""
    if torch.device(device).type == "cuda":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


__all__ = ["LazySplit", "wanted", "read_items", "collated", "tensor_leaves", "HEAD"]
