"""Where a step's time goes when several GPUs train at once (issues 37 and 42): for each worker
count, each rank's step split into the host's time to issue it and the GPU's time to run it.

    PYTHONPATH=. python benchmarks/multi_gpu_probe.py --workers 1,2,4 --variants graph,local,allreduce \
        --model alexnet-small --batch 1024 --out probe.json [--threads 4] [--pin] [--trace DIR]

Each rank builds the variant as `shmlearn bench throughput` does (graph: torch's step in a CUDA
graph; local: shmlearn's step with no communication; allreduce: shmlearn's step averaging the
gradient), warms it up, then times `--steps` steps `--repeats` times. Per repeat and rank it
records: wall seconds (synchronize, loop, synchronize), the host's seconds to issue the loop
(before the final synchronize), the GPU's seconds between two CUDA events around the loop, the
process's CPU seconds and context switches over the loop (getrusage), its intra-op threads, its
CPU affinity, and the GPU's SM clock, power and throttle reasons after the loop (NVML).

What it tells: issue > GPU time means the host cannot feed the GPU (CPU contention: threads,
affinity, a busy loop); GPU time per step rising with the worker count while the host keeps up
means the GPUs slow each other (clocks, power, memory, the interconnect); wall well above both
means the ranks wait for each other. --trace writes a torch.profiler Chrome trace of 20 steps
per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from shmlearn.bench import throughput as tp  # noqa: E402
from shmlearn.bench.common import environment, rank_device, sync  # noqa: E402
from shmlearn.launch.pool import run_local  # noqa: E402


def _nvml(index: int) -> dict:
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "mem_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "temp_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                "throttle": int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))}
    except Exception as e:  # noqa: BLE001 - NVML is evidence, not a requirement
        return {"nvml_error": f"{type(e).__name__}: {e}"[:200]}


def _threads_in_process() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return -1


def _rank(env, cfg: dict, variants: list, steps: int, repeats: int, threads, pin: bool, trace):
    c = tp.ThroughputConfig(**cfg)
    rank, world = env.rank, env.world_size
    device = rank_device(env, "nccl")
    torch.backends.cudnn.benchmark = True
    if threads:
        torch.set_num_threads(threads)
    if pin and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // env.local_world_size)
        os.sched_setaffinity(0, cores[env.local_rank * share:(env.local_rank + 1) * share])
    out = []
    batch = c.batch_sizes[0]
    for v in variants:
        runner = tp._build(c, v, device, batch, rank, world)
        for s in range(20):
            runner.step(s)
        sync(device)
        step = 20
        reps = []
        for _ in range(repeats):
            if hasattr(runner, "flush"):
                runner.flush(step)
            torch.distributed.barrier()
            sync(device)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            e0.record()
            for _ in range(steps):
                runner.step(step)
                step += 1
            e1.record()
            t_issue = time.perf_counter() - t0
            sync(device)
            t_wall = time.perf_counter() - t0
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            reps.append({"wall_ms": 1e3 * t_wall / steps, "issue_ms": 1e3 * t_issue / steps,
                         "gpu_ms": e0.elapsed_time(e1) / steps,
                         "cpu_ms": 1e3 * ((ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)) / steps,
                         "vol_ctx": ru1.ru_nvcsw - ru0.ru_nvcsw, "invol_ctx": ru1.ru_nivcsw - ru0.ru_nivcsw})
        if trace and v != "graph":
            from torch.profiler import ProfilerActivity, profile
            if hasattr(runner, "flush"):
                runner.flush(step)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    runner.step(step)
                    step += 1
                sync(device)
            os.makedirs(trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace, f"w{world}-{v}-rank{rank}.json"))
        if hasattr(runner, "flush"):
            runner.flush(step)
        med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        out.append({"variant": v, "workers": world, "rank": rank, "batch": batch, "median": med, "repeats": reps,
                    "mode": getattr(runner, "mode", None), "threads": torch.get_num_threads(),
                    "process_threads": _threads_in_process(), "affinity": len(os.sched_getaffinity(0)),
                    "gpu": torch.cuda.current_device(), "nvml": _nvml(device.index)})
        runner.close()
        del runner
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--variants", default="graph,local,allreduce")
    ap.add_argument("--model", default="alexnet-small")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each rank")
    ap.add_argument("--pin", action="store_true", help="each rank on its own slice of the cores")
    ap.add_argument("--trace", default=None, help="folder for torch.profiler Chrome traces (20 steps a rank)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="multi-gpu-probe.json")
    a = ap.parse_args(argv)
    cfg = dict(model=a.model, device="cuda", batch_sizes=[a.batch], precision=a.precision, channels_last=True,
               samples=max(50000, 4 * a.batch * 4))
    variants = a.variants.split(",")
    doc = {"probe": "multi-gpu", "label": a.label, **environment("nccl"), "argv": sys.argv[1:], "rows": []}
    for w in (int(x) for x in a.workers.split(",")):
        if w > torch.cuda.device_count():
            continue
        res = run_local(_rank, (cfg, variants, a.steps, a.repeats, a.threads, a.pin, a.trace), w, cuda=True,
                        timeout_s=600)
        for rows in res:
            doc["rows"] += rows
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"{'label':10} {'W':>2} {'variant':10} {'rank':>4} {'wall ms':>8} {'issue ms':>9} {'gpu ms':>8} "
          f"{'cpu ms':>7} {'ctx':>6} {'thr':>4} {'aff':>4} {'sm MHz':>7} {'W':>6}")
    for r in doc["rows"]:
        m, n = r["median"], r["nvml"]
        print(f"{a.label:10} {r['workers']:>2} {r['variant']:10} {r['rank']:>4} {m['wall_ms']:8.3f} {m['issue_ms']:9.3f} "
              f"{m['gpu_ms']:8.3f} {m['cpu_ms']:7.3f} {int(m['invol_ctx']):>6} {r['threads']:>4} {r['affinity']:>4} "
              f"{n.get('sm_mhz', '-'):>7} {n.get('power_w', 0):6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
