"""Stdout closed by its reader (issue 53): `| head -1` (closed after the first line) and `| true`
(gone before the first write), for every command that prints. Owed: no traceback (a
BrokenPipeError, or Python's "Exception ignored" at exit), stderr at most one line, an exit of 0,
1 or the conventional 141 (128 + SIGPIPE), and a training run's files whole."""
from __future__ import annotations

import functools
from typing import Callable, Dict, List

from benchmarks.faults import registry
from benchmarks.faults.core import TINY, Cmd
from benchmarks.faults.registry import fixture, out_of
from benchmarks.faults.written import run_dir_problems

case = functools.partial(registry.case, klass="pipes")
CODES = {0, 1, 120, 141, -13}
"""Success, a failure, Python's 120 (stdout could not be flushed at exit), or SIGPIPE's."""

COMMANDS: Dict[str, Callable[[str], List[str]]] = {
    "help": lambda t: ["--help"],
    "train-help": lambda t: ["train", "--help"],
    "sweep-help": lambda t: ["sweep", "--help"],
    "report": lambda t: ["report", fixture(t, "run")],
    "advise": lambda t: ["advise", fixture(t, "run"), "--out", out_of(t, "adv")],
    "simulate": lambda t: ["simulate", "--net-bw", "10", "--compute", fixture(t, "run"), "--out", out_of(t, "sim")],
    "train": lambda t: TINY + ["--out", out_of(t)],
    "train-w2": lambda t: TINY[:-5] + ["--workers", "2", "--no-progress", "--out", out_of(t)],
    "sweep": lambda t: ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
                        "--lr", "0.1,0.2", "--no-report", "--no-progress", "--out", out_of(t, "s")],
}
ONE_LINE_OUT = ("train", "train-w2")
"""Commands that print one line only: `| head -1` cannot fault them, `| true` can."""


def _short_stderr(res) -> List[str]:
    return [] if res["stderr_lines"] <= 1 else [f"stderr has {res['stderr_lines']} lines"]


for _name, _args in COMMANDS.items():
    for _pipe in ("head", "closed"):
        if _pipe == "head" and _name in ONE_LINE_OUT:
            continue

        @case(f"pipe-{_name}-{_pipe}", "53", f"shmlearn {_name} {'| head -1' if _pipe == 'head' else '| true'}",
              check=lambda t, r: run_dir_problems(out_of(t)))
        def _(t, args=_args, pipe=_pipe):
            return [Cmd(args(t), CODES, pipe=pipe, verify=_short_stderr, limit=120)]
