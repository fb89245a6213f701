"""Where the VAE port's setup went, and what reading its rows lazily costs instead (issue 51
acceptance 1; shmlearn/data/lazy.py), on Fashion-MNIST as examples/vae.py reads it (the stand-in
torchvision Dataset, ToTensor: float32 (1, 28, 28) items), one rank of 2:

    PYTHONPATH=. python benchmarks/lazy_reads.py [--repeats 3] [--out results/.../reads.json]

  collate_half_s   what each rank did before its first step: its half of the train split
                   collated up front (data/tree.py collate_part, rank 0 of 2)
  gather_s         then the halves (train and test) all-gathered between 2 Gloo processes
                   (data/tree.py gather_parts)
  lazy_epoch_s     instead: one epoch of rank 0's batches (128 a batch) read lazily, prepare()
                   of each loader step of the epoch (data/lazy.py through TreeLoader)
  test_pass_s_T_threads  the original's test() pass of examples/vae.py (a DataLoader over the 10,000
                   test items, the VAE's forward) at 1 and at 2 intra-op threads: what the API
                   script runs in its own process after training (the load average is recorded:
                   on a loaded machine 2 threads wait for each other)
Medians and spread of --repeats, with the load average before each measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shmlearn.bench.common import environment, stats  # noqa: E402
from shmlearn.data.lazy import LazySplit  # noqa: E402
from shmlearn.data.tree import TreeLoader, collate_part, gather_parts, tree_data  # noqa: E402

FASHION = "/usr/share/datasets/fashion-mnist"


def splits():
    from fashion_mnist import datasets, transforms  # examples/: torchvision's names over Debian's files
    return (datasets.FashionMNIST(FASHION, train=True, transform=transforms.ToTensor()),
            datasets.FashionMNIST(FASHION, train=False, transform=transforms.ToTensor()))


def load() -> float:
    return os.getloadavg()[0]


def _gather_rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        data = tree_data(splits(), "data=", rank=rank, world=2)
        dist.barrier()
        t0 = time.perf_counter()
        gather_parts(data, "data=")
        took = time.perf_counter() - t0
        if rank == 0:
            with open(out, "w") as f:
                json.dump(took, f)
    finally:
        dist.destroy_process_group()


def gather_s() -> float:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "took")
        mp.start_processes(_gather_rank, args=(os.path.join(d, "store"), out), nprocs=2, join=True,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


def original_test_s(test, threads: int) -> float:
    """examples/vae.py's test(): a DataLoader of 128 over the test split, the forward and the loss."""
    import torch.nn.functional as F
    from torch import nn

    class VAE(nn.Module):  # examples/vae.py's, which runs its training when imported
        def __init__(self):
            super().__init__()
            self.fc1, self.fc21, self.fc22 = nn.Linear(784, 400), nn.Linear(400, 20), nn.Linear(400, 20)
            self.fc3, self.fc4 = nn.Linear(20, 400), nn.Linear(400, 784)

        def forward(self, x):
            h1 = F.relu(self.fc1(x.view(-1, 784)))
            mu, logvar = self.fc21(h1), self.fc22(h1)
            z = mu + torch.randn_like(logvar) * torch.exp(0.5 * logvar)
            return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = VAE().eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            for data, _ in torch.utils.data.DataLoader(test, batch_size=128):
                recon, mu, logvar = model(data)
                F.binary_cross_entropy(recon, data.view(-1, 784), reduction='sum').item()
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # a rank's (2 ranks on 2 cores)
    train, test = splits()
    runs = []
    for rep in range(a.repeats):
        row = {"repeat": rep}
        row["load_collate"] = load()
        t0 = time.perf_counter()
        collate_part(train, "data=", "train", rank=0, world=2)
        row["collate_half_s"] = time.perf_counter() - t0
        row["load_lazy"] = load()
        t0 = time.perf_counter()
        lazy = LazySplit(train, len(train), "data=", "train")
        loader = TreeLoader(lazy.tree, batch_size=128, shard=0, num_shards=2, seed=1, lazy=lazy)
        for step in range(loader.steps_per_epoch):
            loader.prepare(step)
            loader.next_batch()
        row["lazy_epoch_s"], row["lazy_rows_read"] = time.perf_counter() - t0, lazy.count
        row["load_gather"] = load()
        row["gather_s"] = gather_s()
        for threads in (1, 2):
            row[f"load_test_{threads}"] = load()
            row[f"test_pass_s_{threads}_threads"] = original_test_s(test, threads)
        runs.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(runs[-1], flush=True)
    keys = [k for k in runs[0] if k.endswith("_s") or "_s_" in k]
    report = {"what": __doc__.splitlines()[0], "environment": environment("gloo"), "repeats": a.repeats,
              "medians": {k: stats([r[k] for r in runs]) for k in keys}, "runs": runs}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
