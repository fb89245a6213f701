"""pytorch/examples' mnist recipe on Fashion-MNIST, 2 CPU workers: the DDP script a user has
against its shmlearn port, in one run (issue 41, acceptance 4); and how fast a short run starts
and a bad flag is refused.

    PYTHONPATH=. python benchmarks/mnist_port.py --out mnist-port.json [--epochs 1] [--repeats 1]
        [--skip-epochs] [--before OTHER_CHECKOUT]

Rows (wall seconds from starting the command to its exit, as a user waits for it):
  ddp        the recipe as a DDP script (torch.multiprocessing, Gloo, DistributedSampler, batch 32
             a worker, Adadelta lr 1.0, StepLR gamma 0.7 a epoch, nll_loss, one test pass after
             each epoch, as pytorch/examples' main.py does; one intra-op thread a rank, as torchrun
             sets), `--epochs` epochs.
  shmlearn   `shmlearn train --model FILE.py:Net --loss FILE.py:nll` with the same recipe flags,
             2 workers, allreduce, `--epochs`, default evaluation.
  ten-steps  `shmlearn train --workers 2` on digits, 10 steps.
  refusal    `shmlearn train --dataset fashion-mnist --data-dir /nonexistent` (exit 2 expected).
  ten-steps-before, refusal-before  (--before DIR) the same two with the shmlearn of another
             checkout (the code before a change), each run right after its "after" twin.
The DDP and shmlearn runs alternate when --repeats > 1, so a drift in the machine's speed
bends both. The JSON has the machine, torch, the date, each run's seconds and the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

NET_TEMPLATE = """
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Net(nn.Module):  # pytorch/examples mnist/main.py{note}
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, {c1}, 3, 1)
            self.conv2 = nn.Conv2d({c1}, {c2}, 3, 1)
            self.dropout1 = nn.Dropout(0.25)
            self.dropout2 = nn.Dropout(0.5)
            self.fc1 = nn.Linear({flat}, {hidden})
            self.fc2 = nn.Linear({hidden}, 10)

        def forward(self, x):
            x = F.relu(self.conv1(x))
            x = F.relu(self.conv2(x))
            x = F.max_pool2d(x, 2)
            x = self.dropout1(x)
            x = torch.flatten(x, 1)
            x = F.relu(self.fc1(x))
            x = self.dropout2(x)
            return F.log_softmax(self.fc2(x), dim=1)


    def nll(output, target):
        return F.nll_loss(output, target)
"""


def net_source(conv: tuple = (32, 64), hidden: int = 128, flat: int = 9216, note: str = "") -> str:
    """The recipe's Net and nll loss as a user's file (source text; tests/test_mnist_recipe.py
    writes a narrowed one): conv widths, hidden units, and the flattened size the first linear
    layer takes (conv[1] x 12 x 12 = 9216 for 28x28 images; 16 x 2 x 2 = 64 for 8x8 digits)."""
    return textwrap.dedent(NET_TEMPLATE.format(c1=conv[0], c2=conv[1], hidden=hidden, flat=flat, note=note))


NET = net_source()

DDP = """
    import os, sys, time
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.lr_scheduler import StepLR
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mnist_net import Net

    def load(d, kind):
        import gzip
        with gzip.open(os.path.join(d, f"{kind}-images-idx3-ubyte.gz")) as f:
            x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
        with gzip.open(os.path.join(d, f"{kind}-labels-idx1-ubyte.gz")) as f:
            y = np.frombuffer(f.read(), np.uint8, offset=8)
        x = (torch.from_numpy(x.copy()).float() / 255 - 0.1307) / 0.3081  # main.py's Normalize
        return TensorDataset(x, torch.from_numpy(y.astype(np.int64)))

    def rank(r, world, data_dir, epochs, port):
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=r, world_size=world)
        torch.manual_seed(1)
        train, test = load(data_dir, "train"), load(data_dir, "t10k")
        sampler = DistributedSampler(train, num_replicas=world, rank=r, shuffle=True, seed=1)
        loader = DataLoader(train, batch_size=32, sampler=sampler)
        model = DDP(Net())
        opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
        sched = StepLR(opt, step_size=1, gamma=0.7)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                opt.zero_grad()
                loss = F.nll_loss(model(x), y)
                loss.backward()
                opt.step()
            model.eval()
            correct = 0
            with torch.no_grad():
                for x, y in DataLoader(test, batch_size=1000):
                    correct += (model(x).argmax(1) == y).sum().item()
            if r == 0:
                print(f"epoch {epoch + 1}: test accuracy {correct / len(test):.4f}", flush=True)
            sched.step()
        dist.destroy_process_group()

    if __name__ == "__main__":
        world, data_dir, epochs, port = 2, sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        mp.spawn(rank, args=(world, data_dir, epochs, port), nprocs=world)
"""

RECIPE = ["--optimizer", "Adadelta", "--optimizer-args", "lr=1.0", "--scheduler", "StepLR",
          "--scheduler-args", "step_size=1,gamma=0.7"]


def timed(cmd, cwd, env) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    out = (r.stdout + r.stderr).strip().splitlines()
    return {"wall_s": round(time.perf_counter() - t0, 2), "rc": r.returncode, "last": out[-1][:300] if out else ""}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="DDP and shmlearn runs, alternating")
    ap.add_argument("--short-repeats", type=int, default=3, help="ten-steps and refusal runs")
    ap.add_argument("--skip-epochs", action="store_true", help="only the ten-step run and the refusal")
    ap.add_argument("--before", metavar="DIR", help="also time the short rows with the shmlearn of this checkout")
    ap.add_argument("--out", default="mnist-port.json")
    a = ap.parse_args(argv)
    from shmlearn.bench.common import environment
    from shmlearn.launch.start import free_port
    work = tempfile.mkdtemp(prefix="mnist-port-")
    with open(os.path.join(work, "mnist_net.py"), "w") as f:
        f.write(textwrap.dedent(NET))
    with open(os.path.join(work, "ddp_mnist.py"), "w") as f:
        f.write(textwrap.dedent(DDP))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    sh = [sys.executable, "-m", "shmlearn", "train"]
    doc = {"benchmark": "mnist-port", **environment("gloo"), "epochs": a.epochs, "runs": []}
    for i in range(0 if a.skip_epochs else a.repeats):
        for name in ("ddp", "shmlearn"):
            cmd = ([sys.executable, "ddp_mnist.py", a.data_dir, str(a.epochs), str(free_port())] if name == "ddp" else
                   sh + ["--model", "mnist_net.py:Net", "--loss", "mnist_net.py:nll", "--dataset", "fashion-mnist",
                         "--data-dir", a.data_dir, "--workers", "2", "--batch-size", "32", "--epochs", str(a.epochs),
                         "--no-progress", "--out", os.path.join(work, f"run-{i}"), *RECIPE])
            doc["runs"].append(dict(name=name, **timed(cmd, work, env)))
            print(doc["runs"][-1], flush=True)
    checkouts = [("", env)]
    if a.before:
        doc["before"] = os.path.abspath(a.before)
        checkouts.append(("-before", dict(env, PYTHONPATH=doc["before"])))
    for i in range(a.short_repeats):
        for suffix, env_ in checkouts:
            doc["runs"].append(dict(name="ten-steps" + suffix, **timed(
                sh + ["--workers", "2", "--samples", str(10 * 2 * 32), "--no-progress",
                      "--out", os.path.join(work, f"ten{suffix}-{i}")], work, env_)))
            doc["runs"].append(dict(name="refusal" + suffix, **timed(
                sh + ["--dataset", "fashion-mnist", "--data-dir", "/nonexistent"], work, env_)))
            print(doc["runs"][-2:], flush=True)
    doc["loadavg_end"] = list(os.getloadavg())  # beside environment()'s loadavg_start: the load it ran under
    names = sorted({r["name"] for r in doc["runs"]})
    doc["median_s"] = {n: statistics.median(r["wall_s"] for r in doc["runs"] if r["name"] == n) for n in names}
    doc["range_s"] = {n: [f(r["wall_s"] for r in doc["runs"] if r["name"] == n) for f in (min, max)] for n in names}
    if "ddp" in doc["median_s"]:
        doc["shmlearn_over_ddp"] = round(doc["median_s"]["shmlearn"] / doc["median_s"]["ddp"], 3)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: doc[k] for k in ("median_s", "range_s", "shmlearn_over_ddp") if k in doc}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
