"""Whole-number checks shared by config.validate and the strategies' own parameters (sync/), so
that the strategies need not import config (config imports the strategy registry); and the
machine's available memory, which the launcher and async-ps's server plan by."""
from __future__ import annotations

import math
import os
from typing import Optional

from shmlearn.errors import BadInput

MAX_STEPS = 10**9
"""Steps of a run: the loss history is a float32 tensor of steps + 1 on the device (4 GB here)."""


def whole(name: str, value, lo: int, hi: Optional[int] = None) -> None:
    """A whole number from lo to hi (None: no upper bound); None passes (the field's default)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < lo
                              or (hi is not None and value > hi)):
        raise BadInput(f"--{name} {value}: expected a whole number "
                       + (f">= {lo:,}" if hi is None else f"from {lo:,} to {hi:,}"))


def number(name: str, value, lo: float, hi: Optional[float] = None, *, lo_open: bool = False,
            hi_open: bool = False, unit: str = "") -> None:
    """A finite int or float from lo to hi (None: no bound but finiteness); None passes (the
    field's default)."""
    if value is None:
        return
    try:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and (lo < value if lo_open else lo <= value) and (hi is None or (value < hi if hi_open else value <= hi)))
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        low = f"{'>' if lo_open else '>='} {lo:g}"
        high = "" if hi is None else f" and {'<' if hi_open else '<='} {hi:g}"
        raise BadInput(f"--{name} {value}: expected a finite number {low}{high}{unit}")


def mem_available() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


GPU_RANK_THREADS = 4
"""Intra-op CPU threads of a process that drives a GPU, unless --threads says otherwise. Such a
process does little CPU work, but torch's default pool (every core) wakes on each small CPU op
and spins after it: on a 64-core host each rank of a 4-GPU run burned 27-100 CPU-ms per 1-7 ms
step and the ranks slowed each other's steps 2-7x (docs/performance.md, issue 42). torchrun sets
OMP_NUM_THREADS=1 for the same reason."""


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset, a
    Slurm allocation), not the host's count that os.cpu_count() gives."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def busy_cores() -> float:
    """Cores other processes keep busy now, when this process may run on every core of the host
    (else 0: the host's counts say nothing of our own cores): the fewer of the 1-minute load
    average and the runnable threads the kernel counts at this instant (/proc/stat procs_running,
    less this one). The minimum, so that neither a burst nor the load our own previous run left
    in the average (a sweep's earlier trial) takes threads away from a quiet machine."""
    if not hasattr(os, "getloadavg") or len(os.sched_getaffinity(0)) != (os.cpu_count() or 0):
        return 0.0
    running = _procs_running()
    return 0.0 if running is None else max(0.0, min(os.getloadavg()[0], running - 1.0))


def _procs_running() -> Optional[int]:
    """Threads runnable on the host now, this one included (/proc/stat); None where unknown."""
    try:
        with open("/proc/stat") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def rank_threads(device_type: str, local_world_size: int, threads: Optional[int] = None, *,
                 fixed: bool = False) -> int:
    """Intra-op threads for one rank: `threads` if given; on the CPU the cores divided among the
    host's ranks, less the cores other processes keep busy (busy_cores) unless `fixed`; on a GPU at
    most GPU_RANK_THREADS of that share. At least 1.

    fixed (--deterministic): the share whatever the load. Another thread count splits a CPU
    kernel's sums differently, so the bits of a run would follow the machine's load (two resnet18
    runs of one config, one of them started while the machine was busy, differed in their weights).

    Why the load: torch's intra-op threads meet at a barrier after each parallel op, and one thread
    the kernel has preempted for a busy process holds all of them. A 1-worker digits MLP run on 2
    cores beside 2 busy processes (`python -c 'while 1: pass'`) ran at 1,374 samples/s with 2
    threads, 12,005 with --threads 1; with this rule ~15,000 against 16,000-20,000 (docs/training.md,
    "The launcher's environment")."""
    if threads:
        return threads
    cores = usable_cores()
    share = max(1, cores // max(1, local_world_size))
    if device_type != "cpu":
        return min(GPU_RANK_THREADS, share)
    if fixed:
        return share
    free = cores - round(busy_cores())
    return max(1, min(share, free))
