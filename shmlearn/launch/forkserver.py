"""How a pool starts its workers: spawned fresh, forked from a forkserver that has imported
torch once (every pool, CPU or GPU: train, sweeps, experiments, the Python API), or forked from the
caller itself where that is safe (caller_fork: train()'s own pool of one-thread CPU workers, and
the program's CPU sweep that compiles nothing, whose lean pool never imports torch._dynamo:
Pool's lean; the program starts no forkserver for it, cli.prestart). The program's GPU pools that
compile nothing are lean too: their forkserver imports torch alone (start's dynamo).

Why: on the CPU a worker's start is its imports, torch and torch._dynamo (the first optimizer a
process builds imports the latter anyway: launch.import_before_group), and each spawned worker
paid both while the owner imported torch for itself: on a 2-core machine three processes shared
the cores before the first step (issue 41; measured in docs/performance.md). `start()`, called by
the program before it imports torch (cli.main), starts multiprocessing's forkserver, which imports
THIRD_PARTY while the owner does its own imports and checks; a CPU pool's workers are then forks
of it. The program starts one for train, sweep and experiment (cli.prestart), and so does
`import shmlearn` in a script (`autostart`); a notebook, pytest or `python -c` start theirs with
their first CPU pool (`context`), not at import. It lives as long as its owner: where the
owner's import-time environment has changed since (IMPORT_ENV), its pools spawn.

What stays as a spawned worker had it:
* only third-party modules are preloaded: shmlearn's own modules, the user's script (__main__)
  and the user's parts (pickled, parts.py) are imported in each worker, as before; a strategy
  file added after the forkserver started is found (tests/sync/test_new_strategy.py).
* CUDA: the forkserver imports torch and torch._dynamo and runs nothing else, so it never
  initializes CUDA (nor asks the driver anything), and a fork of it initializes its own as a
  spawned worker did: GPU pools fork from it too (issue 52: a spawned GPU worker imported torch
  and torch._dynamo after its owner had imported torch, ~10 s on an H200 host without bytecode
  caches). A pool of an owner that has initialized CUDA itself still spawns: it has no forkserver
  of its own making to trust with its import-time state.
* stdout and stderr: a worker takes its owner's file descriptors 1 and 2 at its start
  (pool_worker.OwnerStdio), not the forkserver's: pytest's capture and a notebook's cell see it.
* the environment: a worker takes its owner's os.environ at its start (pool_worker); what
  torch reads while it imports comes from the forkserver's start, so where such a variable
  (IMPORT_ENV) changed since, the pool spawns.
* Ctrl-C: the forkserver starts with SIGINT blocked, so its forks start with it blocked, as
  Pool._spawn's spawned children do; the worker ignores it and unblocks it (pool_worker).
* dying with the owner: a fork's parent is the forkserver, so PR_SET_PDEATHSIG cannot name the
  owner: launch.die_with_owner watches the owner's pidfd instead. The forkserver itself, the
  owner's child, sets it first thing (GUARD, preloaded before torch), so that an owner killed
  while it imports torch does not leave it importing.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import Dict, Iterator, Optional

from shmlearn.launch.env import RANK_VARIABLES
from shmlearn.launch.parent import OWNER_ENV

THIRD_PARTY = ("torch", "torch._dynamo")
"""What the forkserver imports: third-party only, never shmlearn's modules (see the docstring),
after the guard, which imports the package's two smallest (errors, parent)."""
GUARD = "shmlearn.launch._forkserver_guard"

IMPORT_ENV = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS", "GOMP", "CUDA", "NCCL", "TRITON",
              "LD_", "PYTHON")
"""Prefixes of variables torch, its libraries or the interpreter may read while importing."""
READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)
"""Of those, variables read only when used, which a worker takes from its owner's environment as
any other: Inductor sets TORCHINDUCTOR_CACHE_DIR itself at its first compile, and with it every
later pool of a process that compiled once would spawn."""

FORKSERVER_ENV = {"PYTHONSAFEPATH": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""Set for the forkserver's start only (its forks take their owner's environment at their start):
PYTHONSAFEPATH, see _neutral_cwd; PYTORCH_NVML_BASED_CUDA_CHECK, so that a torch.cuda.is_available()
during its imports asks NVML, not the CUDA driver, whose answer registers torch's fork handler and
leaves every fork unable to initialize CUDA ("Cannot re-initialize CUDA in forked subprocess")."""

_started_env: Optional[Dict[str, str]] = None
"""Those variables as they were when start() started the forkserver; None: not started here."""


def _import_env() -> Dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(IMPORT_ENV) and k not in READ_WHEN_USED}


def start(dynamo: bool = True) -> bool:
    """Start the forkserver now; it imports THIRD_PARTY in the background (without torch._dynamo
    where `dynamo` is False: the program's pools will be lean, Pool's lean). False where this
    platform has none. Idempotent (multiprocessing restarts a forkserver that died)."""
    global _started_env
    if _started_env is not None:
        return True
    if "forkserver" not in mp.get_all_start_methods():
        return False
    from multiprocessing import forkserver, resource_tracker
    # The tracker first: starting it unblocks SIGINT afterwards (see Pool._spawn), which would
    # undo the block below if the forkserver started it.
    resource_tracker.ensure_running()
    forkserver.set_forkserver_preload([GUARD, *(m for m in THIRD_PARTY if dynamo or m != "torch._dynamo")])
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    # PR_SET_PDEATHSIG fires when the thread that started the process ends: only the main thread's
    # start is tied to this process's life (a forkserver multiprocessing restarts from another
    # thread leaves by its alive pipe, after its imports).
    if threading.current_thread() is threading.main_thread():
        os.environ[OWNER_ENV] = str(os.getpid())
    before = {k: os.environ.get(k) for k in FORKSERVER_ENV}
    os.environ.update(FORKSERVER_ENV)
    try:
        with _neutral_cwd():
            forkserver.ensure_running()
    finally:
        os.environ.pop(OWNER_ENV, None)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _started_env = _import_env()
    atexit.register(_stop)  # before any pool registers its close, so that runs first
    return True


@contextlib.contextmanager
def _neutral_cwd() -> Iterator[None]:
    """The forkserver imports its preload (this package first) before it learns the owner's
    sys.path (Python 3.10-3.12's forkserver ignores the sys_path it is sent), with the `''` that
    `python -c` puts first: the current folder. A folder named `shmlearn` there (the clone's parent
    folder, `shmlearn/runs`) became the package, and every worker died with "cannot import name
    'RunDir' from 'shmlearn.record.runs' (unknown location)". PYTHONSAFEPATH (3.11+) leaves `''` out;
    before 3.11 the forkserver starts in this package's parent folder, where `''` finds this
    package. Its forks take the owner's folder and sys.path from multiprocessing (spawn.prepare)."""
    if sys.version_info >= (3, 11):
        yield
        return
    here = os.getcwd()
    os.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        yield
    finally:
        os.chdir(here)


LAUNCHER_ENV = RANK_VARIABLES
"""A rank of torchrun, mpirun or srun: it trains in its own process and starts no pool."""


def autostart() -> bool:
    """`import shmlearn` in a script: start the forkserver at once, so that it imports torch while
    the script imports its own modules and builds its data, and `shmlearn.train(workers=N)`'s
    workers fork ready (the `shmlearn` program does the same, cli.prestart). A worker started by
    spawn imports torch and torch._dynamo itself (~4 s of a core each) after the script has called
    train(); a ported pytorch/examples script reached its first step about twice as late as
    torchrun's (docs/ports.md). Only where it pays and is safe: a script file (not an interactive
    session, `python -c` or pytest, which would keep the forkserver's import-time state for every
    later pool), not a multiprocessing child (the workers import the script too), not a rank of a
    launcher, and not turned off (SHMLEARN_FORKSERVER=0). Elsewhere
    the first CPU pool starts it (context)."""
    main = sys.modules.get("__main__")
    if (_turned_off() or not getattr(main, "__file__", None)
            or "pytest" in sys.modules or mp.parent_process() is not None
            or any(k in os.environ for k in LAUNCHER_ENV)):
        return False
    return start()


def _stop() -> None:
    """At exit, end the forkserver now, not when its imports end: a command refused after start()
    (a bad flag, found once torch is imported) would leave it holding the terminal's or a pipe's
    stdout for seconds (`shmlearn train ... | tail` waits for it). The pools are closed by then."""
    from multiprocessing import forkserver
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # no public handle on it
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _turned_off() -> bool:
    return os.environ.get("SHMLEARN_FORKSERVER", "1") == "0"


def caller_fork(one_thread: bool, lean: bool = False) -> Optional[str]:
    """None where a CPU pool's worker may be a fork of this process itself, else why not (a pool
    then starts it from the forkserver or spawns it: context). A fork of the caller needs no
    imports, no run of the user's script up to its train() call (user_main.py) and no second read
    of its data: everything the caller defined and loaded is there (issue 51: a ported script's
    workers were ready 0.7-0.9 s after the pool asked, every one re-reading Fashion-MNIST). Only
    where that is safe and pays:
    * one intra-op thread a worker (one_thread: the pool's ranks get cores // processes <= 1, or
      --threads 1), made so before the worker's first op (pool_worker): libgomp, torch's OpenMP,
      keeps the caller's thread team, whose threads a fork does not have, and a fork's first
      parallel region of 2+ threads waits for them forever once the caller ran one; a region of
      one thread uses no team (tests/launch/test_pool_fork.py, both ways);
    * the caller has imported torch._dynamo (the first optimizer it built did): else the worker
      would import it after the fork, ~2 s a worker that the forkserver spends at the program's
      start, beside the caller's own imports; or the pool is lean (its workers never import it:
      a CPU sweep that compiles nothing, whose program then starts no forkserver, cli.prestart);
    * CUDA not initialized (a fork cannot use it) and no process group of the caller's (its Gloo
      threads and sockets would be copied half);
    * no other Python thread (a fork copies the locks they hold, not them: a notebook's kernel
      threads own its output), and called from the main thread;
    * not turned off (SHMLEARN_FORKSERVER=0: every pool spawns), and fork exists (POSIX)."""
    if _turned_off():
        return "SHMLEARN_FORKSERVER=0"
    if "fork" not in mp.get_all_start_methods():
        return "no fork on this platform"
    if not one_thread:
        return "its workers run 2+ intra-op threads (libgomp after a fork)"
    if "torch._dynamo" not in sys.modules and not lean:
        return "torch._dynamo not imported here (the forkserver imports it)"
    if _cuda_initialized():
        return "CUDA is initialized here"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "this process is in a process group"
    if threading.current_thread() is not threading.main_thread() or threading.active_count() > 1:
        return "other threads run here"
    return None


def context(cuda: bool, dynamo: bool = True):
    """The multiprocessing context a pool starts a worker with: the forkserver, for a CPU or GPU
    pool of a process that has not initialized CUDA and whose import-time environment is unchanged
    since the forkserver started; else spawn. `cuda`: the pool's workers use GPUs (they fork all
    the same: see the module docstring). The first CPU pool of a process that has none (the Python API in a
    notebook, pytest or `python -c`, where autostart starts none at import) starts it here: it
    imports torch once, where each spawned worker imported it, and every later pool, and every
    worker a pool replaces, forks ready (dynamo: and torch._dynamo; start). SHMLEARN_FORKSERVER=0:
    every pool spawns."""
    if _turned_off() or _cuda_initialized():
        return mp.get_context("spawn")
    if _started_env is None and (mp.parent_process() is not None or not start(dynamo)):
        return mp.get_context("spawn")  # a multiprocessing child's pools (none of ours), or no forkserver here
    if _import_env() != _started_env:
        return mp.get_context("spawn")
    global _served
    _served = True
    return mp.get_context("forkserver")


_served = False
"""Whether a pool of this process has started a worker from the forkserver (context)."""


def stop_idle() -> None:
    """End the forkserver this process started, if no worker came from it yet: a pool whose
    workers fork from the caller (caller_fork) does not need it, and on a small machine its
    imports, still running when a script's train() forks (a script that imported torch before
    shmlearn started it late), take a core from the workers. A later pool that needs one starts
    it again (context). Never once it has served: its forks report their exit through it."""
    global _started_env
    if _started_env is None or _served:
        return
    from multiprocessing import forkserver
    server = forkserver._forkserver  # no public handle on it
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        server._stop()  # reaps it, closes its alive pipe and socket: ensure_running starts anew
    _started_env = None
