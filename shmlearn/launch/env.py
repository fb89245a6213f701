"""The one parser of a launcher's environment: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, ...,
MASTER_ADDR, MASTER_PORT), Open MPI (OMPI_COMM_WORLD_*), MPICH/Intel MPI (PMI_*) and srun (SLURM_*).

Every variable it knows is checked where it is set, before any socket opens: its type (a whole
number), its range (a port from 1 to 65535, a world of at least one rank) and its consistency with
the others (a rank inside its world, a rank given with its world size). Each problem names the
variable, its value and what is expected, once; all of them together are one BadInput (exit 2) of
one line, problems separated by "; " (a refusal is one line, whatever the launcher set wrong).
Imports nothing of torch's: the CLI asks it before its heavy imports.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Mapping, Optional

from shmlearn.errors import BadInput

DEFAULT_PORT = 29500
"""MASTER_PORT when the launcher sets none (torchrun's default)."""


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
    master_port: int = DEFAULT_PORT
    job: str = ""
    """Pool runs: the job's name, so heartbeats of one job never mix with an earlier one's on
    the same (reused) process group."""

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


# Each launcher: (name, rank variable, world-size variable, local rank variables, local size variables).
# A family is in play when its rank or its size variable is set; then both must be.
TORCHRUN = ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",))
OPEN_MPI = ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
            ("OMPI_COMM_WORLD_LOCAL_SIZE",))
PMI = ("mpirun", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",))
SLURM_NUMBERS = ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_STEP_TASKS_PER_NODE_INT")
"""Slurm's counts shmlearn reads (each at least 1), checked wherever SLURM_PROCID is set."""

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                  "SLURM_PROCID")
"""Any of these set: the process may be a launcher's rank (the CLI asks the parser then)."""


class _Reader:
    """Reads whole numbers from the environment, collecting one line per problem."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env
        self.problems: List[str] = []

    def problem(self, name: str, expected: str) -> None:
        self.add(f"{name}={self.env.get(name, '')!r}: expected {expected}")

    def add(self, line: str) -> None:
        if line not in self.problems:  # a variable read twice (SLURM_STEP_NUM_TASKS) is one problem
            self.problems.append(line)

    def number(self, name: str, lo: int, hi: Optional[int] = None, what: str = "") -> Optional[int]:
        raw = self.env.get(name)
        if raw is None:
            return None
        span = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        try:
            value = int(raw.strip())
        except ValueError:
            self.problem(name, f"a whole number {span}{what}")
            return None
        if value < lo or (hi is not None and value > hi):
            self.problem(name, f"a whole number {span}{what}")
            return None
        return value

    def first(self, names, lo: int, what: str = "") -> Optional[int]:
        for n in names:
            if n in self.env:
                return self.number(n, lo, what=what)
        return None


def _family(r: _Reader, family) -> Optional[tuple]:
    """(rank, world, local_rank, local_world) of one launcher's variables, or None when none of
    them is set; problems go to r."""
    launcher, rank_var, size_var, local_vars, local_size_vars = family
    env = r.env
    if rank_var not in env and size_var not in env:
        return None
    world = r.number(size_var, 1, what=f" (the number of ranks {launcher} started)")
    rank = r.number(rank_var, 0, what=" (this process's rank)")
    for have, lack in ((rank_var, size_var), (size_var, rank_var)):
        if have in env and lack not in env:
            r.add(f"{have}={env[have]!r} is set but {lack} is not: a rank of {launcher} needs both")
    local_rank = r.first(local_vars, 0)
    local_world = r.first(local_size_vars, 1)
    if rank is not None and world is not None and rank >= world:
        r.problem(rank_var, f"a rank below {size_var}={world} (ranks are 0 to {world - 1})")
    if local_world is not None and world is not None and local_world > world:
        r.problem(local_size_vars[0], f"at most {size_var}={world}")
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        r.problem(local_vars[0], f"a local rank below {local_size_vars[0]}={local_world}")
    if rank is None or world is None:
        return None
    return rank, world, local_rank or 0, local_world or world


def _master(r: _Reader, default_addr: str, default_port) -> tuple:
    addr = r.env.get("MASTER_ADDR")
    if addr is not None and not addr.strip():
        r.problem("MASTER_ADDR", "a host name or IP address of rank 0's host")
    port = r.number("MASTER_PORT", 1, 65535, what=" (a TCP port free on rank 0's host)") \
        if r.env.get("MASTER_PORT") else None
    return (addr.strip() if addr else None) or default_addr, port or default_port


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


def parse(env: Mapping[str, str]) -> Optional[DistEnv]:
    """The launcher's view of this process, or None when no launcher started it; BadInput (every
    problem of the environment, one line each) when its variables are wrong."""
    r = _Reader(env)
    torchrun = _family(r, TORCHRUN)
    ompi = _family(r, OPEN_MPI)
    pmi = _family(r, PMI)
    slurm = None
    if "SLURM_PROCID" in env:
        for n in SLURM_NUMBERS:
            r.number(n, 1)
        procid = r.number("SLURM_PROCID", 0, what=" (this task's rank)")
        local = r.number("SLURM_LOCALID", 0)
        # SLURM_STEP_NUM_TASKS is set by srun for its job step, not in an sbatch script itself, so
        # a batch script that calls `shmlearn train` directly is not mistaken for rank 0 of N.
        world = r.number("SLURM_STEP_NUM_TASKS", 1) if "SLURM_STEP_NUM_TASKS" in env else None
        if procid is not None and world is not None:
            if procid >= world:
                r.problem("SLURM_PROCID", f"a rank below SLURM_STEP_NUM_TASKS={world}")
            slurm = procid, world, local or 0, r.number("SLURM_STEP_TASKS_PER_NODE_INT", 1) or world
    addr, port = _master(r, "127.0.0.1", None)
    if r.problems:
        raise BadInput("launcher environment: " + "; ".join(r.problems))
    if torchrun is not None:
        return DistEnv(*torchrun, launcher="torchrun", master_addr=addr, master_port=port or DEFAULT_PORT)
    if ompi is not None or pmi is not None:
        job = env.get("OMPI_MCA_orte_ess_jobid") or env.get("OMPI_MCA_ess_base_jobid") \
            or env.get("PMI_JOBID") or env.get("PMIX_NAMESPACE") or "shmlearn"
        return DistEnv(*(ompi or pmi), launcher="mpirun", master_addr=addr, master_port=port or _port_from(job))
    if slurm is not None:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        if not env.get("MASTER_ADDR"):
            addr = "127.0.0.1" if env.get("SLURM_STEP_NUM_NODES", "1").strip() == "1" else _first_host(nodes)
        return DistEnv(*slurm, launcher="srun", master_addr=addr, master_port=port or _port_from(
            env.get("SLURM_JOB_ID", "0") + "." + env.get("SLURM_STEP_ID", "0")))
    return None


def detect_env(env: Mapping[str, str] = os.environ) -> Optional[DistEnv]:
    """The launcher's view of this process, or None when no launcher started it (parse)."""
    return parse(env)
