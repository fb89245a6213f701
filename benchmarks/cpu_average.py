"""The CPU's collectives: shmlearn's through shared memory (sync/shm.py, --shared-memory auto, the
default) against the same step's on Gloo (--shared-memory off) and torch's DDP on Gloo (--strategy
ddp: what a user would write instead), in the same run; allreduce, and the parameter server (ps).
The async-ps cases time its messages (sync/shm_mailbox.py) against Gloo's, without DDP (it has no
asynchronous counterpart): --variants shared-memory,gloo.

    python benchmarks/cpu_average.py [--repeats 3] [--cases digits-mlp-w2,...] [--variants ...] [--out FILE.json]

Each case trains one config with each variant (`shmlearn train`, a fresh process each, interleaved
repeat by repeat so that a shared machine's drift hits all alike) and reads its summary.json:
samples/s over the training (the first step included: the run's own clock), the median step time,
and the mean seconds a step spends in each phase (`allreduce`: the average's; DDP's averages
inside its backward, so its phase is `compute`). Per variant: n, median and spread (min-max) of
each; the ratios of the medians against Gloo and DDP; each run's final loss (auto and off must
agree: a sum of two has one order). The load average is recorded with every run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FASHION = "/usr/share/datasets/fashion-mnist"

CASES = {
    # the README's first command's model, and the start.py trial (2 workers, batch 32)
    "digits-mlp-w2": ["--dataset", "digits", "--model", "mlp", "--workers", "2", "--batch-size", "32",
                      "--samples", "16384"],
    # four ranks on the 2-core machine (oversubscribed: the waits are the average's)
    "digits-mlp-w4": ["--dataset", "digits", "--model", "mlp", "--workers", "4", "--batch-size", "32",
                      "--samples", "16384", "--oversubscribe", "--threads", "1"],
    # the paper's parameter server (gather to rank 0, its update, broadcast), rank 0 also computing
    # (the ddp variant's --strategy comes last and wins: the same DDP reference)
    "digits-mlp-w2-ps": ["--dataset", "digits", "--model", "mlp", "--workers", "2", "--batch-size", "32",
                         "--samples", "16384", "--strategy", "ps"],
    "digits-mlp-w4-ps": ["--dataset", "digits", "--model", "mlp", "--workers", "4", "--batch-size", "32",
                         "--samples", "16384", "--oversubscribe", "--threads", "1", "--strategy", "ps"],
    # async-ps: a server and 2 or 3 workers, the default budget (docs/strategies.md, "How the ranks talk")
    **{f"digits-mlp-async-w{w}-s{st}": ["--dataset", "digits", "--model", "mlp", "--strategy", "async-ps",
                                        "--workers", str(w), "--staleness", str(st)]
       for w in (2, 3) for st in (0, 2)},
    # what a user would run instead of async-ps: the synchronous dedicated server (S = 0's bits)
    **{f"digits-mlp-psd-w{w}": ["--dataset", "digits", "--model", "mlp", "--strategy", "ps", "--ps-dedicated",
                                "--workers", str(w)] for w in (2, 3)},
    # convolutions on 28x28 images (61,706 parameters)
    "fashion-lenet-w2": ["--dataset", "fashion-mnist", "--data-dir", FASHION, "--model", "lenet", "--workers", "2",
                         "--batch-size", "64", "--samples", "16384"],
    # a larger gradient: alexnet-small (2.5 M parameters, 10 MB)
    "synthetic-alexnet-w2": ["--dataset", "synthetic", "--model", "alexnet-small", "--workers", "2",
                             "--batch-size", "32", "--samples", "1024"],
}
VARIANTS = {
    "shared-memory": ["--shared-memory", "auto"],
    "gloo": ["--shared-memory", "off"],
    "ddp": ["--strategy", "ddp"],
}


def one(case: List[str], variant: List[str], out: str) -> Dict[str, Any]:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "shmlearn", "train", *case, *variant, "--no-progress",
                        "--eval-points", "1", "--no-save-model", "--out", out],
                       capture_output=True, text=True, cwd=REPO, timeout=900)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"rc": r.returncode, "error": r.stderr.strip().splitlines()[-1:]}
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    return {"rc": 0, "wall_s": wall, "load": load, "samples_per_s": s["samples_per_s"],
            "train_s": s["wall_time_s"], "step_median_s": s["step_time_s"]["median"],
            "phase_s": s.get("phase_s"), "collectives": s.get("collectives"), "final_loss": s["final_loss"],
            "steps": s["steps"]}


def spread(xs: List[float]) -> Dict[str, float]:
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="cpu-average.json")
    a = ap.parse_args()
    variants = {v: VARIANTS[v] for v in a.variants.split(",") if v}
    sys.path.insert(0, REPO)
    import torch
    from shmlearn.bench.common import environment
    cases = [c for c in a.cases.split(",") if c and (FASHION not in CASES[c] or os.path.isdir(FASHION))]
    rows: Dict[str, Dict[str, List[Dict[str, Any]]]] = {c: {v: [] for v in variants} for c in cases}
    tmp = tempfile.mkdtemp(prefix="cpu-average-")
    try:
        for rep in range(a.repeats):
            for c in cases:
                for v, flags in variants.items():
                    row = one(CASES[c], flags, os.path.join(tmp, f"{c}-{v}-{rep}"))
                    rows[c][v].append(row)
                    print(f"{c} {v} #{rep}: " + (f"{row['samples_per_s']:.0f} samples/s, step "
                          f"{row['step_median_s'] * 1e3:.2f} ms, {row['collectives']}, load {row['load']:.1f}"
                          if row["rc"] == 0 else f"failed {row['error']}"), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {}
    for c in cases:
        per = {}
        for v in variants:
            ok = [r for r in rows[c][v] if r["rc"] == 0]
            if not ok:
                continue
            phases = {k: statistics.median(r["phase_s"][k] for r in ok if r["phase_s"] and k in r["phase_s"])
                      for k in (ok[0]["phase_s"] or {})}
            per[v] = {"samples_per_s": spread([r["samples_per_s"] for r in ok]),
                      "step_median_s": spread([r["step_median_s"] for r in ok]),
                      "phase_s_median": phases, "final_loss": [r["final_loss"] for r in ok]}
        base = per.get("shared-memory", {}).get("samples_per_s", {}).get("median")
        for other in ("gloo", "ddp"):
            if base and other in per:
                per[f"vs_{other}"] = base / per[other]["samples_per_s"]["median"]
        summary[c] = per
        print(f"{c}: " + ", ".join(f"{v} {per[v]['samples_per_s']['median']:.0f}/s" for v in variants if v in per)
              + "".join(f", x{per[k]:.2f} vs {k[3:]}" for k in ("vs_gloo", "vs_ddp") if k in per), flush=True)
    result = {"benchmark": "cpu_average", "env": environment("gloo"), "python": platform.python_version(),
              "torch": torch.__version__, "repeats": a.repeats,
              "cases": {c: CASES[c] for c in cases}, "variants": variants, "summary": summary, "runs": rows}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
