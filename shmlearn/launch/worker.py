"""A pool worker: the process `pool.Pool` starts on each slot, and what it does with one task.

The worker imports torch and shmlearn once (PRELOAD), connects to the pool's store, then runs
tasks until the pool sends None: for each task it joins (or reuses) the job's process group,
runs fn(DistEnv, *args) with the task's log, cores and environment, and sends one message back,
("ok" | "bad_input" | "diverged" | "failed", rank, payload[, timings]). The parent side (queue,
slots, supervision of every rank) is shmlearn/launch/pool.py.
"""
from __future__ import annotations

import datetime
import gc
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from shmlearn.launch import lean, listen

from shmlearn.user import user_main
from shmlearn.errors import BadInput, Diverged, user_traceback
from shmlearn.launch.start import DistEnv, HeldStderr, die_with_owner, join_default_group, leave_default_group

PRELOAD = ("torch", "torch._dynamo", "shmlearn.train.entry", "shmlearn.data", "shmlearn.sync")
"""What a worker imports before its first job (torch._dynamo: see launch.import_before_group, left
out by a lean pool's workers); a fork of the forkserver finds the first two imported
(forkserver.THIRD_PARTY)."""


@dataclass(frozen=True)
class Task:
    """One rank's part of a job, as sent to a worker."""
    job: int
    fn: Callable
    """fn(env: DistEnv, *args) -> picklable result; the default process group is ready."""
    args: tuple
    rank: int
    world: int
    slots: Tuple[int, ...]
    """The job's slots in rank order (the group's identity)."""
    group: int
    """Key prefix of the job's group in the pool's store; equal to the worker's current group
    when that group can be reused."""
    backend: Optional[str]
    """gloo, nccl, or None for no process group."""
    timeout_s: float
    cores: Optional[Tuple[int, ...]] = None
    """CPU cores this rank runs on (sched_setaffinity), or None to leave the affinity alone."""
    log: Optional[str] = None
    """Append this rank's stdout and stderr to this file during the job."""
    env: Dict[str, str] = field(default_factory=dict)
    early: Optional[Tuple[Callable, tuple]] = None
    """(fn, args): fn(*args) started in a daemon thread of its own as the task starts, beside the
    group's join: work the rank needs only later (train/early.py: the data's read, the compiler's
    imports). It must swallow its own errors: the rank redoes whatever it did not finish."""


_store = None


def worker_store():
    """In a pool worker: the pool's store (a client of it), for values the pool's owner posts
    while a job runs (a sweep's pruning bounds); None elsewhere."""
    return _store


class OwnerStdio:
    """The owner's stdout and stderr (file descriptors 1 and 2) as they are when a worker starts,
    handed to that worker: put in a Process's args, pickling it passes both descriptors with the
    process (multiprocessing's DupFd, as it passes a socket) and unpickling it in the worker puts
    them in place of the worker's own 1 and 2. A fork of the forkserver otherwise writes where
    the forkserver's went when it started: not into pytest's capture of the test that runs now,
    nor into a notebook's cell. A spawned worker already has them: the same descriptors."""

    def __reduce__(self):
        from multiprocessing import reduction
        try:
            os.fstat(1), os.fstat(2)
        except OSError:  # an owner started with either closed: the worker keeps what it has
            return _take_stdio, (None, None)
        return _take_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _take_stdio(out, err) -> None:
    """OwnerStdio's other half, in the worker: the owner's descriptors become its 1 and 2 (the
    argument it was in is None)."""
    if out is None:
        return
    for fd, passed in ((1, out), (2, err)):
        got = passed.detach()
        if got != fd:  # a spawned worker's are the inherited ones themselves
            os.dup2(got, fd)
            os.close(got)


def _worker_main(slot: int, conn, parent_pid: int, store_port: int, init, environ: Dict[str, str],
                 main: Optional[Tuple[str, str]] = None, stdio: None = None, siblings: Optional[tuple] = None,
                 lean_jobs: bool = False) -> None:
    """One pool worker's life: its imports, the user's script up to its shmlearn.train call
    (main: user_main.main_reference(), which multiprocessing did not import), then jobs until told
    to leave. stdio: an OwnerStdio where it was passed, which its unpickling has put in place.
    siblings: not None in a fork of the owner itself (forkserver.caller_fork): the owner's ends of
    the other workers' pipes, closed here, so that only the owner holds them. lean_jobs: no job
    of this pool compiles (Pool's lean): the worker runs its optimizers without torch._dynamo
    (launch/lean.py), set up before its imports define anything, and does not import it."""
    if siblings is not None:
        # The owner's objects are the owner's: none is collected here. A garbage cycle holding a
        # TCPStore of the owner's (an earlier pool's) would join the store's thread, which this
        # fork does not have, and wait forever (seen in a caller-forked sweep worker under pytest).
        gc.freeze()
        # First, before any op: one intra-op thread (libgomp's team is the owner's; caller_fork).
        # The rank sets its own count later, 1 too for such a pool (limits.rank_threads).
        sys.modules["torch"].set_num_threads(1)
        for c in siblings:
            c.close()
        for sig in signal.valid_signals():  # the owner's handlers (the program's SIGHUP) are not ours:
            try:                            # the defaults, as a spawned worker or the forkserver's fork has
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    # Ctrl-C reaches the terminal's whole process group: the pool's owner handles it (it replaces
    # or kills its workers); here it only printed KeyboardInterrupt tracebacks. Ignored, then
    # unblocked (Pool._spawn, or the forkserver, started this process with it blocked: one
    # pending is dropped).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with_owner(parent_pid)
    if os.getppid() != parent_pid:  # a fork of the forkserver (forkserver.py): be what a spawn is
        os.environ.clear()
        os.environ.update(environ)  # the owner's now, not the forkserver's at its start
    if (siblings is not None or os.getppid() != parent_pid) and "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # forks share their parent's seed; a spawned one drew its own
    os.environ.update(listen.loopback_env())  # every group's Gloo/NCCL listeners on loopback
    import importlib
    t0 = time.perf_counter()
    if lean_jobs:
        lean.skip_dynamo_in_optimizers()  # nothing where the forkserver imported Dynamo already
    for m in PRELOAD:
        if not (m == "torch._dynamo" and lean.active()):
            importlib.import_module(m)
    user_main.import_main(main)
    t1 = time.perf_counter()
    if init is not None:
        try:  # e.g. load the sweep's dataset onto this worker's device before the first trial
            init[0](slot, *init[1])
        except Exception:  # noqa: BLE001 - the job that needs it fails with the real error
            pass
    import torch.distributed as dist

    global _store
    store = _store = dist.TCPStore(listen.LOOPBACK, store_port, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
    current: Optional[tuple] = None  # (group, backend, rank, world, timeout) of the group we hold
    conn.send(("ready", slot, os.getpid(), {"import_s": t1 - t0, "init_s": time.perf_counter() - t1,
                                            "forked": os.getppid() != parent_pid,
                                            "dynamo": "torch._dynamo" in sys.modules}))
    while True:
        try:
            task: Task = conn.recv()
        except (EOFError, OSError):
            break
        if task is None:
            break
        if task == LEAVE:  # the group's other ranks are leaving it: leave with them
            if current is not None:
                _leave_group(current[1])
                current = None
            conn.send(("left", slot))
            continue
        current = _run_task(task, slot, store, current, conn)
    if current is not None and current[1] != "nccl":
        _leave_group(current[1])
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Library teardown at interpreter exit (NCCL, CUDA, Gloo threads) can hang or abort; nothing
    # is left to write. An NCCL group is not torn down first: its ranks all end here together
    # (the pool's close), every job's work is done and read, and the driver frees what the
    # process held; destroy_process_group took 0.5 s a rank on an H200, after a run's last line
    # (results/gpu-2026-11-28-s26/). Gloo's is, as before (its threads).
    release_semaphores()
    os._exit(0)


def release_semaphores() -> None:
    """Unlink the named semaphores this process made (multiprocessing's locks), as the
    interpreter's exit would, before os._exit skips it. A compiled run's Inductor shows its compile
    progress through tqdm, whose class-wide lock is a multiprocessing RLock; left behind, the
    resource tracker ended the program with "There appear to be 2 leaked semaphore objects to
    clean up at shutdown" after a compiled CPU run's last line. Only their finalizers run: the
    others of the registry (queues' feeder threads, say) could block."""
    from multiprocessing import synchronize, util
    registry = getattr(util, "_finalizer_registry", {})  # multiprocessing's own, since Python 3.0
    for finalize in list(registry.values()):
        if getattr(finalize, "_callback", None) is synchronize.SemLock._cleanup:
            try:
                finalize()
            except Exception:  # noqa: BLE001 - one not released: the warning is all that is left
                pass


LEAVE = "leave"
"""Parent -> idle worker: leave the group you hold, because the job just started on some of its
ranks builds a new one. NCCL's teardown waits for every rank of the group (seen on four H200s: a
rank that left alone, its peer idle in the group, gave up after 30 s and then could not join the
next run's group), so a group is left by all its ranks at once or not at all."""


def _run_task(task: Task, slot: int, store, current, conn):
    saved = _redirect(task.log)
    env_before = {k: os.environ.get(k) for k in task.env}
    os.environ.update(task.env)
    if task.cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, task.cores)
    if task.early is not None:
        threading.Thread(target=task.early[0], args=task.early[1], name="shmlearn-early", daemon=True).start()
    try:
        key = (task.group, task.backend, task.rank, task.world, task.timeout_s)
        g0 = time.perf_counter()
        if key != current:
            if current is not None:
                _leave_group(current[1])
                current = None
                import torch.distributed as dist  # loaded by now (the group was built with it)
                if dist.is_initialized():  # the teardown gave up: a second group cannot be built
                    raise RuntimeError("this worker's previous process group did not shut down; "
                                       "run again (the pool replaces the worker)")
            if task.backend is not None:
                _join_group(task, store)
                current = key
        env = DistEnv(rank=task.rank, world_size=task.world, local_rank=slot,
                      local_world_size=task.world, launcher="local", job=f"j{task.job}")
        group_s = time.perf_counter() - g0
        result = task.fn(env, *task.args)
        msg = ("ok", task.rank, result, {"group_s": group_s})
    except (BadInput, Diverged) as e:
        kind = "bad_input" if isinstance(e, BadInput) else "diverged"
        msg = (kind, task.rank, (str(e), (e.step, e.rank) if isinstance(e, Diverged) else None))
    except BaseException as e:  # noqa: BLE001 - anything else is this rank's failure, reported by rank
        msg = ("failed", task.rank, describe(e))
    _restore(saved)
    for k, v in env_before.items():  # a job's environment is the job's alone
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        conn.send(msg)
    except Exception:  # noqa: BLE001 - an unpicklable result is this rank's failure
        conn.send(("failed", task.rank, f"result of rank {task.rank} cannot be pickled", {}))
    return current


def describe(e: BaseException) -> str:
    """A failure: one line, 'OSError: [Errno 28] No space left on device (runs.py:71)', then, where
    it passed through the user's own files (their model, loss, data), those frames as Python prints
    them, innermost last (errors.user_traceback), so the user sees the cause in their own code."""
    last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" ({os.path.basename(last.filename)}:{last.lineno})" if last else ""
    text = str(e).splitlines()[0] if str(e) else ""
    mine = user_traceback(e)
    if isinstance(e, SystemExit):  # not a clean end: the run stopped inside the user's code
        return f"the user code called sys.exit({e.code!r}){where}" + (f"\n  in your code:\n{mine}" if mine else "")
    return f"{type(e).__name__}: {text}{where}" + (f"\n  in your code:\n{mine}" if mine else "")


def _join_group(task: Task, store) -> None:
    import torch
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=task.timeout_s)
    kwargs = {}
    if task.backend == "nccl":
        device = torch.device("cuda", _gpu_of(task))
        torch.cuda.set_device(device)
        # Two ranks or more: the communicator is built now (a peer's failure shows at the join).
        # One rank: NCCL builds it at the first collective, which a run of one worker never makes
        # (0.45-0.5 s of each process's first 1-worker trial on an H200, results/gpu-2026-11-29-s27).
        if task.world > 1:
            kwargs["device_id"] = device
    prefixed = dist.PrefixStore(f"shmlearn/g{task.group}", store)
    with HeldStderr():  # a peer that never joins: torch's C++ store warnings, then our one line
        join_default_group(task.backend, store=prefixed, rank=task.rank, world_size=task.world,
                           timeout=timeout, **kwargs)


def _gpu_of(task: Task) -> int:
    import torch
    return task.slots[task.rank] % max(torch.cuda.device_count(), 1)


def _leave_group(backend: Optional[str]) -> None:
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    leave_default_group(dist.get_rank(), nccl=backend == "nccl")


def _redirect(log: Optional[str]):
    if log is None:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return saved


def _restore(saved) -> None:
    if saved is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, old in zip((1, 2), saved):
        os.dup2(old, fd)
        os.close(old)
