"""Probe (session 30): 203 KB averages (the digits MLP gradient) after 0.35 ms of compute, 400 calls
a rank (the last 350 timed), through shared memory and Gloo, with and without a Gloo barrier
before each, as bench comm puts one: does the barrier explain why bench comm sees no 2-rank gap?
Output: results/shm-cpu-2026-11-29/barrier-probe.txt.  python benchmarks/shm_barrier_probe.py
"""
import statistics
import time

import torch
import torch.distributed as dist
from shmlearn.launch.pool import run_local
from shmlearn.sync import shm as shm_mod

def work(env, path, barrier):
    torch.set_num_threads(1)
    rank, world = env.rank, env.world_size
    buf = torch.randn(203 * 1024 // 4)
    mat = torch.randn(64, 64)
    comm = None
    if path == "shm":
        comm, why = shm_mod.open_collectives(buf.numel() * 4, rank, world, None, 60.0)
        assert comm is not None, why
    flag = torch.zeros(1)
    ts = []
    for i in range(400):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.00035:
            mat.copy_(torch.tanh(mat @ mat) * 0.5)
        if barrier:
            dist.all_reduce(flag)
        t1 = time.perf_counter()
        if comm is not None:
            comm.sum_(buf); buf.div_(world)
        else:
            dist.all_reduce(buf); buf.div_(world)
        ts.append(time.perf_counter() - t1)
    if comm: comm.close()
    return statistics.median(ts[50:])

if __name__ == "__main__":

  for w in (2, 4):
    for path in ("shm", "gloo"):
        for barrier in (True, False):
            r = run_local(work, (path, barrier), w, cuda=False, timeout_s=120)
            print(f"W={w} {path:5} barrier={barrier!s:5}: median {max(r)*1e6:.0f} us (slowest rank)", flush=True)
