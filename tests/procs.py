"""Shared helpers for tests that watch processes (tests/ is on pytest's pythonpath)."""


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (its state in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
