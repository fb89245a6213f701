"""data/stream.py against the device-resident loader (data/loader.py): a streamed Dataset gives
the same batches, shard by shard and step by step across epochs, the same test slices, and, run
through shmlearn.train on 2 Gloo workers, the same trained weights."""
import json
import os

import numpy as np
import pytest
import torch

import shmlearn
from shmlearn.config.train_config import TrainConfig
from shmlearn.data import load_dataset, normalizer
from shmlearn.data.loader import ShardedLoader
from shmlearn.data import stream
from shmlearn.data.stream import StreamedData, StreamLoader
from shmlearn.data.user import user_data
from shmlearn.errors import BadInput
from shmlearn.launch.pool import Pool, using

from procs import processes_with_tag
from stuck_data import STUCK_DATA

CPU = torch.device("cpu")


class Pairs(torch.utils.data.Dataset):
    """Map-style, items (x, y) as numpy values, as a user's Dataset over files would give.
    Top level: pool workers unpickle it, the DataLoader's workers read it."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Fails(Pairs):
    classes = ("a", "b", "c", "d")  # as torchvision's datasets say it: no label scan reads sample 7 early

    def __getitem__(self, i):
        if i == 7:
            raise IOError(f"sample {i}: truncated file")
        return super().__getitem__(i)


def _features(n_train=103, n_test=21):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n_train, 5)).astype(np.float32), rng.integers(0, 4, n_train),
            rng.normal(size=(n_test, 5)).astype(np.float32), rng.integers(0, 4, n_test))


def _images(n_train=103, n_test=21):
    rng = np.random.default_rng(1)
    return (rng.integers(0, 256, (n_train, 1, 4, 4), dtype=np.uint8), rng.normal(size=n_train),
            rng.integers(0, 256, (n_test, 1, 4, 4), dtype=np.uint8), rng.normal(size=n_test))


def _both(arrays):
    trx, tr_y, tex, te_y = arrays
    pair = (Pairs(trx, tr_y), Pairs(tex, te_y))
    resident = user_data(pair, "data=", loader="resident")
    streamed = user_data(pair, "data=", loader="stream")
    assert isinstance(streamed, StreamedData) and not isinstance(resident, StreamedData)
    return resident, streamed


def _loaders(resident, streamed, shard, *, batch=8, shards=2, seed=3, workers=0, accumulate=1):
    a = ShardedLoader(resident.train_x, resident.train_y, batch_size=batch, shard=shard, num_shards=shards,
                      seed=seed, normalize=normalizer(resident, CPU), accumulate=accumulate)
    b = StreamLoader(streamed, batch_size=batch, shard=shard, num_shards=shards, seed=seed,
                     normalize=normalizer(streamed, CPU), device=CPU, num_workers=workers, accumulate=accumulate)
    return a, b


def _same(got, want, what):
    for g, w, part in zip(got, want, ("x", "y")):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), f"{what}: {part} differs"


@pytest.mark.parametrize("arrays", [_features, _images], ids=["features-classes", "uint8-images-targets"])
def test_stream_batches_are_the_resident_batches_across_epochs(arrays):
    resident, streamed = _both(arrays())
    for shard in (0, 1):
        a, b = _loaders(resident, streamed, shard)
        assert a.steps_per_epoch == b.steps_per_epoch == 6  # 103 // (2 x 8)
        try:
            for step in range(15):  # two epoch boundaries
                _same(b.batch(step), a.batch(step), f"shard {shard} step {step}")
            for step in (40, 3, 4, 12):  # jumps (a resume, the fast step's warm-up) restart the reader
                _same(b.batch(step), a.batch(step), f"shard {shard} step {step} after a jump")
        finally:
            b.close()
    # the two shards of a step are disjoint, and each epoch draws a new order
    a0, a1 = _loaders(resident, streamed, 0)[1], _loaders(resident, streamed, 1)[1]
    assert not set(a0.indices(2)) & set(a1.indices(2))
    assert a0.indices(0) != a0.indices(6)


def test_stream_batches_with_loader_workers_and_through_prepare():
    resident, streamed = _both(_features())
    a, b = _loaders(resident, streamed, 1, workers=1)  # a DataLoader worker process reads ahead
    try:
        for step in range(8):
            _same(b.batch(step), a.batch(step), f"step {step}")
        a2, b2 = _loaders(resident, streamed, 1)
        for step in range(4, 9):  # the fast step's path: prepare on the host, then next_batch
            a2.prepare(step)
            b2.prepare(step)
            _same(b2.next_batch(), a2.next_batch(), f"prepared step {step}")
        b2.close()
    finally:
        b.close()


def test_stream_micro_batches_are_the_resident_ones_through_prepare():
    """--accumulate 2: an epoch is whole training steps (103 // 28 = 3 steps of two micro-batches:
    6 loader steps, not 103 // 14 = 7), and prepare(s*N) readies the N micro-batches the next N
    next_batch() calls return, as the resident loader's device counter does."""
    resident, streamed = _both(_features())
    a, b = _loaders(resident, streamed, 1, batch=7, accumulate=2)
    assert a.steps_per_epoch == b.steps_per_epoch == 6
    try:
        for step in range(7):  # past two epochs' ends
            a.prepare(step * 2)
            b.prepare(step * 2)
            for k in range(2):
                _same(b.next_batch(), a.next_batch(), f"step {step} micro-batch {k}")
                _same(b.batch(step * 2 + k), a.batch(step * 2 + k), f"step {step} micro-batch {k}, eagerly")
    finally:
        b.close()


def test_stream_test_batches_are_the_resident_slices():
    resident, streamed = _both(_features(n_test=21))
    for world in (1, 2, 3):
        for rank in range(world):
            got = list(stream.test_batches(streamed, rank, world, CPU, size=4, num_workers=0))
            want = list(stream.test_batches(resident, rank, world, CPU, size=4))
            assert len(got) == len(want)
            for g, w in zip(got, want):
                _same(g, w, f"rank {rank} of {world}")


def test_a_dataset_that_fails_while_streaming_is_one_line():
    trx, tr_y, tex, te_y = _features()
    streamed = user_data((Fails(trx, tr_y), Pairs(tex, te_y)), "data=", loader="stream")
    loader = StreamLoader(streamed, batch_size=50, shard=0, num_shards=2, seed=0,
                          normalize=normalizer(streamed, CPU), device=CPU, num_workers=0)
    with pytest.raises(BadInput) as e:
        for step in range(2):  # one of the first two batches holds sample 7
            loader.batch(step)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data=: reading the train Dataset at step ")
    assert msg.endswith("raised OSError: sample 7: truncated file")


class Stuck(Pairs):
    classes = ("a", "b", "c", "d")

    def __getitem__(self, i):
        if i == 7:
            import time
            time.sleep(600)  # a read that never returns (a dead network mount)
        return super().__getitem__(i)


def test_a_stuck_dataset_fails_the_run_after_the_timeout_instead_of_hanging_it():
    """The rank's heartbeat keeps beating while it waits on a loader worker, so only the loader's
    own timeout can end this; --timeout is passed to it."""
    trx, tr_y, tex, te_y = _features()
    streamed = user_data((Stuck(trx, tr_y), Pairs(tex, te_y)), "data=", loader="stream")
    loader = StreamLoader(streamed, batch_size=50, shard=0, num_shards=2, seed=0,
                          normalize=normalizer(streamed, CPU), device=CPU, num_workers=1, timeout_s=3)
    with pytest.raises(BadInput) as e:
        for step in range(2):  # one of the first two batches holds sample 7
            loader.batch(step)
    loader.close()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data=: reading the train Dataset at step ")
    assert "timed out after 3 seconds" in msg


def test_a_stuck_test_dataset_fails_the_evaluation_after_the_timeout_instead_of_hanging_it():
    """Issue 38, 5: evaluation read the streamed test set with no timeout, so a 1-worker run
    ignored --timeout and hung. test_batches takes --timeout as training's loader does."""
    trx, tr_y, tex, te_y = _features()
    streamed = user_data((Stuck(trx, tr_y), Stuck(tex, te_y)), "data=", loader="stream")  # classes: no label scan
    with pytest.raises(BadInput) as e:
        for _ in stream.test_batches(streamed, 0, 1, CPU, size=5, num_workers=1, timeout_s=3):
            pass
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data=: reading the test Dataset on rank 0 raised ")
    assert "timed out after 3 seconds" in msg


def test_a_streamed_label_past_the_classes_is_one_line():
    trx, tr_y, tex, te_y = _features()

    class Targets(Pairs):
        targets = np.zeros(3, dtype=np.int64) + 1  # says 2 classes; the items hold 0..3
    streamed = user_data((Targets(trx, tr_y), Targets(tex, te_y)), "data=", loader="stream")
    assert streamed.spec.num_outputs == 2
    loader = StreamLoader(streamed, batch_size=50, shard=0, num_shards=2, seed=0,
                          normalize=normalizer(streamed, CPU), device=CPU, num_workers=0)
    with pytest.raises(BadInput) as e:
        loader.batch(0)
    assert str(e.value) in (f"data=: label {k} is outside the 2 classes 0..1" for k in (2, 3))


def test_streamed_training_gives_the_resident_weights(tmp_path):
    """2 real Gloo workers, 32 steps of 2 x 32 over digits' 1437 images (an epoch is 22 steps):
    the streamed run reads the same batches through DataLoaders, so the weights agree bit for bit."""
    digits = load_dataset("digits")
    data = (Pairs(digits.train_x.numpy(), digits.train_y.numpy()),
            Pairs(digits.test_x.numpy(), digits.test_y.numpy()))
    results = {}
    with Pool(2) as pool, using(pool):
        for loader in ("resident", "stream"):
            cfg = TrainConfig(model="mlp", device="cpu", workers=2, samples=2048, batch_size=32, lr=0.01, eval_points=1,
                              loader=loader, progress=False, out=str(tmp_path / loader))
            results[loader] = shmlearn.train(cfg, data=data)
    for loader, r in results.items():
        assert r.status == "completed" and r.summary["data_path"] == loader
        with open(os.path.join(r.run_dir, "summary.json")) as f:
            assert json.load(f)["data_path"] == loader
        assert r.summary["dataset"] == "python:Pairs pair"
    a, b = results["resident"].model.state_dict(), results["stream"].model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: streamed and resident weights differ"
    assert results["stream"].summary["test_accuracy"] == results["resident"].summary["test_accuracy"]
    assert results["stream"].summary["test_accuracy"] > 0.8  # it trained: equal weights are not both untrained


def test_workers_start_from_a_clean_process_where_the_dataset_allows(tmp_path):
    """forkserver for a Dataset a fresh process can import and unpickle; fork for one loaded by
    path (FILE.py:NAME) or one that does not pickle (a lambda inside), which only a fork can copy."""
    import multiprocessing as mp
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    from shmlearn.user.refs import load_ref
    x = np.zeros((4, 1, 2, 2), dtype=np.uint8)
    y = np.zeros(4, dtype=np.int64)
    assert stream._context(Pairs(x, y)).get_start_method() == "forkserver"
    assert stream._context(torch.utils.data.Subset(Pairs(x, y), [0, 1])).get_start_method() == "forkserver"
    bad = Pairs(x, y)
    bad.transform = lambda v: v
    assert stream._context(bad).get_start_method() == "fork"
    f = tmp_path / "mydata.py"
    f.write_text("import torch\nclass D(torch.utils.data.Dataset):\n    def __len__(self): return 1\n"
                 "    def __getitem__(self, i): return torch.zeros(1), 0\n")
    cls = load_ref(f"{f}:D", "--data")
    assert stream._context(cls()).get_start_method() == "fork"





def test_a_stuck_dataset_at_2_workers_names_the_stuck_rank_and_leaves_no_process(tmp_path):
    """Issue 38, 5: a streamed Dataset whose __getitem__ never returns, on rank 0 of 2, in
    training and in evaluation. Before: the stuck rank waited 5 s for its loader worker to leave
    after the loader's timeout, its peer's collective timed out first and the peer was named
    (rank 1: 'Timed out waiting 20000ms'), the stuck rank was killed, and its loader worker (a
    fork of the pool worker: 'spawn_main') and multiprocessing's resource tracker stayed behind
    with parent 1. Now: exit 2, one line naming the Dataset and rank 0, nothing left."""
    import subprocess
    import sys
    import time
    import uuid
    path = tmp_path / "stuck_data.py"
    path.write_text(STUCK_DATA)
    runs = {}
    for name, what in (("train_stuck", "the train Dataset at step 0 on rank 0"),
                       ("test_stuck", "the test Dataset on rank 0")):
        tag = uuid.uuid4().hex
        p = subprocess.Popen([sys.executable, "-m", "shmlearn", "train", "--dataset", f"{path}:{name}",
                              "--model", "mlp", "--loader", "stream", "--workers", "2", "--batch-size", "16",
                              "--samples", "4096", "--eval-points", "2", "--no-progress", "--timeout", "10",
                              "--out", str(tmp_path / name)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONUNBUFFERED="1", SHMLEARN_TEST_TAG=tag))
        runs[name] = (p, tag, what)
    for name, (p, tag, what) in runs.items():
        try:
            _, err = p.communicate(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 2 and len(err.strip().splitlines()) == 1, err
        assert f"reading {what} raised RuntimeError: DataLoader timed out after 10" in err, err
        deadline = time.monotonic() + 30  # the resource tracker leaves a moment after its owner
        while processes_with_tag(tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [open(f"/proc/{pid}/cmdline", "rb").read()[:120] for pid in processes_with_tag(tag)]
        assert not left, left
