"""What --noise-scale costs per training step (issue 19, acceptance 3: <= 2% of step time).

    python benchmarks/noise_scale_overhead.py --device cpu --out benchmarks/results/noise-scale-overhead-cpu.json
    python benchmarks/noise_scale_overhead.py --device cuda --out benchmarks/results/noise-scale-overhead-h100.json

For each setting (model, dataset, batch, strategy, workers) it trains the same run with and
without --noise-scale, alternating on and off run by run (drift on a shared machine hits both
alike), after one warm-up pair that is not kept (data cache, pool start-up, CUDA graph capture,
cuDNN autotuning). Step time = the run's wall_time_s / steps: training only (train.py starts the
clock after setup and excludes evaluation), the fast step where the strategy has one. The overhead
is median(on) / median(off) - 1, and the median of the paired ratios run by run.

What the measurement adds: at 2+ workers two dot products over the gradient (|g_local|^2 on every
rank, |averaged g|^2 on rank 0) and one more float in the all-reduce or gather; at 1 worker the
batch is computed as two halves (two smaller forward/backward passes) plus one gradient-sized
copy, which is not free on a GPU (docs/noise-scale.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from shmlearn import train  # noqa: E402
from shmlearn.bench.common import environment, parse_int_list, stats  # noqa: E402
from shmlearn.config import TrainConfig  # noqa: E402

SETTINGS = {  # device -> [(model, dataset, batch per worker, steps)]
    "cpu": [("mlp", "digits", 32, 400), ("alexnet-small", "synthetic", 32, 60)],
    "cuda": [("mlp", "digits", 32, 2000), ("alexnet-small", "synthetic", 128, 1000),
             ("resnet18", "synthetic", 128, 300)],
}


def one_run(model, dataset, batch, steps, strategy, workers, device, on, out) -> float:
    cfg = TrainConfig(model=model, dataset=dataset, batch_size=batch, samples=steps * workers * batch,
                      workers=workers, strategy=strategy, device=device, optimizer="momentum", lr=0.01,
                      noise_scale=on, eval_points=1, progress=False, out=out)
    s = train(cfg).summary
    if on and not s.get("gradient_noise_scale"):
        raise RuntimeError(f"{model} {strategy} W={workers}: no gradient_noise_scale in summary.json")
    return s["wall_time_s"] / s["steps"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--workers", default=None, help="worker counts [cpu: 1,2; cuda: 1 and 2 if 2 GPUs]")
    p.add_argument("--strategies", default="allreduce,ps")
    p.add_argument("--models", default=None, help="comma list of models from the device's settings [all]")
    p.add_argument("--runs", type=int, default=7, help="kept runs per setting, each on and off [7]")
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args()
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("noise_scale_overhead: --device cuda: no CUDA device", file=sys.stderr)
        return 2
    default_w = "1,2" if a.device == "cpu" or torch.cuda.device_count() >= 2 else "1"
    workers = parse_int_list(a.workers or default_w, flag="--workers")
    settings = [s for s in SETTINGS[a.device] if not a.models or s[0] in a.models.split(",")]
    doc = {"benchmark": "noise_scale_overhead", "env": environment("nccl" if a.device == "cuda" else "gloo"),
           "method": "alternating on/off runs after one warm-up pair; step = wall_time_s / steps (training only)",
           "runs": a.runs, "results": []}
    tmp = tempfile.mkdtemp(prefix="noise-bench-")
    k = 0
    for model, dataset, batch, steps in settings:
        for strategy in a.strategies.split(","):
            for w in workers:
                if w == 1 and strategy != "allreduce":
                    continue  # at one worker every strategy is the same half-batch step
                times = {True: [], False: []}
                for i in range(a.runs + 1):
                    for on in ((True, False) if i % 2 else (False, True)):
                        k += 1
                        t = one_run(model, dataset, batch, steps, strategy, w, a.device, on, os.path.join(tmp, f"r{k}"))
                        if i > 0:  # the first pair warms up
                            times[on].append(t)
                on_s, off_s = stats(times[True]), stats(times[False])
                ratios = [x / y for x, y in zip(times[True], times[False])]
                row = {"model": model, "dataset": dataset, "batch": batch, "steps": steps, "strategy": strategy,
                       "workers": w, "step_s_on": on_s, "step_s_off": off_s,
                       "step_s_on_runs": times[True], "step_s_off_runs": times[False],
                       "overhead": on_s["median"] / off_s["median"] - 1,
                       "overhead_paired_median": statistics.median(ratios) - 1}
                doc["results"].append(row)
                print(f"{model} b{batch} {strategy} W={w}: off {off_s['median'] * 1e3:.3f} ms, on "
                      f"{on_s['median'] * 1e3:.3f} ms per step: {row['overhead']:+.1%} "
                      f"(paired {row['overhead_paired_median']:+.1%}, n={a.runs})", flush=True)
    doc["env"]["loadavg_end"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
