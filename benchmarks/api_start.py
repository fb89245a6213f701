"""What a small `shmlearn.train()` call from Python costs with its CPU workers spawned (the API's
default) and forked from a forkserver that imported torch once (what the `shmlearn` program and
the test suite do: shmlearn/launch/forkserver.py).

    python benchmarks/api_start.py --repeats 5 --out api-start.json

Each mode runs in a fresh interpreter of its own: `--repeats` calls of `shmlearn.train()` (2 CPU
workers, digits, mlp, 640 samples), each timed from the call to its return; the forked mode first
waits for the forkserver's own imports (done long before in a test session or a notebook). Writes
JSON with the machine, torch version, date, and per mode n, median and spread.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def one_mode(forked: bool, repeats: int, out_dir: str) -> list:
    """In this interpreter: repeats timed train() calls; forked: from a started forkserver."""
    from shmlearn.launch import forkserver
    if forked:
        forkserver.start()
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    if forked:
        time.sleep(5)  # the forkserver's imports of torch and torch._dynamo end first
    times = []
    for i in range(repeats + 1):  # the first call warms this process's own imports; not kept
        t0 = time.perf_counter()
        shmlearn.train(TrainConfig(workers=2, samples=640, batch_size=32, eval_points=1, progress=False,
                                   out=os.path.join(out_dir, f"{'forked' if forked else 'spawned'}-{i}")))
        if i:
            times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="api-start.json")
    ap.add_argument("--runs", default="/tmp/api-start-runs", help="where the train() calls write")
    ap.add_argument("--mode", choices=("spawned", "forked"), help=argparse.SUPPRESS)  # a child's
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(one_mode(a.mode == "forked", a.repeats, a.runs)))
        return 0
    import shutil

    import torch

    from shmlearn.bench.common import environment
    shutil.rmtree(a.runs, ignore_errors=True)
    doc = {"benchmark": "api-start", "env": environment("gloo"), "torch": torch.__version__,
           "config": {"workers": 2, "dataset": "digits", "model": "mlp", "samples": 640, "repeats": a.repeats},
           "results": {}}
    for mode in ("spawned", "forked"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode", mode, "--repeats", str(a.repeats),
                            "--runs", a.runs], capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT))
        if r.returncode != 0:
            print(r.stderr[-2000:], file=sys.stderr)
            return 1
        t = json.loads(r.stdout.strip().splitlines()[-1])
        doc["results"][mode] = {"n": len(t), "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                                "times_s": t}
        print(f"{mode:8s} train() median {statistics.median(t):.2f} s ({min(t):.2f}-{max(t):.2f}), n={len(t)}")
    doc["env"]["loadavg_end"] = list(os.getloadavg())
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
