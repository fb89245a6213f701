"""What every benchmark shares: its ranks' device, recording the machine, sizes and statistics.

docs/architecture.md, Style 7: a benchmark records evidence (device, driver, torch version, date, n runs,
median and spread), so every JSON written under bench/ starts with `environment()`.
"""
from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional, Sequence

import torch

from shmlearn.errors import BadInput

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str, *, flag: str = "--sizes") -> int:
    """'4K' -> 4096, '256M' -> 268435456, '1000' -> 1000 (binary units: K = 1024 bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise BadInput(f"{flag} {text}: not a size; write bytes or a number with K, M or G (4K, 256M)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise BadInput(f"{flag} {text}: must be positive")
    return n


def format_size(n: float) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{int(n)}B"


MAX_COUNTS = 100_000
"""Values a list of counts may hold ('1-100000'): each is a worker count something is predicted or
run at; a range past it is a typo (1-1000000000 took every byte of memory)."""
MAX_WORKERS = 1_000_000
"""The largest worker count advise and simulate predict at: the largest training jobs run about
100,000 accelerators, so 1,000,000,000,000 is a typo, not a question (it was answered, exit 0)."""


def parse_int_list(text: str, *, flag: str, most: Optional[int] = None) -> List[int]:
    """'1,2,4' or '1-4' (inclusive) or a mix: '1-3,8'; at most MAX_COUNTS values, each at most
    `most` (None: no bound)."""
    out: List[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                a, b = part.split("-")
                if int(b) - int(a) + 1 + len(out) > MAX_COUNTS:
                    raise BadInput(f"{flag} {text}: {int(b) - int(a) + 1:,} values in {part.strip()}; "
                                   f"expected at most {MAX_COUNTS:,}")
                out.extend(range(int(a), int(b) + 1))
            elif part.strip():
                out.append(int(part))
    except ValueError:
        raise BadInput(f"{flag} {text}: expected integers like 2,3,4 or 1-4") from None
    if not out or min(out) < 1:
        raise BadInput(f"{flag} {text}: expected positive integers like 2,3,4 or 1-4")
    if most is not None and max(out) > most:
        raise BadInput(f"{flag} {text}: {max(out):,} is more than {most:,}; expected counts up to {most:,}")
    return sorted(set(out))


def replay_us(graph, replays: int, runs: int = 5, before=None) -> List[float]:
    """Microseconds per replay of a captured CUDA graph, timed by CUDA events around `replays`
    replays, `runs` times (before(): called ahead of each run, untimed, e.g. to rewind counters)."""
    out = []
    for _ in range(runs):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / replays)
    return out


def stats(values: Sequence[float]) -> Dict[str, float]:
    """Median and spread (min, quartiles, max) of repeated timings, in the values' unit."""
    v = sorted(values)
    n = len(v)

    def q(p: float) -> float:  # linear interpolation between closest ranks
        x = p * (n - 1)
        lo = int(x)
        hi = min(lo + 1, n - 1)
        return v[lo] + (v[hi] - v[lo]) * (x - lo)

    return {"median": q(0.5), "min": v[0], "p25": q(0.25), "p75": q(0.75), "max": v[-1], "n": n}


# --- the machine -------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> Optional[str]:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _nccl_version() -> Optional[str]:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def environment(backend: str) -> Dict[str, Any]:
    """Device, driver, torch version, backend, date: what a reader needs to trust a number."""
    cuda = backend == "nccl" and torch.cuda.is_available()
    env = {
        "device": torch.cuda.get_device_name(0) if cuda else _cpu_model(),
        "device_count": torch.cuda.device_count() if cuda else None,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "driver": _nvidia_driver() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": _nccl_version() if cuda else None,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "backend": backend,
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # Other processes on the machine bend CPU timings; the load says how busy it was.
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    return env


def check_backend(backend: str, workers: Sequence[int]) -> None:
    """Say exactly what is wrong before spawning anything."""
    if backend not in ("gloo", "nccl"):
        raise BadInput(f"--backend {backend}: choose gloo (CPU processes) or nccl (one process per GPU)")
    if backend == "nccl":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if max(workers) > n:
            raise BadInput(f"--workers {max(workers)}: nccl needs one GPU per process, {n} present")


# --- ranks -------------------------------------------------------------------------------------

RANK_TIMEOUT_S = 300.0
"""The process group's timeout: a rank that waits this long in one collective fails the run."""


def rank_device(env, backend: str) -> torch.device:
    """This rank's device in a pool job (pool.run_local): for nccl the GPU of its slot, the one the
    pool built the group on (pool_worker._gpu_of); cpu for gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def try_pyplot():
    """matplotlib's pyplot on the Agg backend, or None (plots are skipped, JSON is still written)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None
