"""Issue 15's fault campaign, rerun: every fault and bad input the issue lists, plus the classic
ones, as real subprocesses of `python -m shmlearn` (2 CPU workers, digits, small budgets).

    python benchmarks/fault_campaign.py [--only NAME[,NAME...]] [--repeat 3] [--limit 180]

Each run carries its own SHMLEARN_TEST_TAG, so every process it started (launcher, pool workers,
multiprocessing's resource tracker) is found through /proc/*/environ, as the tests find them.
For each run: the expected exit code against the actual one, whether stderr holds a traceback
(Python's, or C++ frames), whether an exit 2 was one line, the wall time, the time from the fault
to the exit where there is a fault moment, the processes left 2 s after the exit, and whether
anything already written was lost or torn (metrics/eval rows, summary.json, results.jsonl).

A run is classified, first match wins: hang (no exit within --limit s: the case is then killed),
orphan, traceback, lost, wrong (exit code or message not the promised one), else survived.
The target (issue 15, acceptance 3): 0 hangs, 0 orphans, 0 tracebacks, 0 lost.

Writes benchmarks/results/fault_campaign/<date>.json (environment first) and README.md there.
A campaign run takes ~15 min on 2 cores; it needs the machine to itself for honest bounds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from shmlearn.bench.common import environment  # noqa: E402

RESULTS = os.path.join(HERE, "results", "fault_campaign")
BASE = ["train", "--dataset", "digits", "--model", "mlp", "--samples", "12800", "--batch-size", "32",
        "--eval-points", "2", "--no-progress"]
"""200 steps at 2 workers (the reliability tests' run): a few seconds of training."""
LONG = ["train", "--dataset", "digits", "--model", "mlp", "--epochs", "200", "--no-progress"]
"""~2200 steps at 2 workers: still training when a signal comes from outside."""
SWEEP = ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "2048", "--no-report",
         "--no-progress"]
SETTLE_S = 2.0
"""Processes of a run still alive this long after it exited are orphans."""
FSIZE = 40_000
"""RLIMIT_FSIZE standing in for a full disk (tests/test_reliability.py's figure): summary.json
fits, trace.json does not."""


# --- processes ------------------------------------------------------------------------------------

def tagged(tag: str) -> List[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SHMLEARN_TEST_TAG={tag}".encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _stat(pid: int) -> Optional[List[str]]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def workers_of(launcher: int) -> List[int]:
    """The launcher's pool workers in rank order, slot 0 first (lower PID): its spawned children,
    or the forks of its forkserver child (the program's CPU runs: shmlearn/forkserver.py).
    multiprocessing's resource tracker is a child too; command lines tell them apart."""
    parent = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        st = _stat(int(p))
        if st:
            parent[int(p)] = int(st[1])
    kids = [p for p, pp in parent.items() if pp == launcher]
    servers = {p for p in kids if "multiprocessing.forkserver" in _cmdline(p)}
    return sorted([p for p in kids if "spawn_main" in _cmdline(p)] + [p for p, pp in parent.items() if pp in servers])


def clean_env(tag: str, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC", "SHMLEARN_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1", SHMLEARN_TEST_TAG=tag, **(extra or {}))
    return env


def _child_setup(fsize: Optional[int]) -> Callable[[], None]:
    """In the run's process before exec: Ctrl-C handled as in a terminal (a campaign started in
    the background of a shell without job control inherits SIGINT ignored, and so would every
    run, so a Ctrl-C case would see no signal), and an optional file-size limit."""
    def apply() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if fsize:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return apply


@dataclass
class Cmd:
    """One `python -m shmlearn` invocation of a case, and what it must do."""
    args: List[str]
    expect: Any
    """The exit code (int), or a set of acceptable ones."""
    fault: Optional[str] = None
    """SHMLEARN_FAULT=kind:rank:step."""
    says: Sequence[str] = ()
    """Substrings stderr must hold (the rank named, the flag named)."""
    last_says: Sequence[str] = ()
    """Substrings the last stderr line must hold."""
    one_line: Optional[bool] = None
    """stderr must be exactly one line (default: when exit 2 is expected)."""
    during: Optional[Callable[["Running", float], None]] = None
    """Called every poll with the seconds since start: sends the outside fault."""
    fsize: Optional[int] = None
    poll_s: float = 0.02
    """How often `during` looks (1 ms to catch a checkpoint being written)."""
    limit: Optional[float] = None
    """Seconds before this command counts as a hang, if less than the campaign's --limit."""


class Running:
    def __init__(self, cmd: Cmd, tag: str, logdir: str, name: str):
        self.cmd, self.tag = cmd, tag
        self.fault_t: Optional[float] = None
        """monotonic time of the fault, where the campaign knows it."""
        self.fault_how = ""
        self.state: Dict[str, Any] = {}
        self.out_path = os.path.join(logdir, f"{name}.stdout")
        self.err_path = os.path.join(logdir, f"{name}.stderr")
        env = clean_env(tag, {"SHMLEARN_FAULT": cmd.fault} if cmd.fault else None)
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        self.t0 = time.monotonic()
        # Its own session: a kill of "the process group" is then ours alone.
        self.proc = subprocess.Popen([sys.executable, "-m", "shmlearn", *cmd.args], cwd=REPO, env=env,
                                     stdout=self._out, stderr=self._err, start_new_session=True,
                                     preexec_fn=_child_setup(cmd.fsize))

    def fault(self, how: str) -> None:
        if self.fault_t is None:
            self.fault_t, self.fault_how = time.monotonic(), how

    def wait(self, limit: float) -> Dict[str, Any]:
        hang = False
        while self.proc.poll() is None:
            el = time.monotonic() - self.t0
            if el > limit:
                hang = True
                break
            if self.cmd.during is not None:
                self.cmd.during(self, el)
            time.sleep(self.cmd.poll_s)
        t_exit = time.monotonic()
        if hang:
            for pid in tagged(self.tag):  # ours, by id
                _kill(pid, signal.SIGKILL)
            self.proc.wait()
        self._out.close()
        self._err.close()
        with open(self.out_path) as f:
            stdout = f.read()
        with open(self.err_path) as f:
            stderr = f.read()
        return self._measure(stdout, stderr, t_exit - self.t0, hang, t_exit)

    def _measure(self, stdout: str, stderr: str, wall: float, hang: bool, t_exit: float) -> Dict[str, Any]:
        c = self.cmd
        lines = stderr.strip().splitlines()
        rc = None if hang else self.proc.returncode
        ok_rc = rc in c.expect if isinstance(c.expect, (set, frozenset, tuple, list)) else rc == c.expect
        one_line = c.one_line if c.one_line is not None else (c.expect == 2)
        problems = []
        if not hang and not ok_rc:
            problems.append(f"exit {rc}, expected {c.expect}")
        if one_line and len(lines) != 1:
            problems.append(f"stderr has {len(lines)} lines, expected one")
        for s in c.says:
            if s not in stderr:
                problems.append(f"stderr lacks {s!r}")
        for s in c.last_says:
            if not lines or s not in lines[-1]:
                problems.append(f"last stderr line lacks {s!r}")
        return {
            "command": "python -m shmlearn " + " ".join(c.args),
            "fault": c.fault, "fsize": c.fsize, "expected": sorted(c.expect) if isinstance(c.expect, set) else c.expect,
            "exit": rc, "hang": hang, "wall_s": round(wall, 2),
            "fault_to_exit_s": round(t_exit - self.fault_t, 2) if self.fault_t and not hang else None,
            "fault_moment": self.fault_how or None,
            "traceback": "Traceback (most recent call last)" in stderr or "frame #" in stderr,
            "stderr_lines": len(lines), "stderr_tail": "\n".join(lines[-6:]),
            "stdout_tail": "\n".join(stdout.strip().splitlines()[-3:]),
            "wrong": problems, "orphans": [], "lost": [],
        }


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def orphans_after(tag: str, settle_s: float = SETTLE_S) -> Dict[str, Any]:
    """Processes of the run alive `settle_s` after its exit (orphans), and when the last one went:
    all_gone_s after the exit (a worker still starting when its launcher died leaves on its own;
    None if one outlived 30 s, after which it is killed so the next case starts clean)."""
    t0 = time.monotonic()

    def alive() -> List[int]:
        return [p for p in tagged(tag) if (_stat(p) or ["Z"])[0] != "Z"]
    left = alive()
    while left and time.monotonic() - t0 < settle_s:
        time.sleep(0.1)
        left = alive()
    info: Dict[str, Any] = {"pids": left, "cmdlines": [_cmdline(p)[:120] for p in left],
                            "all_gone_s": None if left else round(time.monotonic() - t0, 2)}
    while left and time.monotonic() - t0 < 30:
        time.sleep(0.2)
        left = alive()
    if info["pids"] and not left:
        info["all_gone_s"] = round(time.monotonic() - t0, 1)
    for p in left:
        _kill(p, signal.SIGKILL)
    return info


# --- what was written --------------------------------------------------------------------------

def jsonl_problems(path: str, *, key: str = "step", torn_ok: bool = True) -> List[str]:
    """Unparseable lines (a torn LAST line is a kill's, and allowed) and steps out of order."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.decode(errors="replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    probs, prev = [], None
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            if not (torn_ok and i == len(lines) - 1 and not raw.endswith(b"\n")):
                probs.append(f"{os.path.basename(path)} line {i + 1} is not JSON")
            continue
        if key and key in row:
            if prev is not None and row[key] <= prev:
                probs.append(f"{os.path.basename(path)} line {i + 1}: {key} {row[key]} after {prev}")
            prev = row[key]
    return probs


def run_dir_problems(out: str) -> List[str]:
    probs = jsonl_problems(os.path.join(out, "metrics.jsonl")) + jsonl_problems(os.path.join(out, "eval.jsonl"))
    for name in ("summary.json", "trace.json"):
        p = os.path.join(out, name)
        if os.path.exists(p):
            try:
                with open(p) as f:
                    json.load(f)
            except ValueError:
                probs.append(f"{name} is torn")
    if os.path.isdir(out):
        probs += [f"{n} left behind" for n in os.listdir(out) if n.startswith(("summary.json.tmp", "trace.json.tmp"))]
    return probs


def summary(out: str) -> Dict[str, Any]:
    try:
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def completed(out: str) -> List[str]:
    s = summary(out)
    if s.get("status") != "completed" or s.get("steps") != s.get("planned_steps"):
        return [f"{out}: not completed ({s.get('status')}, {s.get('steps')}/{s.get('planned_steps')} steps)"]
    return []


def rows(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --- outside faults (Cmd.during) ------------------------------------------------------------------

def kill_launcher_after(delay_s: float, sig: int = signal.SIGKILL):
    def during(r: Running, el: float) -> None:
        if el >= delay_s and r.fault_t is None:
            r.proc.send_signal(sig)
            r.fault(f"{signal.Signals(sig).name} of the launcher {delay_s:g} s after start")
    return during


def once_training(out: str, action: Callable[[Running], None], rows_needed: int = 3):
    """Act once metrics.jsonl holds `rows_needed` rows (the ranks train)."""
    path = os.path.join(out, "metrics.jsonl")

    def during(r: Running, el: float) -> None:
        if r.fault_t is not None or "done" in r.state:
            return
        try:
            with open(path, "rb") as f:
                n = f.read().count(b"\n")
        except OSError:
            return
        if n >= rows_needed and len(workers(r)) >= 2:
            r.state["done"] = True
            action(r)
    return during


def workers(r: Running) -> List[int]:
    """The run's pool workers, looked up until both are there, then remembered: a scan of /proc
    every poll would take CPU from the run it times."""
    if len(r.state.get("workers", [])) < 2:
        r.state["workers"] = workers_of(r.proc.pid)
    return r.state["workers"]


def signal_rank(rank: int, sig: int):
    def action(r: Running) -> None:
        pid = workers(r)[rank]
        os.kill(pid, sig)
        r.fault(f"{signal.Signals(sig).name} of rank {rank} (pid {pid}) once training")
    return action


def signal_group(sig: int):
    def action(r: Running) -> None:
        os.killpg(r.proc.pid, sig)
        r.fault(f"{signal.Signals(sig).name} of the process group once training")
    return action


def watch_stopped(r: Running, el: float) -> None:
    """SHMLEARN_FAULT=stop: the fault moment is when a worker enters state T."""
    if r.fault_t is None:
        for pid in workers(r):
            st = _stat(pid)
            if st and st[0] == "T":
                r.fault(f"rank's own SIGSTOP (pid {pid} seen in state T)")


def last_row_moment(out: str):
    """A hung rank: the fault moment is bounded below by metrics.jsonl's last write (rank 0 logs
    every 10 steps; the sleep starts within 10 fast steps of it), so fault-to-exit is an upper
    bound."""
    path = os.path.join(out, "metrics.jsonl")

    def during(r: Running, el: float) -> None:
        try:
            m = os.stat(path).st_mtime
        except OSError:
            return
        if r.state.get("mtime") != m:
            r.state["mtime"] = m
            # mtime is wall clock; the campaign's clock is monotonic
            r.fault_t = time.monotonic() - (time.time() - m)
            r.fault_how = "last metrics.jsonl row before the hang (upper bound on fault-to-exit)"
    return during


def when_exists(path: str, action: Callable[[Running], None]):
    def during(r: Running, el: float) -> None:
        if r.fault_t is None and os.path.exists(path):
            action(r)
    return during


# --- the cases ------------------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    item: str
    """Issue 15's item ('1'..'15', 'cosmetic') or 'classic'."""
    what: str
    build: Callable[[str], List[Cmd]]
    """tmp dir -> the commands, run in order; later ones may read what earlier ones wrote."""
    check: Optional[Callable[[str, List[Dict[str, Any]]], List[str]]] = None
    """After all commands: what was lost or torn (a list of problems)."""
    repeat: int = 1
    between: Optional[Callable[[str], None]] = None
    """Between the first and second command (damage a checkpoint)."""
    concurrent: bool = False
    """Start the second command while the first runs (see run_concurrent)."""


CASES: List[Case] = []


def case(name, item, what, *, check=None, repeat=1, between=None, concurrent=False):
    def deco(build):
        CASES.append(Case(name, item, what, build, check, repeat, between, concurrent))
        return build
    return deco


def out_of(tmp: str, sub: str = "run") -> str:
    return os.path.join(tmp, sub)


# item 1: a stopped rank 0
@case("stop-rank0-fault", "1", "rank 0 SIGSTOPs itself at step 30 (--timeout 8)", repeat=3,
      check=lambda t, r: run_dir_problems(out_of(t)))
def _(t):
    return [Cmd(BASE + ["--workers", "2", "--timeout", "8", "--out", out_of(t)], 1, fault="stop:0:30",
                last_says=["rank 0"], during=watch_stopped)]


@case("stop-rank0-signal", "1", "kill -STOP of rank 0 from outside once training (--timeout 8)", repeat=2,
      check=lambda t, r: run_dir_problems(out_of(t)))
def _(t):
    return [Cmd(LONG + ["--workers", "2", "--timeout", "8", "--out", out_of(t)], 1, last_says=["rank 0"],
                during=once_training(out_of(t), signal_rank(0, signal.SIGSTOP), rows_needed=15))]


@case("stop-rank1-signal", "1", "kill -STOP of rank 1 from outside once training (--timeout 8)",
      check=lambda t, r: run_dir_problems(out_of(t)))
def _(t):
    return [Cmd(LONG + ["--workers", "2", "--timeout", "8", "--out", out_of(t)], 1, last_says=["rank 1"],
                during=once_training(out_of(t), signal_rank(1, signal.SIGSTOP), rows_needed=15))]


@case("stop-rank0-fault-timeout20", "1", "rank 0 SIGSTOPs itself at step 30 (--timeout 20): the bound's slack "
      "does not grow with the timeout", check=lambda t, r: run_dir_problems(out_of(t)))
def _(t):
    return [Cmd(BASE + ["--workers", "2", "--timeout", "20", "--out", out_of(t)], 1, fault="stop:0:30",
                last_says=["rank 0"], during=watch_stopped)]


# item 2: a killed launcher
def _no_summary(t, r):
    return ([f"{out_of(t)}/summary.json written after the launcher died"]
            if os.path.exists(os.path.join(out_of(t), "summary.json")) else [])


for _d in (0.0, 0.5, 1.0, 1.5, 2.0):
    case(f"kill-launcher-{_d:g}s", "2", f"kill -9 of the launcher {_d:g} s after start", repeat=2,
         check=_no_summary)(
        lambda t, d=_d: [Cmd(["train", "--workers", "2", "--epochs", "40", "--no-progress", "--out", out_of(t)],
                             -9, during=kill_launcher_after(d))])


@case("kill-launcher-training", "2", "kill -9 of the launcher once its workers train", check=_no_summary)
def _(t):
    return [Cmd(LONG + ["--workers", "2", "--out", out_of(t)], -9,
                during=once_training(out_of(t), lambda r: (r.proc.kill(), r.fault("SIGKILL of the launcher "
                                                                                   "once training"))))]


# item 3: a kill during the first checkpoint
def _resumed_whole(t, r):
    return run_dir_problems(out_of(t)) + completed(out_of(t))


for _w, _rank, _rc in ((2, 1, 1), (2, 0, 1), (1, 0, -9)):
    case(f"kill-in-checkpoint-w{_w}-rank{_rank}", "3",
         f"rank {_rank} of {_w} SIGKILLs itself once its file of the first checkpoint (step 5) is written; "
         f"then --resume", check=_resumed_whole)(
        lambda t, w=_w, rank=_rank, rc=_rc: [
            Cmd(BASE + ["--workers", str(w), "--checkpoint-every", "5", "--out", out_of(t)], rc,
                fault=f"kill-in-checkpoint:{rank}:5", says=[f"rank {rank}"] if rc == 1 else ()),
            Cmd(BASE + ["--workers", str(w), "--checkpoint-every", "5", "--resume", "--out", out_of(t)], 0)])

for _w in (2, 1):
    case(f"killpg-at-first-checkpoint-w{_w}", "3",
         f"SIGKILL of the whole process group ({_w} worker{'s' if _w > 1 else ''}) the moment "
         f"checkpoints/step-00000005 exists; then --resume", check=_resumed_whole)(
        lambda t, w=_w: [
            Cmd(BASE + ["--workers", str(w), "--checkpoint-every", "5", "--out", out_of(t)], -9,
                during=when_exists(os.path.join(out_of(t), "checkpoints", "step-00000005"),
                                   signal_group(signal.SIGKILL)), poll_s=0.001),
            Cmd(BASE + ["--workers", str(w), "--checkpoint-every", "5", "--resume", "--out", out_of(t)], 0)])


# item 4: sweeps whose trials die
@case("sweep-trials-killed-w1", "4", "every trial's worker SIGKILLs itself at step 5 (1 worker)")
def _(t):
    return [Cmd(SWEEP + ["--workers", "1", "--lr", "0.1,0.2", "--out", out_of(t, "s")], 1, fault="kill:0:5",
                says=["worker died (killed by signal 9)"])]


@case("sweep-trials-killed-w2", "4", "every trial's rank 1 SIGKILLs itself at step 5 (2 workers)")
def _(t):
    return [Cmd(SWEEP + ["--workers", "2", "--lr", "0.1,0.2", "--out", out_of(t, "s")], 1, fault="kill:1:5",
                says=["worker died (killed by signal 9)"])]


def _kill_one_trial_worker(out: str):
    tmp = os.path.join(out, "trials", ".tmp")

    def during(r: Running, el: float) -> None:
        if r.fault_t is not None:
            return
        try:
            busy = [n for n in os.listdir(tmp) if not n.endswith(".log")]
        except OSError:
            return
        if not busy or not os.path.exists(os.path.join(tmp, busy[0], "metrics.jsonl")):
            return
        kids = workers_of(r.proc.pid)  # slot 0's worker: the one a sweep of 1 at a time uses
        if kids:
            os.kill(kids[0], signal.SIGKILL)
            r.fault(f"SIGKILL of pool worker pid {kids[0]} while trial {busy[0]} trains")
    return during


def _sweep_whole(n: int):
    def check(t, r):
        path = os.path.join(out_of(t, "s"), "results.jsonl")
        got = rows(path)
        probs = jsonl_problems(path, key="")
        ids = [x["id"] for x in got]
        if len(ids) != n or len(set(ids)) != n:
            probs.append(f"results.jsonl holds {len(ids)} rows ({len(set(ids))} trials), expected {n}")
        return probs
    return check


@case("sweep-trial-killed-from-outside", "4", "kill -9 of a trial's pool worker from outside, mid-trial: "
      "the trial is retried and every trial recorded once", check=_sweep_whole(4))
def _(t):
    return [Cmd(["sweep", "--dataset", "digits", "--model", "mlp", "--samples", "25600", "--workers", "1",
                 "--lr", "0.1,0.2,0.3,0.4", "--no-report", "--no-progress", "--out", out_of(t, "s")], 0,
                says=["retrying once"], during=_kill_one_trial_worker(out_of(t, "s")))]


@case("sweep-disk-full-trials", "4", "a sweep under RLIMIT_FSIZE 10000 B: each trial fails writing its "
      "trace.json (~21 kB)")
def _(t):
    return [Cmd(SWEEP + ["--workers", "1", "--lr", "0.1,0.2", "--out", out_of(t, "s")], 1, fsize=10_000,
                says=["trace.json"])]


# item 5: sweep tracebacks
@case("sweep-unwritable-out", "5", "sweep --out /proc/shmlearn-nowhere/s")
def _(t):
    return [Cmd(["sweep", "--lr", "0.1,0.2", "--out", "/proc/shmlearn-nowhere/s"], 2, says=["cannot write there"])]


def _results_unchanged(t, r):
    path = os.path.join(out_of(t, "s"), "results.jsonl")
    before = r[0].get("results_sha")
    now = _sha(path)
    return [] if before and before == now else [f"results.jsonl changed by the failed report ({before} -> {now})"]


def _sha(path: str) -> Optional[str]:
    import hashlib
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return None


@case("sweep-disk-full-report", "5", "a finished sweep run again with its report, under RLIMIT_FSIZE 20000 B "
      "(the figures do not fit)", check=_results_unchanged)
def _(t):
    args = ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "2048", "--workers", "1",
            "--lr", "0.1,0.2", "--no-progress", "--out", out_of(t, "s")]
    return [Cmd(args + ["--no-report"], 0),
            Cmd(args, 1, fsize=20_000, says=["could not write the report"], one_line=True)]


# item 6: one worker
@case("one-worker-raise", "6", "--workers 1, the rank raises at step 5")
def _(t):
    return [Cmd(BASE + ["--workers", "1", "--out", out_of(t)], 1, fault="raise:0:5", one_line=True,
                says=["rank 0: RuntimeError: injected fault"])]


@case("one-worker-disk-full", "6", f"--workers 1 under RLIMIT_FSIZE {FSIZE} B",
      check=lambda t, r: run_dir_problems(out_of(t)) + _summary_kept(t))
def _(t):
    return [Cmd(BASE + ["--workers", "1", "--out", out_of(t)], 1, fsize=FSIZE, one_line=True, says=["trace.json"])]


def _summary_kept(t):
    probs = [] if summary(out_of(t)).get("status") == "completed" else ["summary.json missing or not completed"]
    if os.path.exists(os.path.join(out_of(t), "trace.json")):
        probs.append("trace.json written past the limit?")
    return probs


# items 7, 8: unusable data (IDX files written here, as tests/data/test_idx.py does)
def _idx_dir(d: str, split: str, x) -> str:
    import numpy as np
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    for s, n in (("train", 64), ("t10k", 16)):
        imgs = x if s == split else rng.integers(0, 256, (n, 28, 28))
        with open(os.path.join(d, f"{s}-images-idx3-ubyte"), "wb") as f:
            f.write(struct.pack(">IIII", 0x803, len(imgs), 28, 28) + np.asarray(imgs, dtype=np.uint8).tobytes())
        with open(os.path.join(d, f"{s}-labels-idx1-ubyte"), "wb") as f:
            f.write(struct.pack(">II", 0x801, len(imgs)) + np.zeros(len(imgs), dtype=np.uint8).tobytes())
    return d


def _data_case(name, item, what, split, make, says):
    def build(t):
        import numpy as np
        d = _idx_dir(os.path.join(t, "data"), split, make(np))
        return [Cmd(["train", "--dataset", "mnist", "--data-dir", d, "--model", "softmax", "--workers", "2",
                     "--batch-size", "16", "--epochs", "1", "--no-progress", "--out", out_of(t)], 2, says=[says])]
    case(name, item, what, check=lambda t, r: [] if not os.path.exists(os.path.join(out_of(t), "summary.json"))
         else ["summary.json written for unusable data"])(build)


_data_case("empty-test-set", "7", "an IDX test set of 0 images", "t10k", lambda np: np.zeros((0, 28, 28)),
           "the test set has 0 images")
_data_case("empty-train-set", "7", "an IDX train set of 0 images", "train", lambda np: np.zeros((0, 28, 28)),
           "the train set has 0 images")
_data_case("constant-images-0", "8", "every training image all 0", "train", lambda np: np.zeros((64, 28, 28)),
           "standard deviation 0")
_data_case("constant-images-255", "8", "every training image all 255", "train",
           lambda np: np.full((64, 28, 28), 255), "standard deviation 0")

# item 9: extreme values (and the cosmetic --epochs 1e-9), each exit 2 in one line naming the flag
EXTREME = [(["--samples", "1000000000000000000000000000000"], "--samples"), (["--lr", "1e308"], "--lr"),
           (["--lr", "inf"], "--lr"), (["--weight-decay", "inf"], "--weight-decay"),
           (["--timeout", "inf"], "--timeout"), (["--seed", "18446744073709551616"], "--seed"),
           (["--epochs", "inf"], "--epochs"), (["--checkpoint-every", "nans"], "--checkpoint-every"),
           (["--timeout", "1e-9"], "--timeout"), (["--threads", "100000"], "--threads")]
for _args, _flag in EXTREME:
    case(f"extreme{_args[0]}={_args[1][:12]}", "9", f"train {' '.join(_args)}")(
        lambda t, a=_args, f=_flag: [Cmd(["train", "--dataset", "digits", "--workers", "2", "--no-progress",
                                          *a, "--out", out_of(t)], 2, says=[f])])


@case("workers-10000", "10", "train --workers 10000 on this machine")
def _(t):
    return [Cmd(["train", "--dataset", "digits", "--workers", "10000", "--no-progress", "--out", out_of(t)], 2,
                says=["--workers"])]


# item 11: two runs on one --out
def _first_intact(t, r):
    probs = run_dir_problems(out_of(t)) + completed(out_of(t))
    m = rows(os.path.join(out_of(t), "metrics.jsonl"))
    if m and m[-1]["step"] != summary(out_of(t)).get("planned_steps"):
        probs.append(f"metrics.jsonl ends at step {m[-1]['step']}")
    return probs


for _resume in (True, False):
    case(f"concurrent-out{'-resume' if _resume else ''}", "11",
         f"a second train{' --resume' if _resume else ''} on the --out of a running one", check=_first_intact,
         concurrent=True)(
        lambda t, resume=_resume: [
            Cmd(["train", "--dataset", "digits", "--model", "mlp", "--workers", "2", "--epochs", "100",
                 "--no-progress", "--out", out_of(t)], 0),
            Cmd(BASE + ["--workers", "2", *(["--resume"] if resume else []), "--out", out_of(t)], 2,
                says=["another run is writing there" if resume else "already holds a run"])])


@case("concurrent-same-start", "11", "two identical trains on one --out started together: one runs, "
      "the other is refused", check=_first_intact, concurrent=True)
def _(t):
    # Which of the two wins is a race: each may exit 0 or 2; run_concurrent checks that one did each.
    return [Cmd(BASE + ["--workers", "2", "--out", out_of(t)], {0, 2}, one_line=False),
            Cmd(BASE + ["--workers", "2", "--out", out_of(t)], {0, 2}, one_line=False)]


# item 12: --resume without checkpoints
def _clean_rows(t, r):
    probs = run_dir_problems(out_of(t)) + completed(out_of(t))
    ev = [x["step"] for x in rows(os.path.join(out_of(t), "eval.jsonl"))]
    if ev.count(0) != 1:
        probs.append(f"eval.jsonl steps {ev}")
    return probs


for _w in (1, 2):
    case(f"resume-without-checkpoints-w{_w}", "12", f"a run of {_w} worker(s) fails at step 50 with no "
         f"checkpoint; then --resume", check=_clean_rows)(
        lambda t, w=_w: [Cmd(BASE + ["--workers", str(w), "--out", out_of(t)], 1, fault=f"raise:{w - 1}:50",
                             says=[f"rank {w - 1}"]),
                         Cmd(BASE + ["--workers", str(w), "--resume", "--out", out_of(t)], 0)])


# item 13: a full disk
@case("disk-full-w2", "13", f"--workers 2 under RLIMIT_FSIZE {FSIZE} B",
      check=lambda t, r: run_dir_problems(out_of(t)) + _summary_kept(t))
def _(t):
    return [Cmd(BASE + ["--workers", "2", "--out", out_of(t)], 1, fsize=FSIZE, one_line=True, says=["trace.json"])]


# item 14: a hung rank
for _rank, _timeout, _rep in ((1, 8, 3), (0, 8, 1), (1, 20, 1)):
    case(f"hang-rank{_rank}-timeout{_timeout}", "14", f"rank {_rank} sleeps at step 30 (--timeout {_timeout})",
         repeat=_rep, check=lambda t, r: run_dir_problems(out_of(t)))(
        lambda t, rank=_rank, to=_timeout: [
            Cmd(BASE + ["--workers", "2", "--timeout", str(to), "--out", out_of(t)], 1, fault=f"sleep:{rank}:30",
                says=[f"rank {rank} (never reached the sync of step 30", "stopped responding"],
                during=last_row_moment(out_of(t)))])


# item 15: output paths
@case("out-unwritable", "15", "train --out /proc/shmlearn-nowhere/run")
def _(t):
    return [Cmd(["train", "--dataset", "digits", "--workers", "2", "--no-progress",
                 "--out", "/proc/shmlearn-nowhere/run"], 2, says=["cannot write there"])]


@case("out-is-a-file", "15", "train --out FILE (a regular file)")
def _(t):
    os.makedirs(t, exist_ok=True)
    with open(os.path.join(t, "file"), "w") as f:
        f.write("x")
    return [Cmd(["train", "--dataset", "digits", "--workers", "2", "--no-progress", "--out", os.path.join(t, "file")],
                2, says=["not a directory"])]


@case("warmup-100000", "15", "train --warmup 100000 (a 64-step run)")
def _(t):
    return [Cmd(["train", "--dataset", "digits", "--workers", "2", "--warmup", "100000", "--no-progress",
                 "--out", out_of(t)], 2, says=["--warmup 100000"])]


# cosmetic
@case("sweep-no-progress", "cosmetic", "sweep --no-progress", check=_sweep_whole(2))
def _(t):
    return [Cmd(SWEEP + ["--workers", "1", "--lr", "0.1,0.2", "--out", out_of(t, "s")], 0)]


@case("epochs-1e-9", "cosmetic", "train --epochs 1e-9")
def _(t):
    return [Cmd(["train", "--dataset", "digits", "--workers", "2", "--epochs", "1e-9", "--no-progress",
                 "--out", out_of(t)], 2, says=["--epochs 1e-09"])]


# the classic faults
@case("kill-worker-fault", "classic", "rank 1 SIGKILLs itself at step 50 (--timeout 20)", repeat=2,
      check=lambda t, r: run_dir_problems(out_of(t)))
def _(t):
    return [Cmd(BASE + ["--workers", "2", "--timeout", "20", "--out", out_of(t)], 1, fault="kill:1:50",
                says=["rank 1: worker died (killed by signal 9)"], during=last_row_moment(out_of(t)))]


@case("kill-worker-signal", "classic", "kill -9 of rank 1 from outside once training",
      check=lambda t, r: run_dir_problems(out_of(t)))
def _(t):
    return [Cmd(LONG + ["--workers", "2", "--out", out_of(t)], 1, says=["rank 1: worker died (killed by signal 9)"],
                during=once_training(out_of(t), signal_rank(1, signal.SIGKILL)))]


@case("kill-worker-then-resume", "classic", "rank 1 SIGKILLs itself at step 130 (checkpoints every 40); "
      "then --resume", check=lambda t, r: _resumed_whole(t, r) + _resumed_from(t, 120))
def _(t):
    a = BASE + ["--workers", "2", "--checkpoint-every", "40", "--out", out_of(t)]
    return [Cmd(a, 1, fault="kill:1:130", says=["rank 1"]), Cmd(a + ["--resume"], 0)]


def _resumed_from(t, step):
    s = summary(out_of(t))
    return [] if s.get("resumed_from_step") == step and s.get("samples_seen") == 12800 else \
        [f"resumed from {s.get('resumed_from_step')}, {s.get('samples_seen')} samples"]


def _truncate_newest(t):
    p = os.path.join(out_of(t), "checkpoints", "step-00000160", "rank1.ckpt")
    with open(p, "rb") as f:
        raw = f.read()
    with open(p, "wb") as f:
        f.write(raw[: len(raw) // 2])


@case("damaged-checkpoint-resume", "classic", "rank 0 killed at step 170; rank 1's newest checkpoint "
      "truncated; then --resume", between=_truncate_newest,
      check=lambda t, r: _resumed_whole(t, r) + _resumed_from(t, 120))
def _(t):
    a = BASE + ["--workers", "2", "--checkpoint-every", "40", "--out", out_of(t)]
    return [Cmd(a, 1, fault="kill:0:170"), Cmd(a + ["--resume"], 0)]


@case("nan-on-a-rank", "classic", "rank 1's loss becomes NaN at step 17",
      check=lambda t, r: run_dir_problems(out_of(t)) + _diverged_at(t, 17, 1))
def _(t):
    return [Cmd(BASE + ["--workers", "2", "--out", out_of(t)], 3, fault="nan:1:17", says=["at step 17 on rank 1"])]


def _diverged_at(t, step, rank):
    s = summary(out_of(t))
    got = (s.get("status"), s.get("diverged_step"), s.get("diverged_rank"))
    return [] if got == ("diverged", step, rank) else [f"summary says {got}"]


@case("raise-on-a-rank", "classic", "rank 1 raises at step 20",
      check=lambda t, r: run_dir_problems(out_of(t)))
def _(t):
    return [Cmd(BASE + ["--workers", "2", "--out", out_of(t)], 1, fault="raise:1:20",
                says=["rank 1: RuntimeError: injected fault"])]


@case("ctrl-c", "classic", "SIGINT to the whole process group once training (Ctrl-C in a terminal)",
      check=lambda t, r: run_dir_problems(out_of(t)))
def _(t):
    return [Cmd(LONG + ["--workers", "2", "--out", out_of(t)], 130, says=["interrupted"],
                during=once_training(out_of(t), signal_group(signal.SIGINT)))]


@case("sigterm-launcher", "classic", "SIGTERM to the launcher only, once training",
      check=lambda t, r: run_dir_problems(out_of(t)) + _no_summary(t, r))
def _(t):
    # No promise on the code beyond "not 0": the default action (-15), or an interrupt (130/143).
    return [Cmd(LONG + ["--workers", "2", "--out", out_of(t)], {-15, 1, 130, 143},
                during=once_training(out_of(t), lambda r: (r.proc.terminate(),
                                                           r.fault("SIGTERM of the launcher once training"))))]


def _sweep_mid_kill(out: str):
    path, tmp = os.path.join(out, "results.jsonl"), os.path.join(out, "trials", ".tmp")

    def during(r: Running, el: float) -> None:
        if r.fault_t is not None:
            return
        try:
            with open(path, "rb") as f:
                done = f.read().count(b"\n") >= 1
            busy = os.listdir(tmp)
        except OSError:
            return
        if done and busy:
            os.killpg(r.proc.pid, signal.SIGKILL)
            r.state["first"] = rows(path)
            r.fault("SIGKILL of the sweep's process group with a result written and a trial in flight")
    return during


def _sweep_rerun_whole(t, r):
    path = os.path.join(out_of(t, "s"), "results.jsonl")
    got = rows(path)
    first = r[0].get("first_rows") or []
    probs = _sweep_whole(6)(t, r)
    if got[:len(first)] != first:
        probs.append("rows written before the kill changed")
    if not first:
        probs.append("the kill came before any result (no test of what was written)")
    return probs


@case("sigkill-mid-sweep-rerun", "classic", "SIGKILL of a sweep with trials in flight; the same command again",
      check=_sweep_rerun_whole)
def _(t):
    a = ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "16384", "--workers", "1",
         "--batch-size", "16,32", "--lr", "0.1,0.3,0.5", "--parallel", "2", "--no-report", "--no-progress",
         "--out", out_of(t, "s")]
    return [Cmd(a, -9, during=_sweep_mid_kill(out_of(t, "s"))), Cmd(a, 0)]


# beyond the list: one rank and nobody waiting on it
@case("hang-one-worker", "beyond", "train --workers 1: the only rank sleeps at step 30 (--timeout 8)")
def _(t):
    return [Cmd(BASE + ["--workers", "1", "--timeout", "8", "--out", out_of(t)], 1, fault="sleep:0:30",
                says=["rank 0"], during=last_row_moment(out_of(t)), limit=90)]


@case("sweep-trial-hangs-w1", "beyond", "sweep --workers 1: the trial's only rank sleeps at step 5 (--timeout 8)")
def _(t):
    return [Cmd(SWEEP + ["--workers", "1", "--lr", "0.1", "--timeout", "8", "--out", out_of(t, "s")], 1,
                fault="sleep:0:5", says=["rank 0"], limit=90)]


@case("sweep-trial-stopped-w1", "beyond", "sweep --workers 1: the trial's only rank SIGSTOPs itself at step 5 "
      "(--timeout 8)")
def _(t):
    return [Cmd(SWEEP + ["--workers", "1", "--lr", "0.1", "--timeout", "8", "--out", out_of(t, "s")], 1,
                fault="stop:0:5", says=["rank 0", "stopped responding"], limit=90)]


# issue 38: studies, async-ps, sweeps and user data
TINY_STUDY = ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "2048", "--eval-points", "2",
              "--workers", "1", "--device", "cpu", "--batch-size", "64", "--lr", "0.1,0.3", "--no-report",
              "--no-progress"]
"""Two trials of a few seconds; a journal holding one such study is ~9 kB, a trial's trace.json ~10 kB."""


@case("i38-journal-disk-full", "38.1", "a second study on a journal under RLIMIT_FSIZE 14000 B (the first "
      "study's ~9 kB fit); then both studies again without the limit")
def _(t):
    url = f"journal:{out_of(t, 'study.log')}"
    a = TINY_STUDY + ["--storage", url, "--study", "a", "--out", out_of(t, "a")]
    b = TINY_STUDY + ["--storage", url, "--study", "b", "--out", out_of(t, "b")]
    return [Cmd(a, 0), Cmd(b, 2, fsize=14_000, says=["the disk is full"], one_line=True), Cmd(b, 0),
            Cmd(a, 0)]  # stdout says "(2 done)": tests/test_study.py checks it


@case("i38-staleness-1e9", "38.2", "async-ps --staleness 1000000000 on a 64-step run, then on a million epochs")
def _(t):
    a = ["train", "--dataset", "digits", "--model", "mlp", "--strategy", "async-ps", "--workers", "2",
         "--staleness", "1000000000", "--eval-points", "1", "--no-progress"]
    return [Cmd(a + ["--samples", "4096", "--out", out_of(t)], 0),
            Cmd(a + ["--epochs", "1000000", "--out", out_of(t, "endless")], 2, says=["use --staleness"])]


@case("i38-search-exhausted", "38.3", "--search random --trials 5 over 2 points")
def _(t):
    return [Cmd(TINY_STUDY[:-4] + ["--lr", "0.1", "--optimizer", "sgd,momentum", "--no-report", "--no-progress",
                                   "--search", "random", "--trials", "5", "--storage",
                                   f"sqlite:///{out_of(t, 'study.db')}", "--study", "r", "--out", out_of(t, "s")],
                0, limit=120)]  # ends (it asked forever); stdout says the space holds 2 distinct points


@case("i38-study-on-a-grid-out", "38.4", "a study on a pooled grid sweep's --out",
      check=_results_unchanged)
def _(t):
    return [Cmd(TINY_STUDY + ["--out", out_of(t, "s")], 0),
            Cmd(TINY_STUDY + ["--storage", f"sqlite:///{out_of(t, 'study.db')}", "--study", "x", "--out",
                              out_of(t, "s")], 2, says=["holds a sweep without --storage"])]


@case("i38-sweep-disk-full-spec", "38.6", "a sweep under RLIMIT_FSIZE 500 B (sweep.json does not fit)")
def _(t):
    return [Cmd(TINY_STUDY + ["--out", out_of(t, "s")], 2, fsize=500, says=["the disk is full", "sweep.json"])]


@case("i38-nested-config", "38.8", "sweep --config with lr: [[0.1, 0.2], 0.3]")
def _(t):
    path = out_of(t, "sweep.yaml")
    with open(path, "w") as f:
        f.write("lr: [[0.1, 0.2], 0.3]\n")
    return [Cmd(["sweep", "--config", path, "--out", out_of(t, "s")], 2, says=["holds a list"])]


def _after(seconds: float, action: Callable[[Running], None]):
    def during(r: Running, el: float) -> None:
        if r.fault_t is None and el > seconds:
            action(r)
    return during


@case("i38-ctrl-c-sweep-starting", "38.8", "SIGINT to a sweep's process group while its 2 workers import")
def _(t):
    return [Cmd(TINY_STUDY + ["--samples", "600000", "--parallel", "2", "--out", out_of(t, "s")], 130,
                says=["interrupted"], last_says=["shmlearn: interrupted"],
                during=_after(4.0, signal_group(signal.SIGINT)))]


@case("i38-nan-feature", "38.10", "your own arrays (--dataset FILE.py:NAME) with one NaN feature")
def _(t):
    path = out_of(t, "nan_data.py")
    with open(path, "w") as f:
        f.write("import numpy as np\n"
                "def data():\n"
                "    rng = np.random.default_rng(0)\n"
                "    x, y = rng.normal(size=(200, 4)).astype('float32'), np.arange(200) % 2\n"
                "    x[17, 3] = np.nan\n"
                "    return x[:160], y[:160], x[160:], y[160:]\n")
    return [Cmd(["train", "--dataset", f"{path}:data", "--model", "mlp", "--workers", "2", "--no-progress",
                 "--out", out_of(t)], 2, says=["train_x holds nan at row 17, column 3"])]


STUCK_DATA = """import time
import numpy as np
import torch


class Pairs(torch.utils.data.Dataset):
    classes = ("a", "b", "c", "d")

    def __init__(self, x, y, stuck=None):
        self.x, self.y, self.stuck = x, y, stuck

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.stuck:
            time.sleep(600)  # a read that never returns (a dead network mount)
        return self.x[i], self.y[i]


def _arrays():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(512, 5)).astype(np.float32), rng.integers(0, 4, 512),
            rng.normal(size=(64, 5)).astype(np.float32), rng.integers(0, 4, 64))


def train_stuck():  # sample 115: rank 0's first batch (seed 0, batch 16, 2 workers)
    a, b, c, d = _arrays()
    return Pairs(a, b, stuck=115), Pairs(c, d)


def test_stuck():  # rank 0 evaluates test samples 0..31, at step 0
    a, b, c, d = _arrays()
    return Pairs(a, b), Pairs(c, d, stuck=3)
"""


def _stuck(t: str, name: str, what: str) -> List[Cmd]:
    path = out_of(t, "stuck_data.py")
    with open(path, "w") as f:
        f.write(STUCK_DATA)
    return [Cmd(["train", "--dataset", f"{path}:{name}", "--model", "mlp", "--loader", "stream", "--workers", "2",
                 "--batch-size", "16", "--samples", "4096", "--eval-points", "2", "--no-progress", "--timeout", "20",
                 "--out", out_of(t)], 2, says=[f"reading {what}", "timed out after 20"], limit=180)]


@case("i38-stuck-train-dataset-w2", "38.5", "a streamed Dataset whose __getitem__ never returns, on rank 0 of 2, "
      "in training (--timeout 20)")
def _(t):
    return _stuck(t, "train_stuck", "the train Dataset at step 0 on rank 0")


@case("i38-stuck-test-dataset-w2", "38.5", "a streamed test Dataset whose __getitem__ never returns, on rank 0 of "
      "2, in the evaluation at step 0 (--timeout 20)")
def _(t):
    return _stuck(t, "test_stuck", "the test Dataset on rank 0")


def _stop_rank0_at_start(r: Running, el: float) -> None:
    """SIGSTOP of rank 0 as soon as both pool workers exist: it never joins the group."""
    if r.fault_t is None and len(workers(r)) >= 2:
        pid = workers(r)[0]
        os.kill(pid, signal.SIGSTOP)
        r.fault(f"SIGSTOP of rank 0 (pid {pid}) as the workers start, before the rendezvous")


@case("i38-stop-rank0-rendezvous", "38.9", "kill -STOP of rank 0 as the workers start, before it joins the group "
      "(--timeout 10)")
def _(t):
    return [Cmd(BASE + ["--workers", "2", "--timeout", "10", "--out", out_of(t)], 1,
                last_says=["rank 0: stopped responding"], during=_stop_rank0_at_start, poll_s=0.05, limit=180)]


# --- running ----------------------------------------------------------------------------------

def run_case(c: Case, tmp: str, logdir: str, limit: float) -> Dict[str, Any]:
    tag = uuid.uuid4().hex
    cmds = c.build(tmp)
    results: List[Dict[str, Any]] = []
    if c.concurrent:
        results = run_concurrent(cmds, tag, logdir, c.name, limit)
    else:
        for i, cmd in enumerate(cmds):
            r = Running(cmd, tag, logdir, f"{c.name}.{i}")
            res = r.wait(min(limit, cmd.limit or limit))
            if "first" in r.state:
                res["first_rows"] = r.state["first"]
            if i == 0 and c.name in ("sweep-disk-full-report", "i38-study-on-a-grid-out"):
                res["results_sha"] = _sha(os.path.join(out_of(tmp, "s"), "results.jsonl"))
            res["orphans"] = orphans_after(tag)
            res["summary"] = _summary_of(cmd)
            results.append(res)
            if res["hang"]:
                break
            if i == 0 and c.between is not None:
                c.between(tmp)
    lost = c.check(tmp, results) if c.check and not any(r["hang"] for r in results) else []
    for r in results:
        r.pop("first_rows", None)
    return {"results": results, "lost": lost, "verdict": verdict(results, lost)}


def _summary_of(cmd: Cmd) -> Optional[Dict[str, Any]]:
    """What the run's summary.json says now (status, steps, where it resumed from), if any."""
    if "--out" not in cmd.args:
        return None
    s = summary(cmd.args[cmd.args.index("--out") + 1])
    return {k: s.get(k) for k in ("status", "steps", "planned_steps", "resumed_from_step")} if s else None


def run_concurrent(cmds: List[Cmd], tag: str, logdir: str, name: str, limit: float) -> List[Dict[str, Any]]:
    """Start cmds[0]; cmds[1] once cmds[0] trains (or at once if both expect {0, 2})."""
    together = isinstance(cmds[0].expect, set)
    first = Running(cmds[0], tag, logdir, f"{name}.0")
    metrics = os.path.join(cmds[0].args[cmds[0].args.index("--out") + 1], "metrics.jsonl")
    t_end = time.monotonic() + limit
    while not together and not os.path.exists(metrics) and first.proc.poll() is None and time.monotonic() < t_end:
        time.sleep(0.02)
    second = Running(cmds[1], tag, logdir, f"{name}.1")
    r2 = second.wait(limit)
    r1 = first.wait(limit)
    if together and sorted([r1["exit"], r2["exit"]]) != [0, 2]:
        r1["wrong"].append(f"exits {r1['exit']} and {r2['exit']}, expected one 0 and one 2")
    r1["orphans"] = r2["orphans"] = orphans_after(tag)
    return [r1, r2]


def verdict(results: List[Dict[str, Any]], lost: List[str]) -> str:
    if any(r["hang"] for r in results):
        return "hang"
    if any(r["orphans"].get("pids") for r in results):
        return "orphan"
    if any(r["traceback"] for r in results):
        return "traceback"
    if lost:
        return "lost"
    if any(r["wrong"] for r in results):
        return "wrong"
    return "survived"


CATEGORIES = ("survived", "hang", "orphan", "traceback", "lost", "wrong")


def totals(flat: List[Dict[str, Any]]) -> Dict[str, int]:
    return {"tried": len(flat), **{k: sum(f["verdict"] == k for f in flat) for k in CATEGORIES}}


BOUNDS = [  # (label, case prefixes, what is measured)
    ("a stopped rank (SIGSTOP) is named and the run exits", ("stop-",), "timeout"),
    ("a hung rank (asleep before a collective) is named and the run exits", ("hang-",), "timeout"),
    ("a killed worker is named and the run exits", ("kill-worker-fault", "kill-worker-signal"), "fault"),
    ("a killed launcher's processes are all gone", ("kill-launcher-",), "gone"),
]


def bounds(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The worst run per kind of fault: seconds from the fault to the exit (and their slack over
    --timeout), or from a launcher's death to its last process's."""
    out = {}
    for label, prefixes, kind in BOUNDS:
        worst = None
        for rec in records:
            if not rec["name"].startswith(prefixes) or rec["verdict"] != "survived":
                continue
            r = rec["results"][0]
            if kind == "gone":
                v = {"value_s": r["orphans"].get("all_gone_s"), "case": rec["name"], "key": "value_s"}
            else:
                if r["fault_to_exit_s"] is None:
                    continue
                t = _timeout_of(r["command"])
                v = {"value_s": r["fault_to_exit_s"], "timeout_s": t, "case": rec["name"], "key": "value_s"}
                if kind == "timeout" and t is not None:
                    v.update(slack_s=round(r["fault_to_exit_s"] - t, 2), key="slack_s")
            if v["value_s"] is None:
                continue
            if worst is None or v[v["key"]] > worst[worst["key"]]:
                worst = v
        if worst:
            worst.pop("key")
            out[label] = {**worst, "kind": kind}
    return out


def _timeout_of(command: str) -> Optional[float]:
    parts = command.split()
    return float(parts[parts.index("--timeout") + 1]) if "--timeout" in parts else None


def write_readme(doc: Dict[str, Any], json_name: str) -> str:
    recs = doc["cases"]
    tot = doc["totals"]
    lines = [
        "# Fault campaign (issue 15, acceptance 3)",
        "",
        f"`python benchmarks/fault_campaign.py`, {doc['environment']['date']}, on {doc['environment']['cpu']} "
        f"({doc['environment']['cpu_count']} cores), torch {doc['environment']['torch_version']}, code at "
        f"{doc['code']['head'][:10]}{' + uncommitted changes' if doc['code']['dirty'] else ''}. "
        f"Every run is a real `python -m shmlearn` subprocess (2 CPU workers, digits). Raw data: "
        f"[{json_name}]({json_name}).",
        "",
        f"Load average at the start and end: {doc['environment']['loadavg_start'][0]:.1f}, "
        f"{doc['environment']['loadavg_end'][0]:.1f} (other sessions shared the machine; the bounds below are "
        f"under that load).",
        "",
        "| faults | tried | survived | " + " | ".join(CATEGORIES[1:]) + " |",
        "|---|---|---|" + "---|" * (len(CATEGORIES) - 1),
        *(f"| {label} | {t['tried']} | {t['survived']} | " + " | ".join(str(t[k]) for k in CATEGORIES[1:]) + " |"
          for label, t in (("issue 15's items and the classic faults", doc["totals_issue15_and_classic"]),
                           ("beyond the issue (one rank, nobody waiting on it)", doc["totals_beyond"]),
                           ("**all**", tot))),
        "",
        "A run is a *hang* if it did not exit within the campaign's limit "
        f"({doc['limit_s']:g} s; 90 s for the cases beyond the issue, 10x their --timeout), an *orphan* if any process it started was alive {SETTLE_S:g} s after "
        "it exited, a *traceback* if stderr held one (or C++ frames), *lost* if a row, summary or "
        "result already written was lost or torn, *wrong* if the exit code or message was not the "
        "promised one (exit 2: one line naming the input).",
        "",
        "*Fault to exit*: from the fault (a worker seen stopped, the signal sent, or for a hang the last "
        "metrics row before it, an upper bound) to the exit; for a killed launcher, from the kill to "
        "the end of its last process. The worst run is shown.",
        "",
        "| case | item | fault | runs | exit (expected) | wall s | fault to exit s | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rec in recs:
        for_runs = rec["runs"]
        exits = sorted({", ".join(str(r["exit"]) for r in run["results"]) for run in for_runs})
        exp = ", ".join(str(r["expected"]) for r in for_runs[0]["results"])
        walls = [sum(r["wall_s"] for r in run["results"]) for run in for_runs]
        if rec["name"].startswith("kill-launcher-"):  # the exit is the kill: the bound is the workers' end
            fte = [run["results"][0]["orphans"].get("all_gone_s") or 0.0 for run in for_runs]
        else:
            fte = [run["results"][0]["fault_to_exit_s"] for run in for_runs if run["results"][0]["fault_to_exit_s"]]
        verdicts = sorted({run["verdict"] for run in for_runs})
        v = ", ".join(verdicts)
        if verdicts != ["survived"]:
            why = "; ".join(sorted({p for run in for_runs for p in _why(run)}))[:300]
            v = f"**{v}**: {why}"
        lines.append(f"| {rec['name']} | {rec['item']} | {rec['what']} | {len(for_runs)} | {' / '.join(exits)} "
                     f"({exp}) | {max(walls):.1f} | {max(fte):.2f} | {v} |" if fte else
                     f"| {rec['name']} | {rec['item']} | {rec['what']} | {len(for_runs)} | {' / '.join(exits)} "
                     f"({exp}) | {max(walls):.1f} | | {v} |")
    lines += ["", "## Bounds measured (worst run)", ""]
    for label, b in doc["bounds"].items():
        if b["kind"] == "timeout":
            lines.append(f"- {label}: {b['value_s']:.1f} s after the fault at --timeout {b['timeout_s']:g}, "
                         f"i.e. timeout + {b['slack_s']:.1f} s ({b['case']})")
        elif b["kind"] == "gone":
            lines.append(f"- {label}: {b['value_s']:.1f} s after the kill ({b['case']})")
        else:
            lines.append(f"- {label}: {b['value_s']:.1f} s after the fault ({b['case']})")
    lines.append("")
    return "\n".join(lines)


def _why(run: Dict[str, Any]) -> List[str]:
    out = list(run["lost"])
    for r in run["results"]:
        out += r["wrong"]
        if r["hang"]:
            out.append("no exit within the limit")
        if r["traceback"]:
            out.append("traceback: " + r["stderr_tail"].splitlines()[-1][:120] if r["stderr_tail"] else "traceback")
        if r["orphans"].get("pids"):
            out.append(f"{len(r['orphans']['pids'])} processes left ({r['orphans'].get('gone_after_s')} s)")
    return out


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated case names (prefixes) to run")
    p.add_argument("--repeat", type=int, default=None, help="runs per case (default: each case's own, 1-3)")
    p.add_argument("--limit", type=float, default=180.0, help="seconds before a run counts as a hang")
    p.add_argument("--out", default=RESULTS, help="where the JSON and README.md go")
    p.add_argument("--keep", action="store_true", help="keep the run directories and logs (printed)")
    p.add_argument("--readme", metavar="FILE.json", help="only write README.md again from a campaign's JSON")
    a = p.parse_args(argv)
    if a.readme:
        with open(a.readme) as f:
            doc = json.load(f)
        with open(os.path.join(os.path.dirname(os.path.abspath(a.readme)), "README.md"), "w") as f:
            f.write(write_readme(doc, os.path.basename(a.readme)))
        return 0
    cases = [c for c in CASES if not a.only or any(c.name.startswith(o) for o in a.only.split(","))]
    if not cases:
        raise SystemExit(f"--only {a.only}: no such case; cases: {', '.join(c.name for c in CASES)}")
    doc: Dict[str, Any] = {"environment": environment("gloo"),
                           "code": {"head": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "shmlearn"))},
                           "limit_s": a.limit, "settle_s": SETTLE_S, "cases": []}
    work = tempfile.mkdtemp(prefix="shmlearn-faults-")
    t_start = time.monotonic()
    for c in cases:
        runs = []
        for i in range(a.repeat or c.repeat):
            tmp = os.path.join(work, f"{c.name}.{i}")
            os.makedirs(tmp)
            run = run_case(c, tmp, tmp, a.limit)
            runs.append(run)
            r0 = run["results"][0]
            print(f"{c.name} [{i + 1}] {run['verdict']}: exit {[r['exit'] for r in run['results']]} "
                  f"wall {sum(r['wall_s'] for r in run['results']):.1f} s"
                  + (f", fault to exit {r0['fault_to_exit_s']} s" if r0["fault_to_exit_s"] else "")
                  + ("" if run["verdict"] == "survived" else f" | {'; '.join(_why(run))[:400]}"), flush=True)
        doc["cases"].append({"name": c.name, "item": c.item, "what": c.what, "runs": runs})
    flat = [{"name": rec["name"], "item": rec["item"], "verdict": run["verdict"], "results": run["results"]}
            for rec in doc["cases"] for run in rec["runs"]]
    doc["totals"] = totals(flat)
    doc["totals_issue15_and_classic"] = totals([f for f in flat if f["item"] != "beyond"])
    doc["totals_beyond"] = totals([f for f in flat if f["item"] == "beyond"])
    doc["bounds"] = bounds(flat)
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    doc["environment"]["loadavg_end"] = list(os.getloadavg())
    os.makedirs(a.out, exist_ok=True)
    name = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d") + ".json"
    if a.only:
        name = name.replace(".json", "-partial.json")
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(doc, f, indent=1)
    if not a.only:
        with open(os.path.join(a.out, "README.md"), "w") as f:
            f.write(write_readme(doc, name))
    print(json.dumps(doc["totals"]), json.dumps(doc["bounds"], indent=1), sep="\n")
    if a.keep:
        print(f"run directories and logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if doc["totals"]["survived"] == doc["totals"]["tried"] else 1


if __name__ == "__main__":
    sys.exit(main())
