"""Dying with the process that started this one (Linux). Imports nothing of torch's or of the
rest of shmlearn: the forkserver imports it before torch (forkserver.py, _forkserver_guard.py)."""
from __future__ import annotations

import os
from typing import Optional

OWNER_ENV = "SHMLEARN_FORKSERVER_OWNER"
"""Set by forkserver.start() for the forkserver it starts: the pid of the process it must die with."""


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """SIGKILL this process when its parent dies (Linux), and leave at once if it died before we
    got here: PR_SET_PDEATHSIG only covers a death after the call, and a spawned child gets here
    only after its interpreter has started (1-2 s on a slow machine). parent_pid None: the
    parent is gone when this process was handed to init (pid 1). Pool workers call it, the
    DataLoader workers of a streamed Dataset (data/stream.py) and the forkserver."""
    import ctypes
    import signal
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    gone = os.getppid() == 1 if parent_pid is None else os.getppid() != parent_pid
    if gone:
        os._exit(1)
