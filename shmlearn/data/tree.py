"""The user's data of any structure, for the general contract (`compute_loss(model, batch)`).

    data=(train, test)          map-style torch Datasets whose items are whatever the user's
    data=(train, val, test)     model takes: a tensor, a tuple/list or a dict of tensors (an item
                                may have no label), numbers and numpy arrays included
    data=(train_x, train_y, test_x, test_y)   arrays: the batch is the pair (x, y), as given

Each split is collated once with torch's `default_collate` (what a DataLoader does to a batch, done
to the whole split) into one tree of (N, ...) tensors and kept on the training device, so a batch
is one gather per tensor: the same sharded, device-resident, CUDA-graph-capturable loading as the
built-in data (data/loader.py; `TreeLoader`). dtypes are kept: token ids stay int64, uint8 images
stay uint8. Nothing is normalized (the data is the user's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.data import default_collate

from shmlearn.data.base import DataSpec
from shmlearn.data.loader import ShardedLoader
from shmlearn.errors import BadInput
from shmlearn.refs import call_user

CUSTOM = "custom"
"""The task of data trained through compute_loss: the user's function says what the outputs mean."""
COLLATE_CHUNK = 4096
"""Items collated at a time (each chunk's tensors are concatenated): default_collate of a whole
split at once would hold every item's tensors and the stacked copy together."""


@dataclass
class TreeData:
    """Every split as one tree of (N, ...) tensors (the same structure in each split)."""

    spec: DataSpec
    train: Any
    test: Any
    val: Any = None
    mean = None  # nothing to normalize (data/base.py normalizer reads these)
    std = None

    @property
    def n_train(self) -> int:
        return rows(self.train)

    @property
    def n_test(self) -> int:
        return rows(self.test)

    @property
    def n_val(self) -> int:
        return rows(self.val) if self.val is not None else 0

    def to(self, device: torch.device) -> "TreeData":
        move = (lambda t: tree_map(lambda v: v.to(device), t) if t is not None else None)
        return TreeData(self.spec, move(self.train), move(self.test), move(self.val))

    def split(self, name: str):
        return {"train": self.train, "val": self.val, "test": self.test}[name]

    def fingerprint_parts(self) -> list:
        """What guard.data_fingerprint compares between ranks: sizes and a sample of every tensor."""
        out: List[Any] = [self.spec, self.n_train, self.n_test, self.n_val]
        for tree in (self.train, self.val, self.test):
            if tree is None:
                continue
            for leaf in tree_flatten(tree)[0]:
                flat = leaf.reshape(-1)
                idx = torch.linspace(0, len(flat) - 1, steps=min(4096, len(flat)), dtype=torch.float64).long()
                out += [tuple(leaf.shape), str(leaf.dtype), flat[idx].double().sum().item() if len(flat) else 0.0]
        return out


def rows(tree) -> int:
    return len(tree_flatten(tree)[0][0])


def take(tree, idx: torch.Tensor):
    """The rows `idx` of every tensor of the tree: one gather each (index_select: see loader.py)."""
    return tree_map(lambda t: t.index_select(0, idx), tree)


def rows_slice(tree, start: int, stop: int):
    return tree_map(lambda t: t[start:stop], tree)


def tree_data(obj: Any, what: str, *, name: str = "user") -> TreeData:
    """TreeData from what the user gave for the general contract; BadInput naming `what`."""
    if callable(obj) and not isinstance(obj, (tuple, list, torch.utils.data.Dataset)):
        obj = call_user(obj, (), what)
    if isinstance(obj, (tuple, list)) and len(obj) == 4 and not any(
            isinstance(d, torch.utils.data.Dataset) for d in obj):
        trx, tr_y, tex, te_y = (_as_tensor(a, label, what) for a, label in
                                zip(obj, ("train_x", "train_y", "test_x", "test_y")))
        for x, y, split in ((trx, tr_y, "train"), (tex, te_y, "test")):
            if len(x) != len(y):
                raise BadInput(f"{what}: {split}_x has {len(x)} samples but {split}_y has {len(y)}")
        return _checked(name, (trx, tr_y), None, (tex, te_y), what)
    if isinstance(obj, (tuple, list)) and len(obj) in (2, 3) and all(
            isinstance(d, torch.utils.data.Dataset) for d in obj):
        names = ("train", "test") if len(obj) == 2 else ("train", "val", "test")
        trees = {n: collate_split(d, what, n) for n, d in zip(names, obj)}
        return _checked(name, trees["train"], trees.get("val"), trees["test"], what)
    got = f"a {type(obj).__name__} of {len(obj)}" if isinstance(obj, (tuple, list)) else f"a {type(obj).__name__}"
    raise BadInput(f"{what}: with compute_loss, expected torch Datasets (train, test) or (train, val, test), "
                   f"(train_x, train_y, test_x, test_y) arrays, or a callable returning one; got {got}")


def _as_tensor(a, label: str, what: str) -> torch.Tensor:
    try:
        return (a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as e:
        raise BadInput(f"{what}: {label} is not a numeric array ({str(e).splitlines()[0][:120]})") from None


def collate_split(ds, what: str, split: str):
    """The whole split as one collated tree on the CPU (COLLATE_CHUNK items at a time)."""
    try:
        n = len(ds)
    except TypeError:
        raise BadInput(f"{what}: the {split} Dataset has no len(); a map-style Dataset "
                       f"(__len__ and __getitem__) is needed") from None
    if n == 0:
        raise BadInput(f"{what}: the {split} Dataset is empty")
    chunks, spec0 = [], None
    for start in range(0, n, COLLATE_CHUNK):
        items = [call_user(ds.__getitem__, (i,), f"{what} ({split} Dataset[{i}])")
                 for i in range(start, min(n, start + COLLATE_CHUNK))]
        try:
            batch = default_collate(items)
        except (TypeError, RuntimeError) as e:
            raise BadInput(f"{what}: the {split} Dataset's items {start}..{start + len(items) - 1} cannot be batched "
                           f"({str(e).splitlines()[0][:200]}); every item needs the same structure, tensors of "
                           f"one shape") from None
        leaves, spec = tree_flatten(batch)
        if spec0 is None:
            spec0 = spec
        elif spec != spec0:
            raise BadInput(f"{what}: the {split} Dataset's item {start} has another structure than item 0")
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise BadInput(f"{what}: the {split} Dataset's items hold a {type(leaf).__name__}; only tensors, "
                               f"numbers and numpy arrays can be batched on the device (drop it from the item)")
        chunks.append(leaves)
    leaves = [torch.cat(parts) if len(chunks) > 1 else parts[0] for parts in zip(*chunks)]
    return tree_unflatten(leaves, spec0)


def _checked(name: str, train, val, test, what: str) -> TreeData:
    structure = tree_flatten(train)[1]
    for tree, split in ((val, "val"), (test, "test")):
        if tree is None:
            continue
        if tree_flatten(tree)[1] != structure:
            raise BadInput(f"{what}: the {split} items have another structure than the train items")
        for a, b in zip(tree_flatten(train)[0], tree_flatten(tree)[0]):
            if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                raise BadInput(f"{what}: a {split} tensor is {tuple(b.shape[1:])} {b.dtype} where the train one is "
                               f"{tuple(a.shape[1:])} {a.dtype}")
    for tree, split in ((train, "train"), (val, "val"), (test, "test")):
        if tree is None:
            continue
        leaves = tree_flatten(tree)[0]
        if not leaves:
            raise BadInput(f"{what}: the {split} items hold no tensor")
        if any(len(v) != len(leaves[0]) for v in leaves):
            raise BadInput(f"{what}: the {split} tensors have different numbers of rows")
        if len(leaves[0]) == 0:
            raise BadInput(f"{what}: the {split} set is empty")
    first = tree_flatten(train)[0][0]
    spec = DataSpec(name=name, task=CUSTOM, input_shape=tuple(first.shape[1:]), num_outputs=0)
    return TreeData(spec, train, test, val)


def eval_batches(tree, rank: int, world: int, size: int) -> Iterator[Any]:
    """Rank r's contiguous r-th of W slices of a split, `size` rows at a time (as evaluation of
    the built-in data splits its test set: no row skipped or counted twice)."""
    n = rows(tree)
    bounds = torch.arange(n).tensor_split(world)[rank]
    if len(bounds) == 0:
        return
    lo, hi = int(bounds[0]), int(bounds[-1]) + 1
    for start in range(lo, hi, size):
        yield rows_slice(tree, start, min(hi, start + size))


class TreeLoader(ShardedLoader):
    """ShardedLoader's batches (the same permutation, shards and device counter) of every
    tensor of a tree: `batch(step)` and `next_batch()` return (tree batch, None)."""

    def __init__(self, tree, *, batch_size: int, shard: int, num_shards: int, seed: int):
        leaves = tree_flatten(tree)[0]
        super().__init__(leaves[0], None, batch_size=batch_size, shard=shard, num_shards=num_shards, seed=seed,
                         normalize=lambda x: x)
        self.tree = tree

    def _gather(self, idx: torch.Tensor, table) -> tuple:
        return take(self.tree, idx), None


__all__ = ["TreeData", "TreeLoader", "tree_data", "collate_split", "eval_batches", "rows", "take", "CUSTOM"]
