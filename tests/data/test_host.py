"""Training batches from host memory under compute_loss (data/host.py, data/iterable.py): an endless
IterableDataset bounded by --samples, and a train split kept in host memory (--loader stream, or
auto past the device's memory). References: one process with torch only, reading the stream in
order a global batch a step; the device-resident path of the same Datasets."""
import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

import shmlearn
from shmlearn.config.train_config import TrainConfig
from shmlearn.data import user as user_data
from shmlearn.data.host import HostTreeLoader, StreamTreeLoader
from shmlearn.data.iterable import TrainStream
from shmlearn.data.tree import TreeLoader, collate_split
from shmlearn.errors import BadInput
from shmlearn.launch.pool import Pool, using

B, STEPS, LR = 8, 12, 0.05
W_TRUE = torch.tensor([1.0, -2.0, 0.5, 3.0])


def item(i: int):
    """Item i of the stream: a pure function of i."""
    x = torch.randn(4, generator=torch.Generator().manual_seed(i))
    return x, (x @ W_TRUE + 0.1).reshape(1)


class Endless(torch.utils.data.IterableDataset):
    """Never stops, has no __len__."""

    def __iter__(self):
        i = 0
        while True:
            yield item(i)
            i += 1


class Items(torch.utils.data.Dataset):
    def __init__(self, lo: int, n: int):
        self.lo, self.n = lo, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return item(self.lo + i)


class Finite(torch.utils.data.IterableDataset):
    """Ten items, then stops (no __len__): a stream iterated again and again."""

    def __iter__(self):
        return (item(i) for i in range(10))


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def _cfg(out, workers, **kw):
    return TrainConfig(workers=workers, batch_size=B, optimizer="sgd", lr=LR, lr_schedule="constant", eval_points=1,
                       eval_at_start="off", progress=False, out=str(out), **kw)


def plain_stream_loop(steps: int, batch: int):
    """What a user writes: one process reads the stream in order, `batch` items a step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    it = iter(Endless())
    for _ in range(steps):
        x, y = torch.utils.data.default_collate([next(it) for _ in range(batch)])
        opt.zero_grad()
        mse(model, (x, y)).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_auto_keeps_the_train_split_on_the_host_past_half_the_free_memory(tmp_path, monkeypatch):
    """One worker, in this process (before the module's pool exists): free memory of 1000 bytes makes the 200 x 20-byte split too
    large for the device; the run then reads from the host and trains as the resident one."""
    data = (Items(0, 200), Items(1000, 40))
    resident = shmlearn.train(_cfg(tmp_path / "r", 1, samples=160), model=_model(), data=data, compute_loss=mse)
    monkeypatch.setattr(user_data, "_free_bytes", lambda device: 1000)
    host = shmlearn.train(_cfg(tmp_path / "h", 1, samples=160), model=copy.deepcopy(_model()), data=data,
                          compute_loss=mse)
    assert (resident.summary["data_path"], host.summary["data_path"]) == ("resident", "stream")
    torch.testing.assert_close(_weights(host.model), _weights(resident.model), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def pool():
    with Pool(2) as p, using(p):
        yield p


@pytest.mark.parametrize("workers,accumulate", [(1, 1), (2, 1), (2, 2)])
def test_an_endless_stream_trains_as_one_process_reading_it_in_order(tmp_path, pool, workers, accumulate):
    res = shmlearn.train(_cfg(tmp_path / "run", workers, samples=STEPS * workers * B * accumulate, accumulate=accumulate),
                         model=_model(), data=(Endless(), Items(10 ** 6, 64)), compute_loss=mse)
    s = res.summary
    assert (s["status"], s["steps"], s["data_path"]) == ("completed", STEPS, "stream"), s
    ref = plain_stream_loop(STEPS, workers * B * accumulate)
    torch.testing.assert_close(_weights(res.model), ref, rtol=1e-5, atol=1e-6)
    assert (ref - _weights(_model())).abs().max() > 0.1, "training did not move the weights"
    with open(os.path.join(res.run_dir, "summary.json")) as f:
        assert json.load(f)["test_loss"] == pytest.approx(s["test_loss"])


def test_an_endless_stream_without_samples_is_refused_before_any_worker(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(BadInput) as e:
        shmlearn.train(_cfg(out, 2, epochs=1), model=_model(), data=(Endless(), Items(0, 8)), compute_loss=mse)
    assert str(e.value) == ("data=: the train split is an IterableDataset without __len__ (endless, or of unknown "
                            "length), whose epochs cannot be counted; give the budget in samples (--samples N, "
                            "TrainConfig(samples=N))")
    assert not out.exists()  # refused before the run directory, let alone a worker


def test_a_stream_is_read_in_order_restarted_on_a_step_back_and_iterated_again_when_it_ends():
    s = TrainStream(Finite(), None, "data=")
    loader = StreamTreeLoader(s, device=torch.device("cpu"), batch_size=2, shard=1, num_shards=2)
    # loader step L holds items 4L .. 4L+3 of the stream repeated (10 items a pass); shard 1 its last two
    want = {L: [(4 * L + k) % 10 for k in (2, 3)] for L in range(6)}
    for L in (0, 1, 3, 1, 5):  # a jump ahead skips; a step back starts the stream again
        x, _ = loader.batch(L)[0]
        ref = torch.stack([item(i)[0] for i in want[L]])
        assert torch.equal(x, ref), L
    assert loader.passes == 3  # items 0..23 of the stream: the third pass holds 20..23
    loader.prepare(2)
    assert torch.equal(loader.next_batch()[0][0], torch.stack([item(i)[0] for i in want[2]]))


def test_host_loader_batches_are_the_resident_loaders():
    tree = collate_split(Items(0, 100), "data=", "train")
    kw = dict(batch_size=6, shard=1, num_shards=2, seed=3, accumulate=2)
    host, resident = HostTreeLoader(tree, device=torch.device("cpu"), **kw), TreeLoader(tree, **kw)
    for step in (0, 7, 8, 19):  # an epoch is 8 loader steps: 7 -> 8 crosses into a new permutation
        a, b = host.batch(step)[0], resident.batch(step)[0]
        assert all(torch.equal(u, v) for u, v in zip(a, b)), step
    host.prepare(8)
    resident.prepare(8)
    for _ in range(2):
        a, b = host.next_batch()[0], resident.next_batch()[0]
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_a_split_larger_than_the_device_streams_from_host_memory_with_the_same_losses(tmp_path, pool):
    """2 workers, --accumulate 2: --loader stream (the train tree kept in host memory) against the
    resident path; the same batches, so the same losses and weights to float tolerance. 4200 items
    (data/tree.py SHARD_MIN): resident collates half a rank and gathers the halves; stream reads the
    rows of each batch into the host tree as it first needs them (data/lazy.py)."""
    data = (Items(0, 4200), Items(10 ** 5, 40))
    runs = {how: shmlearn.train(_cfg(tmp_path / how, 2, samples=400, accumulate=2, loader=how), model=_model(),
                                data=data, compute_loss=mse) for how in ("resident", "stream")}
    a, b = runs["resident"], runs["stream"]
    assert (a.summary["data_path"], b.summary["data_path"]) == ("resident", "stream")
    torch.testing.assert_close(_weights(b.model), _weights(a.model), rtol=1e-5, atol=1e-6)
    assert b.summary["final_loss"] == pytest.approx(a.summary["final_loss"], rel=1e-5)
    assert b.summary["test_loss"] == pytest.approx(a.summary["test_loss"], rel=1e-5)
    assert (_weights(a.model) - _weights(_model())).abs().max() > 0.1, "training did not move the weights"
