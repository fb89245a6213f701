"""simulate against real CPU runs whose collectives go through shared memory (the default on one
host since sync/shm.py): its prediction from the Gloo fits (what it used before) and from the
shared-memory fits (results/comm-shm-cpu.json, what it uses now), beside the measured step.

    python benchmarks/shm_validation.py --tries 3            # ~3 min on 2 cores
    python benchmarks/shm_validation.py --reuse results/shm-cpu-2026-11-29/validation.json  # refit only

Runs `shmlearn train --dataset digits --model mlp` at 1 worker (the compute source) and at 2 and 4
workers with allreduce and ps, each --tries times, under --shared-memory auto (the default) and
off (Gloo, for the Gloo fits' own check). A run's step = its summary.json step_time_s median (every
step timed); a configuration's = the median over its tries. Writes results/shm-validation-cpu.json:
the compute source (a throughput JSON that `simulate --compute` reads), the measured runs (a bundle
`simulate --measured` reads), the load average around every run, and simulate's validation rows
per network. The table: docs/scaling.md, "Shared memory on the CPU".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "results")
DIR = "shm-cpu-2026-11-29"
NETWORKS = {  # name: (comm, after-compute or None), under results/
    "gloo, after 17.9 ms": ("comm-gloo-cpu.json", "comm-gloo-cpu-after-compute.json"),  # simulate/advise before
    "gloo here, back to back": (f"{DIR}/comm-gloo-cpu-here.json", None),
    "gloo here, after 0.35 ms": (f"{DIR}/comm-gloo-cpu-here.json", f"{DIR}/comm-gloo-cpu-after-0.35ms.json"),
    "shm, after 17.9 ms": ("comm-shm-cpu.json", "comm-shm-cpu-after-compute.json"),  # their default now
    "shm, back to back": ("comm-shm-cpu.json", None),
    "shm, after 0.35 ms": ("comm-shm-cpu.json", f"{DIR}/comm-shm-cpu-after-0.35ms.json"),
}
"""17.9 ms: alexnet-small's compute phase, the committed after-compute files' (docs/scaling.md);
"here": Gloo measured on the machine and day of the runs (the committed comm-gloo-cpu*.json are
of another VM, an AMD EPYC, 2026-11-23);
0.35 ms: the digits MLP's one-worker compute phase (bench comm --compute-ms 0.35, sizes 64K-1M
around its 203 KB gradient)."""


def train(out: str, workers: int, strategy: str, shm: str) -> dict:
    cmd = [sys.executable, "-m", "shmlearn", "train", "--dataset", "digits", "--model", "mlp", "--workers",
           str(workers), "--strategy", strategy, "--shared-memory", shm, "--out", out, "--no-progress",
           "--no-save-model"]
    load = os.getloadavg()[0]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    s["loadavg_1m"] = [load, os.getloadavg()[0]]
    return s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RES, DIR, "validation.json"))
    ap.add_argument("--reuse", default=None, help="an earlier --out: its runs, predicted again (no training)")
    a = ap.parse_args()
    if a.reuse:
        with open(a.reuse) as f:
            doc = json.load(f)
        return predict(doc, a.out)
    runs_root = tempfile.mkdtemp(prefix="shm-validation-")
    configs = [(1, "allreduce", "auto")] + [(w, s, m) for m in ("auto", "off") for s in ("allreduce", "ps")
                                           for w in (2, 4)]
    measured, compute = [], None
    for t in range(a.tries):  # tries interleaved: a burst of load elsewhere spreads over configurations
        for w, s, m in configs:
            out = os.path.join(runs_root, f"{s}-w{w}-{m}-{t}")
            summ = train(out, w, s, m)
            measured.append({"name": f"{s} W={w} --shared-memory {m}", "try": t, "summary": summ})
            print(f"{s} W={w} {m} try {t}: step {summ['step_time_s']['median'] * 1e3:.3f} ms "
                  f"({summ.get('collectives')}), load {summ['loadavg_1m'][0]:.2f}", flush=True)
    bundle = []
    for w, s, m in configs:
        name = f"{s} W={w} --shared-memory {m}"
        tries = sorted((r["summary"] for r in measured if r["name"] == name), key=lambda x: x["step_time_s"]["median"])
        mid = tries[(len(tries) - 1) // 2]
        row = {k: mid[k] for k in ("workers", "batch_size", "steps", "wall_time_s", "strategy", "model", "dataset",
                                   "check_every", "strategy_params", "phase_s", "collectives", "device")}
        row.update(name=name, step_s=mid["step_time_s"]["median"], shared_memory=m,
                   tries_step_s=[x["step_time_s"]["median"] for x in tries],
                   loadavg_1m=[x["loadavg_1m"] for x in tries])
        if w == 1:
            compute = {"device": "cpu", "model": "mlp", "dataset": "digits", "batch_size": mid["batch_size"],
                       "step_s": row["step_s"], "phase_s": mid["phase_s"], "torch_version": mid["torch_version"],
                       "source": "shmlearn train --dataset digits --model mlp --workers 1: the median try's "
                                 "step_time_s median and phase_s"}
        else:
            bundle.append(row)
    doc = {"what": "simulate's CPU prediction against runs whose collectives go through shared memory",
           "command": "python benchmarks/shm_validation.py --tries %d" % a.tries,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_count": os.cpu_count(),
           "estimator": "a run's step = summary.json step_time_s median (every step); a configuration's = the "
                        "median over its tries", "compute": compute, "runs": bundle, "validation": {}}
    return predict(doc, a.out)


def predict(doc: dict, out: str) -> int:
    """simulate's prediction of doc's runs from each network of NETWORKS, into doc; written to out."""
    compute, bundle = doc["compute"], doc["runs"]
    doc["validation"], doc["networks"] = {}, {n: [c, x] for n, (c, x) in NETWORKS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        cpath, mpath = os.path.join(tmp, "compute.json"), os.path.join(tmp, "measured.json")
        with open(cpath, "w") as f:
            json.dump(compute, f)
        with open(mpath, "w") as f:
            json.dump({"runs": bundle}, f)
        sys.path.insert(0, ROOT)
        from shmlearn.analysis.simulate.main import simulate  # after the runs: torch not loaded while they ran
        for net, (comm, after) in NETWORKS.items():
            d = simulate(comm=os.path.join(RES, comm), comm_after_compute=after and os.path.join(RES, after),
                         compute=cpath, measured=[mpath], slots=2, strategies=["allreduce", "ps"], workers=[2, 4])
            doc["validation"][net] = [{k: v[k] for k in ("name", "strategy", "workers", "measured_step_s",
                                                         "predicted_step_s", "error")} for v in d["validation"]]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"| run | measured ms | " + " | ".join(NETWORKS) + " |")
    print("|---|---|" + "---|" * len(NETWORKS))
    for i, r in enumerate(bundle):
        cells = [doc["validation"][n][i] for n in NETWORKS]
        print(f"| {r['name']} | {r['step_s'] * 1e3:.2f} | " + " | ".join(
            f"{c['predicted_step_s'] * 1e3:.2f} ({c['error'] * 100:+.0f}%)" for c in cells) + " |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
