"""Issue 52, "Measure first": what a run costs beyond its training, from the outside, as a user
runs it: time to the first line, to the first step, the process's wall time and where it went,
and what a sweep adds per trial; each against the floor measured in the same run.

    python benchmarks/start.py [--device cpu|cuda] [--repeats 3] [--temps cold,warm] [--out FILE.json]
    python benchmarks/start.py --combine A.json B.json ... --out ALL.json   # one summary of several runs

Cases, each a fresh process (`python -m shmlearn ...` or a script), run interleaved repeat by
repeat so that drift on a shared machine hits all alike:
  floor   `python -c "import torch"` (on CUDA also a CUDA context: torch.zeros(1, device="cuda"))
  train   the README's first command, `shmlearn train` (--no-progress; on CUDA: --device cuda --model
          alexnet-small, issue 52's GPU acceptance 2)
  trial   one `train` of a sweep trial's settings (2 workers, digits, mlp, 8,192 samples)
  sweep   the 8-trial digits sweep of benchmarks/sweep_overhead.py, report included
  api     the same trial as `shmlearn.train(TrainConfig(...))` from a script
cold: SHMLEARN_CACHE_DIR, TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR in a fresh temporary folder;
warm: the same case again with the folders the cold run filled.

Each row records the wall time, the CPU seconds of the process and the children it waited for,
the first and last line's time and the first step's (from
summary.json's train_start_unix: the launch's own clock, both unix seconds on one machine), and
the run's own phases (summary.json: setup, compile, train, eval; a sweep's timing.json: training,
evaluation, overhead per trial, and how each worker started: fork, forkserver or spawn). A run's
wall in consecutive phases: to_entry_s (to the rank's entry: interpreter, imports, checks, the
workers' start), setup_s, train_s, eval_s, end_s (files, the pool's close, exit); a sweep's in
phase_s (SWEEP_PHASES, from its timing.json marks), with each trial's start and end (trials_s).
cpu_s of a sweep counts its workers where they fork from it (a lean CPU sweep's), not where the
forkserver forked them. The JSON ends with issue 52's CPU acceptance figures:
train_overhead_s = train's wall - (its training + evaluation) - the floor (<= 2.5 s) and
sweep_ratio = sweep's wall / trial's wall (<= 1.3), from the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

TRAIN_OVERHEAD_LIMIT_S = 2.5  # issue 52, CPU acceptance 1: beyond training + evaluation + floor
SWEEP_RATIO_LIMIT = 1.3       # issue 52, CPU acceptance 1: 8-trial sweep / one train of a trial
TRIAL = ["--dataset", "digits", "--model", "mlp", "--workers", "2", "--samples", "8192", "--batch-size", "32",
         "--no-progress"]
SWEEP = ["sweep", "--dataset", "digits", "--model", "mlp", "--samples", "8192", "--workers", "1,2",
         "--batch-size", "32,64", "--lr", "0.1,0.3"]
API = """import sys, shmlearn
from shmlearn import TrainConfig
if __name__ == "__main__":
    shmlearn.train(TrainConfig(dataset="digits", model="mlp", workers=2, samples=8192, batch_size=32,
                               progress=False, device=sys.argv[2], out=sys.argv[1]))
    print("api: done", flush=True)
"""
CACHE_VARS = ("SHMLEARN_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def commands(device: str, out: str, api: str) -> Dict[str, List[str]]:
    """Each case's command line; api: the path of the API case's script (API)."""
    py = sys.executable
    floor = "import torch" + ("; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" if device == "cuda" else "")
    readme = ["train"] + (["--device", "cuda", "--model", "alexnet-small"] if device == "cuda" else [])
    dev = ["--device", device]
    return {"floor": [py, "-c", floor],
            "train": [py, "-m", "shmlearn", *readme, "--no-progress", "--out", out],
            "trial": [py, "-m", "shmlearn", "train", *TRIAL, *dev, "--out", out],
            "sweep": [py, "-m", "shmlearn", *SWEEP, *dev, "--out", out],
            "api": [py, api, out, device]}


def timed(cmd: List[str], env: Dict[str, str], timeout_s: float) -> Dict[str, Any]:
    """Run cmd; wall seconds, the first and last output line's (stdout or stderr, whichever
    comes first), exit code, and the output's tail."""
    lines: List[tuple] = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0_unix = time.time()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO, text=True)

    def read(stream, name):
        for line in stream:
            lines.append((time.perf_counter() - t0, name, line.rstrip("\n")))
    readers = [threading.Thread(target=read, args=(s, n), daemon=True) for s, n in ((p.stdout, "out"), (p.stderr, "err"))]
    for r in readers:
        r.start()
    try:
        rc = p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    wall = time.perf_counter() - t0
    for r in readers:
        r.join(5)
    lines.sort()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the process and of the descendants it waited for (not the forkserver's
    # forks, which the forkserver reaps): on a shared machine a steadier figure than the wall's.
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"rc": rc, "wall_s": wall, "cpu_s": cpu, "start_unix": t0_unix,
            "first_line_s": lines[0][0] if lines else None, "last_line_s": lines[-1][0] if lines else None,
            "tail": [f"{n}: {text}" for _, n, text in lines[-4:]]}


def _json(path: str) -> Optional[Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def phases(case: str, out: str, row: Dict[str, Any]) -> None:
    """The run's own record of where its time went, beside the outside view."""
    if case == "floor":
        return
    if case == "sweep":
        timing = _json(os.path.join(out, "timing.json")) or {}
        starts = []
        try:
            with open(os.path.join(out, "results.jsonl")) as f:
                for line in f:
                    s = (json.loads(line).get("summary") or {})
                    if s.get("train_start_unix"):
                        starts.append(s["train_start_unix"])
        except (OSError, ValueError):
            pass
        over = [o["s"] for o in timing.get("overhead_s", [])]
        row.update(sweep_phases(timing, row["start_unix"], row["wall_s"]))
        row.update({"first_step_s": min(starts) - row["start_unix"] if starts else None,
                    "sweep_wall_s": timing.get("wall_s"), "train_s": timing.get("training_s"),
                    "eval_s": timing.get("eval_s"), "efficiency": timing.get("efficiency"),
                    "trial_overhead_s": over,
                    # the first trial of each worker count starts its workers; the others reuse them
                    "warm_trial_overhead_s": sorted(over)[:max(len(over) - 2, 0)],
                    "startup": timing.get("startup")})
        return
    s = _json(os.path.join(out, "summary.json")) or {}
    row.update({"first_step_s": s["train_start_unix"] - row["start_unix"] if s.get("train_start_unix") else None,
                "setup_s": s.get("setup_time_s"), "compile_s": s.get("compile_s"), "train_s": s.get("wall_time_s"),
                "eval_s": (s.get("eval_time_s") or 0.0) + (s.get("checkpoint_time_s") or 0.0),
                "steps": s.get("steps"), "test_accuracy": s.get("test_accuracy")})
    if row["first_step_s"] is not None and row["setup_s"] is not None and row["train_s"] is not None:
        # The process's wall in consecutive phases: to the rank's entry (the interpreter, imports,
        # the config's checks, the workers' start), the rank's setup (data, model, strategy; its
        # compile included), training, evaluation, and the rest (the files, the pool's close, exit).
        to_entry = row["first_step_s"] - row["setup_s"]
        row["to_entry_s"] = to_entry
        row["end_s"] = row["wall_s"] - row["first_step_s"] - row["train_s"] - row["eval_s"]


SWEEP_PHASES = (("to_parsed", None, "parsed"), ("imports", "parsed", "imported"), ("checks", "imported", "checked"),
                ("to_pool", "checked", "pool_start"), ("workers_forked", "pool_start", "workers_forked"),
                ("workers_ready", "workers_forked", "workers_ready"), ("report_warm", "workers_ready", "report_warm"),
                ("trials", None, "trials_done"), ("winners", "trials_done", "winners"), ("report", "winners", "report"),
                ("exit", None, None))
"""A sweep's wall in consecutive phases, from its timing.json marks (unix seconds, trials.py
TrialRunner.mark): (name, from mark, to mark); None: the previous phase's end, or the process's
start and end. to_parsed: the interpreter, the CLI's imports and the forkserver's start; imports:
torch and the sweep's modules; checks: the grid expanded and validated; to_pool: the lock, results
and sweep.json; workers_forked / workers_ready: the pool's workers forked (waiting for the
forkserver's imports) and ready (their imports and the data); report_warm: matplotlib loaded;
trials: the first trial's start to the pool's close; winners: the verdict and its table; report:
the figures and report.html; exit: the last mark to the process's end."""


def sweep_phases(timing: Dict[str, Any], start_unix: float, wall_s: float) -> Dict[str, Any]:
    """marks_s (each mark in seconds from the process's start), phase_s (SWEEP_PHASES: consecutive,
    summing to the wall) and trials_s (each trial's start and end in seconds from the process's
    start, its training and evaluation seconds)."""
    marks = {k: v - start_unix for k, v in (timing.get("marks") or {}).items()}
    if not marks:
        return {}
    phase: Dict[str, float] = {}
    t = 0.0
    for name, _, to in SWEEP_PHASES:
        end = wall_s if to is None and name == "exit" else marks.get(to)
        if end is None:
            continue
        phase[name] = end - t
        t = end
    trials = [{"id": o["id"], "workers": o.get("workers"), "start_s": o["start_unix"] - start_unix,
               "end_s": o["end_unix"] - start_unix} for o in timing.get("overhead_s", [])
              if o.get("start_unix") is not None and o.get("end_unix") is not None]
    return {"marks_s": marks, "phase_s": phase, "trials_s": trials, "parallel": timing.get("parallel")}


def run(device: str, repeats: int, temps: List[str], cases: List[str], timeout_s: float) -> List[Dict[str, Any]]:
    rows = []
    scratch = tempfile.mkdtemp(prefix="shmlearn-start-")
    api = os.path.join(scratch, "api_start.py")
    with open(api, "w") as f:
        f.write(API)
    try:
        for rep in range(repeats):
            caches = tempfile.mkdtemp(prefix="caches-", dir=scratch)
            env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=REPO,
                       **{v: os.path.join(caches, v.lower()) for v in CACHE_VARS})
            for temp in temps:  # cold first: the warm run finds what it left
                for case in cases:
                    out = os.path.join(scratch, f"{case}-{rep}-{temp}")
                    cmd = commands(device, out, api)[case]
                    row = {"case": case, "temp": temp, "repeat": rep, "loadavg": os.getloadavg()[0],
                           **timed(cmd, env, timeout_s)}
                    row["loadavg_end"] = os.getloadavg()[0]
                    phases(case, out, row)
                    rows.append(row)
                    print(f"{case:6s} {temp:4s} #{rep}: rc {row['rc']}, wall {row['wall_s']:.2f} s, first line "
                          f"{row['first_line_s'] or float('nan'):.2f} s, first step "
                          f"{row.get('first_step_s') or float('nan'):.2f} s, train {row.get('train_s') or 0:.2f} s "
                          f"(load {row['loadavg']:.1f})", flush=True)
                    if row.get("phase_s"):
                        print("        " + ", ".join(f"{k} {v:.2f}" for k, v in row["phase_s"].items()), flush=True)
                    if row["rc"] != 0:
                        print("\n".join(row["tail"]), file=sys.stderr)
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per case and temperature: n, median and spread of each figure; then the acceptance."""
    from shmlearn.bench.common import stats
    out: Dict[str, Any] = {}
    keys = ("wall_s", "cpu_s", "first_line_s", "last_line_s", "first_step_s", "to_entry_s", "setup_s", "compile_s",
            "train_s", "eval_s", "end_s")
    for r in rows:
        out.setdefault(f"{r['case']}/{r['temp']}", []).append(r)
    table = {}
    for name, rs in out.items():
        ok = [r for r in rs if r["rc"] == 0]
        table[name] = {"failed": len(rs) - len(ok)}
        for k in keys:
            v = [r[k] for r in ok if r.get(k) is not None]
            if v:
                table[name][k] = stats(v)
        warm = [o for r in ok for o in r.get("warm_trial_overhead_s", [])]
        if warm:
            table[name]["warm_trial_overhead_s"] = stats(warm)
        names = [p for p, _, _ in SWEEP_PHASES if any(p in (r.get("phase_s") or {}) for r in ok)]
        if names:
            table[name]["phase_s"] = {p: stats([r["phase_s"][p] for r in ok if p in (r.get("phase_s") or {})])
                                      for p in names}
    return table


def acceptance(table: Dict[str, Any], temp: str) -> Dict[str, Any]:
    def med(case, k):
        return table.get(f"{case}/{temp}", {}).get(k, {}).get("median")
    acc: Dict[str, Any] = {"temp": temp}
    floor, wall, train, ev = med("floor", "wall_s"), med("train", "wall_s"), med("train", "train_s"), med("train", "eval_s")
    if None not in (floor, wall, train, ev):
        over = wall - train - ev - floor
        acc.update({"train_overhead_s": over, "train_overhead_limit_s": TRAIN_OVERHEAD_LIMIT_S,
                    "train_overhead_ok": over <= TRAIN_OVERHEAD_LIMIT_S})
    sweep, trial = med("sweep", "wall_s"), med("trial", "wall_s")
    if None not in (sweep, trial):
        acc.update({"sweep_ratio": sweep / trial, "sweep_ratio_limit": SWEEP_RATIO_LIMIT,
                    "sweep_ratio_ok": sweep / trial <= SWEEP_RATIO_LIMIT})
    warm = table.get(f"sweep/{temp}", {}).get("warm_trial_overhead_s", {}).get("median")
    if warm is not None:
        acc["warm_trial_overhead_s"] = warm
    return acc


def combine(paths: List[str], out: str, note: str) -> int:
    """One summary of several runs' rows (each run's environment kept): interleaving short runs of
    two trees spreads a shared machine's drift over both."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    rows = [r for d in docs for r in d["rows"]]
    temps = sorted({r["temp"] for r in rows}, key=["cold", "warm"].index)
    table = summarize(rows)
    doc = {"benchmark": "start", "issue": 52, "note": note, "combined": paths,
           "env": [d["env"] for d in docs], "rev": sorted({d["rev"] for d in docs}),
           "config": docs[0]["config"], "summary": table, "acceptance": [acceptance(table, t) for t in temps],
           "rows": rows}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    for acc in doc["acceptance"]:
        print(json.dumps(acc))
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temps", default="cold,warm", help="cold, warm or both (cold,warm)")
    ap.add_argument("--cases", default="floor,train,trial,sweep,api")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    ap.add_argument("--note", default="", help="recorded in the JSON (what changed, the machine's state)")
    ap.add_argument("--out", default="start.json")
    ap.add_argument("--combine", nargs="+", metavar="FILE.json",
                    help="summarize the rows of these earlier outputs (runs interleaved with another tree's) "
                         "into --out, instead of running")
    a = ap.parse_args()
    if a.combine:
        return combine(a.combine, a.out, a.note)
    temps = [t for t in a.temps.split(",") if t]
    cases = [c for c in a.cases.split(",") if c]
    if set(temps) - {"cold", "warm"} or set(cases) - {"floor", "train", "trial", "sweep", "api"} or a.repeats < 1:
        ap.error("--temps: cold,warm; --cases: floor,train,trial,sweep,api; --repeats >= 1")
    import torch

    from shmlearn.bench.common import environment
    device = a.device if a.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    env = environment("nccl" if device == "cuda" else "gloo")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    t0 = time.time()
    rows = run(device, a.repeats, temps, cases, a.timeout)
    table = summarize(rows)
    doc = {"benchmark": "start", "issue": 52, "env": env, "rev": rev, "note": a.note,
           "config": {"device": device, "repeats": a.repeats, "temps": temps, "cases": cases,
                      "commands": {c: " ".join(commands(device, "OUT", "api_start.py")[c][1:]) for c in cases}},
           "seconds": time.time() - t0, "summary": table,
           "acceptance": [acceptance(table, t) for t in temps], "rows": rows}
    doc["env"]["loadavg_end"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for acc in doc["acceptance"]:
        print(json.dumps(acc))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
