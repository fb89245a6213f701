"""Start the workers, or adopt the ones a launcher started.

* Under torchrun (RANK/WORLD_SIZE), mpirun (OMPI_COMM_WORLD_* or PMI_*) or srun (SLURM_* of a
  job step) this process IS one rank: detect it and never spawn again.
* Otherwise `--workers N` runs N local ranks (plus one with --ps-dedicated) on the pool of
  long-lived workers (pool.py), Gloo on CPU, one process per GPU with NCCL on CUDA: the first
  rank that dies, fails or stops brings the others down, and the message names it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
from typing import Optional

from shmlearn.launch import listen
from shmlearn.errors import BadInput, WorkerFailed, count, one_line
from shmlearn.launch import env as launch_env
from shmlearn.launch.env import DistEnv
from shmlearn.config.limits import mem_available, usable_cores
from shmlearn.launch.parent import die_with_parent
from shmlearn.launch import lean


detect_env = launch_env.detect_env
"""The launcher's view of this process (launch/env.py parses and checks its variables)."""


def die_with_owner(owner_pid: int) -> None:
    """die_with_parent for a process that `owner_pid` started, directly (spawn) or through the
    forkserver (forkserver.py), whose fork has the forkserver as its parent and so cannot name its
    owner to PR_SET_PDEATHSIG: a daemon thread waits on the owner's pidfd and SIGKILLs this
    process when the owner ends. Leaves at once if the owner is already gone."""
    if os.getppid() == owner_pid:
        die_with_parent(owner_pid)
        return
    import select
    import signal
    import threading
    try:
        fd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (not Linux, or before 5.3): ask once a second
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable when the owner has exited
        else:
            while _alive(owner_pid):
                select.select([], [], [], 1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="shmlearn-owner-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def import_before_group() -> None:
    """Import torch._dynamo before a process group exists. The first optimizer a process builds
    imports it (~800 modules), and some of them keep references to the default group from then
    on, so destroy_process_group() no longer frees it: Gloo's threads live on, and at interpreter
    exit the group is destroyed under them ("terminate called without an active exception",
    SIGABRT of a finished rank: 6 of 10 runs of a script calling shmlearn.train() under mpirun;
    torch 2.13). Imported first, those modules find no group to hold. Not where this process runs
    its optimizers without Dynamo (launch/lean.py): nothing imports it then."""
    if lean.active():
        return
    import torch._dynamo  # noqa: F401


def init_process_group(backend: str, env: DistEnv, timeout_s: float) -> None:
    """Join the default process group of `env`.

    Under torchrun with restarts, every attempt gets its own key prefix in the store: torchrun's
    c10d rendezvous keeps ONE TCP store for the whole job (TORCH_DISABLE_SHARE_RDZV_TCP_STORE is
    off by default) and torch adds no per-attempt prefix, so after a restart a rank could read
    the address a dead rank of the previous attempt published, and Gloo's connect fails with
    "Connection refused" (seen in CI, torch 2.13). The prefix costs nothing when there is no
    restart.
    """
    import datetime

    import torch.distributed as dist

    import_before_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world = env.rank, env.world_size
    if env.launcher == "local" and world == 1:  # a 1-worker run in this process: all on loopback
        store = listen.bound_store(listen.LOOPBACK, 0, timeout=timeout, world_size=1)
        _join(backend, store, rank, world, timeout, env)
        return
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    listen.resolve(env.master_addr, timeout_s)  # a name that does not resolve: one line, not a hang
    held = HeldStderr()
    try:
        with held:
            if agent:  # torchrun's store: no listener of ours
                store, rank, world = next(dist.rendezvous(env.init_method, env.rank, env.world_size, timeout=timeout))
            else:  # rank 0 hosts the store on MASTER_ADDR's address only (listen.py)
                store = listen.launcher_store(env.master_addr, env.master_port, rank, world, timeout)
                roll_call(store, env, timeout_s)
            _join(backend, store, rank, world, timeout, env)
    except dist.DistError as e:
        # A rank the others wait for is stopped, gone or never started. Under a launcher the
        # store is rank 0's (or torchrun's agent's): a rank other than 0 cannot tell which of
        # them does not answer (issue 38, 9: SIGSTOP of rank 0 gave rank 1's traceback).
        host = "torchrun's agent" if agent else f"rank 0 at {env.master_addr}:{env.master_port}"
        who = ("another rank did not join (stopped, gone or never started)" if rank == 0 and not agent
               else f"rank 0 or the launcher does not answer (the store is {host})")
        raise WorkerFailed(f"rank {rank}: the rendezvous timed out after {timeout_s:g} s (--timeout): {who} "
                           f"({one_line(e)})") from None


def _prefix(env: DistEnv) -> str:
    """The key prefix of this process's next group in its job's store (_join): one per torchrun
    attempt and per group this process joins."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") if env.launcher == "torchrun" else None
    return f"shmlearn/attempt_{attempt or 0}/group_{_groups_joined + 1}"


def roll_call(store, env: DistEnv, timeout_s: float) -> None:
    """Every rank posts that it reached the store; rank 0 waits up to timeout_s (--timeout) for all
    of them and names those that never came (torch's own wait says only that it timed out)."""
    import time
    prefix = _prefix(env)
    if env.rank != 0:
        store.set(f"{prefix}/joined/{env.rank}", "1")
        return
    missing = list(range(1, env.world_size))
    deadline = time.monotonic() + timeout_s
    while missing:
        missing = [r for r in missing if not store.check([f"{prefix}/joined/{r}"])]
        if not missing:
            break
        if time.monotonic() > deadline:
            ranks = ", ".join(map(str, missing))
            raise WorkerFailed(f"rank 0: {count(len(missing), 'rank')} of {env.world_size} did not join within "
                               f"{timeout_s:g} s (--timeout): rank{'s' if len(missing) > 1 else ''} {ranks} "
                               f"(not started, or started with another MASTER_ADDR, MASTER_PORT or world size; "
                               f"the store is {env.master_addr}:{env.master_port})")
        time.sleep(0.1)


class HeldStderr:
    """Holds this process's fd 2 in a temporary file during the rendezvous: torch's C++ store
    logs each failed connect with a 30-frame C++ stack trace before the error it ends with. On
    success what was held is written out; on a failure it is dropped for the one line that
    replaces it. Pool workers hold theirs around their group's rendezvous too (pool.py)."""

    def __enter__(self):
        import tempfile
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, kind, value, tb) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        import torch.distributed as dist
        if not isinstance(value, (dist.DistError, BadInput, WorkerFailed)):  # each is one line of ours
            self.file.seek(0)
            with os.fdopen(os.dup(2), "wb") as err:
                shutil.copyfileobj(self.file, err)
        self.file.close()


def _join(backend: str, store, rank: int, world: int, timeout, env: DistEnv) -> None:
    import torch.distributed as dist
    global _groups_joined
    # And every group of this process its own prefix too: a script that calls shmlearn.train twice
    # under torchrun rendezvouses twice on the same store, and the second group would read the
    # first one's keys and hang. Every rank makes the same calls, so the counts agree.
    store = dist.PrefixStore(_prefix(env), store)
    _groups_joined += 1
    with listen.on_loopback() if env.launcher == "local" else contextlib.nullcontext():
        join_default_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


_groups_joined = 0


_excepthook_before_group = None
"""sys.excepthook as it was before this process's first live default group (join_default_group)."""


def join_default_group(backend: str, **kwargs) -> None:
    """dist.init_process_group(backend, **kwargs), remembering the sys.excepthook it replaces.
    torch wraps sys.excepthook at every init_process_group to prefix "[rankN]: " to a traceback,
    and no destroy_process_group undoes it: a notebook or a pool worker that trained 13 runs
    printed its next traceback with "[rank0]: " 13 times on each line. leave_default_group puts
    the hook back."""
    import torch.distributed as dist
    global _excepthook_before_group
    before = sys.excepthook
    dist.init_process_group(backend, **kwargs)
    if _excepthook_before_group is None:
        _excepthook_before_group = before


def leave_default_group(rank: int, nccl: bool) -> None:
    """Tear the default process group down (NCCL: destroy_group, never hanging) and put back the
    sys.excepthook the group's join replaced."""
    import torch.distributed as dist
    global _excepthook_before_group
    if nccl:
        destroy_group(rank)
    else:
        dist.destroy_process_group()
    if _excepthook_before_group is not None:
        sys.excepthook, _excepthook_before_group = _excepthook_before_group, None


def destroy_group(rank: int, limit_s: float = 30.0) -> None:
    """NCCL: tear the process group down, but never hang in it: the run's files are written by now,
    and a communicator that will not close must not keep the run from ending."""
    import threading

    import torch.distributed as dist

    t = threading.Thread(target=dist.destroy_process_group, name="shmlearn-destroy-group", daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        print(f"shmlearn: rank {rank}: the process group did not shut down within {limit_s:.0f} s; "
              f"leaving it to the process's exit", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- local runs ---------------------------------------------------------------------------------

def check_capacity(processes: int, threads: Optional[int], oversubscribe: bool) -> None:
    """Refuse, before any process starts, a local CPU run this machine cannot hold: more than 16
    processes per core (each waits its turn in every collective; the single-neuron study's 17
    processes on 2 cores are 8.5 per core), or more memory than is available (~150 MB per
    process that is its own: torch's import and the worker's buffers)."""
    if oversubscribe:
        return
    cores = usable_cores()
    if processes > 16 * cores:
        raise BadInput(f"--workers: {processes} processes on {count(cores, 'core')} (at most {16 * cores}); "
                       f"use fewer, or --oversubscribe")
    if threads is not None and threads > 4 * cores:
        raise BadInput(f"--threads {threads}: more than 4 per core ({count(cores, 'core')}); use fewer, or --oversubscribe")
    avail = mem_available()
    if avail is not None and processes * PROCESS_MB * 2**20 > avail:
        raise BadInput(f"--workers: {processes} processes need about {processes * PROCESS_MB} MB, "
                       f"{avail // 2**20} MB available; use fewer, or --oversubscribe")


PROCESS_MB = 150

