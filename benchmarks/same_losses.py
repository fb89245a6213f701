"""Issue 54 acceptance 5: the same per-step losses on the CPU for each strategy before and after a
restructuring. Each registered strategy trains the MLP on digits at 1 and 2 workers, with the
classic step (--check-every 1) and the fast one (--check-every 3), 24 steps at one worker, logging
every step; the two commits' runs are compared value for value: every metrics.jsonl loss, the
summary.json keys in their order, and every summary field but the clock's.

    PYTHONPATH=. python benchmarks/same_losses.py --before 3fc80b8 --after HEAD

Each commit's shmlearn/ is exported (git archive) into a temporary folder and run there in a
process of its own, so the two never share a module. Exits 1 if any run differs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CLOCK = {"wall_time_s", "eval_time_s", "setup_time_s", "checkpoint_time_s", "samples_per_s", "phase_s",
         "loss_area", "step_time_s", "train_start_unix", "loss_area_steps"}
"""Summary fields that follow the clock (seconds), so differ between any two runs."""

RUNS = r'''
import json, os, sys, tempfile
import shmlearn
from shmlearn.config.train_config import TrainConfig
from shmlearn.sync import registry
out = {}
for strategy in registry.names():
    for workers in (1, 2):
        for check_every in (1, 3):
            run = os.path.join(tempfile.mkdtemp(), "run")
            r = shmlearn.train(TrainConfig(model="mlp", dataset="digits", workers=workers, strategy=strategy,
                                           device="cpu", samples=64 * 2 * 12, batch_size=64, eval_points=2,
                                           progress=False, check_every=check_every, log_every=1, out=run))
            with open(os.path.join(run, "metrics.jsonl")) as f:
                losses = [json.loads(line)["loss"] for line in f]
            out[f"{strategy}-w{workers}-k{check_every}"] = {"losses": losses, "keys": list(r.summary),
                                                            "summary": r.summary}
json.dump({"from": shmlearn.__file__, "runs": out}, open(sys.argv[1], "w"))
'''


def run(commit: str, tmp: str) -> dict:
    """Every run's losses and summary on `commit`'s shmlearn/."""
    tree = os.path.join(tmp, commit)
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "shmlearn"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    out = os.path.join(tmp, f"{commit}.json")
    subprocess.run([sys.executable, "-c", RUNS, out], check=True, cwd=tree, env={**os.environ, "PYTHONPATH": tree})
    with open(out) as f:
        got = json.load(f)
    if not got["from"].startswith(tree + os.sep):  # the commit's own code ran, not another copy's
        raise SystemExit(f"{commit}: shmlearn was imported from {got['from']}, not {tree}")
    return got["runs"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a, b = run(args.before, tmp), run(args.after, tmp)
    differ = 0
    for name in a:
        was, now = a[name], b[name]
        fields = [k for k in was["summary"] if k not in CLOCK and was["summary"][k] != now["summary"].get(k)]
        losses, keys = was["losses"] == now["losses"], was["keys"] == now["keys"]
        differ += not (losses and keys and not fields)
        print(f"{name:22s} {len(was['losses']):3d} steps  losses {'same' if losses else 'DIFFER'}  "
              f"keys {'same' if keys else 'DIFFER'}  fields differing: {fields}")
    print(f"{args.before} -> {args.after}: " + (f"{differ} runs differ" if differ else f"all {len(a)} runs the same"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
