"""The two ports of issue 51 against their DDP references, 2 CPU workers, the same budget: wall time
end to end, time to first step, final test loss / perplexity (acceptance 1).

    PYTHONPATH=. python benchmarks/ports.py [--repeats 3] [--ports vae,lm] [--out DIR]
        [--vae-epochs 1] [--lm-epochs 2] [--lm-lr 5]

Rows, each a command as a user types it, run from an empty folder:
  ddp  torchrun --standalone --nproc-per-node 2 examples/ddp/{vae,language_model}_ddp.py
  api  python examples/{vae,language_model}.py   (shmlearn.train(..., compute_loss=...), 2 workers)
  cli  shmlearn train --model/--dataset/--compute-loss examples/PORT.py:NAME --workers 2 ...
Same model, data, seed, budget (epochs), batch per worker, optimizer, lr, clipping. VAE: Adam 1e-3,
batch 128 a worker. LM: upstream's TransformerModel (its defaults), AdamW (the original's
--use-optimizer) at --lm-lr (0.001: upstream README's Transformer command with it), clip 0.25,
batch 20 windows of 35 tokens a worker (tests/test_ports.py uses the same: at SGD's lr 5 one
epoch's perplexity moved 11% between two seeds of the DDP script).

Measures, per run:
  wall_s   from starting the command to its exit (the ports also run the original's test pass after
           training, the DDP scripts theirs).
  ttfs_s   time to first step: from starting the command to the end of the first optimizer step on
           rank 0. DDP: the script prints `first step ended at unix T` (time.time() right after
           optimizer.step()). shmlearn: summary.json has no absolute time, so from the moment
           rank 0's progress bar first shows a finished step n (bar_s, bar_step: tqdm redraws at
           most every 0.5 s, after a step's update), less the training clock's time at step n
           (metrics.jsonl, interpolated between its rows), plus the first step's seconds.
  where the time goes (shmlearn): summary.json's setup_time_s (worker entry to the first step's
           start: data collated onto the device, model, strategy), first_step_s (the first step's
           phases, from trace.json), and the rest of ttfs before the worker's entry (start_s: the
           command's imports and script, spawning the workers, their imports and the script again,
           torch._dynamo's import, the process group).
  test     VAE: the test loss (mean of the original's loss a sample; api: the original's test() on
           the trained model, cli: summary.json test_loss). LM: perplexity, exp(test loss), of the
           original's evaluate() (ddp, api) and over the port's test windows (summary.json
           test_loss: api, cli; the DDP script prints it too).
The rows alternate (ddp, api, cli; then api, cli, ddp; ...) so a drift in the machine's load bends
all three. Writes DIR/ports.json (default results/ports-cpu-<date>/): the machine,
torch, the date, the commit, each run, medians and spread, and the ratios to DDP's medians.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from shmlearn.bench.common import environment, stats  # noqa: E402

EX = os.path.join(ROOT, "examples")
RUNNERS = ("ddp", "api", "cli")
LIMIT = 1.1
"""Acceptance: shmlearn's wall time and time to first step at most 1.1x DDP's."""
BAR = re.compile(r"train:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")
"""A tqdm line of shmlearn's progress bar: 'train:  3%|▎  | 7/234 [...'."""


def commands(port: str, runner: str, a) -> list:
    py = sys.executable
    if port == "vae":
        budget = ["--epochs", str(a.vae_epochs)]
        if runner == "ddp":
            return [os.path.join(os.path.dirname(py), "torchrun"), "--standalone", "--nproc-per-node", "2",
                    os.path.join(EX, "ddp", "vae_ddp.py"), *budget]
        if runner == "api":
            return [py, os.path.join(EX, "vae.py"), *budget]
        ref = os.path.join(EX, "vae.py")
        return [py, "-m", "shmlearn", "train", "--model", f"{ref}:VAE", "--dataset", f"{ref}:dataset",
                "--compute-loss", f"{ref}:compute_loss", "--workers", "2", "--batch-size", "128", "--seed", "1",
                "--optimizer", "Adam", "--optimizer-args", "lr=0.001", "--eval-at-start", "off", *budget]
    budget = ["--epochs", str(a.lm_epochs)]
    if runner == "ddp":
        return [os.path.join(os.path.dirname(py), "torchrun"), "--standalone", "--nproc-per-node", "2",
                os.path.join(EX, "ddp", "language_model_ddp.py"), "--use-optimizer", "--lr", str(a.lm_lr), *budget]
    if runner == "api":
        return [py, os.path.join(EX, "language_model.py"), "--use-optimizer", "--lr", str(a.lm_lr), "--save", "model.pt",
                *budget]
    ref = os.path.join(EX, "language_model.py")
    return [py, "-m", "shmlearn", "train", "--model", f"{ref}:model", "--dataset", f"{ref}:dataset",
            "--compute-loss", f"{ref}:compute_loss", "--workers", "2", "--batch-size", "20", "--seed", "1111",
            "--optimizer", "AdamW", "--optimizer-args", f"lr={a.lm_lr}", "--clip-grad-norm", "0.25",
            "--eval-at-start", "off", *budget]


def timed(argv: list, cwd: str, timeout_s: float) -> dict:
    """Run argv; its output as (seconds since the start, text) pieces, split at \\n and \\r (tqdm
    rewrites its line with \\r), stamped as they arrive."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    pieces = []
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def read():
        buf = b""
        while True:
            chunk = proc.stdout.read1(65536)
            if not chunk:
                break
            now = time.time() - t0
            buf += chunk
            parts = re.split(rb"[\r\n]", buf)
            buf = parts.pop()
            pieces.extend((now, p.decode(errors="replace")) for p in parts if p.strip())
        if buf.strip():
            pieces.append((time.time() - t0, buf.decode(errors="replace")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    wall = time.time() - t0
    reader.join(30)
    return {"rc": rc, "wall_s": wall, "t0_unix": t0, "pieces": pieces}


def _last_float(pieces, pattern: str):
    found = [float(m.group(1)) for _, p in pieces for m in [re.search(pattern, p)] if m]
    return found[-1] if found else None


def _clock_at(rows, n: int):
    """Training-clock seconds at the end of step n, interpolated between metrics.jsonl's rows
    (every 10th step; step 0 at 0 s)."""
    points = [(0, 0.0)] + [(r["step"], r["time_s"]) for r in rows if "time_s" in r]
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s0 <= n <= s1:
            return t0 + (t1 - t0) * (n - s0) / max(s1 - s0, 1)
    return None


def _summary(cwd: str):
    """summary.json, the first step's seconds (trace.json) and metrics.jsonl's rows of a run."""
    paths = glob.glob(os.path.join(cwd, "runs", "*", "summary.json"))
    if len(paths) != 1:
        return None, None, []
    with open(paths[0]) as f:
        summary = json.load(f)
    with open(os.path.join(os.path.dirname(paths[0]), "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    trace_path = os.path.join(os.path.dirname(paths[0]), "trace.json")
    first_step_s = None
    if os.path.exists(trace_path):
        with open(trace_path) as f:
            events = [e for e in json.load(f).get("traceEvents", []) if e.get("pid") == 0 and "ts" in e]
        step0 = [e for e in events if e.get("args", {}).get("step") == 0]
        if step0:  # trace times are microseconds from the earliest event of any rank
            first_step_s = (max(e["ts"] + e["dur"] for e in step0) - min(e["ts"] for e in step0)) / 1e6
    return summary, first_step_s, rows


def measure(port: str, runner: str, out: dict) -> dict:
    """One run's numbers from its output and, for shmlearn, its run directory."""
    pieces, cwd = out["pieces"], out["cwd"]
    row = {"rc": out["rc"], "wall_s": round(out["wall_s"], 3)}
    if runner == "ddp":
        first = _last_float(pieces, r"first step ended at unix ([0-9.]+)")
        row["ttfs_s"] = round(first - out["t0_unix"], 3) if first is not None else None
        row["train_s"] = _last_float(pieces, r"training: \d+ steps of .* in ([0-9.]+) s")
    else:
        bar = [(t, int(m.group(1))) for t, p in pieces for m in [BAR.search(p)] if m and int(m.group(1)) >= 1]
        row["bar_s"], row["bar_step"] = (round(bar[0][0], 3), bar[0][1]) if bar else (None, None)
        summary, first_step_s, rows = _summary(cwd)
        row["ttfs_s"] = None
        if summary is not None:
            row.update(setup_s=summary.get("setup_time_s"), train_s=summary.get("wall_time_s"),
                       eval_s=summary.get("eval_time_s"), first_step_s=first_step_s,
                       step_mode=summary.get("step_mode"), status=summary.get("status"),
                       summary_test_loss=summary.get("test_loss"))
            at_bar = _clock_at(rows, row["bar_step"]) if row["bar_step"] else None
            if at_bar is not None and first_step_s is not None:
                # The bar showed step n at the training clock's time_s(n): the clock started at
                # bar_s - time_s(n), and the first step ended first_step_s later.
                row["ttfs_s"] = round(row["bar_s"] - at_bar + first_step_s, 3)
            if row["ttfs_s"] is not None and row["setup_s"] is not None:
                row["start_s"] = round(row["ttfs_s"] - row["setup_s"] - first_step_s, 3)
    if port == "vae":
        original = _last_float(pieces, r"====> Test set loss: ([0-9.]+)")
        row["test_loss"] = original if runner != "cli" else row.get("summary_test_loss")
    else:
        original = _last_float(pieces, r"test ppl\s+([0-9.]+)")
        row["test_ppl"] = original if runner != "cli" else None
        windows = row.get("summary_test_loss") if runner != "ddp" else _last_float(pieces, r"windows test loss ([0-9.]+)")
        row["windows_test_ppl"] = math.exp(windows) if windows is not None else None
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ports", default="vae,lm", help="comma-separated: vae, lm")
    p.add_argument("--vae-epochs", type=int, default=1)
    p.add_argument("--lm-epochs", type=int, default=2)
    p.add_argument("--lm-lr", type=float, default=0.001, help="the LM's AdamW lr (upstream README's --use-optimizer)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    p.add_argument("--out", default=None, help="folder for ports.json (default results/ports-cpu-DATE)")
    p.add_argument("--keep-logs", action="store_true", help="write each run's output next to ports.json")
    a = p.parse_args(argv)
    ports = [x for x in a.ports.split(",") if x]
    if not ports or any(x not in ("vae", "lm") for x in ports):
        p.error(f"--ports {a.ports}: choose from vae, lm")
    date = datetime.date.today().isoformat()
    out_dir = a.out or os.path.join(ROOT, "results", f"ports-cpu-{date}")
    os.makedirs(out_dir, exist_ok=True)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"what": "issue 51 ports vs DDP, 2 CPU workers", "date": date, "commit": commit,
              "environment": environment("gloo"), "nproc": os.cpu_count(), "repeats": a.repeats,
              "budget": {"vae_epochs": a.vae_epochs, "lm_epochs": a.lm_epochs, "lm_lr": a.lm_lr},
              "limit": LIMIT, "commands": {}, "runs": {}, "medians": {}, "ratios": {}}
    for port in ports:
        report["commands"][port] = {r: commands(port, r, a) for r in RUNNERS}
        runs = {r: [] for r in RUNNERS}
        for rep in range(a.repeats):
            order = RUNNERS[rep % 3:] + RUNNERS[:rep % 3]
            for runner in order:
                cwd = tempfile.mkdtemp(prefix=f"ports-{port}-{runner}-")
                out = timed(commands(port, runner, a), cwd, a.timeout)
                out["cwd"] = cwd
                row = measure(port, runner, out)
                row["repeat"] = rep
                runs[runner].append(row)
                print(f"{port} {runner} #{rep}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "repeat"), flush=True)
                if a.keep_logs or out["rc"] != 0:
                    with open(os.path.join(out_dir, f"{port}-{runner}-{rep}.log"), "w") as f:
                        f.writelines(f"{t:9.3f} {text}\n" for t, text in out["pieces"])
                shutil.rmtree(cwd, ignore_errors=True)
        report["runs"][port] = runs
        med = {}
        for runner, rows in runs.items():
            keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k not in ("rc", "repeat")})
            med[runner] = {k: stats([r[k] for r in rows if r.get(k) is not None]) for k in keys
                           if any(r.get(k) is not None for r in rows)}
        report["medians"][port] = med
        ratios = {}
        for runner in ("api", "cli"):
            for k in ("wall_s", "ttfs_s"):
                mine, ddp = med[runner].get(k, {}).get("median"), med["ddp"].get(k, {}).get("median")
                if mine is not None and ddp:
                    ratios[f"{runner}_{k}"] = round(mine / ddp, 3)
        ratios["within_limit"] = all(v <= LIMIT for v in ratios.values() if isinstance(v, float))
        report["ratios"][port] = ratios
        print(f"{port}: ratios to DDP's medians {ratios}", flush=True)
    path = os.path.join(out_dir, "ports.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
