"""Large splits of the general contract read row by row as training first needs them (data/lazy.py;
--loader auto and stream), and a TensorDataset taken as its tensors (data/tree.py).

References: the split collated whole in one process (collate_split), byte for byte; the eager
TreeLoader's batches over the same tree; the rows a rank's batches and its evaluation slice hold
(each read once, and no other); two real Gloo workers against one process training plain torch
on the concatenated batches; the test loss of the same run with the split read whole up front.

The Datasets and functions below are at the top level: the pool's processes find them by reference.
"""
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset, WeightedRandomSampler, default_collate

import shmlearn
from shmlearn.config.train_config import TrainConfig
from shmlearn.data.lazy import HEAD, LazySplit, wanted
from shmlearn.data.loader import epoch_permutation
from shmlearn.data.tree import SHARD_MIN, TreeLoader, collate_split, eval_slices, tree_data
from shmlearn.errors import BadInput
from shmlearn.launch.pool import Pool, using

N = SHARD_MIN + 100
"""The smallest split read lazily, and some."""


class Mixed(torch.utils.data.Dataset):
    """Dict items of four dtypes and shapes; remembers which items it gave (in this process), and
    with `log` appends each index to log/PID (what a pool worker read)."""

    def __init__(self, n, seed=0, bad_from=None, log=None):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, generator=g)
        self.ids = torch.randint(0, 50_000, (n, 5), generator=g)
        self.img = torch.randint(0, 256, (n, 2, 2), generator=g).to(torch.uint8)
        self.y = (self.x.sum(1) + 0.1 * torch.randn(n, generator=g)).reshape(n, 1)
        self.bad_from, self.log, self.read = bad_from, log, []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.read.append(i)
        if self.log is not None:
            with open(os.path.join(self.log, str(os.getpid())), "a") as f:
                f.write(f"{i}\n")
        ids = self.ids[i].to(torch.int32) if self.bad_from is not None and i >= self.bad_from else self.ids[i]
        return {"x": self.x[i], "ids": ids, "img": self.img[i], "y": self.y[i]}


class Batched(Mixed):
    """A Dataset with torch's batched read (`__getitems__`, which a DataLoader's fetcher calls)."""

    def __init__(self, n):
        super().__init__(n)
        self.calls = []

    def __getitems__(self, ids):
        self.calls.append(list(ids))
        return [super(Batched, self).__getitem__(i) for i in ids]


def _equal_rows(tree, want, rows):
    for key in want:
        assert tree[key].dtype == want[key].dtype
        assert torch.equal(tree[key][rows], want[key][rows]), key


def test_a_lazy_split_holds_the_collated_rows_it_was_asked_for_and_reads_each_once():
    ds = Mixed(N)
    lazy = LazySplit(ds, N, "data=", "train")
    assert ds.read == list(range(HEAD))  # the checks before training read these
    want = collate_split(Mixed(N), "data=", "train")
    rows = torch.tensor([4000, 7, 7, 1, 4000, 93])  # repeats (a sampler with replacement), a row read already
    lazy.fill(rows)
    assert sorted(ds.read) == [0, 1, 7, 93, 4000]
    _equal_rows(lazy.tree, want, rows)
    lazy.fill(rows)
    lazy.fill_range(90, 95)
    assert sorted(ds.read) == [0, 1, 7, 90, 91, 92, 93, 94, 4000]  # only the rows not read before
    assert not lazy.complete
    lazy.fill_range(0, N)
    assert lazy.complete and len(ds.read) == N
    _equal_rows(lazy.tree, want, torch.arange(N))
    lazy.fill(torch.tensor([5]))
    assert len(ds.read) == N


def test_a_dataset_with_getitems_is_read_a_batch_a_call():
    ds = Batched(N)
    lazy = LazySplit(ds, N, "data=", "train")
    lazy.fill(torch.tensor([9, 3, 9, 1]))
    assert ds.calls == [[0, 1], [3, 9]]
    _equal_rows(lazy.tree, collate_split(Mixed(N), "data=", "train"), torch.tensor([0, 1, 3, 9]))


def test_items_of_another_dtype_are_one_line_when_a_batch_first_reads_them():
    lazy = LazySplit(Mixed(N, bad_from=3000), N, "data=", "train")
    lazy.fill(torch.arange(2990, 3000))  # all int64 so far
    with pytest.raises(BadInput) as e:
        lazy.fill(torch.tensor([3007, 3001, 3002, 3001, 3003]))
    msg = str(e.value)
    assert msg.startswith("data=: the train Dataset's items 3001, 3002, 3003, ... (4 items) are ")
    assert "torch.int32" in msg
    assert "item 0's are" in msg and "torch.int64" in msg and "\n" not in msg


@pytest.mark.parametrize("accumulate,sampler", [(1, None), (2, None), (1, "weighted")],
                         ids=["plain", "accumulate-2", "sampler-with-replacement"])
def test_lazy_loader_batches_are_the_eager_loaders_and_read_only_their_rows(accumulate, sampler):
    ds = Mixed(N)
    data = tree_data((ds, Mixed(40)), "data=", lazy=True)
    eager = collate_split(Mixed(N), "data=", "train")
    assert set(data.lazy) == {"train"}  # the 40-item test split is collated whole
    smp = WeightedRandomSampler(torch.rand(N, generator=torch.Generator().manual_seed(1)), N) if sampler else None
    kw = dict(batch_size=100, shard=1, num_shards=3, seed=5, accumulate=accumulate, sampler=smp)
    lazy_loader = TreeLoader(data.train, lazy=data.lazy["train"], **kw)
    eager_loader = TreeLoader(eager, **kw)
    steps_per_epoch = eager_loader.steps_per_epoch
    asked = set(range(HEAD))
    for step in (0, 1, steps_per_epoch - 1, steps_per_epoch, 2 * steps_per_epoch + 3):  # across epochs
        a, b = lazy_loader.batch(step)[0], eager_loader.batch(step)[0]
        assert all(torch.equal(a[k], b[k]) for k in b), step
        epoch, i = divmod(step, steps_per_epoch)
        order = eager_loader._permutation_cpu(epoch)
        start = i * 300 + 100
        asked |= set(order[start:start + 100].tolist())
    assert set(ds.read) == asked and len(ds.read) == len(asked)  # those rows, each once
    lazy_loader.prepare(4 * accumulate)  # the device-counter read (the fast step's)
    eager_loader.prepare(4 * accumulate)
    for _ in range(accumulate):
        a, b = lazy_loader.next_batch()[0], eager_loader.next_batch()[0]
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_tensor_dataset_is_its_tensors_with_no_item_read():
    x, y = torch.randn(N, 3), torch.randint(0, 9, (N,))
    ds = TensorDataset(x, y)
    data = tree_data((ds, TensorDataset(x[:10], y[:10])), "data=", lazy=True, rank=1, world=2)
    assert not data.lazy and not data.pending  # nothing to read lazily, nothing to gather
    want = default_collate([ds[i] for i in range(N)])
    assert isinstance(data.train, list) and len(data.train) == 2
    for got, ref in zip(data.train, want):
        assert got.dtype == ref.dtype and torch.equal(got, ref)


def mse(model, batch):
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


@pytest.fixture(scope="module")
def pool():
    with Pool(2) as p, using(p):
        yield p


def _cfg(tmp_path, name, loader):
    return TrainConfig(device="cpu", workers=2, batch_size=32, optimizer="sgd", momentum=0.0, lr=0.05,
                       lr_schedule="constant", samples=64 * 40, eval_points=1, eval_at_start="off",
                       eval_batch_size=500, progress=False, threads=1, out=str(tmp_path / name), seed=3, loader=loader)


def test_two_lazy_workers_train_one_process_weights_reading_only_their_batches(tmp_path, pool):
    """Each rank reads the rows of its own batches and its half of the test split, once each; the
    weights are plain torch's on the concatenated batches; the test loss is the one of the same
    run with both splits read whole before the first step (--loader resident)."""
    logs = {split: tmp_path / split for split in ("train", "test")}
    for d in logs.values():
        d.mkdir()
    torch.manual_seed(7)
    model = nn.Linear(3, 1)
    ref = nn.Linear(3, 1)
    ref.load_state_dict(model.state_dict())
    train, test = Mixed(N, log=str(logs["train"])), Mixed(N, seed=1, log=str(logs["test"]))
    lazy = shmlearn.train(_cfg(tmp_path, "lazy", "auto"), model=model, data=(train, test), compute_loss=mse)
    whole = shmlearn.train(_cfg(tmp_path, "whole", "resident"), model=model, data=(Mixed(N), Mixed(N, seed=1)),
                           compute_loss=mse)
    assert lazy.status == whole.status == "completed"

    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    perm = epoch_permutation(N, 3, 0)
    for step in range(40):
        idx = perm[step * 64:(step + 1) * 64]
        opt.zero_grad()
        nn.functional.mse_loss(ref(train.x[idx]), train.y[idx]).backward()
        opt.step()
    for (name, got), want in zip(lazy.model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert (ref.weight - model.weight).abs().max() > 0.05, "training did not move the weights"
    assert lazy.summary["test_loss"] == pytest.approx(whole.summary["test_loss"], rel=1e-6)

    # rank r: rows r*32 .. r*32+31 of each global batch of 64; its contiguous half of the test split
    want = {"train": [set(range(HEAD)).union(*(perm[s * 64 + r * 32:s * 64 + r * 32 + 32].tolist() for s in range(40)))
                      for r in range(2)],
            "test": [set(range(HEAD)) | set(range(lo, hi)) for r in range(2) for lo, hi in
                     [(list(eval_slices(N, r, 2, 500))[0][0], list(eval_slices(N, r, 2, 500))[-1][1])]]}
    for split, log in logs.items():
        reads = []
        for pid in os.listdir(log):
            with open(log / pid) as f:
                got = [int(line) for line in f]
            assert len(got) == len(set(got)), f"a {split} row was read twice"
            reads.append(set(got))
        assert sorted(map(sorted, reads)) == sorted(map(sorted, want[split])), split


def test_large_splits_are_read_lazily_on_the_cpu_and_with_stream_whole_first_on_a_gpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert (wanted("auto", cpu), wanted("stream", cpu), wanted("resident", cpu)) == (True, True, False)
    assert (wanted("auto", gpu), wanted("stream", gpu), wanted("resident", gpu)) == (False, True, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU")
def test_a_lazy_split_on_the_gpu_fills_its_rows_from_pinned_memory():
    ds = Mixed(N)
    lazy = LazySplit(ds, N, "data=", "test").to(torch.device("cuda"))
    rows = torch.tensor([4000, 7, 93])
    lazy.fill(rows)
    lazy.fill_range(100, 300)
    want = collate_split(Mixed(N), "data=", "test")
    got = {k: v.cpu() for k, v in lazy.tree.items()}
    _equal_rows(got, want, torch.cat([torch.arange(HEAD), rows, torch.arange(100, 300)]))
    assert lazy.tree["x"].device.type == "cuda" and lazy.count == HEAD + 3 + 200


class Broken(Mixed):
    """Item `bad` raises, as a corrupt file would, once a batch first reads it."""

    def __init__(self, n, bad):
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"cannot decode record {i}")
        return super().__getitem__(i)


def test_an_item_that_raises_mid_run_is_one_line_and_the_run_ends(tmp_path, pool):
    """The item is read only when the 20th step's batch needs it (lazily): the worker's BadInput
    ends the run on both ranks with the Dataset's own words, no traceback, no hang."""
    bad = int(epoch_permutation(N, 3, 0)[20 * 64 + 5])  # rank 0's 6th row of step 20
    with pytest.raises(BadInput) as e:
        shmlearn.train(_cfg(tmp_path, "run", "auto"), model=nn.Linear(3, 1), data=(Broken(N, bad), Mixed(100)),
                       compute_loss=mse)
    msg = str(e.value)
    assert f"train Dataset[{bad}]" in msg and f"ValueError: cannot decode record {bad}" in msg and "\n" not in msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU")
def test_on_a_gpu_stream_reads_lazily_into_host_memory_and_trains_as_resident(tmp_path):
    """One worker on the GPU (in this process): --loader stream (the train rows read lazily into
    host memory and copied from pinned memory, the test split lazy on the GPU) against resident
    and auto (which reads whole first on a GPU): the same batches, so the same weights and test loss."""
    runs = {}
    for loader in ("resident", "auto", "stream"):
        torch.manual_seed(7)
        cfg = TrainConfig(device="cuda", workers=1, batch_size=32, optimizer="sgd", momentum=0.0, lr=0.05,
                          lr_schedule="constant", samples=64 * 40, eval_points=1, eval_at_start="off",
                          eval_batch_size=500, progress=False, out=str(tmp_path / loader), seed=3, loader=loader)
        runs[loader] = shmlearn.train(cfg, model=nn.Linear(3, 1), data=(Mixed(N), Mixed(N, seed=1)), compute_loss=mse)
    a = runs["resident"]
    assert (a.summary["data_path"], runs["stream"].summary["data_path"]) == ("resident", "stream")
    for loader in ("auto", "stream"):
        b = runs[loader]
        for got, want in zip(b.model.state_dict().values(), a.model.state_dict().values()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert b.summary["test_loss"] == pytest.approx(a.summary["test_loss"], rel=1e-5)
