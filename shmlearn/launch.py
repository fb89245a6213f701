"""Start the workers, or adopt the ones a launcher started.

* Under torchrun (RANK/WORLD_SIZE), mpirun (OMPI_COMM_WORLD_* or PMI_*) or srun (SLURM_* of a
  job step) this process IS one rank: detect it and never spawn again.
* Otherwise `--workers N` starts N local processes (plus one with --ps-dedicated), Gloo on CPU,
  one process per GPU with NCCL on CUDA, and watches them: the first rank that dies or fails
  brings the others down, and the message names it.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Dict, Mapping, Optional, Tuple

from shmlearn.errors import BadInput, Diverged, WorkerFailed


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    """local, torchrun, mpirun or srun."""
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for n in names:
        if n in env:
            return int(env[n])
    return None


def _first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: 'node[03-05,07],gpu1' -> 'node03'."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return prefix + first


def _port_from(job_id: str) -> int:
    # Every rank derives the same port from the job id, so none has to tell the others.
    return 20000 + (sum(ord(c) * 31 ** i for i, c in enumerate(job_id)) % 20000)


def detect_env(env: Mapping[str, str] = os.environ) -> Optional[DistEnv]:
    """The launcher's view of this process, or None when no launcher started it."""
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or anything that speaks env://
        return DistEnv(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                       local_rank=_int(env, "LOCAL_RANK") or 0,
                       local_world_size=_int(env, "LOCAL_WORLD_SIZE") or int(env["WORLD_SIZE"]),
                       launcher="torchrun", master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(env.get("MASTER_PORT", 29500)))
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:  # Open MPI; MPICH/Intel MPI (PMI)
        ompi = "OMPI_COMM_WORLD_RANK" in env
        world = _int(env, "OMPI_COMM_WORLD_SIZE" if ompi else "PMI_SIZE")
        job = env.get("OMPI_MCA_orte_ess_jobid") or env.get("OMPI_MCA_ess_base_jobid") \
            or env.get("PMI_JOBID") or env.get("PMIX_NAMESPACE") or "shmlearn"
        return DistEnv(rank=_int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK"), world_size=world,
                       local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") or 0,
                       local_world_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS") or world,
                       launcher="mpirun", master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(env.get("MASTER_PORT") or _port_from(job)))
    # SLURM_STEP_NUM_TASKS is set by srun for its job step, not in an sbatch script itself, so a
    # batch script that calls `shmlearn train` directly is not mistaken for rank 0 of N.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        world = int(env["SLURM_STEP_NUM_TASKS"])
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if env.get("SLURM_STEP_NUM_NODES", "1") == "1"
                                          else _first_host(nodes))
        return DistEnv(rank=int(env["SLURM_PROCID"]), world_size=world,
                       local_rank=_int(env, "SLURM_LOCALID") or 0,
                       local_world_size=_int(env, "SLURM_STEP_TASKS_PER_NODE_INT") or world,
                       launcher="srun", master_addr=addr,
                       master_port=int(env.get("MASTER_PORT") or _port_from(
                           env.get("SLURM_JOB_ID", "0") + "." + env.get("SLURM_STEP_ID", "0"))))
    return None


def import_before_group() -> None:
    """Import torch._dynamo before a process group exists. The first optimizer a process builds
    imports it (~800 modules), and some of them keep references to the default group from then
    on, so destroy_process_group() no longer frees it: Gloo's threads live on, and at interpreter
    exit the group is destroyed under them ("terminate called without an active exception",
    SIGABRT of a finished rank: 6 of 10 runs of a script calling shmlearn.train() under mpirun;
    torch 2.13). Imported first, those modules find no group to hold."""
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
    store, rank, world = next(dist.rendezvous(env.init_method, env.rank, env.world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") if env.launcher == "torchrun" else None
    if attempt is not None:
        store = dist.PrefixStore(f"shmlearn/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- local spawning ---------------------------------------------------------------------------

def _die_with_parent() -> None:
    """Linux: have the kernel SIGTERM this worker if the launching process dies, so a killed
    launcher never leaves orphans blocked in a collective."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(cfg_dict: dict, env: DistEnv, q) -> None:
    _die_with_parent()
    from shmlearn.config import TrainConfig
    from shmlearn.train import run_worker
    try:
        result = run_worker(TrainConfig(**cfg_dict), env)
        q.put(("ok", env.rank, result.summary if env.rank == 0 else None, result.run_dir))
        code = 0
    except (BadInput, Diverged) as e:
        kind = "bad_input" if isinstance(e, BadInput) else "diverged"
        extra = (e.step, e.rank) if isinstance(e, Diverged) else None
        q.put((kind, env.rank, str(e), extra))
        code = e.exit_code
    except BaseException as e:  # noqa: BLE001 - anything else is a worker failure, reported by rank
        last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        where = f" ({os.path.basename(last.filename)}:{last.lineno})" if last else ""
        q.put(("failed", env.rank, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}", None))
        code = 1
    # Let the queue's feeder thread flush, then leave at once: the result is reported and the
    # files written, and library teardown at interpreter exit (NCCL, CUDA) can hang.
    q.close()
    q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(cfg, world_size: int, *, grace_s: float = 10.0, exit_grace_s: float = 30.0) -> Tuple[Optional[dict], Optional[str]]:
    """Run `world_size` local workers; return rank 0's (summary, run_dir) or raise the first
    error as BadInput / Diverged / WorkerFailed, naming the rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs: Dict[int, mp.Process] = {}
    for r in range(world_size):
        env = DistEnv(rank=r, world_size=world_size, local_rank=r, local_world_size=world_size,
                      launcher="local", master_port=port)
        p = ctx.Process(target=_child, args=(cfg.to_dict(), env, q), name=f"shmlearn-rank{r}", daemon=False)
        p.start()
        procs[r] = p
    outcomes: Dict[int, tuple] = {}
    deadline = None
    try:
        while any(p.is_alive() for p in procs.values()):
            wait([p.sentinel for p in procs.values() if p.is_alive()], timeout=0.5)
            _drain(q, outcomes)
            for r, p in procs.items():
                if not p.is_alive() and r not in outcomes and p.exitcode not in (0, None):
                    _drain(q, outcomes)  # its report may have arrived just now
                    if r not in outcomes:
                        why = (f"killed by signal {-p.exitcode}" if p.exitcode < 0
                               else f"exited with code {p.exitcode}")
                        outcomes[r] = ("died", r, f"worker died ({why})", None)
            bad = [o for o in outcomes.values() if o[0] != "ok"]
            if not bad and len(outcomes) == world_size and deadline is None:
                # Every rank reported its result: one that then fails to exit is stopped.
                deadline = time.monotonic() + exit_grace_s
            if bad and deadline is None:
                # Others stop on their own after a divergence (same step) or bad input (before
                # any collective); a death or failure leaves them blocked in a collective: give
                # them a moment to report (a dead peer's neighbours fail at once), then stop them.
                quick = any(o[0] in ("died", "failed") for o in bad)
                deadline = time.monotonic() + (1.0 if quick else grace_s)
            if deadline is not None and time.monotonic() > deadline:
                break
    except KeyboardInterrupt:
        _terminate(procs)
        raise
    _terminate(procs)  # whatever we stop here is not reported as having died
    _drain(q, outcomes)
    # The root cause first: a rank that died, before ranks that failed because it died.
    order = {"died": 0, "failed": 1, "bad_input": 2, "diverged": 3}
    bad = sorted((o for o in outcomes.values() if o[0] != "ok"), key=lambda o: (order[o[0]], o[1]))
    if bad:
        kind, rank, msg, extra = bad[0]
        if kind == "bad_input":
            raise BadInput(msg)
        if kind == "diverged":
            raise Diverged(msg, step=extra[0], rank=extra[1])
        raise WorkerFailed(f"rank {rank}: {msg}")
    ok = outcomes.get(0)
    if ok is None:
        raise WorkerFailed("rank 0: ended without reporting a result")
    return ok[2], ok[3]


def _drain(q, outcomes: Dict[int, tuple]) -> None:
    while True:
        try:
            o = q.get_nowait()
        except queue_mod.Empty:
            return
        outcomes.setdefault(o[1], o)


def _terminate(procs: Dict[int, mp.Process]) -> None:
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    for p in procs.values():
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
