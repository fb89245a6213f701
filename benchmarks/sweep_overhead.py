"""Issue #14's acceptance figures: what a sweep costs beyond its trials' training.

    python benchmarks/sweep_overhead.py [cpu] [--runs 3] [--baseline-rev 180af54] [--tag cpu]
    python benchmarks/sweep_overhead.py analyze DIR [DIR...] [--out FILE.json]

`cpu` times, as subprocesses (`python -m shmlearn ...`, wall clock around the process, so
imports and pool start-up count), interleaved run by run so drift on a shared machine hits all
alike: (a) one 2-worker `train`, what a user would run instead of a sweep; (b) an 8-trial sweep
whose trials together train 8x (a)'s samples on half the workers on average (acceptance:
median(b) / median(a) <= 1.5); (c) 6-trial sweeps at 2 and 4 workers, reading each one's
timing.json for the per-trial overhead after the first trial, the first pays for starting the
pool (acceptance: <= 0.3 s). --baseline-rev also runs (a), (b) and the README's `shmlearn train`
from a git worktree of that revision (before the pool: 180af54), in the same runs.

`analyze` summarizes sweep directories made elsewhere (a GPU sweep): run it on the machine that
ran them, since its JSON starts with this machine's environment().
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
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from shmlearn.bench.common import environment, stats  # noqa: E402

LIMIT_S = 0.3      # issue #14: overhead per trial after the first, seconds
LIMIT_RATIO = 1.5  # issue #14: 8-trial sweep wall / one train's wall
TRAIN_A = ["train", "--dataset", "digits", "--model", "mlp", "--workers", "2", "--samples", "8192",
           "--batch-size", "32", "--no-progress"]
SWEEP_B = ["sweep", "--dataset", "digits", "--model", "mlp", "--samples", "8192", "--workers", "1,2",
           "--batch-size", "32,64", "--lr", "0.1,0.3", "--no-report"]
SWEEP_B_REPORT = [x for x in SWEEP_B if x != "--no-report"]
"""The issue's command as written: the sweep also draws its figures and report.html."""
README_TRAIN = ["train", "--no-progress"]  # README's first command, digits defaults


def sweep_c(w: int) -> List[str]:
    return ["sweep", "--dataset", "digits", "--model", "mlp", "--workers", str(w), "--threads", "1",
            "--batch-size", "32", "--lr", "0.05,0.1,0.2,0.3,0.4,0.5", "--samples", "4096", "--slots", str(w),
            "--no-report"]


def run_timed(args: List[str], out: str, code: Optional[str]) -> float:
    """Wall seconds of `python -m shmlearn ARGS --out OUT`. code: a worktree to import shmlearn
    from (cwd and PYTHONPATH, since `-m` puts the cwd first on sys.path), None for this repo."""
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = code
    cmd = [sys.executable, "-m", "shmlearn", *args, "--out", out]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=code or REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{(p.stdout + p.stderr)[-3000:]}")
    return wall


def overheads(timing: Dict) -> List[float]:
    """Per-trial overhead after the first finished trial (the first includes starting the pool)."""
    return [o["s"] for o in timing["overhead_s"][1:]]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def cpu_mode(a) -> Dict:
    res = {"environment": environment("gloo"), "mode": "cpu", "runs": a.runs,
           "code": {"head": git("rev-parse", "HEAD"),
                    # other sessions may be editing the tree: the timed code is the working tree
                    "dirty": bool(git("status", "--porcelain", "shmlearn"))},
           "commands": {"train_a": TRAIN_A, "sweep_b": SWEEP_B,
                        "sweep_c": {w: sweep_c(w) for w in a.overhead_workers}},
           "estimator": "wall clock around each subprocess (imports and pool start included); "
                        "median and spread over --runs, the measurements interleaved run by run"}
    root = tempfile.mkdtemp(prefix="sweep-overhead-")
    old = None
    try:
        if a.baseline_rev:
            old = os.path.join(root, "baseline")
            git("worktree", "add", "--detach", old, a.baseline_rev)
            res["code"]["baseline"] = git("-C", old, "rev-parse", "HEAD")
            # an installed (editable) shmlearn must not shadow the worktree's: check what imports
            where = subprocess.run([sys.executable, "-c", "import shmlearn; print(shmlearn.__file__)"], cwd=old,
                                   env={**os.environ, "PYTHONPATH": old}, capture_output=True, text=True).stdout
            if not where.startswith(old):
                raise SystemExit(f"--baseline-rev: python -m shmlearn imports {where.strip()!r}, not {old}")
        # name -> (args, code, whether it writes timing.json); all in one loop per run
        jobs = {"train_a": (TRAIN_A, None, False), "sweep_b": (SWEEP_B, None, True),
                "sweep_b_report": (SWEEP_B_REPORT, None, True)}
        jobs.update({f"sweep_c_w{w}": (sweep_c(w), None, True) for w in a.overhead_workers})
        if old:
            jobs.update({"train_a_old": (TRAIN_A, old, False), "sweep_b_old": (SWEEP_B, old, False),
                         "sweep_b_report_old": (SWEEP_B_REPORT, old, False),
                         "readme_train": (README_TRAIN, None, False),
                         "readme_train_old": (README_TRAIN, old, False)})
        walls: Dict[str, List[float]] = {k: [] for k in jobs}
        timings: Dict[str, List[Dict]] = {k: [] for k, j in jobs.items() if j[2]}
        for i in range(a.runs):
            for name, (args, code, has_timing) in jobs.items():
                out = os.path.join(root, f"{name}-{i}")  # fresh: a sweep resumes an existing dir
                walls[name].append(run_timed(args, out, code))
                if has_timing:
                    with open(os.path.join(out, "timing.json")) as f:
                        timings[name].append(json.load(f))
                shutil.rmtree(out, ignore_errors=True)
                print(f"run {i + 1}/{a.runs} {name}: {walls[name][-1]:.2f} s", flush=True)
    finally:
        if old:
            subprocess.run(["git", "worktree", "remove", "--force", old], cwd=REPO)
        shutil.rmtree(root, ignore_errors=True)
    res["wall_s"] = {k: {**stats(v), "values": v} for k, v in walls.items()}
    med = {k: res["wall_s"][k]["median"] for k in walls}
    res["ratio"] = {"sweep_b_over_train_a": med["sweep_b"] / med["train_a"], "limit": LIMIT_RATIO}
    res["ratio"]["pass"] = res["ratio"]["sweep_b_over_train_a"] <= LIMIT_RATIO
    res["ratio"]["with_report_over_train_a"] = med["sweep_b_report"] / med["train_a"]
    if old:
        res["ratio"]["old_sweep_b_over_train_a"] = med["sweep_b_old"] / med["train_a_old"]
        res["ratio"]["old_with_report_over_train_a"] = med["sweep_b_report_old"] / med["train_a_old"]
        res["readme_train_new_over_old"] = med["readme_train"] / med["readme_train_old"]
    res["sweep_b_timing"] = timings["sweep_b"]
    res["overhead"] = {}
    for w in a.overhead_workers:
        t = timings[f"sweep_c_w{w}"]
        after = [s for x in t for s in overheads(x)]  # pooled over runs: n = runs * 5
        res["overhead"][w] = {"after_first_s": stats(after), "over_limit": sum(s > LIMIT_S for s in after),
                              "first_s": stats([x["overhead_s"][0]["s"] for x in t]),
                              "efficiency": stats([x["efficiency"] for x in t]),
                              "wall_s_in_sweep": stats([x["wall_s"] for x in t]),
                              "workers_started": [x["workers_started"] for x in t], "limit": LIMIT_S,
                              "pass": max(after) <= LIMIT_S, "timing": t}
    res["environment"]["loadavg_end"] = list(os.getloadavg())
    return res


def print_cpu(res: Dict) -> None:
    print(f"\n{res['environment']['device']}, torch {res['environment']['torch_version']}, "
          f"n={res['runs']}, load {res['environment']['loadavg_start'][0]:.1f} -> "
          f"{res['environment']['loadavg_end'][0]:.1f}")
    print(f"{'measurement':<20}{'median s':>10}{'min':>8}{'max':>8}")
    for k, s in res["wall_s"].items():
        print(f"{k:<20}{s['median']:>10.2f}{s['min']:>8.2f}{s['max']:>8.2f}")
    r = res["ratio"]
    print(f"sweep(b)/train(a) = {r['sweep_b_over_train_a']:.2f} (<= {LIMIT_RATIO}: "
          f"{'pass' if r['pass'] else 'FAIL'})"
          + (f"; before ({res['code'].get('baseline', '')[:7]}): {r['old_sweep_b_over_train_a']:.2f}"
             if "old_sweep_b_over_train_a" in r else ""))
    print(f"with figures and report.html: {r['with_report_over_train_a']:.2f}"
          + (f"; before: {r['old_with_report_over_train_a']:.2f}" if "old_with_report_over_train_a" in r else ""))
    if "readme_train_new_over_old" in res:
        print(f"README train new/old = {res['readme_train_new_over_old']:.2f}")
    print(f"{'workers':<9}{'overhead med':>13}{'max':>7}{'>0.3s':>7}{'first':>7}{'efficiency':>11}")
    for w, o in res["overhead"].items():
        s = o["after_first_s"]
        print(f"{w:<9}{s['median']:>13.3f}{s['max']:>7.3f}{o['over_limit']:>7}{o['first_s']['median']:>7.2f}"
              f"{o['efficiency']['median']:>11.2f}")


def analyze_dir(d: str) -> Dict:
    with open(os.path.join(d, "timing.json")) as f:
        t = json.load(f)
    with open(os.path.join(d, "sweep.json")) as f:
        spec = json.load(f)
    device = None
    with open(os.path.join(d, "results.jsonl")) as f:
        for line in f:
            if line.strip():
                device = json.loads(line)["summary"].get("device")
                break
    after = overheads(t)
    by_w: Dict[int, List[float]] = {}
    for o in t["overhead_s"][1:]:  # a pool grows with the largest trial: overhead by worker count
        by_w.setdefault(o["workers"], []).append(o["s"])
    return {"dir": os.path.abspath(d), "device": device, "sweep_device": spec.get("device"),
            "trials": len(spec.get("trials", [])), "trials_run": t["trials_run"], "wall_s": t["wall_s"],
            "training_s": t["training_s"], "eval_s": t["eval_s"], "efficiency": t["efficiency"],
            "parallel": t["parallel"], "prune": t["prune"], "pruned": t["pruned"],
            "workers_started": t.get("workers_started"),
            "first_overhead_s": t["overhead_s"][0]["s"] if t["overhead_s"] else None,
            "overhead_after_first_s": stats(after) if after else None,
            "over_limit": sum(s > LIMIT_S for s in after),
            "overhead_by_workers": {w: stats(v) for w, v in sorted(by_w.items())},
            "date": t.get("date")}


def analyze_mode(a) -> Dict:
    rows = [analyze_dir(d) for d in a.dirs]
    backend = "nccl" if any(r["sweep_device"] == "cuda" for r in rows) else "gloo"
    return {"environment": environment(backend), "mode": "analyze", "limit_s": LIMIT_S, "sweeps": rows}


def print_analyze(res: Dict) -> None:
    print(f"\n{res['environment']['device']}, torch {res['environment']['torch_version']}")
    print(f"{'dir':<28}{'trials':>7}{'wall s':>8}{'train s':>8}{'eff':>6}{'ovh med':>8}{'max':>7}"
          f"{'>0.3s':>6}{'pruned':>7}  device")
    for r in res["sweeps"]:
        o = r["overhead_after_first_s"] or {"median": float("nan"), "max": float("nan")}
        print(f"{os.path.basename(r['dir'])[:27]:<28}{r['trials_run']:>7}{r['wall_s']:>8.1f}"
              f"{r['training_s']:>8.1f}{r['efficiency']:>6.2f}{o['median']:>8.3f}{o['max']:>7.3f}"
              f"{r['over_limit']:>6}{r['pruned']:>7}  {r['device']}")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("cpu", "analyze", "-h", "--help"):
        argv.insert(0, "cpu")  # cpu is the default mode
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("cpu", help="time train vs sweep and per-trial overhead on this CPU (default)")
    c.add_argument("--runs", type=int, default=3, help="repetitions of every measurement")
    c.add_argument("--overhead-workers", default="2,4", help="worker counts of the overhead sweeps (c)")
    c.add_argument("--baseline-rev", help="also time (a), (b) and the README train at this revision (180af54)")
    an = sub.add_parser("analyze", help="summarize DIR/timing.json of sweeps run elsewhere")
    an.add_argument("dirs", nargs="+", metavar="DIR")
    for p in (c, an):
        p.add_argument("--tag", default=None, help="result name [cpu | analyze]")
        p.add_argument("--out", default=None, help="JSON path [results/sweep_overhead/<tag>.json]")
    a = ap.parse_args(argv)
    if a.mode == "cpu":
        a.overhead_workers = [int(w) for w in a.overhead_workers.split(",")]
        if a.runs < 1:
            ap.error("--runs: at least 1")
    res = cpu_mode(a) if a.mode == "cpu" else analyze_mode(a)
    out = a.out or os.path.join(REPO, "results", "sweep_overhead", f"{a.tag or a.mode}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    (print_cpu if a.mode == "cpu" else print_analyze)(res)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
