"""Whole-number checks shared by config.validate and the strategies' own parameters (sync/), so
that the strategies need not import config (config imports the strategy registry); and the
machine's available memory, which the launcher and async-ps's server plan by."""
from __future__ import annotations

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
