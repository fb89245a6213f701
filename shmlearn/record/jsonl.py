"""Append-only JSON-lines files and their torn last line.

A write cut off by a kill or a full disk leaves the file's last line without its newline (and
usually not valid JSON). The next append would go on after those bytes, turning two records into
one bad line in the middle of the file, for good. So before such a file is read for appending,
its tail is mended (`mend_tail`): a whole record missing only its newline gets it; a torn one is
moved to FILE.torn and the file cut back to the end of its last whole line. sweep.py's
results.jsonl and study.py's journal storage both go through here. Every write here is refused
through a symlink that leads out of the file's folder (safe_write), and opened with O_NOFOLLOW.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional, Tuple

from shmlearn.record import safe_write

FULL = safe_write.FULL
"""The errnos of a full disk (safe_write.FULL), as the sweeps and study storage test them."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def is_json(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except (ValueError, UnicodeDecodeError):
        return False


def last_line(path: str, chunk: int = 1 << 16) -> Tuple[int, bytes]:
    """(offset, bytes) of the file's last line when it lacks its newline; (size, b"") when the
    file is empty or ends with one. Reads backwards from the end, not the whole file."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        tail, pos = b"", size
        while pos > 0:
            step = min(chunk, pos)
            pos -= step
            f.seek(pos)
            buf = f.read(step)
            cut = buf.rfind(b"\n")
            if cut >= 0:
                tail = buf[cut + 1:] + tail
                return pos + cut + 1, tail
            tail = buf + tail
        return 0, tail


def mend_tail(path: str, start: int, tail: bytes, whole: bool) -> None:
    """Mend the unterminated last line `tail` at offset `start` (`last_line`): end it with its
    newline where it is a whole record (whole=True), else append it to PATH.torn and cut the file
    back to `start`. The caller holds whatever lock its writers take."""
    if whole:
        with safe_write.open_log(path, binary=True) as f:
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
        return
    with safe_write.open_log(path + ".torn", binary=True) as f:
        f.write(tail + b"\n")
    safe_write.check(path)
    fd = os.open(path, os.O_WRONLY | _NOFOLLOW)
    try:
        os.ftruncate(fd, start)
        os.fsync(fd)
    finally:
        os.close(fd)


def mend(path: str, whole: Callable[[bytes], bool] = is_json) -> Optional[str]:
    """`mend_tail` on the file's own last line, if it lacks its newline; a note saying what was
    done, or None where the file ends well (or does not exist)."""
    if not os.path.exists(path):
        return None
    start, tail = last_line(path)
    if not tail:
        return None
    if tail.strip() and whole(tail):
        mend_tail(path, start, tail, True)
        return f"{path}: the last line lacked its newline; ended it"
    mend_tail(path, start, tail, False)
    return (f"{path}: the last line ({len(tail)} bytes) was cut off by an interrupted write (a kill or a "
            f"full disk); moved it to {os.path.basename(path)}.torn")


def append_or_cut_back(path: str, data: bytes) -> None:
    """Append `data` (whole lines) and fsync; where the write fails (a full disk), cut the file
    back to its size before, so that no torn line stays behind, and raise the OSError."""
    safe_write.check(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass  # the next mend cuts it back
            raise OSError(e.errno, e.strerror, path) from None  # a write error carries no path
    finally:
        os.close(fd)
