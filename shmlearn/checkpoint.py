"""Checkpoints that survive kills: atomic, checksummed, one file per rank, complete or ignored.

Layout under the run directory:

    checkpoints/step-00000600/rank0.ckpt, rank1.ckpt, ...   each rank's own state
    checkpoints/step-00000600/COMPLETE                      written by rank 0 after every rank's
                                                            file is durable (a barrier)

A file is  MAGIC | sha256(payload) | len(payload) | payload  (payload = torch.save bytes),
written to a temp name, fsynced, renamed, and the directory fsynced. A reader checks magic,
length and checksum, so a truncated file, a flipped byte or a rename that never happened (only
the temp file exists) is detected; resume then falls back to the previous good checkpoint.
The payload is read with torch.load(weights_only=True): tensors and plain values only (dicts,
lists, numbers, strings; RNG states are tensors), so a file that would run code when unpickled
(a planted or doctored checkpoint) is refused (UnsafeCheckpoint), never loaded (docs/security.md).
Each rank keeps its own file because not every strategy keeps replicas' state identical
(weight averaging between rounds; a parameter server's optimizer lives on rank 0 only).
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import shutil
import struct
from typing import Any, List, Optional, Tuple

import torch

MAGIC = b"SHMLCKPT"
_HEADER = struct.Struct(">8s32sQ")
_DIR = re.compile(r"^step-(\d+)$")
KEEP = 2
"""Complete checkpoints kept on disk: the newest, and one to fall back to if it is damaged."""


class CorruptCheckpoint(Exception):
    pass


class UnsafeCheckpoint(CorruptCheckpoint):
    """A well-formed checkpoint whose payload holds more than tensors and plain values: unpickling
    it could run code, so it is refused, and not as damage to fall back from (resume stops)."""


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(root(run_dir), f"step-{step:08d}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, state: Any) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload)))
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def read_file(path: str, map_location=None) -> Any:
    """The state in `path`, or CorruptCheckpoint saying what is wrong with it."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: missing") from None
    except OSError as e:
        raise CorruptCheckpoint(f"{path}: unreadable ({e.strerror})") from None
    if len(raw) < _HEADER.size:
        raise CorruptCheckpoint(f"{path}: truncated ({len(raw)} bytes, shorter than the header)")
    magic, digest, n = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size:]
    if magic != MAGIC:
        raise CorruptCheckpoint(f"{path}: not a shmlearn checkpoint (bad magic)")
    if len(payload) != n:
        raise CorruptCheckpoint(f"{path}: truncated (header says {n} bytes, file has {len(payload)})")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{path}: checksum mismatch (damaged)")
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's refusal: what it would have had to import, or run
        m = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"it needs {m.group(1)}" if m else "it holds more than tensors and plain values"
        raise UnsafeCheckpoint(f"{path}: refused: {what}, and loading it could run code "
                               f"(a checkpoint holds only tensors and plain values)") from None


def candidates(run_dir: str) -> List[int]:
    """Steps of checkpoints marked COMPLETE, newest first."""
    r = root(run_dir)
    if not os.path.isdir(r):
        return []
    steps = []
    for name in os.listdir(r):
        m = _DIR.match(name)
        if m and os.path.exists(os.path.join(r, name, "COMPLETE")):
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def remove_incomplete(run_dir: str) -> List[str]:
    """Delete checkpoint folders without a COMPLETE mark (a kill while writing); their names."""
    import shutil
    r = root(run_dir)
    if not os.path.isdir(r):
        return []
    gone = [n for n in os.listdir(r) if _DIR.match(n) and not os.path.exists(os.path.join(r, n, "COMPLETE"))]
    for n in gone:
        shutil.rmtree(os.path.join(r, n), ignore_errors=True)
    return gone


def any_started(run_dir: str) -> bool:
    r = root(run_dir)
    return os.path.isdir(r) and any(_DIR.match(n) for n in os.listdir(r))


def mark_complete(run_dir: str, step: int, world_size: int) -> None:
    d = step_dir(run_dir, step)
    tmp = os.path.join(d, "COMPLETE.tmp")
    with open(tmp, "w") as f:
        f.write(f"{world_size}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, "COMPLETE"))
    _fsync_dir(d)


def prune(run_dir: str, keep: int = KEEP) -> None:
    """Delete all but the newest `keep` complete checkpoints (and abandoned partial ones older
    than the oldest kept)."""
    done = candidates(run_dir)
    if len(done) <= keep:
        return
    oldest_kept = done[keep - 1]
    for name in os.listdir(root(run_dir)):
        m = _DIR.match(name)
        if m and int(m.group(1)) < oldest_kept:
            shutil.rmtree(os.path.join(root(run_dir), name), ignore_errors=True)


def load_rank(run_dir: str, step: int, rank: int, map_location=None) -> Tuple[Optional[Any], Optional[str]]:
    """(state, None) or (None, why it is unusable) for this rank's file of checkpoint `step`.
    Raises UnsafeCheckpoint for a file that would run code: never a fallback, always a refusal."""
    try:
        return read_file(os.path.join(step_dir(run_dir, step), f"rank{rank}.ckpt"), map_location), None
    except UnsafeCheckpoint:
        raise
    except CorruptCheckpoint as e:
        return None, str(e)
