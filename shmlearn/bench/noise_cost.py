"""The cost of --noise-scale per step, measured by alternating it step by step in one run.

On a CPU that other processes share, whole runs (or even round-robin repeats of ~0.5 s) one
after another swing by far more than the few percent to be measured: a load average of 5-7 on 2
cores made one variant's repeats range from 27 to 1107 steps/s. Here one training step
(`Stepper.run`, shmlearn's fast step as `train` runs it on a CPU: eager, no host sync) is timed at
a time, and the noise meter is attached on even steps and detached on odd ones, on every rank
alike. A burst of other load lasts many steps, so it lands on both halves of a pair; the cost is
the median over pairs of (with - without) / without. The loop's reads of the losses (every
--check-every steps) are done outside the timed steps, so they fall on neither side.

Eager only: a CUDA graph captures one step as it was (benchmarks/noise_scale_overhead.py times
GPUs with whole variants round-robin instead; GPUs are not shared).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict

import torch

from shmlearn.bench.common import RANK_TIMEOUT_S, rank_device, stats
from shmlearn.bench.throughput import ThroughputConfig, _Shmlearn
from shmlearn.launch import run_local


def _worker(env, cfg: dict, strategy: str, batch: int, steps: int, warmup: int):
    import torch.distributed as dist
    c = ThroughputConfig(**cfg)
    device = rank_device(env, "gloo")
    torch.set_num_threads(c.threads or max(1, (os.cpu_count() or 1) // env.world_size))
    runner = _Shmlearn(c, device, batch, env.rank, env.world_size, strategy=strategy, eager=True, local=False,
                       noise=True)
    st, s = runner.stepper, runner.strategy
    meter = s.noise
    times = {True: [], False: []}
    for step in range(warmup + steps):
        on = step % 2 == 0
        s.noise = meter if on else None
        t0 = time.perf_counter()
        st.run(step)
        dt = time.perf_counter() - t0
        s.noise = meter
        if step >= warmup:
            times[on].append(dt)
        if st.due(step + 1):
            st.read(step + 1)
    st.flush(warmup + steps)
    # the step time of a synchronous step is the slowest rank's
    t = torch.tensor([times[True], times[False]], dtype=torch.float64)
    if env.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    runner.close()
    return {"mode": st.mode, "on": t[0].tolist(), "off": t[1].tolist()} if env.rank == 0 else None


def measure(c: ThroughputConfig, strategy: str, workers: int, batch: int, pairs: int, warmup: int = 40) -> Dict[str, Any]:
    from dataclasses import asdict
    r = run_local(_worker, (asdict(c), strategy, batch, 2 * pairs, warmup), workers, cuda=False,
                  timeout_s=RANK_TIMEOUT_S)[0]
    ratios = [a / b - 1 for a, b in zip(r["on"], r["off"])]
    return {"strategy": strategy, "workers": workers, "batch": batch, "mode": r["mode"], "pairs": pairs,
            "step_s_on": stats(r["on"]), "step_s_off": stats(r["off"]),
            "overhead": statistics.median(ratios),
            "overhead_of_medians": stats(r["on"])["median"] / stats(r["off"])["median"] - 1}
