"""Issue 40 acceptance 5: `shmlearn train` and the 8-trial sweep no slower after a restructuring.
Two commits, checked out side by side (git worktrees in a temporary folder), run alternately in
one process so a drift in the machine's speed bends both; wall seconds from starting the command
to its exit, as a user waits for it.

    PYTHONPATH=. python benchmarks/refactor_speed.py --before 02bb6d1 --after HEAD --repeats 3 \
        --out results/refactor-speed-cpu.json

Rows:
  train   `shmlearn train` with its defaults (2 CPU workers, all-reduce, digits)
  sweep   `shmlearn sweep --workers 1,2 --batch-size 32,64 --lr 0.05,0.1` on digits (8 trials)
The JSON has the machine, torch, the date, both commits, every run's seconds, the medians and
after/before per row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

COMMANDS = {
    "train": ["train", "--no-progress"],
    "sweep": ["sweep", "--workers", "1,2", "--batch-size", "32,64", "--lr", "0.05,0.1", "--no-report"],
}


def _checkout(ref: str, into: str) -> str:
    sha = subprocess.run(["git", "rev-parse", ref], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    subprocess.run(["git", "worktree", "add", "--detach", "-q", into, sha], cwd=ROOT, check=True)
    return sha


def _timed(tree: str, args: list, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "shmlearn", *args, "--out", out], cwd=tree, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    last = (p.stdout.strip().splitlines() or [""])[-1][:200]
    return {"wall_s": round(wall, 2), "rc": p.returncode, "last": last if p.returncode == 0 else p.stderr[-300:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="git ref of the code before")
    ap.add_argument("--after", default="HEAD", help="git ref of the code after")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default="train,sweep")
    ap.add_argument("--out", default="refactor-speed.json")
    a = ap.parse_args(argv)
    from shmlearn.bench.common import environment
    work = tempfile.mkdtemp(prefix="refactor-speed-")
    trees = {}
    doc = {"benchmark": "refactor-speed", **environment("gloo"), "runs": []}
    try:
        for name, ref in (("before", a.before), ("after", a.after)):
            path = os.path.join(work, name)
            doc[f"{name}_commit"] = _checkout(ref, path)
            trees[name] = path
        for i in range(a.repeats):
            for row in a.rows.split(","):
                for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                    r = _timed(trees[name], COMMANDS[row], os.path.join(work, f"{row}-{name}-{i}"))
                    doc["runs"].append({"row": row, "code": name, **r})
                    print(doc["runs"][-1], flush=True)
    finally:
        for path in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", path], cwd=ROOT, check=False)
    med = {}
    for row in a.rows.split(","):
        for name in ("before", "after"):
            xs = [r["wall_s"] for r in doc["runs"] if r["row"] == row and r["code"] == name and r["rc"] == 0]
            med[f"{row}/{name}"] = {"median_s": statistics.median(xs) if xs else None, "n": len(xs),
                                    "min_s": min(xs) if xs else None, "max_s": max(xs) if xs else None}
        b, f = med[f"{row}/before"]["median_s"], med[f"{row}/after"]["median_s"]
        med[f"{row}/after_over_before"] = round(f / b, 3) if b and f else None
    doc["medians"] = med
    with open(a.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(json.dumps(med, indent=1))
    return 0 if all(r["rc"] == 0 for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
