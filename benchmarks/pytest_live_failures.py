"""A pytest plugin for device runs that may be cut off by their time limit: each failing test's
report goes to $LIVE_FAILURES the moment it fails (pytest, and xdist's controller, print them only
at the end). Use: PYTHONPATH=benchmarks LIVE_FAILURES=f.txt python -m pytest -p pytest_live_failures"""
import os
import time


def pytest_runtest_logreport(report):
    if not report.failed or not os.environ.get("LIVE_FAILURES"):
        return
    with open(os.environ["LIVE_FAILURES"], "a") as f:
        f.write(f"==== {time.strftime('%H:%M:%S')} {report.nodeid} ({report.when}, {report.duration:.1f} s)\n")
        f.write(report.longreprtext[-6000:] + "\n")
        for name, text in report.sections:
            if "stderr" in name or "stdout" in name:
                f.write(f"---- {name}\n{text[-3000:]}\n")
