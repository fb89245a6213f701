"""Benchmarks: `shmlearn bench <name>`.

Each benchmark module has `register(bench_subparsers)`, which adds its parser with
set_defaults(func=handler). To add one (e.g. `bench throughput`), append its register function
to `SUBCOMMANDS`; the `bench` parent command needs no other change. Modules are imported only
when the parser is built, and they import torch.distributed only inside the workers.
"""
from __future__ import annotations

from typing import Callable, List


def _comm(sub) -> None:
    from shmlearn.bench.comm import register  # lazy: torch; every bench.* import runs this file
    register(sub)


def _ps_sim(sub) -> None:
    from shmlearn.bench.ps_sim import register  # lazy: torch; every bench.* import runs this file
    register(sub)


def _throughput(sub) -> None:
    from shmlearn.bench.throughput import register  # lazy: torch; every bench.* import runs this file
    register(sub)


def _timeline(sub) -> None:
    from shmlearn.bench.timeline import register  # lazy: torch; every bench.* import runs this file
    register(sub)


SUBCOMMANDS: List[Callable] = [_comm, _ps_sim, _throughput, _timeline]
"""register(bench_subparsers) functions, one per `shmlearn bench` subcommand."""


def register(sub) -> None:
    """Add the `bench` parent command and every subcommand in SUBCOMMANDS under it."""
    p = sub.add_parser("bench", help="benchmarks (communication, parameter-server simulation, ...)",
                       description="Benchmarks that record evidence: device, driver, torch version, date, "
                                   "repeats, median and spread. Each writes JSON (and a plot where it has one).")
    bench_sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK",
                                 parser_class=type(p))
    for register_one in SUBCOMMANDS:
        register_one(bench_sub)
