"""Data that does not fit on the device: map-style torch Datasets read through a DataLoader.

The batches are exactly the device-resident loader's (data/loader.py): every epoch all ranks draw
the same global permutation (epoch_permutation), and at global step t rank r reads the r-th block
of B from perm[t*W*B : (t+1)*W*B]. Only the indices are computed here; the DataLoader's worker
processes read and collate the samples ahead of time, in pinned memory on CUDA, and the copy to the
device is asynchronous. For the captured fast step, `prepare(step)` copies the batch into fixed
device buffers on the host side and `next_batch()` (inside the graph) only reads them.
"""
from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from shmlearn.data.base import DataSpec
from shmlearn.data.loader import epoch_permutation, epoch_steps, too_few
from shmlearn.errors import BadInput
from shmlearn.launch.parent import die_with_parent
from shmlearn.config.limits import usable_cores


@dataclass
class StreamedData:
    """A pair of Datasets that stay where they are (disk, host memory); read a batch at a time."""

    spec: DataSpec
    train: Any
    test: Any
    what: str
    """The argument or flag the data came from, for messages."""
    bytes_needed: int = 0
    mean: Optional[tuple] = None  # used as given: no normalization
    std: Optional[tuple] = None
    label_dtype: Optional[torch.dtype] = None
    """The train Dataset's item 0's label dtype: every batch's labels must be of its kind
    (integer, float or bool; `check_label_kind`), or class labels 2.7 would train as 2."""

    @property
    def n_train(self) -> int:
        return len(self.train)

    @property
    def n_test(self) -> int:
        return len(self.test)

    def to(self, device) -> "StreamedData":
        return self


def convert_batch(x: torch.Tensor, y: torch.Tensor, task: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The dtypes and shapes the resident path stores (data/user.py): uint8 inputs stay uint8,
    others become float32; class labels int64 (N,), targets float32 (N, outputs)."""
    x = x if x.dtype == torch.uint8 else x.float()
    if task == "classification":
        y = y.reshape(-1).long()
    else:
        y = y.float().reshape(len(y), -1)
    return x, y


def _collate(items):
    x, y = torch.utils.data.default_collate(items)
    return torch.as_tensor(x), torch.as_tensor(y)


def _importable(ds) -> bool:
    """Whether a fresh process can take the Dataset: its class (a Subset's inner one) importable
    by name (findable on sys.path: not __main__, not a FILE.py loaded by path), and it pickles."""
    import importlib.machinery
    while isinstance(ds, Subset):
        ds = ds.dataset
    module = type(ds).__module__ or "__main__"
    top = module.split(".")[0]
    if top == "__main__":
        return False
    if top not in sys.builtin_module_names and importlib.machinery.PathFinder.find_spec(top, sys.path) is None:
        return False
    try:  # a worker receives it pickled (a lambda or an open file inside cannot be): write to nowhere
        pickle.Pickler(_Nowhere(), protocol=pickle.HIGHEST_PROTOCOL).dump(ds)
    except Exception:  # noqa: BLE001 - whatever pickling raises, fork still works
        return False
    return True


class _Nowhere:
    def write(self, b) -> int:
        return len(b)


def _context(ds):
    """How loader workers start. forkserver where the Dataset's class can be imported by name:
    workers then start from a clean process. A fork of a rank copies its state mid-flight
    (Gloo's threads, OpenMP's pool, the heartbeat thread, Triton's libraries), and a forked
    worker hung for 300 s in CI (tests/data/test_stream.py, 2 Gloo ranks, 1 in 3 runs). Fork
    otherwise: a `FILE.py:NAME` Dataset loaded by path (shmlearn/user/refs.py) cannot be imported by a
    fresh process, and a forked worker inherits it. They never touch CUDA."""
    import multiprocessing as mp
    methods = mp.get_all_start_methods()
    if "forkserver" in methods and _importable(ds):
        return mp.get_context("forkserver")
    return mp.get_context("fork") if "fork" in methods else None


def _worker_init(_worker_id: int) -> None:
    """In each DataLoader worker: die with the process it reads for. A rank killed while its
    worker sat in a stuck __getitem__ left that worker, and multiprocessing's resource tracker
    (whose pipe the worker holds), with parent 1 (issue 38, 5)."""
    die_with_parent()


def _stop(it, *, stuck: bool = False) -> None:
    """Stop a DataLoader iterator's workers. stuck: kill them first (a read failed or timed out):
    torch's shutdown waits 5 s for each worker to leave, and one stuck in __getitem__ never
    does, which held this rank back past its peers' collective timeout, so the peers were
    named instead of it."""
    if it is None or not hasattr(it, "_shutdown_workers"):
        return
    if stuck:
        if getattr(it, "_worker_pids_set", False):  # else torch's SIGCHLD handler raises for the kill
            from torch.utils.data import _utils
            _utils.signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        for w in getattr(it, "_workers", []):
            if w.is_alive():
                w.kill()
    it._shutdown_workers()


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _workers(num_workers: Optional[int]) -> int:
    if num_workers is not None:
        return num_workers
    return min(4, max(1, usable_cores() // 2))


def materialize(ds, what: str, split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The whole Dataset as two tensors (x, y), read once with a DataLoader."""
    xs: List[torch.Tensor] = []
    ys: List[torch.Tensor] = []
    loader = DataLoader(ds, batch_size=1024, shuffle=False, collate_fn=_collate, num_workers=0)
    try:
        for x, y in loader:
            xs.append(x)
            ys.append(y)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - the user's __getitem__, or items that do not stack
        first = str(e).strip().splitlines()
        raise BadInput(f"{what}: reading the {split} Dataset raised {type(e).__name__}"
                       f"{': ' + first[0][:200] if first else ''}") from None
    return torch.cat(xs), torch.cat(ys)


def label_scan(ds, what: str) -> torch.Tensor:
    """Every label of a Dataset (reads every item once: a Dataset with `targets` is not scanned)."""
    return materialize(ds, what, "train")[1]


class StreamLoader:
    """Same interface as ShardedLoader: batch(step), prepare(step) / next_batch(), invalidate()."""

    def __init__(self, data: StreamedData, *, batch_size: int, shard: int, num_shards: int, seed: int,
                 normalize: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                 num_workers: Optional[int] = None, timeout_s: float = 300.0, accumulate: int = 1):
        self.data, self.normalize, self.device = data, normalize, device
        self.timeout_s = timeout_s
        """A batch that takes longer (a stuck __getitem__) fails the run instead of hanging it: the
        rank's heartbeat keeps beating while it waits, so the watchdog would not name it."""
        self.n = data.n_train
        self.batch_size, self.shard, self.num_shards, self.seed = batch_size, shard, num_shards, seed
        self.global_batch = batch_size * num_shards
        self.accumulate = accumulate
        """Micro-batches a training step reads (--accumulate; ShardedLoader's docstring)."""
        self.steps_per_epoch = epoch_steps(self.n, self.global_batch, accumulate)
        if self.steps_per_epoch == 0:
            raise too_few(batch_size, self.n, num_shards, accumulate)
        self.num_workers = _workers(num_workers)
        self._it: Optional[Iterator] = None
        self._next: Optional[int] = None
        self._bufs: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._k = 0  # the buffer pair the next next_batch() returns

    def indices(self, step: int) -> List[int]:
        """The samples this shard reads at global step `step` (a pure function of seed and step)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        start = i * self.global_batch + self.shard * self.batch_size
        return epoch_permutation(self.n, self.seed, epoch)[start:start + self.batch_size].tolist()

    def _steps_from(self, step: int):
        perm, epoch = None, None
        while True:
            e, i = divmod(step, self.steps_per_epoch)
            if e != epoch:
                perm, epoch = epoch_permutation(self.n, self.seed, e), e
            start = i * self.global_batch + self.shard * self.batch_size
            yield perm[start:start + self.batch_size].tolist()
            step += 1

    def _fetch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if step != self._next or self._it is None:
            self.close()
            cuda = self.device.type == "cuda"
            self._it = iter(DataLoader(self.data.train, batch_sampler=self._steps_from(step), collate_fn=_collate,
                                       num_workers=self.num_workers, pin_memory=cuda,
                                       prefetch_factor=4 if self.num_workers else None,
                                       multiprocessing_context=_context(self.data.train) if self.num_workers else None,
                                       worker_init_fn=_worker_init if self.num_workers else None,
                                       timeout=self.timeout_s if self.num_workers else 0))
        try:
            x, y = next(self._it)
        except BadInput:
            self._stop_stuck()
            raise
        except Exception as e:  # noqa: BLE001 - the user's __getitem__ failed in a loader worker
            self._stop_stuck()
            first = str(e).strip().splitlines()
            raise BadInput(f"{self.data.what}: reading the train Dataset at step {step} on rank {_rank()} raised "
                           f"{type(e).__name__}{': ' + first[-1][:200] if first else ''}") from None
        self._next = step + 1
        check_label_kind(y, self.data, "train", self.indices(step), step)
        x, y = convert_batch(x, y, self.data.spec.task)
        _check_labels(y, self.data.spec, self.data.what)
        return x, y

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x, y = self._fetch(step)
        return self.normalize(x.to(self.device, non_blocking=True)), y.to(self.device, non_blocking=True)

    def prepare(self, step: int) -> None:
        """Host side: read the batches of loader steps step .. step + accumulate - 1 (one training
        step's micro-batches) into the fixed device buffers the next `accumulate` next_batch()
        calls return, in order."""
        for k in range(self.accumulate):
            x, y = self._fetch(step + k)
            if len(self._bufs) <= k:
                self._bufs.append((torch.empty(x.shape, dtype=x.dtype, device=self.device),
                                   torch.empty(y.shape, dtype=y.dtype, device=self.device)))
            self._bufs[k][0].copy_(x, non_blocking=True)
            self._bufs[k][1].copy_(y, non_blocking=True)
        self._k = 0

    def invalidate(self) -> None:
        self._next = None

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The next of the prepared micro-batches (a host counter: a captured step's calls read
        buffers 0 .. accumulate - 1, as every eager step's do)."""
        x, y = self._bufs[self._k]
        self._k = (self._k + 1) % len(self._bufs)
        return self.normalize(x), y

    def close(self) -> None:
        """Stop the DataLoader's worker processes (a pool worker runs many trials)."""
        it, self._it = self._it, None
        _stop(it)

    def _stop_stuck(self) -> None:
        it, self._it = self._it, None
        _stop(it, stuck=True)


def _label_kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "float" if dtype.is_floating_point or dtype.is_complex else "integer"


def check_label_kind(y: torch.Tensor, data: StreamedData, split: str, indices, step: Optional[int] = None) -> None:
    """The collated labels `y` of the items at `indices` are of the kind of item 0's (an integer
    label beside float ones collates to floats); else BadInput naming the first odd item, found by
    reading the batch's items again (only on this error path)."""
    if data.label_dtype is None or _label_kind(y.dtype) == _label_kind(data.label_dtype):
        return
    ds = data.train if split == "train" else data.test
    odd = min((i for i in indices if _label_kind(torch.as_tensor(np.asarray(ds[i][1])).dtype)
               != _label_kind(data.label_dtype)), default=None)  # the first in the Dataset's order
    where = f"item {odd}" if odd is not None else f"an item of the batch of step {step}"
    got = torch.as_tensor(np.asarray(ds[odd][1])).dtype if odd is not None else y.dtype
    raise BadInput(f"{data.what}: the {split} Dataset's {where} has a label of dtype "
                   f"{str(got).replace('torch.', '')}, but item 0's is {str(data.label_dtype).replace('torch.', '')}; "
                   f"every label must be of one kind ({_label_kind(data.label_dtype)})")


def _check_labels(y: torch.Tensor, spec: DataSpec, what: str) -> None:
    """Host-side, per batch: a class label past the model's outputs would be a device-side assert
    on CUDA (fatal to the process), and garbage on the CPU."""
    if spec.task == "classification" and len(y) and (int(y.min()) < 0 or int(y.max()) >= spec.num_outputs):
        bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
        raise BadInput(f"{what}: label {bad} is outside the {spec.num_outputs} classes 0..{spec.num_outputs - 1}")


def test_batches(data, rank: int, world: int, device: torch.device, size: int = 1024,
                 num_workers: Optional[int] = None, timeout_s: Optional[float] = None):
    """Rank r's contiguous r-th of W slices of the test set, `size` samples at a time: the same
    slices for resident and streamed data, so evaluation sums match. timeout_s (--timeout): a
    streamed read that takes longer is BadInput naming the test Dataset, as in training (the
    rank's heartbeat beats on while it waits, so nothing else would end the wait)."""
    if isinstance(data, StreamedData):
        n = data.n_test
        bounds = torch.arange(n).tensor_split(world)[rank]
        if len(bounds) == 0:
            return
        part = Subset(data.test, range(int(bounds[0]), int(bounds[-1]) + 1))
        nw = _workers(num_workers)
        loader = iter(DataLoader(part, batch_size=size, collate_fn=_collate, num_workers=nw,
                                 pin_memory=device.type == "cuda",
                                 multiprocessing_context=_context(part) if nw else None,
                                 worker_init_fn=_worker_init if nw else None,
                                 timeout=timeout_s if nw and timeout_s else 0))
        seen = 0
        while True:
            try:
                x, y = next(loader)
            except StopIteration:
                break
            except BadInput:
                raise
            except Exception as e:  # noqa: BLE001 - the user's __getitem__ failed or hung in a loader worker
                _stop(loader, stuck=True)
                first = str(e).strip().splitlines()
                raise BadInput(f"{data.what}: reading the test Dataset on rank {rank} raised "
                               f"{type(e).__name__}{': ' + first[-1][:200] if first else ''}") from None
            check_label_kind(y, data, "test", range(int(bounds[0]), int(bounds[-1]) + 1)[seen:seen + len(y)])
            seen += len(y)
            x, y = convert_batch(x, y, data.spec.task)
            _check_labels(y, data.spec, data.what)
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return
    x = data.test_x.tensor_split(world)[rank]
    y = data.test_y.tensor_split(world)[rank]
    for i in range(0, len(x), size):
        yield x[i:i + size], y[i:i + size]
