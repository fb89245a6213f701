"""Large splits of the general contract's data are collated in parts, one a rank, and gathered
(data/tree.py: part_bounds, collate_part, gather_parts).

References: the gathered tree equals the whole split collated in one process, byte for byte (the
same default_collate, moved as bytes); each rank calls the Dataset's __getitem__ for its part only;
a rank holding the whole split (a pool worker's cache) and ranks holding parts agree; items that
differ between the parts are one line on every rank; and two real Gloo workers trained on a split
collated in parts end with the weights of one process training plain torch on the concatenated
batches.

The Datasets and functions below are at the top level: the forked processes find them by
reference.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shmlearn
from shmlearn.config.train_config import TrainConfig
from shmlearn.data.loader import epoch_permutation
from shmlearn.data.tree import SHARD_MIN, collate_part, collate_split, gather_parts, part_bounds, tree_data
from shmlearn.errors import BadInput
from shmlearn.launch.pool import Pool, using

from procs import processes

N = SHARD_MIN + 905
"""Uneven across 2 and 3 ranks: the last part is shorter (the gather pads it)."""


class Mixed(torch.utils.data.Dataset):
    """Dict items of four dtypes and shapes; counts its __getitem__ calls (in this process)."""

    def __init__(self, n, bad_from=None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, generator=g)
        self.ids = torch.randint(0, 50_000, (n, 5), generator=g)
        self.img = torch.randint(0, 256, (n, 2, 2), generator=g).to(torch.uint8)
        self.flag = self.ids[:, 0] % 2 == 0
        self.bad_from, self.calls = bad_from, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.calls += 1
        ids = self.ids[i].to(torch.int32) if self.bad_from is not None and i >= self.bad_from else self.ids[i]
        return {"x": self.x[i], "ids": ids, "img": self.img[i], "flag": self.flag[i]}


def test_parts_are_equal_but_the_last_and_small_splits_stay_whole():
    assert part_bounds(10_000, 0, 3) == (0, 3334)
    assert part_bounds(10_000, 2, 3) == (6668, 10_000)
    assert part_bounds(SHARD_MIN - 1, 0, 2) is None
    assert part_bounds(10_000, 0, 1) is None
    tree, total = collate_part(Mixed(N), "data=", "train", rank=1, world=2)
    assert total == N and len(tree["x"]) == N - (N + 1) // 2


def _gather(rank, world, store, bad_from, whole_rank, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ds = Mixed(N, bad_from)
        test = Mixed(100, 0 if bad_from is not None and rank == 1 else None)  # agrees with the rank's train part
        data = tree_data((ds, test), "data=", rank=0 if rank == whole_rank else rank,
                         world=1 if rank == whole_rank else world)
        calls = ds.calls
        try:
            gather_parts(data, "data=")
        except BadInput as e:
            torch.save({"error": str(e)}, f"{out}.{rank}")
            return
        torch.save({"train": data.train, "test": data.test, "calls": calls, "pending": data.pending,
                    "n": data.n_train}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,whole_rank", [(2, None), (3, None), (2, 1)],
                         ids=["2-ranks", "3-ranks", "one-rank-holds-it-whole"])
def test_the_gathered_split_is_the_whole_split_collated_in_one_process(tmp_path, world, whole_rank):
    out = str(tmp_path / "got")
    processes(_gather, (world, str(tmp_path / "store"), None, whole_rank, out), world)
    want = collate_split(Mixed(N), "data=", "train")
    for rank in range(world):
        got = torch.load(f"{out}.{rank}")
        assert not got["pending"] and got["n"] == N
        for key in want:
            assert got["train"][key].dtype == want[key].dtype
            assert torch.equal(got["train"][key], want[key]), (rank, key)
        assert len(got["test"]["x"]) == 100  # below SHARD_MIN: collated whole by every rank
        if rank != whole_rank:
            lo, hi = part_bounds(N, rank, world)
            assert got["calls"] == hi - lo  # this rank's part only


def test_items_that_differ_between_the_parts_are_one_line_on_every_rank(tmp_path):
    out = str(tmp_path / "got")
    lo = part_bounds(N, 1, 2)[0]  # rank 1's items hold int32 ids, rank 0's int64
    processes(_gather, (2, str(tmp_path / "store"), lo, None, out), 2)
    for rank in range(2):
        error = torch.load(f"{out}.{rank}")["error"]
        assert "rank 1's part" in error and "torch.int32" in error and "\n" not in error


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.t = self.x.sum(1) + 0.1 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.t[i]


def mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]).squeeze(1), batch[1])


def test_two_workers_on_parts_train_the_weights_of_one_process(tmp_path):
    n = SHARD_MIN + 100
    cfg = TrainConfig(device="cpu", workers=2, batch_size=32, optimizer="sgd", momentum=0.0, lr=0.05,
                      lr_schedule="constant", samples=64 * 40, eval_points=1, progress=False, threads=1,
                      out=str(tmp_path / "run"), seed=3, loader="resident")  # auto reads rows lazily: test_lazy.py
    torch.manual_seed(7)
    model = nn.Linear(4, 1)
    ref = nn.Linear(4, 1)
    ref.load_state_dict(model.state_dict())
    with Pool(2) as pool, using(pool):
        result = shmlearn.train(cfg, model=model, data=(Pairs(n), Pairs(300)), compute_loss=mse)
    assert result.status == "completed"
    train, opt = Pairs(n), torch.optim.SGD(ref.parameters(), lr=cfg.lr)
    for step in range(40):
        idx = epoch_permutation(n, cfg.seed, 0)[step * 64:(step + 1) * 64]
        opt.zero_grad()
        mse(ref, (train.x[idx], train.t[idx])).backward()
        opt.step()
    for (name, got), want in zip(result.model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert os.path.exists(os.path.join(result.run_dir, "summary.json"))
