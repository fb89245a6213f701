"""What --noise-scale costs per training step (issue 19, acceptance 3: <= 2% of step time), at the
default --noise-every (noise.default_every: 50 at 1 worker, 10 at 2+), amortized over its K-step
cycle, and per measured step.

    python benchmarks/noise_scale_overhead.py --device cpu --out results/noise-scale-overhead-cpu.json
    python benchmarks/noise_scale_overhead.py --device cuda --out results/noise-scale-overhead-h100.json

Method on a CPU (--device cpu): shmlearn/bench/noise_cost.py. One run per setting, its steps timed
one by one in blocks of K (--noise-every), the noise meter attached in one block of each adjacent
pair and detached in the other (which comes first alternates), on every rank alike; a block with
the meter is one K-step cycle as training runs it, its first step measuring. The overhead is the
median over block pairs of (time with) / (time without) - 1; per measured step, the same median
of the blocks' first steps (the cost of one measurement). The machine this was
measured on is shared (load average 5-7 on 2 cores): other load lasts many steps, so it lands on
both steps of a pair, while whole runs or even 0.5 s repeats one after another swung by far more
than the effect.

Method on GPUs (--device cuda): `shmlearn bench throughput` (shmlearn/bench/throughput.py), in one process group per worker
count, with each strategy three times: as `shmlearn train` runs it, with the noise meter attached
at the default --noise-every (variant `NAME:noise`, exactly what --noise-scale attaches: a
measuring CUDA graph replayed every K-th step, the plain one otherwise), and measuring every step
(`NAME:noise1`, --noise-every 1: the cost per measured step). Each variant is built and warmed up
(its CUDA graph captured, cuDNN autotuned), then timed round-robin: repeat 1 of every variant,
repeat 2 of every variant, ..., each repeat ~--seconds of steps, its time the slowest rank's. On
a CPU that other processes share this interleaving is what makes the two comparable; whole runs
one after another were not (a first version of this script timed alternating `train` runs: under
a load average of 5-7 on 2 cores, step times swung 20x between runs). The overhead is
median(step time with) / median(step time without) - 1 (a repeat spans many K-step cycles: the
amortized cost); per_measured_step is the same ratio for `NAME:noise1`. The JSON keeps the
medians and spreads.
A CUDA graph captures one step as it was, so the step-by-step alternation cannot run there.

What a measured step adds: at 2+ workers two squared norms of the gradient (|g_local|^2 on every
rank, |averaged g|^2 on rank 0) and one more float in the all-reduce or gather; at 1 worker the
batch is computed as two halves (two smaller forward/backward passes) plus one gradient-sized
copy, which is not free (docs/noise-scale.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from shmlearn.bench.common import parse_int_list  # noqa: E402
from shmlearn.bench.throughput import ThroughputConfig, run  # noqa: E402
from shmlearn.train.noise import default_every  # noqa: E402

SETTINGS = {  # device -> [(model, input C x H x W, batch per worker)]
    "cpu": [("mlp", [1, 8, 8], 32), ("alexnet-small", [3, 32, 32], 32)],
    "cuda": [("mlp", [1, 8, 8], 32), ("alexnet-small", [3, 32, 32], 128), ("resnet18", [3, 32, 32], 128)],
}
CPU_STEPS = {"mlp": 10000, "alexnet-small": 1600}
"""cpu: timed steps per setting unless --steps, in pairs of K-step blocks: mlp at 1 worker (K = 50)
100 pairs, at 2 (K = 10) 500; alexnet-small 16 and 80 (~6 min in all on 2 loaded cores)."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--workers", default=None, help="worker counts [cpu: 1,2; cuda: 1, and 2 with 2+ GPUs]")
    p.add_argument("--strategies", default="allreduce,ps")
    p.add_argument("--models", default=None, help="comma list of the device's models [all]")
    p.add_argument("--repeats", type=int, default=9, help="timed repeats per variant, >= 5 [9]")
    p.add_argument("--seconds", type=float, default=0.5, help="cuda: length of one repeat [0.5]")
    p.add_argument("--steps", type=int, default=None, help="cpu: timed steps per setting, in (with, without) "
                                                         "pairs of K-step blocks, >= 10 pairs "
                                                         "[mlp 10000, alexnet-small 1600]")
    p.add_argument("--noise-every", type=int, default=None,
                   help="cpu: the overhead at --noise-every K [the default: 50 at 1 worker, 10 at 2+]; "
                        "cuda: the default")
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args()
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("noise_scale_overhead: --device cuda: no CUDA device", file=sys.stderr)
        return 2
    default_w = "1,2" if a.device == "cpu" or torch.cuda.device_count() >= 2 else "1"
    workers = parse_int_list(a.workers or default_w, flag="--workers")
    strategies = a.strategies.split(",")
    settings = [s for s in SETTINGS[a.device] if not a.models or s[0] in a.models.split(",")]
    if a.device == "cpu":
        return _cpu(a, workers, strategies, settings)
    out = {"benchmark": "noise_scale_overhead", "method": __doc__.split("Method on GPUs")[1].split("\n\n")[0],
           "results": [], "throughput": []}
    for model, shape, batch in settings:
        c = ThroughputConfig(model=model, input_shape=shape, batch_sizes=[batch], workers=workers, device=a.device,
                             strategies=[v for s in strategies for v in (s, f"{s}:noise", f"{s}:noise1")],
                             baselines=[],
                             repeats=a.repeats, seconds=a.seconds)
        doc = run(c, log=lambda m: print(m, flush=True))
        out.setdefault("env", doc["env"])
        out["throughput"].append(doc)
        rows = {(r["workers"], r["variant"]): r for r in doc["results"] if "error" not in r}
        def step_s(r):
            return r["repeat_s"]["median"] / r["steps_per_repeat"]
        for (w, v), off in sorted(rows.items()):
            on, every = rows.get((w, f"{v}:noise")), rows.get((w, f"{v}:noise1"))
            if ":" in v or on is None:
                continue
            t_off, t_on = step_s(off), step_s(on)
            row = {"model": model, "input": shape, "batch": batch, "strategy": v, "workers": w,
                   "every": default_every(w), "mode": off.get("mode"), "step_s_off": t_off, "step_s_on": t_on,
                   "steps_per_s_off": off["steps_per_s"], "steps_per_s_on": on["steps_per_s"],
                   "repeats": a.repeats, "overhead": t_on / t_off - 1,
                   "step_s_every_step": step_s(every) if every else None,
                   "per_measured_step": step_s(every) / t_off - 1 if every else None}
            out["results"].append(row)
            per = f"{row['per_measured_step']:+.1%}" if every else "n/a"
            print(f"{model} b{batch} {v} W={w} ({row['mode']}): {t_off * 1e3:.3f} ms -> {t_on * 1e3:.3f} ms "
                  f"per step with --noise-scale at --noise-every {row['every']}: {row['overhead']:+.1%} "
                  f"(per measured step {per}; median of {a.repeats} repeats; "
                  f"steps/s spread off {off['steps_per_s']['min']:.0f}-{off['steps_per_s']['max']:.0f}, "
                  f"on {on['steps_per_s']['min']:.0f}-{on['steps_per_s']['max']:.0f})", flush=True)
    out["env"]["loadavg_end"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0


def _cpu(a, workers, strategies, settings) -> int:
    from shmlearn.bench.common import environment
    from shmlearn.bench.noise_cost import measure
    out = {"benchmark": "noise_scale_overhead", "env": environment("gloo"),
           "method": __doc__.split("Method on a CPU")[1].split("\n\n")[0], "results": []}
    for model, shape, batch in settings:
        c = ThroughputConfig(model=model, input_shape=shape, device="cpu")
        for w in workers:
            for s in strategies:
                if w == 1 and s != "allreduce":
                    continue  # at one worker every strategy is the same half-batch step
                row = {"model": model, "input": shape,
                       **measure(c, s, w, batch, a.steps or CPU_STEPS[model], every=a.noise_every)}
                out["results"].append(row)
                off, k, u = row["step_s_off"], row["every"], row["per_unmeasured_step"]
                print(f"{model} b{batch} {s} W={w} ({row['mode']}): --noise-scale at --noise-every {k} costs "
                      f"{row['overhead']:+.2%} of a {off['median'] * 1e3:.3f} ms step (median over {row['cycles']} "
                      f"pairs of {k}-step blocks; per measured step {row['per_measured_step']:+.1%}, "
                      f"/ {k} = {row['per_measured_step_over_k']:+.2%}; per other step "
                      f"{'n/a' if u is None else f'{u:+.2%}'}; without: p25-p75 "
                      f"{off['p25'] * 1e3:.3f}-{off['p75'] * 1e3:.3f} ms)", flush=True)
    out["env"]["loadavg_end"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
