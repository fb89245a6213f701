"""What --noise-scale costs per training step (issue 19, acceptance 3: <= 2% of step time).

    python benchmarks/noise_scale_overhead.py --device cpu --out benchmarks/results/noise-scale-overhead-cpu.json
    python benchmarks/noise_scale_overhead.py --device cuda --out benchmarks/results/noise-scale-overhead-h100.json

Method on a CPU (--device cpu): shmlearn/bench/noise_cost.py. One run per setting, its steps timed
one by one, the noise meter attached on even steps and detached on odd ones on every rank alike;
the overhead is the median over adjacent pairs of (with - without) / without. The machine this
was measured on is shared (load average 5-7 on 2 cores): other load lasts many steps, so it
lands on both steps of a pair, while whole runs or even 0.5 s repeats one after another swung by
far more than the effect.

Method on GPUs (--device cuda): `shmlearn bench throughput` (shmlearn/bench/throughput.py), in one process group per worker
count, with each strategy twice: as `shmlearn train` runs it, and with the noise meter attached
(variant `NAME:noise`, exactly what --noise-scale attaches). Each variant is built and warmed up
(its CUDA graph captured, cuDNN autotuned), then timed round-robin: repeat 1 of every variant,
repeat 2 of every variant, ..., each repeat ~--seconds of steps, its time the slowest rank's. On
a CPU that other processes share this interleaving is what makes the two comparable; whole runs
one after another were not (a first version of this script timed alternating `train` runs: under
a load average of 5-7 on 2 cores, step times swung 20x between runs). The overhead is
median(step time with) / median(step time without) - 1; the JSON keeps both medians and spreads.
A CUDA graph captures one step as it was, so the step-by-step alternation cannot run there.

What the measurement adds: at 2+ workers two dot products over the gradient (|g_local|^2 on every
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

SETTINGS = {  # device -> [(model, input C x H x W, batch per worker)]
    "cpu": [("mlp", [1, 8, 8], 32), ("alexnet-small", [3, 32, 32], 32)],
    "cuda": [("mlp", [1, 8, 8], 32), ("alexnet-small", [3, 32, 32], 128), ("resnet18", [3, 32, 32], 128)],
}
CPU_PAIRS = {"mlp": 3000, "alexnet-small": 300}
"""cpu: (with, without) pairs per setting unless --pairs: a ~2 ms step varies more from step to step."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--workers", default=None, help="worker counts [cpu: 1,2; cuda: 1, and 2 with 2+ GPUs]")
    p.add_argument("--strategies", default="allreduce,ps")
    p.add_argument("--models", default=None, help="comma list of the device's models [all]")
    p.add_argument("--repeats", type=int, default=9, help="timed repeats per variant, >= 5 [9]")
    p.add_argument("--seconds", type=float, default=0.5, help="cuda: length of one repeat [0.5]")
    p.add_argument("--pairs", type=int, default=None, help="cpu: timed (with, without) step pairs per setting "
                                                         "[mlp 3000, alexnet-small 300]")
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
                             strategies=[v for s in strategies for v in (s, f"{s}:noise")], baselines=[],
                             repeats=a.repeats, seconds=a.seconds)
        doc = run(c, log=lambda m: print(m, flush=True))
        out.setdefault("env", doc["env"])
        out["throughput"].append(doc)
        rows = {(r["workers"], r["variant"]): r for r in doc["results"] if "error" not in r}
        for (w, v), off in sorted(rows.items()):
            on = rows.get((w, f"{v}:noise"))
            if v.endswith(":noise") or on is None:
                continue
            t_off, t_on = off["repeat_s"]["median"] / off["steps_per_repeat"], on["repeat_s"]["median"] / on["steps_per_repeat"]
            row = {"model": model, "input": shape, "batch": batch, "strategy": v, "workers": w,
                   "mode": off.get("mode"), "step_s_off": t_off, "step_s_on": t_on,
                   "steps_per_s_off": off["steps_per_s"], "steps_per_s_on": on["steps_per_s"],
                   "repeats": a.repeats, "overhead": t_on / t_off - 1}
            out["results"].append(row)
            print(f"{model} b{batch} {v} W={w} ({row['mode']}): {t_off * 1e3:.3f} ms -> {t_on * 1e3:.3f} ms "
                  f"per step with --noise-scale: {row['overhead']:+.1%} (median of {a.repeats} repeats; "
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
                pairs = a.pairs or CPU_PAIRS[model]
                row = {"model": model, "input": shape, **measure(c, s, w, batch, pairs)}
                out["results"].append(row)
                on, off = row["step_s_on"], row["step_s_off"]
                print(f"{model} b{batch} {s} W={w} ({row['mode']}): {off['median'] * 1e3:.3f} ms -> "
                      f"{on['median'] * 1e3:.3f} ms per step with --noise-scale: {row['overhead']:+.1%} "
                      f"(median over {pairs} adjacent pairs; ratio of medians {row['overhead_of_medians']:+.1%}; "
                      f"without: p25-p75 {off['p25'] * 1e3:.3f}-{off['p75'] * 1e3:.3f} ms)", flush=True)
    out["env"]["loadavg_end"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
