"""THE local launcher: a pool of long-lived worker processes that runs a function on a set of ranks.

    Pool(slots) --start(fn, ranks on slots)--> workers (one per CPU core slot or GPU)
       |  hosts the TCP store every group rendezvouses in (never a rank: a stopped rank 0
       |  cannot take the store down with it)
       '-- watches each job: the first rank that dies, fails or stops is named, the job's other
           ranks are stopped, and their processes are replaced by fresh ones

Why a pool: a fresh process costs its interpreter, torch's import, the CUDA context, the dataset's
upload and the group's rendezvous, 2-17 s per trial, more than the training of a sweep's trial.
A pool worker keeps all of them between jobs:
* the process, its imports and its CUDA context;
* the dataset on the device (data.load_dataset's per-process cache);
* the process group: a job on the same ranks as the last one (same slots, same order, same
  backend and timeout) reuses it, so a sweep's trials of one worker count rendezvous once. A job
  on other slots destroys the old group and builds one under a fresh key prefix in the store.
Each job still builds its model, optimizer, strategy and CUDA graph fresh (train.py does).

`train --workers N`, sweeps, experiments and benchmarks all start their ranks here; a `with
Pool(...)` (or `using(pool)`) around several `shmlearn.train` calls makes them share one pool.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from shmlearn.config.limits import usable_cores
from shmlearn.errors import BadInput, count
from shmlearn.launch import forkserver, listen
from shmlearn.user import user_main
from shmlearn.launch.supervise import Job, Watchdog
# describe and worker_store are imported from here by train.py and the tests (the worker side moved)
from shmlearn.launch.worker import LEAVE, OwnerStdio, Task, _worker_main, describe, worker_store  # noqa: F401


# --- the pool (parent side) ----------------------------------------------------------------------

@dataclass
class _Worker:
    slot: int
    proc: Any
    conn: Any
    ready: bool = False
    job: Optional[int] = None
    rank: Optional[int] = None
    group: Optional[int] = None
    """The group this worker holds after its last job (None: none, or unknown after a failure)."""
    group_key: Optional[tuple] = None
    pending: Optional[Task] = None
    """A task waiting for the worker to finish starting."""
    t_spawn: float = field(default_factory=time.monotonic)
    start: str = ""
    """How it started: fork (of this process), forkserver or spawn."""
    why_not_fork: Optional[str] = None
    """Why it is not a fork of this process (forkserver.caller_fork), for the startup record."""
    told: bool = False
    """Told to leave (Pool.stop), not yet reaped (Pool.close)."""


class Pool:
    """Long-lived workers on `slots` (CPU core indices into this process's affinity, or GPU
    indices); see the module docstring. Not thread-safe: one thread drives it."""

    def __init__(self, slots: Sequence[int] | int, *, cuda: bool = False, init: Optional[tuple] = None,
                 quick_grace_s: float = 1.0, grace_s: float = 10.0, one_thread: bool = False, lean: bool = False):
        """init: (fn, args): each worker calls fn(slot, *args) once after its imports, before its
        first job (what every job will need: the dataset on the device). one_thread: every job's
        ranks run one intra-op thread, so a worker may fork from this process where
        forkserver.caller_fork finds it safe (checked at each start: a replacement too). lean: no
        job of this pool compiles, so its workers run their optimizers without torch._dynamo
        (launch/lean.py) and never import it (~1.2 s of a core on this 2-core CPU; a sweep's
        forkserver then preloads torch alone: cli.prestart)."""
        self.slots = list(range(slots)) if isinstance(slots, int) else list(slots)
        self.cuda = cuda
        self.init = init
        self.one_thread = one_thread
        self.lean = lean
        # On loopback only (torch's own store would listen on every interface): listen.py
        self.store = listen.bound_store(listen.LOOPBACK, 0, timeout=datetime.timedelta(seconds=60))
        self.watchdog = Watchdog(self.store, quick_grace_s, grace_s)
        self.workers: Dict[int, _Worker] = {}
        self.jobs: Dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._groups = itertools.count(1)
        self.leaves = self.left = 0  # LEAVE messages sent, and done
        self.startup: List[Dict[str, float]] = []
        """Per started worker: seconds from spawn to ready, of which imports and init."""
        self.started_workers = 0
        """Processes started, replacements included (a benchmark and the tests read it)."""
        self._closed = self._stopped = False
        # Closed at the latest at exit, before multiprocessing's own exit joins its children:
        # workers ignore Ctrl-C, so a pool left open by an interrupt (in wait_ready, say) would
        # make that join wait for them forever.
        atexit.register(self.close)

    # -- workers --------------------------------------------------------------------------------
    def _spawn(self, slot: int) -> _Worker:
        why_not = "a GPU pool" if self.cuda else forkserver.caller_fork(self.one_thread, self.lean)
        if why_not is None:  # a fork of this process: its modules, the script's objects, its data
            forkserver.stop_idle()
            ctx, main = mp.get_context("fork"), None
            # this process's ends of the other workers' pipes, which the fork would keep open
            siblings = tuple(w.conn for w in self.workers.values())
        else:
            ctx = forkserver.context(self.cuda, dynamo=not self.lean)
            main = user_main.main_reference(self.init)  # the worker imports the script itself (user_main.py)
            siblings = None
        parent, child = ctx.Pipe(duplex=True)
        p = ctx.Process(target=_worker_main, name=f"shmlearn-worker{slot}",
                        args=(slot, child, os.getpid(), self.store.port, self.init, dict(os.environ), main,
                              OwnerStdio(), siblings, self.lean),
                        daemon=False)
        t0 = time.monotonic()  # startup's ready_s counts the wait for the forkserver's imports too
        with _interrupts_deferred():
            _start(p, main)
            child.close()
            w = _Worker(slot, p, parent, t_spawn=t0, start=ctx.get_start_method(), why_not_fork=why_not)
            self.workers[slot] = w
            self.started_workers += 1
        return w

    def warm(self, slots: Optional[Sequence[int]] = None) -> None:
        """Start workers on `slots` (default all) now, so the first job does not wait for them."""
        for s in (self.slots if slots is None else slots):
            if s not in self.workers:
                self._spawn(s)

    def grow(self, n: int) -> None:
        """Add n slots (CPU pools: a slot is a process, not a core)."""
        top = max(self.slots, default=-1)
        self.slots.extend(range(top + 1, top + 1 + n))

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every started worker has imported and initialized (a worker that dies
        meanwhile is dropped, and started again when a job needs its slot)."""
        t_end = time.monotonic() + timeout_s
        while any(not w.ready for w in self.workers.values()) and time.monotonic() < t_end:
            self.poll(0.2)

    def free_slots(self) -> List[int]:
        busy = {w.slot for w in self.workers.values() if w.job is not None}
        return [s for s in self.slots if s not in busy]

    def _kill_now(self, slots: Sequence[int]) -> None:
        """SIGKILL the workers of these slots all at once (reaped by _replace or close): killed one
        by one, a rank whose peer was already gone had the moment to print Gloo's C++ error line for
        the lost connection (seen in CI: Ctrl-C during the ranks' rendezvous, a second line besides
        the program's one)."""
        for s in slots:
            w = self.workers.get(s)
            if w is not None and w.proc.is_alive():
                w.proc.kill()

    def _replace(self, slot: int) -> None:
        w = self.workers.pop(slot, None)
        if w is not None:
            _kill(w.proc)
            w.conn.close()
        self._spawn(slot)

    # -- jobs -----------------------------------------------------------------------------------
    def start(self, fn: Callable, args: tuple = (), *, slots: Sequence[int], backend: Optional[str] = "gloo",
              timeout_s: float = 300.0, cores: Optional[Sequence[Sequence[int]]] = None,
              log: Optional[str] = None, env: Optional[Dict[str, str]] = None, tag: Any = None,
              early: Optional[Tuple[Callable, tuple]] = None) -> Job:
        """Run fn(DistEnv, *args) on len(slots) ranks, rank r on the worker of slots[r]; early:
        (fn, args) each rank starts in a thread beside its group's join (worker.Task.early)."""
        if self._stopped:
            raise ValueError("the pool was stopped: no job starts on it")
        slots = tuple(slots)
        busy = [s for s in slots if s in self.workers and self.workers[s].job is not None]
        if busy or len(set(slots)) != len(slots) or any(s not in self.slots for s in slots):
            raise ValueError(f"slots {slots}: busy {busy} or not in the pool {self.slots}")
        group = self._group_for(slots, backend, timeout_s)
        for w in self._holders_left_behind(slots, group):  # NCCL: a group is left by all at once
            w.conn.send(LEAVE)
            w.group = w.group_key = None
            self.leaves += 1
        job = Job(next(self._ids), slots, timeout_s, group, tag)
        for r, s in enumerate(slots):
            w = self.workers.get(s) or self._spawn(s)
            task = Task(job.id, fn, args, r, len(slots), slots, group, backend, timeout_s,
                        tuple(cores[r]) if cores else None, log, dict(env or {}), early)
            w.job, w.rank = job.id, r
            w.group, w.group_key = group, (slots, backend, timeout_s)
            if w.ready:
                w.conn.send(task)
            else:
                w.pending = task
        self.jobs[job.id] = job
        return job

    def _holders_left_behind(self, slots: Tuple[int, ...], group: int) -> List[_Worker]:
        """Idle workers outside `slots` that hold a group the workers of `slots` leave for `group`."""
        old = {w.group for s in slots if (w := self.workers.get(s)) is not None and w.group not in (None, group)}
        return [w for w in self.workers.values() if w.slot not in slots and w.job is None and w.ready
                and w.group in old]

    def _group_for(self, slots: Tuple[int, ...], backend, timeout_s) -> int:
        """Reuse the group the workers of `slots` hold, if it is exactly this rank set."""
        key = (slots, backend, timeout_s)
        ws = [self.workers.get(s) for s in slots]
        if all(w is not None for w in ws):
            g = ws[0].group
            if g is not None and all(w.group == g and w.group_key == key for w in ws):
                return g
        return next(self._groups)

    def poll(self, timeout: float = 0.5) -> List[Job]:
        """Wait up to `timeout` s for news; return the jobs that ended (their outcomes complete)."""
        objs = {}
        for w in self.workers.values():
            objs[w.conn] = w
            objs[w.proc.sentinel] = w
        ready = wait(list(objs), timeout=timeout) if objs else []
        for o in ready:
            w = objs[o]
            if o is w.conn:
                self._receive(w)
            elif not w.proc.is_alive() and self.workers.get(w.slot) is w:
                self._receive(w)  # its last words may be in the pipe
                self._died(w)
        self.watchdog.check(self.jobs.values(), self.workers)
        return self._collect()

    def _receive(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "left":  # a LEAVE done
                    self.left += 1
                    continue
                if msg[0] == "ready":
                    w.ready = True
                    self.startup.append({"slot": w.slot, "ready_s": time.monotonic() - w.t_spawn, **msg[3],
                                         "start": w.start, "why_not_fork": w.why_not_fork})
                    if w.pending is not None:
                        w.conn.send(w.pending)
                        w.pending = None
                    continue
                job = self.jobs.get(w.job)
                if job is not None:
                    job.outcomes.setdefault(msg[1], msg)
                w.job = w.rank = None
        except (EOFError, OSError):
            pass

    def _died(self, w: _Worker) -> None:
        job = self.jobs.get(w.job) if w.job is not None else None
        code = w.proc.exitcode
        why = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        if job is not None and w.rank not in job.outcomes:
            job.outcomes[w.rank] = ("died", w.rank, f"worker died ({why})")
        if job is not None:
            self._replace(w.slot)
        else:  # idle: started again when a job needs its slot
            self.workers.pop(w.slot, None)
            w.conn.close()

    def _collect(self) -> List[Job]:
        ended = []
        for job in list(self.jobs.values()):
            if not job.done:
                continue
            del self.jobs[job.id]
            healthy = job.ok() or all(o[0] in ("ok", "bad_input", "diverged") for o in job.outcomes.values()) \
                and len(job.outcomes) == job.world
            # Still running after the deadline, or a peer of a failed rank: its group may be
            # broken and the process may be stuck in a collective. A fresh one.
            stale = [s for s in job.slots if s in self.workers and (self.workers[s].job == job.id or not healthy)]
            self._kill_now(stale)
            for s in stale:
                self._replace(s)
            ended.append(job)
        return ended

    def run(self, fn: Callable, args: tuple = (), *, slots: Sequence[int], **kw) -> List[Any]:
        """start + wait: every rank's result in rank order, or the job's error (rank named)."""
        job = self.start(fn, args, slots=slots, **kw)
        try:
            while True:
                for j in self.poll(0.5):
                    if j is job:
                        return job.results()
        except KeyboardInterrupt:
            self._kill_now(job.slots)
            for s in job.slots:
                self._replace(s)
            raise

    # -- the end --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Tell every idle worker to leave, without waiting for it: its group's teardown and its
        exit (20-25 ms for a CPU sweep's two workers on 2 cores) overlap what the owner does
        next (a sweep's winners and report), and close() then finds them gone. No job starts after."""
        self._stopped = True
        for w in self.workers.values():
            if w.job is None and w.ready and not w.told:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
                w.told = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.stop()
        deadline = time.monotonic() + 10
        for w in self.workers.values():
            if w.job is None and w.ready:
                w.proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_now(list(self.workers))  # the rest, a job's ranks among them, at once
        for w in self.workers.values():
            _kill(w.proc)
            w.conn.close()
        self.workers.clear()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _start(p, main) -> None:
    """Start worker process p with SIGINT blocked (a spawned child inherits the mask): a Ctrl-C
    during its interpreter's start and imports stays pending until _worker_main ignores it, instead
    of a KeyboardInterrupt traceback from the import it hit. Here a pending one comes after.
    multiprocessing starts its resource tracker on the first spawn (p.start) with SIGINT blocked and
    then UNBLOCKS it, which would undo our block for that first worker: start the tracker first, so
    that p.start finds it running. A fork of the forkserver has the forkserver's mask, blocked as
    well (forkserver.start); p.start waits for its imports. main: the script the worker imports
    itself (user_main.py), left out of multiprocessing's own start."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        # No file to import (`python -`: '<stdin>'): multiprocessing would try to run it anyway.
        with user_main.no_main_import() if main is not None or user_main.main_file() is None else contextlib.nullcontext():
            with warnings.catch_warnings():
                # Python 3.12+ warns at a fork of a process with native threads (torch's; the
                # store's): a fork of the caller is made only where caller_fork found it safe.
                warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
                p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C (and SIGHUP) taken in the block raise at its end, not inside it. Around a worker's
    start and its record in Pool.workers: one that raised in between left a started worker that
    close() did not know, waiting for its store, while multiprocessing's exit joined it: the
    program hung (1 in ~20 Ctrl-Cs as `shmlearn train`'s 2 workers forked from it). Python-level, not
    a signal mask: a process's signal goes to any thread that does not block it (the store's), and
    Python's handler then raises in the main thread whatever its mask. Only in the main thread,
    where handlers are set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken: List[Tuple[int, Any]] = []
    held = [sig for sig in (signal.SIGINT, getattr(signal, "SIGHUP", None)) if sig is not None]
    before = {sig: signal.signal(sig, lambda n, frame: taken.append((n, frame))) for sig in held}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for n, frame in taken[:1]:  # the first one, as its own handler would have taken it
            handler = before[n]
            if callable(handler):
                handler(n, frame)
            elif handler == signal.SIG_DFL:  # the default action, now
                os.kill(os.getpid(), n)


def _kill(proc) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(10)


_current: List[Pool] = []


@contextmanager
def using(pool: Pool) -> Iterator[Pool]:
    """Within this block, `shmlearn.train` runs its ranks on `pool` (experiments do)."""
    _current.append(pool)
    try:
        yield pool
    finally:
        _current.pop()


def current() -> Optional[Pool]:
    return _current[-1] if _current else None


def run_local(fn, args: tuple, world: int, *, cuda: bool, timeout_s: float, backend: Optional[str] = None,
              threads: Optional[int] = None, rank_threads: bool = False,
              early: Optional[Tuple[Callable, tuple]] = None, lean: bool = False) -> list:
    """Run fn(DistEnv, *args) on `world` local ranks: on the current pool's free slots (pool.using),
    or on a pool of `world` workers made for this call. Returns every rank's result; raises
    BadInput / Diverged / WorkerFailed naming the rank. backend: default NCCL on GPUs, else Gloo
    (Gloo on GPUs: ranks may share one). rank_threads: fn sets each rank's intra-op threads as
    limits.rank_threads does (--threads `threads`, else at most the cores over `world`); where that
    is one, the pool made here may fork its workers from this process (Pool's one_thread). early:
    what each rank starts beside its group's join (worker.Task.early). lean: the pool made here is
    lean (Pool's lean: the run compiles nothing, and no worker imports torch._dynamo)."""
    backend = backend or ("nccl" if cuda else "gloo")
    pool = current()
    if pool is not None:
        if len(pool.free_slots()) < world and not cuda:  # CPU slots are processes: grow
            pool.grow(world - len(pool.free_slots()))
        free = pool.free_slots()
        if len(free) < world:
            raise BadInput(f"--workers: {world} processes needed, the pool has {count(len(free), 'free slot')} "
                           f"of {len(pool.slots)}")
        return pool.run(fn, args, slots=free[:world], backend=backend, timeout_s=timeout_s, early=early)
    one_thread = rank_threads and not cuda and (threads or max(1, usable_cores() // world)) == 1
    with Pool(world, cuda=cuda, one_thread=one_thread, lean=lean) as pool:
        return pool.run(fn, args, slots=range(world), backend=backend, timeout_s=timeout_s, early=early)
