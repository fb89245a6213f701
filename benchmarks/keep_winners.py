"""Copy a sweep directory without the run directories of trials that did not win: results.jsonl,
winners.json, sweep.json, timing.json and the winners' run directories (no Chrome traces), then
rebuild figures/ and report.html from that copy, which proves the kept files suffice.

    python benchmarks/keep_winners.py SWEEP_DIR DEST

Every trial's numbers stay in results.jsonl (its summary and test-accuracy curve); only the
per-step curves of the losing trials go, which are most of a sweep's bytes.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

KEEP = ("results.jsonl", "winners.json", "sweep.json", "timing.json")


def keep_winners(src: str, dest: str) -> str:
    if os.path.exists(dest):
        raise SystemExit(f"{dest}: exists; give a new folder")
    os.makedirs(dest)
    for name in KEEP:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), dest)
    with open(os.path.join(src, "winners.json")) as f:
        w = json.load(f)
    entries = [i["winner"] for i in w["by_workers"].values()] + \
              [i["winner"] for i in (w.get("by_target") or {}).values()]
    for e in entries:
        if e and e.get("run_dir"):
            shutil.copytree(os.path.join(src, e["run_dir"]), os.path.join(dest, e["run_dir"]),
                            ignore=shutil.ignore_patterns("trace.json", "checkpoints"), dirs_exist_ok=True)
    from shmlearn.report import write_report
    return write_report([dest])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(keep_winners(sys.argv[1], sys.argv[2]))
