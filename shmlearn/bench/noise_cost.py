"""The cost of --noise-scale, measured by alternating it block by block in one run: over a cycle
of --noise-every K steps (default noise.default_every(W)), and per measured step.

On a CPU that other processes share, whole runs (or even round-robin repeats of ~0.5 s) one after
another swing by far more than the few percent to be measured: a load average of 5-7 on 2 cores
made one variant's repeats differ 40-fold (docs/performance.md, "Behind the code"). Here the steps
of one run (`Stepper.run`, shmlearn's fast step as `train` runs it on a CPU: eager, no host sync)
are timed one by one in blocks of K, the noise meter attached in one block of each adjacent pair
and detached in the other, on every rank alike; which block comes first alternates (in an A/A test
even and odd steps differed by well under 1%; docs/performance.md, "Behind the code"). A block
starts at a step that is a multiple of K, so with the meter it is one K-step cycle as training
runs it: its first step measures, the others run nothing of the meter. A burst of other load lasts
many steps, so it lands on both blocks of a pair. Medians over the pairs: `overhead` of (sum with)
/ (sum without) - 1, the cost at K; `per_measured_step` of the first steps' ratio (the cost of one
measurement, as at --noise-every 1); `per_unmeasured_step` of the other steps' (~0: within the
noise); `per_measured_step_over_k` the cost at K if those cost nothing. The loop's reads of the
losses (every 10 steps, as --check-every 10) are done outside the timed steps.

Eager only: a CUDA graph captures one step as it was (benchmarks/noise_scale_overhead.py times
GPUs with whole variants round-robin instead; GPUs are not shared).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, Optional

import torch

from shmlearn.bench.common import RANK_TIMEOUT_S, rank_device, stats
from shmlearn.bench.throughput_runners import _Shmlearn
from shmlearn.bench.throughput_variants import ThroughputConfig
from shmlearn.launch.pool import run_local
from shmlearn.train.noise import default_every


def _worker(env, cfg: dict, strategy: str, batch: int, cycles: int, warmup: int, every: int):
    import torch.distributed as dist
    c = ThroughputConfig(**cfg)
    device = rank_device(env, "gloo")
    torch.set_num_threads(c.threads or max(1, (os.cpu_count() or 1) // env.world_size))
    runner = _Shmlearn(c, device, batch, env.rank, env.world_size, strategy=strategy, eager=True, local=False,
                       noise=True)
    st, s = runner.stepper, runner.strategy
    meter = s.noise
    meter.every = every
    blocks = {True: [], False: []}  # per timed cycle: the block's K step times
    for cycle in range(warmup + cycles):
        for half in (0, 1):
            attached = half == cycle % 2  # the block with the meter first in even cycles, second in odd
            s.noise = meter if attached else None
            times = []
            for j in range(every):
                step = (2 * cycle + half) * every + j  # a block starts at a multiple of K: it measures there
                t0 = time.perf_counter()
                st.run(step)
                times.append(time.perf_counter() - t0)
                if (step + 1) % 10 == 0:  # read the losses as --check-every 10 does, between timed steps
                    st.read(step + 1)
            if cycle >= warmup:
                blocks[attached].append(times)
    s.noise = meter
    st.flush(2 * (warmup + cycles) * every)
    # the step time of a synchronous step is the slowest rank's
    t = torch.tensor([blocks[True], blocks[False]], dtype=torch.float64)
    if env.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    runner.close()
    return {"mode": st.mode, "with": t[0].tolist(), "without": t[1].tolist()} if env.rank == 0 else None


def measure(c: ThroughputConfig, strategy: str, workers: int, batch: int, steps: int, warmup: int = 1,
            every: Optional[int] = None) -> Dict[str, Any]:
    """steps: timed steps, in whole cycles of 2 K (at least 10 cycles); warmup: untimed cycles
    before them (at least 40 steps); every: --noise-every K (None: the default at this W)."""
    from dataclasses import asdict
    k = every or default_every(workers)
    cycles = max(10, steps // (2 * k))
    warmup = max(warmup, -(-40 // (2 * k)))
    r = run_local(_worker, (asdict(c), strategy, batch, cycles, warmup, k), workers, cuda=False,
                  timeout_s=RANK_TIMEOUT_S)[0]
    on, off = r["with"], r["without"]
    rest = [(sum(a[1:]), sum(b[1:])) for a, b in zip(on, off)] if k > 1 else []
    return {"strategy": strategy, "workers": workers, "batch": batch, "mode": r["mode"], "every": k,
            "cycles": cycles, "steps": 2 * cycles * k,
            "step_s_off": stats([t for b in off for t in b]), "step_s_measured": stats([a[0] for a in on]),
            "overhead": statistics.median(sum(a) / sum(b) - 1 for a, b in zip(on, off)),
            "per_measured_step": statistics.median(a[0] / b[0] - 1 for a, b in zip(on, off)),
            "per_unmeasured_step": statistics.median(a / b - 1 for a, b in rest) if rest else None,
            # what the cycle costs if the other steps cost nothing, as they run nothing of the meter
            # (tests/train/test_noise.py): less noisy than `overhead` where the step time swings
            "per_measured_step_over_k": statistics.median(a[0] / b[0] - 1 for a, b in zip(on, off)) / k}
