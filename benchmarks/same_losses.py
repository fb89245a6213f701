"""Identical training before and after a refactor: each strategy's per-step losses from two source
trees, on the CPU (issue 54, acceptance 5: the package move must not change what a run computes).

    python benchmarks/same_losses.py --before /path/to/old/checkout --after . \
        --out results/same-losses-cpu-2026-11-28.json

Each tree trains the same runs with the same seed, one process tree at a time: every registered
strategy at 2 workers on digits (mlp), once with the default fast step (losses read every 10
steps) and once with `--check-every 1 --log-every 1` (the classic step, a loss logged every step). async-ps runs at
`--staleness 0`, where the server answers in a fixed order; above 0 the order of arrivals, and so
the losses, vary between runs of one tree. Both trees run the same kernels on the same machine, so
the losses must be equal bit for bit; the script exits 1 on any difference and names the run and
the first step that differs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

RUNS = [  # (name, extra flags)
    ("allreduce", ["--strategy", "allreduce"]),
    ("ps", ["--strategy", "ps"]),
    ("ps-dedicated", ["--strategy", "ps", "--ps-dedicated"]),
    ("weight-avg", ["--strategy", "weight-avg", "--avg-period", "4"]),
    ("ddp", ["--strategy", "ddp"]),
    ("async-ps-s0", ["--strategy", "async-ps", "--staleness", "0"]),
]
MODES = [("fast", []), ("every-step", ["--check-every", "1", "--log-every", "1"])]


def train(tree: str, flags: list, out: str) -> list:
    """The (step, loss) rows of one run of `tree`'s shmlearn."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, "-m", "shmlearn", "train", "--workers", "2", "--samples", "12800", "--seed", "0",
           "--no-progress", "--no-save-model", "--out", out] + flags
    r = subprocess.run(cmd, env=env, cwd=os.path.abspath(tree), capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(cmd[3:])} exited {r.returncode}: {r.stderr.strip()[-400:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        s = json.load(f)
    return [[r["step"], r["loss"]] for r in rows] + [["final", s.get("final_loss")], ["test_accuracy", s.get("test_accuracy")]]


def rev(tree: str) -> str:
    r = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="checkout of the old tree")
    ap.add_argument("--after", default=".", help="checkout of the new tree")
    ap.add_argument("--out", help="JSON file to write")
    a = ap.parse_args()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "command": " ".join(sys.argv), "before": rev(a.before), "after": rev(a.after), "runs": []}
    try:
        import torch
        report["torch"] = torch.__version__
    except ImportError:
        pass
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in RUNS:
            for mode, extra in MODES:
                got = {}
                for side, tree in (("before", a.before), ("after", a.after)):
                    got[side] = train(tree, flags + extra, os.path.join(tmp, f"{side}-{name}-{mode}"))
                same = got["before"] == got["after"]
                first = next((b[0] for b, c in zip(got["before"], got["after"]) if b != c), None)
                report["runs"].append({"run": name, "mode": mode, "flags": flags + extra, "rows": len(got["after"]),
                                       "identical": same, "first_difference": first,
                                       "final_loss": got["after"][-2][1], "test_accuracy": got["after"][-1][1]})
                print(f"{name:14s} {mode:10s} {len(got['after']):4d} rows  "
                      + ("identical" if same else f"DIFFERENT from step {first}"), flush=True)
                bad += not same
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    print(f"{len(report['runs']) - bad} of {len(report['runs'])} runs identical before ({report['before']}) "
          f"and after ({report['after']})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
