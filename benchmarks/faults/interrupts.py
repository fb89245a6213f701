"""Ctrl-C at every phase (issue 53): 0.5 s and 2.5 s after start, while the pool starts, while
the ranks train, while they evaluate, while a report is written; once and twice. Owed: exit 130
however many times, one line saying "interrupted" (and, for a run that has begun, that --resume
continues it), no traceback, no process left. SIGHUP to a training run is not a success."""
from __future__ import annotations

import functools
import glob
import os
import signal

from benchmarks.faults import registry
from benchmarks.faults.core import LONG, Cmd, Running, workers_of
from benchmarks.faults.during import after, once_training, signal_group, signal_rank, when_exists
from benchmarks.faults.registry import fixture, out_of, write
from benchmarks.faults.written import run_dir_problems, tmp_leftovers

case = functools.partial(registry.case, klass="interrupts")
SIGINT = signal_group(signal.SIGINT)

COMMANDS = {
    "train-w2": (lambda t: LONG + ["--workers", "2", "--out", out_of(t)], 2),
    "train-w1": (lambda t: LONG + ["--workers", "1", "--out", out_of(t)], 1),
    "sweep": (lambda t: ["sweep", "--dataset", "digits", "--model", "mlp", "--epochs", "100", "--workers", "1",
                         "--lr", "0.1,0.2", "--no-report", "--no-progress", "--out", out_of(t, "s")], 1),
}
"""A command that is still busy when the signal comes, and its pool workers."""


def pool_starting(action):
    """Act once the first pool worker exists and nothing has trained yet."""
    def during(r: Running, el: float) -> None:
        if r.fault_t is None and workers_of(r.proc.pid):
            action(r)
            r.fault_how += " (pool starting)"
    return during


def sweep_training(s: str, action):
    """Act once a trial's metrics.jsonl holds 3 rows."""
    def during(r: Running, el: float) -> None:
        if r.fault_t is not None:
            return
        for p in glob.glob(os.path.join(s, "trials", "*", "metrics.jsonl")) + \
                glob.glob(os.path.join(s, "trials", ".tmp", "*", "metrics.jsonl")):
            try:
                with open(p, "rb") as f:
                    if f.read().count(b"\n") >= 3:
                        action(r)
                        return
            except OSError:
                pass
    return during


def twice(during, gap_s: float = 0.3):
    """`during`, then a second SIGINT to the group `gap_s` after the first fault."""
    def both(r: Running, el: float) -> None:
        if r.fault_t is None:
            during(r, el)
        elif "second" not in r.state and el - (r.fault_t - r.t0) >= gap_s:
            r.state["second"] = True
            try:
                os.killpg(r.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
    return both


def phase(kind: str, cmd: str, t: str):
    n = COMMANDS[cmd][1]
    if kind.startswith("at-"):
        return after(float(kind[3:-1]), SIGINT)
    if kind == "pool-start":
        return pool_starting(SIGINT)
    if cmd == "sweep":
        return sweep_training(out_of(t, "s"), SIGINT)
    return once_training(out_of(t), SIGINT, rows_needed=3, n_workers=n if n > 1 else 0)


def _intact(t, results):
    return run_dir_problems(out_of(t)) + tmp_leftovers(out_of(t))


PHASES = {"at-0.5s": ("train-w2", "train-w1", "sweep"), "at-2.5s": ("train-w2", "train-w1", "sweep"),
          "pool-start": ("train-w2", "sweep"), "training": ("train-w2", "train-w1", "sweep")}
for _kind, _cmds in PHASES.items():
    for _cmd in _cmds:
        for _times in (1, 2):
            @case(f"int-{_cmd}-{_kind}{'-twice' if _times == 2 else ''}", "53",
                  f"Ctrl-C {'twice (0.3 s apart) ' if _times == 2 else ''}to {_cmd}'s process group, {_kind}",
                  check=_intact)
            def _(t, kind=_kind, cmd=_cmd, times=_times):
                during = phase(kind, cmd, t)
                resume = ["--resume"] if kind == "training" and cmd.startswith("train") else []
                return [Cmd(COMMANDS[cmd][0](t), 130, says=["interrupted", *resume],
                            during=twice(during) if times == 2 else during, poll_s=0.01)]


SLOW_TEST = """import os
import time
import numpy as np
import torch


class Pairs(torch.utils.data.Dataset):
    def __init__(self, x, y, slow=False):
        self.x, self.y, self.slow = x, y, slow

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.slow:  # an evaluation of ~30 s, and where it runs
            open(os.environ["FAULT_MARK"] + "." + str(os.getpid()), "a").close()
            time.sleep(0.5)
        return self.x[i], self.y[i]


def data():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(576, 5)).astype(np.float32), rng.integers(0, 4, 576)
    return Pairs(x[:512], y[:512]), Pairs(x[512:], y[512:], slow=True)
"""


def in_eval(mark: str, action):
    """Act once a pool worker (not the launcher, which may look at the data) reads a test item."""
    def during(r: Running, el: float) -> None:
        if r.fault_t is None and any(not p.endswith(f".{r.proc.pid}") for p in glob.glob(mark + ".*")):
            action(r)
            r.fault_how += " (evaluating)"
    return during


for _cmd in ("train-w2", "sweep"):
    for _times in (1, 2):
        @case(f"int-{_cmd}-eval{'-twice' if _times == 2 else ''}", "53",
              f"Ctrl-C {'twice ' if _times == 2 else ''}to {_cmd} while a rank evaluates (a test set read slowly)",
              check=_intact)
        def _(t, cmd=_cmd, times=_times):
            data = write(out_of(t, "slow_data.py"), SLOW_TEST)
            common = ["--dataset", f"{data}:data", "--model", "mlp", "--loader", "stream", "--samples", "8192",
                      "--no-progress"]
            args = (["train", *common, "--workers", "2", "--out", out_of(t)] if cmd == "train-w2" else
                    ["sweep", *common, "--workers", "1", "--lr", "0.1,0.2", "--no-report", "--out", out_of(t, "s")])
            mark = out_of(t, "evaluating")
            during = in_eval(mark, SIGINT)
            return [Cmd(args, 130, says=["interrupted", *(["--resume"] if cmd == "train-w2" else [])],
                        env={"FAULT_MARK": mark}, during=twice(during) if times == 2 else during, poll_s=0.01)]


def _report_clean(t, results):
    run = out_of(t)
    return tmp_leftovers(run) + ([] if not os.path.exists(os.path.join(run, "report.html")) or results[0]["exit"] == 0
                                 or _whole_html(os.path.join(run, "report.html")) else ["report.html torn"])


def _whole_html(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read().rstrip().endswith(b"</html>")


@case("int-report-figures", "53", "Ctrl-C to `report RUN` the moment RUN/figures appears", check=_report_clean,
      keep=lambda t: [out_of(t)])
def _(t):
    run = fixture(t, "run")
    return [Cmd(["report", run], {0, 130}, during=when_exists(os.path.join(run, "figures"), SIGINT), poll_s=0.001,
                verify=lambda res: [] if res["exit"] == 0 or "interrupted" in res["stderr"] else
                ["stderr lacks 'interrupted'"])]


for _at in (0.5, 2.0):
    @case(f"int-report-at-{_at:g}s", "53", f"Ctrl-C to `report RUN` {_at:g} s after start", check=_report_clean,
          keep=lambda t: [out_of(t)])
    def _(t, at=_at):
        return [Cmd(["report", fixture(t, "run")], {0, 130}, during=after(at, SIGINT))]


@case("int-sweep-report", "53", "Ctrl-C to a sweep the moment its report's figures folder appears",
      check=lambda t, r: tmp_leftovers(out_of(t, "s")))
def _(t):
    s = out_of(t, "s")
    return [Cmd(["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
                 "--lr", "0.1,0.2", "--no-progress", "--out", s], {0, 130},
                during=when_exists(os.path.join(s, "figures"), SIGINT), poll_s=0.001)]


@case("int-train-progress-bar", "53", "Ctrl-C to a training run with its progress bar on: the line is its own, "
      "and says --resume continues", check=_intact)
def _(t):
    args = [a for a in LONG if a != "--no-progress"] + ["--workers", "2", "--out", out_of(t)]
    return [Cmd(args, 130, last_says=["interrupted", "--resume"], during=once_training(out_of(t), SIGINT),
                verify=lambda res: [] if res["stderr_tail"].splitlines()[-1].startswith("shmlearn") else
                ["the interrupt line is glued to the progress bar"])]


HUP_CODES = {1, 129, 130, -1}
"""Anything but a success: the default action (-1), 128 + 1, or an interrupt's 130, or 1."""
for _cmd in ("train-w2", "train-w1", "sweep"):
    @case(f"hup-{_cmd}-training", "53", f"SIGHUP to {_cmd}'s process group once training (the terminal closed)",
          check=_intact)
    def _(t, cmd=_cmd):
        return [Cmd(COMMANDS[cmd][0](t), HUP_CODES,
                    during=_hup(cmd, t), poll_s=0.01)]


def _hup(cmd: str, t: str):
    hup = signal_group(signal.SIGHUP)
    if cmd == "sweep":
        return sweep_training(out_of(t, "s"), hup)
    return once_training(out_of(t), hup, rows_needed=3, n_workers=COMMANDS[cmd][1] if cmd != "train-w1" else 0)


for _cmd in ("train-w2", "train-w1"):
    @case(f"hup-{_cmd}-launcher-only", "53", f"SIGHUP to {_cmd}'s launcher alone once training (kill -HUP PID; "
          f"it exited 0)", check=_intact)
    def _(t, cmd=_cmd):
        def hup(r: Running) -> None:
            r.proc.send_signal(signal.SIGHUP)
            r.fault("SIGHUP of the launcher once training")
        n = COMMANDS[cmd][1]
        return [Cmd(COMMANDS[cmd][0](t), HUP_CODES, during=once_training(out_of(t), hup, n_workers=n if n > 1 else 0),
                    poll_s=0.01)]


for _rank in (0, 1):
    @case(f"hup-train-w2-rank{_rank}", "53", f"SIGHUP to rank {_rank} of a 2-worker run once training",
          check=_intact)
    def _(t, rank=_rank):
        hup = signal_rank(rank, signal.SIGHUP)
        return [Cmd(COMMANDS["train-w2"][0](t), HUP_CODES, during=once_training(out_of(t), hup), poll_s=0.01)]


@case("hup-train-w2-at-0.5s", "53", "SIGHUP to a training run's process group 0.5 s after start")
def _(t):
    return [Cmd(COMMANDS["train-w2"][0](t), HUP_CODES, during=after(0.5, signal_group(signal.SIGHUP)))]


@case("term-train-w2-group", "53", "SIGTERM to a training run's whole process group once training", check=_intact)
def _(t):
    return [Cmd(COMMANDS["train-w2"][0](t), {1, 130, 143, -15},
                during=once_training(out_of(t), signal_group(signal.SIGTERM)), poll_s=0.01)]
