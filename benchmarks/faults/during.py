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



def after(seconds: float, action: Callable[[Running], None]):
    def during(r: Running, el: float) -> None:
        if r.fault_t is None and el > seconds:
            action(r)
    return during
