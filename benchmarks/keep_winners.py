"""Copy a sweep directory without its trial folders: results.jsonl, winners.json (with the
curves the report and advise draw, read from the trial folders: shmlearn.sweeps.results.add_curves),
sweep.json and timing.json, then rebuild figures/ and report.html from that copy, which proves
the kept files suffice.

    python benchmarks/keep_winners.py SWEEP_DIR DEST

Every trial's numbers stay in results.jsonl (its summary and test-accuracy curve); the winners'
loss and test curves, thinned, and every trial's noise-scale rows stay in winners.json; the
per-step files (metrics.jsonl, eval.jsonl, traces, logs), most of a sweep's bytes, go.
"""
from __future__ import annotations

import os
import shutil
import sys

from shmlearn.sweeps.results import keep_curves

KEEP = ("results.jsonl", "winners.json", "sweep.json", "timing.json")


def keep_winners(src: str, dest: str) -> str:
    if os.path.exists(dest):
        raise SystemExit(f"{dest}: exists; give a new folder")
    os.makedirs(dest)
    for name in KEEP:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), dest)
    keep_curves(dest, source=src)
    from shmlearn.report import write_report
    return write_report([dest])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(keep_winners(sys.argv[1], sys.argv[2]))
