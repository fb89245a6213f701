"""What averaging and broadcasting a model's buffers costs on CPU ranks: one collective per buffer
(what sync/base.py did until 2026-11-29) against one per dtype through `through_flat` (what it
does now: setup's broadcast on Gloo, sync_buffers' average through `_average_`, shared memory on
one host's CPU ranks).

    python benchmarks/buffer_sync.py --model resnet18 --workers 2,4 --out results/buffer-sync-cpu.json

Each rank builds the model (CIFAR-shaped: 3x32x32, 10 classes) and an allreduce strategy, then
times, alternating, --repeats rounds of each way of each operation; the median and spread per
(workers, op, way) over rank 0's rounds. Same values: the test of record is tests/sync/test_eval_sync.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rank(rank: int, world: int, port: int, model_name: str, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from shmlearn.data.base import DataSpec
    from shmlearn.models import build_model
    from shmlearn.sync import build_strategy
    from shmlearn.sync.base import by_kind, through_flat
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = build_model(model_name, DataSpec("cifar10", "classification", (3, 32, 32), 10))
    s = build_strategy("allreduce", rank=rank, world_size=world)
    s.timeout_s, s.shared_memory = 120.0, "auto"
    s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    buffers = list(model.buffers())
    floats = [b for b in buffers if b.is_floating_point()]

    def broadcast_each():
        for b in buffers:
            dist.broadcast(b, src=0, group=s.group)

    def broadcast_flat():
        for bufs in by_kind(buffers):
            through_flat(bufs, lambda flat: dist.broadcast(flat, src=0, group=s.group))

    def average_each():
        for b in floats:
            dist.all_reduce(b, group=s.group)
            b.div_(world)

    ways = {("broadcast", "each"): broadcast_each, ("broadcast", "flat"): broadcast_flat,
            ("average", "each"): average_each, ("average", "flat"): s.sync_buffers}
    times = {k: [] for k in ways}
    for _ in range(repeats + 2):  # the first two rounds warm up
        for k, fn in ways.items():
            dist.barrier(group=s.group)
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"buffers": len(buffers), "float_buffers": len(floats),
                       "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
                       "collectives": s.collectives_path,
                       "times": {f"{op}/{way}": t[2:] for (op, way), t in times.items()}}, f)
    s.close()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "buffer-sync-cpu.json"))
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    from shmlearn.launch.start import free_port
    rows, load0 = [], os.getloadavg()
    for w in [int(x) for x in args.workers.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rank0.json")
            mp.start_processes(_rank, args=(w, free_port(), args.model, args.repeats, path), nprocs=w,
                               join=True, start_method="fork")
            got = json.load(open(path))
        for key, t in got.pop("times").items():
            op, way = key.split("/")
            rows.append({"workers": w, "op": op, "way": way, "n": len(t), "median_ms": 1e3 * statistics.median(t),
                         "p25_ms": 1e3 * statistics.quantiles(t, n=4)[0], "p75_ms": 1e3 * statistics.quantiles(t, n=4)[2],
                         **got})
        for op in ("broadcast", "average"):
            each, flat = (next(r for r in rows if r["workers"] == w and r["op"] == op and r["way"] == way)
                          for way in ("each", "flat"))
            print(f"W={w} {op}: {got['buffers' if op == 'broadcast' else 'float_buffers']} buffers one by one "
                  f"{each['median_ms']:.2f} ms, flat ({got['collectives'] if op == 'average' else 'gloo'}) "
                  f"{flat['median_ms']:.2f} ms: {each['median_ms'] / flat['median_ms']:.1f}x")
    env = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "torch_version": torch.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open(args.out, "w") as f:
        json.dump({"benchmark": "buffer_sync", "model": args.model, "env": env, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
