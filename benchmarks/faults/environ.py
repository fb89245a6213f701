"""The launcher's environment (issue 53): torchrun's, Open MPI's, PMI's and Slurm's variables
with a wrong type, out of range or inconsistent are one line naming the variable, exit 2, before
any socket opens; a rendezvous that cannot complete (an unresolvable MASTER_ADDR, a port taken,
rank 0 alone in a world of 2) ends within its --timeout, in one line."""
from __future__ import annotations

import functools
import socket

from benchmarks.faults import registry
from benchmarks.faults.core import TINY, Cmd
from benchmarks.faults.registry import out_of

case = functools.partial(registry.case, klass="environ")
W1 = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
LAUNCHED = TINY[:TINY.index("--workers")] + TINY[TINY.index("--workers") + 2:]
"""TINY without --workers: under a launcher the world size is the worker count."""

BAD = [  # (name, environment, the variable the line must name)
    ("world-size-0", {"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ("world-size-two", {"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE"),
    ("world-size-negative", {"RANK": "0", "WORLD_SIZE": "-2"}, "WORLD_SIZE"),
    ("world-size-fraction", {"RANK": "0", "WORLD_SIZE": "1.5"}, "WORLD_SIZE"),
    ("world-size-empty", {"RANK": "0", "WORLD_SIZE": ""}, "WORLD_SIZE"),
    ("rank-3-of-2", {"RANK": "3", "WORLD_SIZE": "2"}, "RANK"),
    ("rank-negative", {"RANK": "-1", "WORLD_SIZE": "1"}, "RANK"),
    ("rank-x", {"RANK": "x", "WORLD_SIZE": "1"}, "RANK"),
    ("local-rank-x", {**W1, "LOCAL_RANK": "x"}, "LOCAL_RANK"),
    ("local-world-size-0", {**W1, "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE"),
    ("master-port-70000", {**W1, "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ("master-port-negative", {**W1, "MASTER_PORT": "-1"}, "MASTER_PORT"),
    ("master-port-x", {**W1, "MASTER_PORT": "http"}, "MASTER_PORT"),
    ("ompi-rank-without-size", {"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
    ("ompi-rank-x", {"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "1"}, "OMPI_COMM_WORLD_RANK"),
    ("ompi-size-0", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}, "OMPI_COMM_WORLD_SIZE"),
    ("ompi-rank-2-of-2", {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
    ("pmi-rank-without-size", {"PMI_RANK": "0"}, "PMI_SIZE"),
    ("slurm-ntasks-x", {"SLURM_PROCID": "0", "SLURM_NTASKS": "x", "SLURM_STEP_NUM_TASKS": "x"}, "SLURM_"),
    ("slurm-procid-x", {"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "1"}, "SLURM_PROCID"),
    ("slurm-procid-2-of-1", {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "1"}, "SLURM_PROCID"),
]
for _name, _env, _var in BAD:
    case(f"env-{_name}", "53", " ".join(f"{k}={v}" for k, v in _env.items()) + " shmlearn train")(
        lambda t, env=_env, var=_var: [Cmd(LAUNCHED + ["--out", out_of(t)], 2, env=env, says=[var], limit=60)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def held_port(listen: bool) -> socket.socket:
    """A port another program holds: bound, and listening (a server that never answers) or not."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    if listen:
        s.listen(8)
    return s


TIMEOUT = ["--timeout", "10"]
"""Each rendezvous below must end within this (the case's hang limit is 60 s)."""


@case("env-master-addr-unresolvable-w1", "53", "RANK=0 WORLD_SIZE=1 MASTER_ADDR=no-such-host.invalid (--timeout 10; "
      "it never exited)")
def _(t):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": str(free_port())}
    return [Cmd(LAUNCHED + TIMEOUT + ["--out", out_of(t)], {1, 2}, env=env, one_line=True,
                says=["no-such-host.invalid"],
                limit=60)]


@case("env-master-addr-unresolvable-w1-default-timeout", "53", "RANK=0 WORLD_SIZE=1 "
      "MASTER_ADDR=no-such-host.invalid with the default --timeout (300 s): the name cannot resolve, so waiting "
      "cannot help (it never exited)")
def _(t):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": str(free_port())}
    return [Cmd(LAUNCHED + ["--out", out_of(t)], {1, 2}, env=env, one_line=True, says=["no-such-host.invalid"],
                limit=90)]


@case("env-master-addr-unresolvable-rank1", "53", "RANK=1 WORLD_SIZE=2 MASTER_ADDR=no-such-host.invalid "
      "(--timeout 10)")
def _(t):
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": str(free_port())}
    return [Cmd(LAUNCHED + TIMEOUT + ["--out", out_of(t)], {1, 2}, env=env, one_line=True,
                says=["no-such-host.invalid"], limit=60)]


@case("env-rank0-alone-of-2", "53", "RANK=0 WORLD_SIZE=2 and no rank 1 (--timeout 10)")
def _(t):
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return [Cmd(LAUNCHED + TIMEOUT + ["--out", out_of(t)], {1, 2}, env=env, one_line=True,
                limit=60)]


@case("env-rank1-alone-of-2", "53", "RANK=1 WORLD_SIZE=2 and no rank 0 listening (--timeout 10)")
def _(t):
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return [Cmd(LAUNCHED + TIMEOUT + ["--out", out_of(t)], {1, 2}, env=env, one_line=True,
                limit=60)]


for _listen in (False, True):
    for _world in (1, 2):
        @case(f"env-master-port-taken{'-listening' if _listen else ''}-w{_world}", "53",
              f"RANK=0 WORLD_SIZE={_world} MASTER_PORT held by another program"
              f"{' that listens and never answers' if _listen else ''} (--timeout 10)")
        def _(t, listen=_listen, world=_world):
            s = held_port(listen)
            env = {"RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(s.getsockname()[1])}
            return [Cmd(LAUNCHED + TIMEOUT + ["--out", out_of(t)], {1, 2}, env=env, one_line=True,
                        says=[str(s.getsockname()[1])], hold=[s], limit=60)]
