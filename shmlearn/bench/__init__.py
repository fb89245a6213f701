"""Benchmarks: `shmlearn bench <name>`.

Each benchmark has a register function (`register(bench_subparsers)`: bench/parsers.py holds those of
comm, ps-sim and throughput, timeline's is its own), which adds its parser with
set_defaults(func=handler). To add one, add its name, register function and help line to
`SUBCOMMANDS`; the `bench` parent command needs no other change. The parsers import no torch, so
`bench --help` and `bench NAME --help` answer at once (issue 53); each handler imports its
benchmark's module (torch) when it runs, and only the benchmark named is built in full.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from shmlearn.bench.parsers import comm, ps_sim, throughput
from shmlearn.bench.timeline import register as timeline


SUBCOMMANDS: Dict[str, Tuple[Callable, str]] = {
    "comm": (comm, "latency and bus bandwidth of the collectives vs size and workers"),
    "ps-sim": (ps_sim, "the seed's dummy-gradient parameter-shard benchmark"),
    "throughput": (throughput, "steps/s of shmlearn's step vs a plain PyTorch loop, its CUDA graph, "
                                "torch.compile and DDP, same run"),
    "timeline": (timeline, "read a saved trace of replayed steps: streams, gaps, forward against backward"),
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
