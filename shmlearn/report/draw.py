"""A report's figures drawn side by side: each is its data in and PNG bytes out, independent of
the others, so the pages (pages.py) name them as `Later`s and `draw_all` draws them before the page
is rendered, in forked copies of this process, one per core, each taking the next figure left.

Why: a sweep draws its report after its last trial, in its wall time, where nothing else runs;
matplotlib draws on one core. The 8-trial digits sweep's ten figures took 0.77 s in one process
on the 2-core CPU and 0.48 s in two (medians of 5, alternating, load average 1.8 from other
sessions: results/start-cpu-2026-11-28-a4/report-draw.json); a busy second core takes the gain.
Since (session 30, docs/performance.md; results/report-cost-cpu-2026-11-29.json, load 3-9): a
fresh helper's first report 0.69 -> 0.57 s of CPU in one process, 1.04 -> 0.91 s of wall in two,
the figures the same; and each process takes figures until none is left rather than a fixed
half, so that one slowed by other work on its core leaves the rest to the other.

Only where it is safe and pays: a fork (POSIX), no other Python thread in this process (a fork
copies the locks they hold, not them), two or more usable cores and two or more figures. Else,
and for what a copy took and did not deliver (it died, or a figure failed), the figures are
drawn here, one by one: a figure's error is raised here as it would be without copies. A copy
ignores Ctrl-C (its owner's interrupt ends the report) and writes nothing but its figures' bytes
to its pipe."""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import struct
import threading
import warnings
from typing import Any, Callable, List, Optional


class Later:
    """A figure to draw: fn(*args, **kw) -> PNG bytes, or None where it has nothing to show.
    `data` holds the bytes once drawn (draw_all)."""

    __slots__ = ("fn", "args", "kw", "data", "done")

    def __init__(self, fn: Callable[..., Optional[bytes]], *args: Any, **kw: Any):
        self.fn, self.args, self.kw = fn, args, kw
        self.data: Optional[bytes] = None
        self.done = False

    def draw(self) -> Optional[bytes]:
        if not self.done:
            self.data, self.done = _drawn(self), True
        return self.data


def _drawn(item: Later) -> Optional[bytes]:
    """The figure's bytes, drawn without the cyclic garbage collector: the 8-trial sweep's ten
    figures set off 78 young collections (3-6% of their CPU time); a figure's garbage goes with the
    first collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return item.fn(*item.args, **item.kw)
    finally:
        if enabled:
            gc.enable()


def data(item: Any) -> Optional[bytes]:
    """A figure's bytes: a Later's (drawn now if draw_all has not), or the bytes as given."""
    return item.draw() if isinstance(item, Later) else item


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _can_fork() -> bool:
    return ("fork" in mp.get_all_start_methods() and threading.current_thread() is threading.main_thread()
            and threading.active_count() == 1)


def draw_all(items: List[Later], procs: Optional[int] = None) -> None:
    """Draw every item not drawn yet: in `procs` processes (default: the usable cores), this one
    and forked copies, where _can_fork (the module docstring). Each process takes the next figure
    not taken (`_taken`) until none is left: a process that draws slower, on a core that others'
    work shares, or figures that cost more, leave it fewer."""
    todo = [x for x in items if not x.done]
    n = min(len(todo), procs or _cores())
    if n < 2 or len(todo) > MAX_SHARED or not _can_fork():
        for x in todo:
            x.draw()
        return
    taken, put = os.pipe()  # the figures' numbers, each taken once by whichever process reads it
    os.write(put, b"".join(struct.pack("I", i) for i in range(len(todo))))
    os.close(put)  # at the end of the numbers a read returns nothing: no figure is left
    ctx = mp.get_context("fork")
    copies = []
    try:
        for _ in range(n - 1):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_draw_taken, args=(todo, taken, send), name="shmlearn-report", daemon=True)
            with warnings.catch_warnings():  # Python 3.12+: a fork of a process with native threads (torch's)
                warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
                p.start()
            send.close()
            copies.append((p, recv))
        for i in _taken(taken):
            todo[i].draw()
    finally:
        os.close(taken)
    for p, recv in copies:
        try:
            got = recv.recv()
        except (EOFError, OSError):  # the copy died: what it took is drawn below
            got = []
        recv.close()
        p.join()
        for i, d in got:
            todo[i].data, todo[i].done = d, True
    for x in todo:  # taken by a copy that died or failed: drawn here, a figure's own error raised here
        x.draw()


MAX_SHARED = 16384
"""The most figures drawn side by side: their numbers (4 bytes each) fill a pipe's 64 KiB at most,
written before the copies start."""


def _taken(fd: int):
    """The numbers of the figures this process takes, one at a time, until none is left (a read
    of 4 bytes from a pipe is whole: the pipe's lock serializes the processes' reads)."""
    while True:
        b = os.read(fd, 4)
        if len(b) < 4:
            return
        yield struct.unpack("I", b)[0]


def _draw_taken(todo: List[Later], taken: int, send) -> None:
    """In a forked copy: (number, bytes) of each figure it took and drew; it stops at a figure
    that fails, which the owner draws again and so meets the error itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = []
    try:
        for i in _taken(taken):
            out.append((i, _drawn(todo[i])))
    except Exception:  # noqa: BLE001 - raised again by the owner, where it is reported
        pass
    send.send(out)
    send.close()
