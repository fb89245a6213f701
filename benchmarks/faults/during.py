"""Faults from outside a run (Cmd.during): signals at a time or at a phase the campaign sees in
the run's folder or in /proc."""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, List

from benchmarks.faults.core import Running, _stat, workers_of


def kill_launcher_after(delay_s: float, sig: int = signal.SIGKILL):
    def during(r: Running, el: float) -> None:
        if el >= delay_s and r.fault_t is None:
            r.proc.send_signal(sig)
            r.fault(f"{signal.Signals(sig).name} of the launcher {delay_s:g} s after start")
    return during


def once_training(out: str, action: Callable[[Running], None], rows_needed: int = 3, n_workers: int = 2):
    """Act once metrics.jsonl holds `rows_needed` rows and the `n_workers` pool workers are seen
    (the ranks train)."""
    path = os.path.join(out, "metrics.jsonl")

    def during(r: Running, el: float) -> None:
        if r.fault_t is not None or "done" in r.state:
            return
        try:
            with open(path, "rb") as f:
                n = f.read().count(b"\n")
        except OSError:
            return
        if n >= rows_needed and len(workers(r, n_workers)) >= n_workers:
            r.state["done"] = True
            action(r)
    return during


def workers(r: Running, n: int = 2) -> List[int]:
    """The run's pool workers, looked up until `n` are there, then remembered: a scan of /proc
    every poll would take CPU from the run it times."""
    if len(r.state.get("workers", [])) < n:
        r.state["workers"] = workers_of(r.proc.pid)
    return r.state.get("workers", [])


def signal_rank(rank: int, sig: int):
    def action(r: Running) -> None:
        pid = workers(r)[rank]
        os.kill(pid, sig)
        r.fault(f"{signal.Signals(sig).name} of rank {rank} (pid {pid}) once training")
    return action


def signal_group(sig: int):
    def action(r: Running) -> None:
        os.killpg(r.proc.pid, sig)
        r.fault(f"{signal.Signals(sig).name} of the process group once training")
    return action


def watch_stopped(r: Running, el: float) -> None:
    """SHMLEARN_FAULT=stop: the fault moment is when a worker enters state T."""
    if r.fault_t is None:
        for pid in workers(r):
            st = _stat(pid)
            if st and st[0] == "T":
                r.fault(f"rank's own SIGSTOP (pid {pid} seen in state T)")


def last_row_moment(out: str):
    """A hung rank: the fault moment is bounded below by metrics.jsonl's last write (rank 0 logs
    every 10 steps; the sleep starts within 10 fast steps of it), so fault-to-exit is an upper
    bound."""
    path = os.path.join(out, "metrics.jsonl")

    def during(r: Running, el: float) -> None:
        try:
            m = os.stat(path).st_mtime
        except OSError:
            return
        if r.state.get("mtime") != m:
            r.state["mtime"] = m
            # mtime is wall clock; the campaign's clock is monotonic
            r.fault_t = time.monotonic() - (time.time() - m)
            r.fault_how = "last metrics.jsonl row before the hang (upper bound on fault-to-exit)"
    return during


def when_exists(path: str, action: Callable[[Running], None]):
    def during(r: Running, el: float) -> None:
        if r.fault_t is None and os.path.exists(path):
            action(r)
    return during



def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask >> (sig - 1) & 1)


def after(seconds: float, action: Callable[[Running], None]):
    """`seconds` after start, once the program handles SIGINT: on a loaded machine the child may
    not have run Popen's preexec (which resets the SIGINT a background campaign inherits ignored)
    or Python's start 0.5 s after the fork, and a signal then is lost or kills Python itself: the
    harness's race, not the program's (int-train-w1-at-0.5s exited 0 at a load of 16 on 2 cores)."""
    def during(r: Running, el: float) -> None:
        if r.fault_t is None and el > seconds and _catches(r.proc.pid, signal.SIGINT):
            action(r)
    return during
