"""What a rank of `train` starts in the background while it joins its process group: reading the
built-in dataset, and the compiler's imports where the step compiles (issue 52, warm start: "no
work before the first step that is not needed for it: imports in parallel with the pool's start").

Why: a pool worker runs its rank's work one piece after the other: the GPU's context and the
group's rendezvous (0.7 s on an H200 host), then the data (1.0 s for Fashion-MNIST, 0.5 of it
gunzip), then the model, then torch.compile, whose first call imports Inductor and functorch's
compile stack (1.3 s with bytecode caches, 4.3 s without, as in the device image), and hashes
torch's and Triton's sources for its cache keys (0.5 s). The first two
wait on the driver, the network and zlib, which let go of the GIL; so a thread started with the
task reads the data and imports the compiler meanwhile, and the rank finds both done.

Safe by construction: the thread only loads what the rank would load itself, under the same key
(train/inputs.py cached_dataset takes its result), and imports modules the rank imports anyway.
Whatever fails in it is dropped, and the rank does that part itself as before, so its errors
(a missing file: one line, exit 2) are the ones the rank would have raised. Not for the user's
own data or a dataset reference (user code, which may not expect a thread), nor under
SHMLEARN_EARLY=0.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional, Tuple

COMPILER_MODULES = ("torch._inductor.compile_fx", "torch._dynamo.repro.after_dynamo")
"""What torch.compile's first call imports (its Inductor backend, and Dynamo's debug wrapper,
which imports functorch.compile): 2.8 + 1.5 s of fashion-94's warm start on an H200 without
bytecode caches."""

_lock = threading.Lock()
_reads: Dict[tuple, "_Read"] = {}


class _Read:
    """One dataset's background read: its result or nothing (the rank reads it then)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.dataset: Optional[Any] = None


def data_key(name: str, data_dir: Optional[str], seed: int) -> tuple:
    return (name, os.path.abspath(data_dir) if data_dir else None, seed)


def start(cfg: Dict[str, Any]) -> None:
    """The task's early work for a run of config dict `cfg` (launch/worker.py runs it in a thread
    of its own at the task's start): the dataset's read, then the compiler's imports."""
    if os.environ.get("SHMLEARN_EARLY", "1") == "0":
        return
    name, compile_mode = cfg.get("dataset"), cfg.get("compile", "off")
    from shmlearn.user.refs import is_ref  # lazy: a pool worker imports this module before its first task
    if isinstance(name, str) and not is_ref(name):
        key = data_key(name, cfg.get("data_dir"), int(cfg.get("seed", 0)))
        with _lock:
            read = _reads.get(key)
            if read is None:
                read = _reads[key] = _Read()
            else:
                read = None  # already read (or reading): a later task of this worker
        if read is not None:
            try:
                from shmlearn.data import load_dataset  # lazy: only where a dataset is read early
                read.dataset = load_dataset(name, cfg.get("data_dir"), seed=int(cfg.get("seed", 0)))
            except BaseException:  # noqa: BLE001 - the rank reads it itself and raises its own error
                read.dataset = None
            finally:
                read.done.set()
    if compile_mode != "off":
        import importlib
        try:
            for m in COMPILER_MODULES:
                importlib.import_module(m)
            # The source hashes in every compiled graph's cache key, computed once a process
            # (functools caches; no CUDA call: the rank's device is not set yet): torch's and
            # Triton's .py files read and hashed, 0.2 + 0.3 s of a warm compile here.
            from torch._inductor import codecache
            codecache.torch_key()
            codecache.triton_key()
        except BaseException:  # noqa: BLE001 - torch.compile does it again and says what failed
            return


def take_dataset(name: str, data_dir: Optional[str], seed: int):
    """The dataset the early work read for this key (waiting for it if it is still reading), or
    None: not read early, or its read failed (the caller reads it itself)."""
    key = data_key(name, data_dir, seed)
    with _lock:
        read = _reads.pop(key, None)
        if read is None:  # not started yet: the thread that starts later finds this and skips
            taken = _reads[key] = _Read()
            taken.done.set()
            return None
    read.done.wait()
    return read.dataset


def task_early(cfg: Dict[str, Any]) -> Optional[Tuple[Any, tuple]]:
    """launch.pool's `early` for a rank of `cfg`: (start, (cfg,)), or None under SHMLEARN_EARLY=0
    (train() passes none where the user gave objects of their own: their code may not expect a
    thread)."""
    if os.environ.get("SHMLEARN_EARLY", "1") == "0":
        return None
    return (start, (cfg,))
