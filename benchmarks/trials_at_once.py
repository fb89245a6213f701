"""Do two 1-thread trials at once on a 2-core CPU change each trial's step times? (issue 52: the
CPU sweep's cost; `sweep --parallel`, grid.trials_at_once's CPU default.)

    python benchmarks/trials_at_once.py [--repeats 5] [--cases digits-mlp,fashion-lenet] [--out FILE.json]

A trial's loss area is integrated over its wall-clock training seconds (the paper's rule), so two
trials may share the machine only where neither's step times move. Each case is a sweep of four
1-worker trials (one intra-op thread each, pinned to its core), run with --parallel 1 (one trial
at a time, the other core idle) and --parallel 2 (two at once, one per core), alternating which
goes first repeat by repeat so that a shared machine's drift hits both alike. Per trial it reads
metrics.jsonl (training seconds every 10 steps) and takes the p10 and the median of the seconds
per step over those intervals; it sets each trial's figures at --parallel 2 against the same
trial's at --parallel 1 in the same repeat (ratio > 1: slower at once), and against the spread of
--parallel 1 between repeats (the noise floor: the same trial, alone, twice). The load average
is recorded with every sweep.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

CASES = {
    # the start.py sweep's 1-worker half: a model that fits in a core's cache
    "digits-mlp": ["--dataset", "digits", "--model", "mlp", "--samples", "8192", "--batch-size", "32,64",
                   "--lr", "0.1,0.3"],
    # convolutions on 28x28 images: more memory traffic per step
    "fashion-lenet": ["--dataset", "fashion-mnist", "--model", "lenet", "--samples", "2048", "--batch-size", "32,64",
                      "--lr", "0.05,0.1"],
}


def step_times(run_dir: str) -> List[float]:
    """Seconds per step over each logged interval of the run's training clock (metrics.jsonl)."""
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            rows.append((r["step"], r["time_s"]))
    return [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(rows, rows[1:]) if s1 > s0]


def one_sweep(case: str, parallel: int, out: str) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "shmlearn", "sweep", *CASES[case], "--workers", "1", "--threads", "1",
           "--device", "cpu", "--parallel", str(parallel), "--no-report", "--out", out]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONPATH=REPO))
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{case} --parallel {parallel}: exit {p.returncode}\n{p.stderr[-2000:]}")
    from shmlearn.bench.common import stats
    trials = {}
    with open(os.path.join(out, "results.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            st = step_times(os.path.join(out, row["run_dir"]))
            s = stats(st)
            trials[row["id"]] = {"p10_step_s": sorted(st)[len(st) // 10], "median_step_s": s["median"],
                                 "intervals": len(st), "train_s": row["summary"]["wall_time_s"],
                                 "loss_area": row["summary"]["loss_area"]}
    with open(os.path.join(out, "timing.json")) as f:
        timing = json.load(f)
    return {"case": case, "parallel": parallel, "wall_s": wall, "sweep_wall_s": timing["wall_s"],
            "loadavg": load, "loadavg_end": os.getloadavg()[0], "trials": trials}


def compare(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per case: the ratios parallel 2 / parallel 1 of each trial's p10 and median step time in
    the same repeat, and the noise floor: the same ratio between two repeats at parallel 1."""
    from shmlearn.bench.common import stats
    out: Dict[str, Any] = {}
    for case in sorted({r["case"] for r in rows}):
        one = [r for r in rows if r["case"] == case and r["parallel"] == 1]
        two = {r["repeat"]: r for r in rows if r["case"] == case and r["parallel"] == 2}
        res: Dict[str, Any] = {}
        for key in ("p10_step_s", "median_step_s", "train_s"):
            at_once = [two[a["repeat"]]["trials"][t][key] / a["trials"][t][key]
                       for a in one if a["repeat"] in two for t in a["trials"]]
            noise = [b["trials"][t][key] / a["trials"][t][key] for a, b in zip(one, one[1:]) for t in a["trials"]]
            res[key] = {"at_once_over_alone": stats(at_once) if at_once else None,
                        "alone_repeat_over_repeat": stats(noise) if noise else None}
        res["sweep_wall_s"] = {p: stats([r["sweep_wall_s"] for r in rows if r["case"] == case and r["parallel"] == p])
                               for p in (1, 2)}
        res["loadavg"] = stats([r["loadavg"] for r in rows if r["case"] == case])
        out[case] = res
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="trials_at_once.json")
    a = ap.parse_args()
    cases = [c for c in a.cases.split(",") if c]
    if set(cases) - set(CASES) or a.repeats < 2:
        ap.error(f"--cases: of {','.join(CASES)}; --repeats >= 2 (the noise floor compares repeats)")
    from shmlearn.bench.common import environment
    scratch = tempfile.mkdtemp(prefix="shmlearn-at-once-")
    rows = []
    t0 = time.time()
    try:
        for rep in range(a.repeats):
            for case in cases:
                for parallel in ((1, 2) if rep % 2 == 0 else (2, 1)):
                    out = os.path.join(scratch, f"{case}-{rep}-{parallel}")
                    row = dict(one_sweep(case, parallel, out), repeat=rep)
                    rows.append(row)
                    med = sorted(t["median_step_s"] for t in row["trials"].values())
                    print(f"{case:13s} #{rep} --parallel {parallel}: sweep {row['sweep_wall_s']:.2f} s, median step "
                          f"{[round(m * 1e3, 3) for m in med]} ms (load {row['loadavg']:.1f})", flush=True)
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    doc = {"benchmark": "trials_at_once", "issue": 52, "note": a.note, "env": environment("gloo"),
           "rev": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip(),
           "config": {"repeats": a.repeats, "cases": {c: CASES[c] for c in cases}}, "seconds": time.time() - t0,
           "summary": compare(rows), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for case, res in doc["summary"].items():
        for key in ("p10_step_s", "median_step_s"):
            x, n = res[key]["at_once_over_alone"], res[key]["alone_repeat_over_repeat"]
            print(f"{case} {key}: at once / alone median {x['median']:.3f} [{x['min']:.3f}, {x['max']:.3f}]; "
                  f"alone / alone median {n['median']:.3f} [{n['min']:.3f}, {n['max']:.3f}]")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
