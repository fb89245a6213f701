"""Issue 20, acceptance 2: `sweep --search tpe --trials 20` against the 3x3 grid, on Fashion-MNIST
with lenet, both through an Optuna study (sweep --storage), on this machine.

"As good" is the paper's rule (results.pick_winners): the least loss area (training loss x
training seconds) among runs whose minimum loss is <= 1.8. Loss areas are wall-clock, so the
script also re-trains the grid's winner and TPE's best config, interleaved, `--confirm` times
each, and gives their median areas; and it gives each run's loss integrated over samples (no
clock in it) and test accuracy beside the area.

    python benchmarks/study_tpe.py --samples 2048 --out results/study_tpe_cpu.json

writes JSON: device, torch version, date, the commands, both sweeps' trials in order, the grid's
winner, TPE's best, the trial at which TPE first matched the grid's winner, the re-measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def shmlearn(args, log):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "shmlearn", *args], capture_output=True, text=True, cwd=ROOT)
    with open(log, "a") as f:
        f.write(" ".join(args) + "\n" + r.stdout + r.stderr + "\n")
    if r.returncode != 0:
        sys.exit(f"study_tpe: shmlearn {' '.join(args)} exited {r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return time.monotonic() - t0, r.stdout


def sample_area(run_dir):
    """Loss integrated over training samples (loss x samples / 1000): the area without the clock."""
    pts = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            pts.append((m["samples"], m["loss"]))
    return sum((s1 - s0) * (l0 + l1) / 2 for (s0, l0), (s1, l1) in zip(pts, pts[1:])) / 1000


def trials_of(sweep_dir):
    with open(os.path.join(sweep_dir, "sweep.json")) as f:
        spec = json.load(f)
    rows = [json.loads(line) for line in open(os.path.join(sweep_dir, "results.jsonl"))]
    out = []
    for r in rows:
        s = r["summary"]
        out.append({"id": r["id"], "batch_size": r["config"]["batch_size"], "lr": r["config"]["lr"],
                    "status": r["status"], "loss_area": s.get("loss_area"), "min_loss": s.get("min_loss"),
                    "test_accuracy": s.get("test_accuracy"), "wall_time_s": s.get("wall_time_s"),
                    "sample_area": sample_area(os.path.join(sweep_dir, r["run_dir"]))})
    with open(os.path.join(sweep_dir, "winners.json")) as f:
        winner = json.load(f)["overall"]
    return spec, out, winner


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2048, help="training samples per trial")
    ap.add_argument("--data-dir", default=os.path.join(ROOT, "data", "fashion-mnist"))
    ap.add_argument("--batch-size", default="16,32,64")
    ap.add_argument("--lr", default="0.01,0.03,0.1")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="TPE's seed (--search-seed)")
    ap.add_argument("--confirm", type=int, default=2, help="re-trainings of each winner, interleaved")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "study_tpe_cpu.json"))
    a = ap.parse_args()
    import torch
    work = tempfile.mkdtemp(prefix="study_tpe-")
    log = os.path.join(work, "log.txt")
    common = ["--dataset", "fashion-mnist", "--data-dir", a.data_dir, "--model", "lenet", "--workers", "1",
              "--device", "cpu", "--samples", str(a.samples), "--eval-points", "1", "--no-report",
              "--batch-size", a.batch_size, "--lr", a.lr, "--storage", f"sqlite:///{work}/study.db"]
    grid_cmd = ["sweep", *common, "--study", "grid", "--out", f"{work}/grid"]
    tpe_cmd = ["sweep", *common, "--study", "tpe", "--search", "tpe", "--trials", str(a.trials),
               "--search-seed", str(a.seed), "--out", f"{work}/tpe"]
    t0 = time.monotonic()
    grid_s, _ = shmlearn(grid_cmd, log)
    tpe_s, _ = shmlearn(tpe_cmd, log)
    _, grid, gw = trials_of(f"{work}/grid")
    _, tpe, tw = trials_of(f"{work}/tpe")
    survivors = [t for t in tpe if t["status"] == "completed" and t["min_loss"] is not None and t["min_loss"] <= 1.8]
    matched = next((i + 1 for i, t in enumerate(tpe) if t in survivors and t["loss_area"] <= gw["loss_area"]), None)
    confirm = {"grid_winner": [], "tpe_best": []}
    if gw is None or tw is None:
        sys.exit(f"study_tpe: no winner (grid {gw}, tpe {tw}): no run reached min loss 1.8; raise --samples")
    for k in range(a.confirm):  # interleaved, so a change in the machine's load hits both alike
        for name, w in (("grid_winner", gw), ("tpe_best", tw)):
            d = f"{work}/confirm-{name}-{k}"
            shmlearn(["train", "--dataset", "fashion-mnist", "--data-dir", a.data_dir, "--model", "lenet",
                      "--workers", "1", "--threads", "1", "--device", "cpu", "--samples", str(a.samples),
                      "--eval-points", "1", "--batch-size", str(w["batch_size"]), "--lr", repr(w["lr"]),
                      "--no-progress", "--out", d], log)
            with open(os.path.join(d, "summary.json")) as f:
                s = json.load(f)
            confirm[name].append({"loss_area": s["loss_area"], "min_loss": s["min_loss"],
                                  "test_accuracy": s["test_accuracy"], "sample_area": sample_area(d)})
    med = {n: statistics.median(x["loss_area"] for x in v) if v else None for n, v in confirm.items()}
    result = {
        "what": "issue 20 acceptance 2: TPE (20 trials) vs the 3x3 grid, Fashion-MNIST lenet, 1 CPU worker",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch_version": torch.__version__, "python": platform.python_version(),
        "optuna_version": __import__("optuna").__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_average_at_end": os.getloadavg(),
        "commands": {"grid": "shmlearn " + " ".join(grid_cmd), "tpe": "shmlearn " + " ".join(tpe_cmd)},
        "samples_per_trial": a.samples, "wall_s": {"grid": grid_s, "tpe": tpe_s, "all": time.monotonic() - t0},
        "grid": {"trials": grid, "winner": gw},
        "tpe": {"trials": tpe, "best": tw,
                "first_trial_at_least_as_good_as_grid_winner": matched},
        "confirm": {"runs_each": a.confirm, "runs": confirm, "median_loss_area": med},
        "verdict": {
            "tpe_best_area_le_grid_winner_area": tw is not None and tw["loss_area"] <= gw["loss_area"],
            "tpe_matched_in_fewer_trials_than_grid": matched is not None and matched < len(grid),
            "confirmed_median_tpe_le_grid": (med["tpe_best"] is not None and med["grid_winner"] is not None
                                             and med["tpe_best"] <= med["grid_winner"]),
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("wall_s", "verdict")}, indent=2))
    print(f"grid winner b{gw['batch_size']} lr{gw['lr']:g} area {gw['loss_area']:.4g}; TPE best b{tw['batch_size']} "
          f"lr{tw['lr']:.4g} area {tw['loss_area']:.4g}; matched at TPE trial {matched}; log {log}; -> {a.out}")


if __name__ == "__main__":
    main()
