"""Benchmarks: `shmlearn bench <name>`.

Each benchmark module has `register(bench_subparsers)`, which adds its parser with
set_defaults(func=handler). To add one (e.g. `bench throughput`), add its name, register function
and help line to `SUBCOMMANDS`; the `bench` parent command needs no other change. A module is
imported only when its own parser is built (`bench NAME ...`): `bench --help` lists them by name
and help line without importing them (torch), and they import torch.distributed only inside the
workers.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple


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


SUBCOMMANDS: Dict[str, Tuple[Callable, str]] = {
    "comm": (_comm, "latency and bus bandwidth of the collectives vs size and workers"),
    "ps-sim": (_ps_sim, "the seed's dummy-gradient parameter-shard benchmark"),
    "throughput": (_throughput, "steps/s of shmlearn's step vs a plain PyTorch loop, its CUDA graph, "
                                "torch.compile and DDP, same run"),
    "timeline": (_timeline, "read a saved trace of replayed steps: streams, gaps, forward against backward"),
}
"""name -> (register(bench_subparsers), the help line that register gives; tests/cli/test_cli_start.py
checks each against it), one per `shmlearn bench` subcommand."""


def register(sub, argv: Optional[List[str]] = None) -> None:
    """Add the `bench` parent command and every subcommand in SUBCOMMANDS under it. argv: the
    words after `bench`; then only the benchmark it names is built in full, the others listed by
    name and help line, so that `bench --help` and a misspelled benchmark answer at once."""
    p = sub.add_parser("bench", help="benchmarks (communication, parameter-server simulation, ...)",
                       description="Benchmarks that record evidence: device, driver, torch version, date, "
                                   "repeats, median and spread. Each writes JSON (and a plot where it has one).")
    bench_sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK",
                                 parser_class=type(p))
    chosen = argv[0] if argv else None
    for name, (register_one, help_) in SUBCOMMANDS.items():
        if argv is None or name == chosen:
            register_one(bench_sub)
        else:
            bench_sub.add_parser(name, help=help_)
