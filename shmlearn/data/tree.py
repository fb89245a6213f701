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

A large split (SHARD_MIN items or more, torch's default_collate) is read row by row as training
first needs it (`--loader stream`, and `auto` on the CPU: data/lazy.py LazySplit): a rank reads the
rows of its batches before each step and its slice of the test split before evaluating it, so it
starts stepping after reading its first batch, as a DDP rank does. Else (`--loader resident`, and
`auto` on a GPU) it is read whole before the first step: in a run of W ranks in W parts, rank r the r-th, all-gathered once the
process group exists (`gather_parts`). A TensorDataset is its tensors, with no item read at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.data import default_collate

from shmlearn.data.base import DataSpec, dataset_len
from shmlearn.data.iterable import TrainStream, is_stream
from shmlearn.data.lazy import LazySplit, collated, read_items, tensor_leaves
from shmlearn.data.loader import ShardedLoader, epoch_steps
from shmlearn.errors import BadInput
from shmlearn.user.refs import call_user

CUSTOM = "custom"
"""The task of data trained through compute_loss: the user's function says what the outputs mean."""
COLLATE_CHUNK = 4096
"""Items collated at a time (each chunk's tensors are concatenated): default_collate of a whole
split at once would hold every item's tensors and the stacked copy together."""
GATHER_CHUNK = 64 << 20
"""Bytes a rank sends per all-gather of a part kept in host memory under NCCL (`_gather_leaf`)."""
SHARD_MIN = 4096
"""Splits of at least this many items are collated in parts, one a rank, and gathered: below it
a rank's whole read costs less than a gather's start (tens of ms)."""


@dataclass
class TreeData:
    """Every split as one tree of (N, ...) tensors (the same structure in each split)."""

    spec: DataSpec
    train: Any
    test: Any
    val: Any = None
    sampler: Any = None
    """The train DataLoader's sampler, whose order the loader follows (TreeLoader), or None."""
    parts: Dict[str, int] = field(default_factory=dict)
    """Splits this rank holds a part of, until gather_parts: name -> the whole split's items."""
    shardable: Tuple[str, ...] = ()
    """Splits collated with default_collate from a map-style Dataset: those a run of W ranks may
    collate in parts (part_bounds decides from the split's length)."""
    stream: Any = None
    """The train split when it is an IterableDataset without __len__ (data/iterable.py TrainStream):
    never collated whole, `train` holds its first two items; else None."""
    stream_n: int = 0
    """A stream's samples in the run (its --samples budget): what n_train reads for it."""
    host: bool = False
    """The train tree stays in host memory (data/host.py HostTreeLoader; `to`)."""
    lazy: Dict[str, LazySplit] = field(default_factory=dict)
    """Splits read row by row as they are first needed (data/lazy.py): name -> its LazySplit, whose
    tree is the split's here."""
    mean = None  # nothing to normalize (data/base.py normalizer reads these)
    std = None

    def _n(self, name: str) -> int:
        tree = self.split(name)
        return self.parts[name] if name in self.parts else rows(tree) if tree is not None else 0

    @property
    def n_train(self) -> int:
        return self.stream_n if self.stream is not None else self._n("train")

    @property
    def n_test(self) -> int:
        return self._n("test")

    @property
    def n_val(self) -> int:
        return self._n("val")

    @property
    def pending(self) -> bool:
        """Whether this rank holds only its part of a split (gather_parts completes it)."""
        return bool(self.parts)

    def to(self, device: torch.device, host_train: bool = False) -> "TreeData":
        """The splits on `device`; host_train: the train split (too large for the device, or a
        stream's first items) stays where it is, in host memory."""
        move = (lambda t: tree_map(lambda v: v.to(device), t) if t is not None else None)
        host = host_train and self.stream is None
        lazy = {n: s.to(torch.device("cpu") if host and n == "train" else device) for n, s in self.lazy.items()}
        train, val, test = (lazy[n].tree if n in lazy else self.split(n) if host and n == "train" else move(self.split(n))
                            for n in ("train", "val", "test"))
        return TreeData(self.spec, train, test, val, self.sampler, dict(self.parts), self.shardable, self.stream,
                        self.stream_n, host, lazy)

    def split(self, name: str):
        return {"train": self.train, "val": self.val, "test": self.test}[name]

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor of every split, in order (guard.data_fingerprint compares them between ranks);
        of a split read lazily, its rows read at the start (data/lazy.py HEAD)."""
        return [leaf for n in ("train", "val", "test") if self.split(n) is not None
                for leaf in (self.lazy[n].head() if n in self.lazy else tree_flatten(self.split(n))[0])]

    def eval_batches(self, name: str, rank: int, world: int, size: int) -> Iterator[Any]:
        """eval_batches of split `name`, each batch's rows read first where the split is lazy."""
        lazy = self.lazy.get(name)
        for lo, hi in eval_slices(self._n(name), rank, world, size):
            if lazy is not None:
                lazy.fill_range(lo, hi)
            yield rows_slice(self.split(name), lo, hi)


def rows(tree) -> int:
    return len(tree_flatten(tree)[0][0])


def take(tree, idx: torch.Tensor):
    """The rows `idx` of every tensor of the tree: one gather each (index_select: see loader.py)."""
    return tree_map(lambda t: t.index_select(0, idx), tree)


def rows_slice(tree, start: int, stop: int):
    return tree_map(lambda t: t[start:stop], tree)


def tree_data(obj: Any, what: str, *, name: str = "user", rank: int = 0, world: int = 1,
              lazy: bool = False) -> TreeData:
    """TreeData from what the user gave for the general contract; BadInput naming `what`. lazy: each
    large split is read row by row as it is needed (data/lazy.py); else rank, world: a rank of a
    run of `world` collates its part of each large split (part_bounds); the run completes them
    with gather_parts once its process group exists."""
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
            isinstance(d, (torch.utils.data.Dataset, torch.utils.data.DataLoader)) for d in obj):
        names = ("train", "test") if len(obj) == 2 else ("train", "val", "test")
        trees, sampler, parts, shardable, stream, lazies = {}, None, {}, [], None, {}
        for n, d in zip(names, obj):
            collate = None
            if isinstance(d, torch.utils.data.DataLoader):
                d, collate, s = _unwrap(d, what, n)
                sampler = s if n == "train" else sampler
            if n == "train" and is_stream(d):  # never read whole: data/host.py reads it a batch a step
                stream = TrainStream(d, collate, what)
                trees[n] = stream.head
                continue
            if collate is None and not isinstance(d, torch.utils.data.IterableDataset):
                shardable.append(n)  # a collate_fn may pad to the split's longest item: whole only
                if lazy and not _vectorized(d) and dataset_len(d, what, n) >= SHARD_MIN:
                    lazies[n] = LazySplit(d, len(d), what, n)
                    trees[n] = lazies[n].tree
                    continue
            trees[n], total = collate_part(d, what, n, collate=collate, rank=rank,
                                           world=world if n in shardable else 1)
            if total is not None:
                parts[n] = total
        data = _checked(name, trees["train"], trees.get("val"), trees["test"], what)
        data.sampler, data.parts, data.shardable, data.stream = sampler, parts, tuple(shardable), stream
        data.lazy = lazies
        return data
    got = f"a {type(obj).__name__} of {len(obj)}" if isinstance(obj, (tuple, list)) else f"a {type(obj).__name__}"
    raise BadInput(f"{what}: with compute_loss, expected torch Datasets (train, test) or (train, val, test), "
                   f"(train_x, train_y, test_x, test_y) arrays, or a callable returning one; got {got}")


def _as_tensor(a, label: str, what: str) -> torch.Tensor:
    try:
        return (a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as e:
        raise BadInput(f"{what}: {label} is not a numeric array ({str(e).splitlines()[0][:120]})") from None


def _unwrap(loader, what: str, split: str):
    """(dataset, collate_fn or None for the default, the train split's sampler or None) of a
    DataLoader the user built. Its batch_size, num_workers and pinning are not used: --batch-size
    is per worker, and the split is collated once."""
    if not isinstance(loader.dataset, torch.utils.data.IterableDataset) and loader.batch_sampler is not None \
            and type(loader.batch_sampler) is not torch.utils.data.BatchSampler:
        raise BadInput(f"{what}: the {split} DataLoader has a batch_sampler of its own "
                       f"({type(loader.batch_sampler).__name__}); give a sampler of indices instead (shmlearn "
                       f"cuts its order into batches of --batch-size per worker)")
    collate = None if loader.collate_fn is default_collate else loader.collate_fn
    sampler = None
    if split == "train" and not isinstance(loader.dataset, torch.utils.data.IterableDataset):
        sampler = loader.sampler
        if hasattr(sampler, "set_epoch"):  # DistributedSampler-like: one replica's share is not an epoch
            raise BadInput(f"{what}: a {type(sampler).__name__} shards for its own ranks; give the Dataset's own "
                           f"sampler (or none): shmlearn shards the batches across its ranks itself")
    return loader.dataset, collate, sampler


def part_bounds(n: int, rank: int, world: int) -> Optional[Tuple[int, int]]:
    """Rank r's items [lo, hi) of a split of n collated in W parts of ceil(n / W) (equal parts but
    the last: the gather's unit), or None where the split stays whole: fewer than SHARD_MIN
    items, one rank, or a rank that would get none."""
    b = -(-n // world)
    if world < 2 or n < SHARD_MIN or (world - 1) * b >= n:
        return None
    return rank * b, min(n, (rank + 1) * b)


def collate_split(ds, what: str, split: str, collate=None):
    """The whole split as one collated tree on the CPU (see collate_part)."""
    return collate_part(ds, what, split, collate=collate)[0]


def collate_part(ds, what: str, split: str, collate=None, rank: int = 0, world: int = 1):
    """(tree, the split's items or None): the split collated on the CPU (COLLATE_CHUNK items at a
    time with torch's default_collate; in one call with a DataLoader's own collate_fn, which may
    pad to the longest item), or where part_bounds(n, rank, world) cuts it, only rank's part and
    the split's length. An IterableDataset with a length is read once, in order (a train split
    without one is a stream: data/iterable.py)."""
    if isinstance(ds, torch.utils.data.IterableDataset):
        items = []
        try:
            for item in ds:
                items.append(item)
        except BadInput:
            raise
        except Exception as e:  # noqa: BLE001 - the user's iterator
            raise BadInput(f"{what}: the {split} IterableDataset raised {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''} after {len(items)} items") from None
        ds = items
    n = dataset_len(ds, what, split)
    if collate is None and _vectorized(ds):  # what default_collate makes of its (tensor rows) items
        return [t.detach() for t in ds.tensors], None
    bounds = part_bounds(n, rank, world)
    lo, hi = bounds or (0, n)
    chunks, spec0 = [], None
    step = n if collate is not None else COLLATE_CHUNK
    for start in range(lo, hi, step):
        ids = list(range(start, min(hi, start + step)))
        items = read_items(ds, ids, what, split)
        if collate is None:
            leaves, spec = collated(items, ids, what, split)
        else:
            leaves, spec = _user_collated(collate, items, ids, what, split)
        if spec0 is None:
            spec0 = spec
        elif spec != spec0:
            raise BadInput(f"{what}: the {split} Dataset's item {start} has another structure than item 0")
        chunks.append(leaves)
    leaves = [torch.cat(parts) if len(chunks) > 1 else parts[0] for parts in zip(*chunks)]
    return tree_unflatten(leaves, spec0), (n if bounds else None)


def _user_collated(collate, items: list, ids: List[int], what: str, split: str):
    """(leaves, structure) of a DataLoader's own collate_fn over the items; BadInput as `collated`."""
    try:
        batch = collate(items)
    except Exception as e:  # noqa: BLE001 - the user's collate_fn
        raise BadInput(f"{what}: the {split} Dataset's items {ids[0]}..{ids[-1]} cannot be batched "
                       f"({str(e).splitlines()[0][:200]}); every item needs the same structure, tensors of "
                       f"one shape") from None
    return tensor_leaves(batch, what, split)


def _vectorized(ds) -> bool:
    """A torch TensorDataset (its own class, not a subclass that may change its items): its items
    are rows of its tensors, so default_collate of any of them is those rows of the tensors."""
    return type(ds) is torch.utils.data.TensorDataset


def _layout(tree) -> tuple:
    leaves, spec = tree_flatten(tree)
    return str(spec), tuple((tuple(v.shape[1:]), str(v.dtype)) for v in leaves)


def gather_parts(data: TreeData, what: str) -> None:
    """Complete, in place, every split some rank holds in parts (TreeData.parts): a collective of
    the default process group, called by every rank of the run. Each rank's part goes out as
    bytes (any dtype; one all-gather a tensor, on the GPU under NCCL). A rank holding the whole
    split (a pool worker's cached data) sends its own part of it. First the ranks compare the
    splits' lengths, structure and dtypes, so that a Dataset whose items differ between the parts
    is one line on every rank (BadInput), not a failed or hung gather."""
    world, rank = dist.get_world_size(), dist.get_rank()
    names = [n for n in ("train", "val", "test") if data.split(n) is not None]
    mine = (sorted(data.parts), {n: (data._n(n), _layout(data.split(n))) for n in names})
    metas: List[Any] = [None] * world
    dist.all_gather_object(metas, mine)
    pending = sorted({n for m in metas for n in m[0]}, key=("train", "val", "test").index)
    for n in pending:
        for r, m in enumerate(metas):
            if m[1].get(n) != metas[0][1].get(n):
                raise BadInput(f"{what}: the {n} items of rank {r}'s part are {m[1].get(n)} (items, (structure, "
                               f"(shape, dtype) a tensor)) where rank 0's are {metas[0][1].get(n)}; every item "
                               f"needs the same structure and tensors of one shape and dtype")
        total = metas[0][1][n][0]
        lo, hi = part_bounds(total, rank, world)
        tree = data.split(n)
        piece = tree if n in data.parts else rows_slice(tree, lo, hi)
        full = tree_map(lambda v: _gather_leaf(v, total, world), piece)
        setattr(data, n, full)
    data.parts = {}


def _gather_leaf(piece: torch.Tensor, n: int, world: int) -> torch.Tensor:
    """The n rows of one tensor from the ranks' equal parts of ceil(n / W) rows (the last padded).
    Under NCCL through the GPU: whole for a part on the device, GATHER_CHUNK bytes at a time for a
    part kept in host memory (data/host.py: a split the device cannot hold is never whole there)."""
    b = -(-n // world)
    nccl = dist.get_backend() == "nccl"
    host_part = nccl and piece.device.type != "cuda"
    comm = piece.device if nccl and not host_part else torch.device("cpu")
    p = piece.to(comm)
    if len(p) < b:
        p = torch.cat([p, p.new_zeros((b - len(p), *p.shape[1:]))])
    flat = p.contiguous().reshape(-1).view(torch.uint8)
    if host_part:
        out = torch.empty(world, flat.numel(), dtype=torch.uint8)
        dev = torch.device("cuda", torch.cuda.current_device())
        for lo in range(0, flat.numel(), GATHER_CHUNK):
            hi = min(flat.numel(), lo + GATHER_CHUNK)
            got = torch.empty(world * (hi - lo), dtype=torch.uint8, device=dev)
            dist.all_gather_into_tensor(got, flat[lo:hi].to(dev))
            out[:, lo:hi].copy_(got.view(world, hi - lo))
        out = out.reshape(-1)
    elif comm.type == "cuda":
        out = torch.empty(world * flat.numel(), dtype=torch.uint8, device=comm)
        dist.all_gather_into_tensor(out, flat)
    else:
        bufs = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(bufs, flat)
        out = torch.cat(bufs)
    return out.view(piece.dtype).reshape(world * b, *piece.shape[1:])[:n].to(piece.device)


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


def eval_slices(n: int, rank: int, world: int, size: int) -> Iterator[Tuple[int, int]]:
    """Rows [lo, hi) of rank r's contiguous r-th of W slices of a split of n, `size` rows at a time
    (as evaluation of the built-in data splits its test set: no row skipped or counted twice)."""
    bounds = torch.arange(n).tensor_split(world)[rank]
    if len(bounds) == 0:
        return
    lo, hi = int(bounds[0]), int(bounds[-1]) + 1
    for start in range(lo, hi, size):
        yield start, min(hi, start + size)


def eval_batches(tree, rank: int, world: int, size: int) -> Iterator[Any]:
    """The tree's rows of eval_slices, a batch at a time."""
    for lo, hi in eval_slices(rows(tree), rank, world, size):
        yield rows_slice(tree, lo, hi)


class TreeLoader(ShardedLoader):
    """ShardedLoader's batches (the same permutation, shards and device counter) of every
    tensor of a tree: `batch(step)` and `next_batch()` return (tree batch, None). sampler: the
    user's (a train DataLoader's), whose order replaces the permutation: drawn once per epoch,
    seeded by (seed, epoch) on every rank alike, and cut into global batches as the permutation
    is (rank r takes the r-th block of B of each). lazy: the tree's LazySplit (data/lazy.py), whose
    rows a step gathers are read before it: in batch(step), and in prepare(step) for the
    micro-batches the next_batch() calls after it take."""

    def __init__(self, tree, *, batch_size: int, shard: int, num_shards: int, seed: int, sampler=None,
                 accumulate: int = 1, lazy: Optional[LazySplit] = None):
        leaves = tree_flatten(tree)[0]
        super().__init__(leaves[0], None, batch_size=batch_size, shard=shard, num_shards=num_shards, seed=seed,
                         normalize=lambda x: x, accumulate=accumulate)
        self.tree, self.sampler, self.lazy = tree, sampler, lazy
        self._order: Tuple[Optional[int], Any] = (None, None)
        """(epoch, its order on the CPU): the permutation or the sampler's, drawn once an epoch."""
        if sampler is not None:
            self.order_len = len(sampler)
            self.steps_per_epoch = epoch_steps(self.order_len, self.global_batch, accumulate)
            if self.steps_per_epoch == 0:
                raise BadInput(f"--batch-size {batch_size}: the sampler gives {self.order_len} samples an epoch, "
                               f"fewer than one step of {num_shards} x {batch_size} x {accumulate} (--accumulate)")

    def _permutation_cpu(self, epoch: int) -> torch.Tensor:
        if self._order[0] != epoch:
            order = (super()._permutation_cpu(epoch) if self.sampler is None
                     else sampler_order(self.sampler, self.seed, epoch, rows(self.tree)))
            self._order = (epoch, order)
        return self._order[1]

    def _gather(self, idx: torch.Tensor, table) -> tuple:
        return take(self.tree, idx), None

    def _read(self, step: int) -> None:
        """Read the rows of loader step `step`'s batch on this shard that the lazy tree lacks
        (the rows batch(step) gathers: ShardedLoader's slice of the epoch's order)."""
        if self.lazy is None or self.lazy.complete:
            return
        epoch, i = divmod(step, self.steps_per_epoch)
        start = i * self.global_batch + self.shard * self.batch_size
        self.lazy.fill(self._permutation_cpu(epoch)[start:start + self.batch_size])

    def batch(self, step: int) -> tuple:
        self._read(step)
        return super().batch(step)

    def prepare(self, step: int) -> None:
        for k in range(self.accumulate):
            self._read(step + k)
        super().prepare(step)


def sampler_order(sampler, seed: int, epoch: int, n: int) -> torch.Tensor:
    """One epoch of the user's sampler as int64 indices, the same on every rank: its generator (a
    RandomSampler's, a WeightedRandomSampler's) and torch's global one are seeded by (seed,
    epoch) while it is drawn, and put back after."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    had = getattr(sampler, "generator", None)
    try:
        if hasattr(sampler, "generator"):
            sampler.generator = g
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + epoch)
            order = torch.as_tensor([int(i) for i in sampler], dtype=torch.int64)
            if len(order) != len(sampler):
                raise BadInput(f"data=: the sampler gave {len(order)} indices in epoch {epoch}, not its len() "
                               f"{len(sampler)}; every epoch must have the same length")
    finally:
        if hasattr(sampler, "generator"):
            sampler.generator = had
    if len(order) and (int(order.min()) < 0 or int(order.max()) >= n):
        raise BadInput(f"data=: the sampler gave index {int(order.max()) if int(order.max()) >= n else int(order.min())}"
                       f" for a training set of {n} items")
    return order


__all__ = ["TreeData", "TreeLoader", "tree_data", "collate_split", "collate_part", "gather_parts", "part_bounds",
           "eval_batches", "eval_slices", "rows", "take", "CUSTOM"]
