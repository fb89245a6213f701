"""Issue 53's acceptance 3: how long the CLI takes to answer `--help`, a subcommand's `--help` and a
misspelled flag, as a user runs it (a fresh `python -m shmlearn` process each time), and whether
it imported torch to answer.

    python benchmarks/cli_answer_times.py [--repeats 5] [--code DIR] [--out FILE.json]

Each command runs twice untimed first: the first run fills the kept tables (the train flags, the
strategies' names), as any first run after an install or an edit does, and may import torch to
read them; the second says whether an answer from the tables imports torch (`python -X
importtime`). Then --repeats timed runs, the commands interleaved repeat by repeat so that the
machine's load hits all alike. Recorded per command: the wall times, their median, min and max,
the exit code, torch imported (second run) and torch_first_run; the load average before and after. The acceptance: a median under 1 s.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = [["--help"], ["train", "--help"], ["train", "--worker", "1"], ["sweep", "--help"],
            ["simulate", "--help"], ["bench", "--help"], ["bench", "comm", "--help"],
            ["bench", "throughput", "--help"], ["report", "--help"], ["advise", "--help"]]


def _env(code: str, cache: str) -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=code, SHMLEARN_CACHE_DIR=cache, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONUNBUFFERED", None)
    return env


def once(args: List[str], env: Dict[str, str], importtime: bool = False) -> Dict[str, Any]:
    argv = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "shmlearn", *args]
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "exit": p.returncode}
    if importtime:
        # "import time: self | cumulative | <indent>torch": imported, at any depth
        out["torch"] = any(re.search(r"\|\s+torch$", line.rstrip()) for line in p.stderr.splitlines())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--code", default=REPO, help="the checkout whose shmlearn to time [this one]")
    ap.add_argument("--out", default=None, help="JSON file to write [print only]")
    a = ap.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="shmlearn-cli-times-")
    try:
        return _measure(a, _env(os.path.abspath(a.code), cache))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _measure(a: argparse.Namespace, env: Dict[str, str]) -> int:
    rows = {}
    for c in COMMANDS:  # untimed: the first run fills the tables (and may import torch to), the second says
        first = once(c, env, importtime=True)  # whether an answer from them imports torch
        rows[" ".join(c)] = {"command": "shmlearn " + " ".join(c), **once(c, env, importtime=True),
                             "torch_first_run": first["torch"], "walls_s": []}
    load_before = os.getloadavg()
    for _ in range(a.repeats):
        for c in COMMANDS:
            rows[" ".join(c)]["walls_s"].append(round(once(c, env)["wall_s"], 3))
    load_after = os.getloadavg()
    for r in rows.values():
        w = r.pop("walls_s")
        r.pop("wall_s")
        r.update(walls_s=w, median_s=round(statistics.median(w), 3), min_s=min(w), max_s=max(w),
                 under_1s=statistics.median(w) < 1.0)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=a.code, capture_output=True, text=True).stdout.strip()
    doc = {"code": head, "python": sys.version.split()[0], "cpu_count": os.cpu_count(), "repeats": a.repeats,
           "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commands": list(rows.values())}
    for r in doc["commands"]:
        print(f"{r['command']:<38} median {r['median_s']:.3f} s (min {r['min_s']:.3f}, max {r['max_s']:.3f}) "
              f"exit {r['exit']} torch {'imported' if r['torch'] else 'not imported'}")
    print(f"load average before {doc['loadavg_before']}, after {doc['loadavg_after']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
