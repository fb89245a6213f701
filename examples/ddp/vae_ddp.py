"""pytorch/examples' VAE (vae/main.py) as a DDP script, written as a careful user would: the
reference the shmlearn port (examples/vae.py) is held to (docs/ports.md, tests/test_ports.py,
benchmarks/ports.py).

    torchrun --standalone --nproc-per-node 2 examples/ddp/vae_ddp.py [--epochs N | --samples N]

What it shares with the port: the VAE and its loss (copied from the original), Fashion-MNIST through
examples/fashion_mnist.py, the seed (every rank seeds torch before it builds the VAE, so every rank
starts from the port's weights), --batch-size samples a rank a step, Adam lr 1e-3, the budget.
What a DDP user adds: Gloo (the CPU), a DistributedSampler (shuffled by --seed, set_epoch each epoch,
drop_last so every rank takes the same steps: the full batches shmlearn takes too), the original's
summed loss per rank (DDP averages the ranks' gradients; Adam does not see the scale), and the test
loss of the original (summed over the test set, divided by its size), each rank summing every
world-th sample, all-reduced.

Budget: --epochs passes over the training set, or --samples samples of all ranks together
(steps = samples // (ranks x batch size)), as shmlearn counts them.
Rank 0 prints the original's test-loss line, then `time to first step` (from this process's start to
the end of the first optimizer step), `first step ended at unix T` (for benchmarks/ports.py, which
measures from its own launch), and the training seconds.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/
from fashion_mnist import datasets, transforms  # noqa: E402 - torchvision's names over Debian's files

FASHION = "/usr/share/datasets/fashion-mnist"


def process_start_unix() -> float:
    """When this process started (Linux: /proc/self/stat's start time, in clock ticks since boot)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class VAE(nn.Module):  # vae/main.py's, unchanged
    def __init__(self):
        super(VAE, self).__init__()

        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5*logvar)
        eps = torch.randn_like(std)
        return mu + eps*std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):  # vae/main.py's: summed over the batch
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction='sum')
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def main():
    parser = argparse.ArgumentParser(description="VAE on Fashion-MNIST with DDP (torchrun, Gloo)")
    parser.add_argument("--batch-size", type=int, default=128, help="samples a rank a step (default: 128)")
    parser.add_argument("--epochs", type=float, default=None, help="passes over the training set (default: 10)")
    parser.add_argument("--samples", type=int, default=None, help="instead of --epochs: samples of all ranks together")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (the original's 1e-3)")
    parser.add_argument("--data", default=FASHION, help="folder of the four Fashion-MNIST IDX .gz files")
    args = parser.parse_args()
    if args.epochs is not None and args.samples is not None:
        parser.error("--epochs and --samples: give one budget")
    started = process_start_unix()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    train_set = datasets.FashionMNIST(args.data, train=True, transform=transforms.ToTensor())
    test_set = datasets.FashionMNIST(args.data, train=False, transform=transforms.ToTensor())
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    # Every rank tests every world-th sample: a DistributedSampler would pad the last shard with repeats.
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=1024)
    # shmlearn's budget: epochs x the training set's size, in samples, over (ranks x batch) a step; a
    # remainder of steps past the last full epoch runs into the next one.
    samples = args.samples if args.samples is not None else int((10 if args.epochs is None else args.epochs) * len(train_set))
    steps = samples // (world * args.batch_size)
    if steps < 1:
        parser.error(f"the budget gives no step of {world} x {args.batch_size} samples")

    model = DDP(VAE())
    optimizer = optim.Adam(model.parameters(), lr=args.lr)
    first_step = None
    t_train = time.perf_counter()
    step, epoch = 0, 0
    model.train()
    while step < steps:
        sampler.set_epoch(epoch)
        for data, _ in train_loader:
            optimizer.zero_grad()
            recon_batch, mu, logvar = model(data)
            loss = loss_function(recon_batch, data, mu, logvar)
            loss.backward()
            optimizer.step()
            step += 1
            if first_step is None:
                first_step = time.time()
            if step == steps:
                break
        epoch += 1
    train_s = time.perf_counter() - t_train

    model.eval()
    total = torch.zeros(2, dtype=torch.float64)  # summed loss, samples
    with torch.no_grad():
        for data, _ in test_loader:
            recon_batch, mu, logvar = model.module(data)
            total[0] += loss_function(recon_batch, data, mu, logvar).item()
            total[1] += len(data)
    dist.all_reduce(total)
    test_loss = (total[0] / total[1]).item()
    if rank == 0:
        print('====> Test set loss: {:.4f}'.format(test_loss))
        print(f"time to first step: {first_step - started:.2f} s (from this process's start)")
        print(f"first step ended at unix {first_step:.3f}")
        print(f"training: {steps} steps of {world} x {args.batch_size} samples in {train_s:.2f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: with torch 2.13 and Gloo, a rank's exit after
    # destroy_process_group() aborted ("terminate called without an active exception") or hung in
    # the group's destructors, seen in CI; everything is printed and the group is gone by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
