"""Issue 52: what a sweep's report costs to draw, this checkout against another, as the sweep's
report helper draws it: a fresh process that imports the report and warms up as report/helper.py
does (`_warm`, each checkout its own), then `write_report` on a copy of a sweep's folder.

    python benchmarks/report_cost.py [--sweep DIR] [--base CHECKOUT] [--rounds 3] [--repeats 7] [--out FILE.json]

Without --sweep it first runs the issue's 8-trial digits sweep (--no-report) into a temporary
folder. Each round runs one process per checkout, alternating, so that drift on a shared machine
hits both alike. In each process the report is written `repeats` times with its figures drawn in
that one process (draw._can_fork off: CPU seconds, not how two cores share them), then `repeats`
times with them drawn side by side as the helper draws them (`forked`: the wall counts). Recorded per call: CPU seconds
(process_time) and wall; the first call is the sweep's case (a fresh helper's first report); the
load average before and after each process.
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
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SWEEP = ["sweep", "--dataset", "digits", "--model", "mlp", "--samples", "8192", "--workers", "1,2",
         "--batch-size", "32,64", "--lr", "0.1,0.3", "--device", "cpu", "--no-report"]
CHILD = """import json, sys, time
from shmlearn.report import draw, helper
helper._warm()
from shmlearn.report import write_report
folder, n = sys.argv[1], int(sys.argv[2])
real = draw._can_fork
draw._can_fork = lambda: False
rows = []
for forked in [False] * n + [True] * n:
    draw._can_fork = real if forked else (lambda: False)
    c, w = time.process_time(), time.perf_counter()
    write_report([folder])
    rows.append({"forked": forked, "cpu_s": time.process_time() - c, "wall_s": time.perf_counter() - w})
print(json.dumps(rows))
"""


def load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def one(tree: str, folder: str, repeats: int) -> Dict[str, Any]:
    before = load()
    out = subprocess.run([sys.executable, "-c", CHILD, folder, str(repeats)], cwd=tree, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=tree), check=True).stdout
    return {"calls": json.loads(out.splitlines()[-1]), "load_before": before, "load_after": load()}


def summary(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    def stats(xs):
        return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    calls = [c for r in runs for c in r["calls"]]
    return {"one_process_cpu_s": stats([c["cpu_s"] for c in calls if not c["forked"]]),
            "first_call_cpu_s": stats([r["calls"][0]["cpu_s"] for r in runs]),
            "forked_wall_s": stats([c["wall_s"] for c in calls if c["forked"]]),
            "load": [min(r["load_before"] for r in runs), max(r["load_after"] for r in runs)]}


def versions(tree: str) -> Dict[str, str]:
    code = "import matplotlib, numpy, PIL, torch; print(matplotlib.__version__, numpy.__version__, PIL.__version__, torch.__version__)"
    mpl, np_, pil, torch = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tree,
                                          check=True).stdout.split()
    return {"matplotlib": mpl, "numpy": np_, "pillow": pil, "torch": torch, "python": platform.python_version()}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", help="a sweep's folder (copied, never written); default: run the 8-trial sweep")
    ap.add_argument("--base", help="another checkout to compare with (e.g. `git worktree add /tmp/base HEAD~3`)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7, help="reports a process writes in one process each")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="report-cost.json")
    a = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="shmlearn-report-cost-")
    try:
        src = a.sweep
        if src is None:
            src = os.path.join(scratch, "sweep")
            subprocess.run([sys.executable, "-m", "shmlearn", *SWEEP, "--out", src], cwd=REPO, check=True,
                           env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL)
        trees = {"this": REPO, **({"base": os.path.abspath(a.base)} if a.base else {})}
        runs: Dict[str, list] = {k: [] for k in trees}
        for rnd in range(a.rounds):
            for name, tree in trees.items():
                folder = os.path.join(scratch, f"{name}-{rnd}")
                shutil.copytree(src, folder, ignore=shutil.ignore_patterns("figures", "report.html"))
                runs[name].append(one(tree, folder, a.repeats))
                s = runs[name][-1]
                forked = statistics.median(c["wall_s"] for c in s["calls"] if c["forked"])
                print(f"{name:5s} round {rnd}: first {s['calls'][0]['cpu_s']:.3f} s cpu, forked wall "
                      f"{forked:.3f} s median (load {s['load_before']:.1f})", flush=True)
        doc = {"schema": 1, "cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "versions": versions(REPO),
               "sweep": " ".join(SWEEP) if a.sweep is None else a.sweep, "rounds": a.rounds, "repeats": a.repeats,
               "trees": trees, "note": a.note, "summary": {k: summary(v) for k, v in runs.items()}, "runs": runs}
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        for k, v in doc["summary"].items():
            print(k, json.dumps({m: (round(x["median"], 3) if isinstance(x, dict) else x) for m, x in v.items()}))
        print(f"wrote {a.out}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
