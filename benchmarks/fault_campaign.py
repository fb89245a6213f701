"""The fault campaign of issues 15, 38 and 53: every fault and bad input those issues list, as
real subprocesses of `python -m shmlearn` (CPU workers, digits, small budgets).

    python benchmarks/fault_campaign.py [--class NAME[,NAME...]] [--only NAME[,NAME$...]]
                                        [--repeat 3] [--limit 180] [--list] [--code DIR] [--json NAME]

--code DIR runs the cases against another checkout's shmlearn (a worktree of an older commit:
what a case did before its fix; benchmarks/issue53_acceptance.py does so for issue 53's cases).

The cases live in benchmarks/faults/, one module per class (its __init__ lists them). Each run
carries its own SHMLEARN_TEST_TAG, so every process it started (launcher, pool workers,
multiprocessing's resource tracker) is found through /proc/*/environ, as the tests find them.
For each run: the expected exit code against the actual one, whether stderr holds a traceback
(Python's, C++ frames, or one printed at exit), whether an exit 2 was one line, the wall time,
the time from the fault to the exit where there is a fault moment, the processes left 2 s after
the exit, whether anything already written was lost or torn, and whether anything changed in a
sentinel folder outside --out (a symlink in --out may point there).

A run is classified, first match wins: hang (no exit within --limit s, or the case's own bound:
it is then killed), orphan, outside, traceback, lost, wrong (exit code or message not the
promised one), else survived. The target: 0 hangs, 0 orphans, 0 outside, 0 tracebacks, 0 lost.

Writes results/fault_campaign/<date>.json (environment first) and README.md there
(a partial run, with --only or --class, writes <date>-partial.json only). It needs the machine
to itself for honest bounds.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.faults.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
