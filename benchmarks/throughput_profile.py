"""Where one training step's time goes: the kernels of shmlearn's step, eager, under the PyTorch
profiler, against the same step replayed from its CUDA graph (CUDA events).

    PYTHONPATH=. python benchmarks/throughput_profile.py --model alexnet-small --batch-sizes 128,1024 \
        --precision bf16 --channels-last --out profile.json

For each batch size: the number of kernels one step launches, their summed GPU time, the top
kernels by GPU time, the eager step's wall time, and the graph replay's time per step (the
median of 5 x 200 replays). A graph removes the launch gaps, so its step time approaches the
summed kernel time: what is left is the kernels themselves (the floor without fusing them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def profile_one(c, batch: int, device) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from shmlearn.bench.throughput import _Shmlearn
    from shmlearn.timing import NULL_TIMER
    r = _Shmlearn(c, device, batch, 0, 1, strategy="allreduce", eager=False, local=True)
    st = r.stepper
    out = {"batch": batch, "mode": st.mode, "note": st.note}
    step = 0
    for _ in range(20):
        r.step(step)
        step += 1
    r.flush(step)
    torch.cuda.synchronize()
    # eager: one step, profiled (the same device function the graph holds)
    st.loader.invalidate()
    st.loader.prepare(0)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            st._device_step(NULL_TIMER, False)
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = {}
        for e in events:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        out.update(kernels=sum(v[0] for v in kernels.values()), kernel_us=sum(v[1] for v in kernels.values()),
                   top=[{"name": n[:110], "count": v[0], "us": round(v[1], 2)}
                        for n, v in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:20]])
    except Exception as e:  # noqa: BLE001 - the timings below still say something
        out.update(kernels=-1, kernel_us=float("nan"), top=[], profile_error=f"{type(e).__name__}: {e}"[:300])
    st._expected = None  # the eager step advanced the device counters
    # chunks of steps that stay inside one epoch: the device counters are reset before each
    n = min(100, st.loader.steps_per_epoch)

    def rewind():
        st.loader.invalidate()
        st.loader.prepare(0)
        st._t.fill_(0)

    ts = []
    for _ in range(5):  # eager step wall time
        rewind()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            st._device_step(NULL_TIMER, False)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / n * 1e6)
    out["eager_step_us"] = statistics.median(ts)
    if st.graphs:
        g = st.graphs[False]
        ts = []
        for _ in range(5):
            rewind()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / n)
        out["graph_step_us"] = statistics.median(ts)
    out["steps_timed"] = n
    st._expected = None
    r.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="alexnet-small")
    p.add_argument("--input", default="3x32x32")
    p.add_argument("--batch-sizes", default="128,1024")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--out", default="profile.json")
    a = p.parse_args(argv)
    import torch.distributed as dist
    from shmlearn.bench.common import environment
    from shmlearn.launch import free_port
    from shmlearn.bench.throughput import ThroughputConfig
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    c = ThroughputConfig(model=a.model, input_shape=[int(v) for v in a.input.split("x")], device="cuda",
                         precision=a.precision, channels_last=a.channels_last)
    doc = {"env": environment("nccl"), "config": vars(a), "results": []}
    for b in (int(v) for v in a.batch_sizes.split(",")):
        doc["results"].append(profile_one(c, b, device))
    dist.destroy_process_group()
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for r in doc["results"]:
        print(f"B={r['batch']} {r['mode']}: {r['kernels']} kernels, {r['kernel_us']:.1f} us of kernels; "
              f"eager step {r['eager_step_us']:.1f} us; graph step {r.get('graph_step_us', float('nan')):.1f} us")
        for k in r["top"][:12]:
            print(f"    {k['us']:9.1f} us {k['count']:4d}x  {k['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
