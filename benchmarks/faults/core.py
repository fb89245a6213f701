"""What every case of the fault campaign shares: its processes (found by SHMLEARN_TEST_TAG in
/proc/*/environ, as the tests find them), one `python -m shmlearn` invocation (Cmd) and its run
(Running: exit code, traceback, stderr lines, wall time, fault-to-exit), and the processes left
behind after an exit."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(REPO, "results", "fault_campaign")
_CODE = [REPO]
"""The checkout whose shmlearn the cases run (`--code DIR`; this repository by default): its
folder leads PYTHONPATH, and the earlier rounds' cases run in it."""


def code() -> str:
    return _CODE[0]


def use_code(path: str) -> None:
    """Run the cases against the shmlearn of checkout `path` (an older commit's worktree: what a
    case did before its fix). The campaign itself, its fixtures' damage included, stays this tree's."""
    _CODE[0] = os.path.abspath(path)
sys.path.insert(0, os.path.join(REPO, "tests"))  # the tests' helpers the campaign shares (procs, stuck_data)
from procs import processes_with_tag as tagged  # noqa: E402 - processes by SHMLEARN_TEST_TAG
BASE = ["train", "--dataset", "digits", "--model", "mlp", "--samples", "12800", "--batch-size", "32",
        "--eval-points", "2", "--no-progress"]
"""200 steps at 2 workers (the reliability tests' run): a few seconds of training."""
LONG = ["train", "--dataset", "digits", "--model", "mlp", "--epochs", "200", "--no-progress"]
"""~2200 steps at 2 workers: still training when a signal comes from outside."""
SWEEP = ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "2048", "--no-report",
         "--no-progress"]
TINY = ["train", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
        "--eval-points", "1", "--no-progress"]
"""A run of ~16 steps: what a case that may train (where it should have refused) costs."""
SETTLE_S = 2.0
"""Processes of a run still alive this long after it exited are orphans."""
FSIZE = 40_000
"""RLIMIT_FSIZE standing in for a full disk (tests/test_reliability.py's figure): summary.json
fits, trace.json does not."""
TRACEBACK_MARKS = ("Traceback (most recent call last)", "frame #", "Exception ignored in")
"""A traceback in stderr: Python's, C++ frames, or one Python printed while exiting (a
BrokenPipeError flushing stdout)."""



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
    or the forks of its forkserver child (the program's CPU runs: shmlearn/launch/forkserver.py).
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
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # The repository first on the path: a case run from another folder (its own cwd) still runs
    # this tree's shmlearn, as an installed one would be found.
    path = [code()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (REPO, code())]
    env.update(PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1", SHMLEARN_TEST_TAG=tag,
               PYTHONPATH=os.pathsep.join(path), **(extra or {}))
    return env


def _child_setup(fsize: Optional[int]) -> Callable[[], None]:
    """In the run's process before exec: Ctrl-C and hangups handled as in a terminal (a campaign
    started in the background of a shell without job control inherits SIGINT ignored, one started
    under nohup SIGHUP, and so would every run, so a Ctrl-C or SIGHUP case would see no signal),
    and an optional file-size limit."""
    def apply() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        if fsize:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return apply




@dataclass
class Cmd:
    """One invocation of a case (`python -m shmlearn ARGS`, or `python ARGV`), and what it must do."""
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
    """stderr must be exactly one line (default: when the exit is 2 and 2 was expected)."""
    during: Optional[Callable[["Running", float], None]] = None
    """Called every poll with the seconds since start: sends the outside fault."""
    fsize: Optional[int] = None
    poll_s: float = 0.02
    """How often `during` looks (1 ms to catch a checkpoint being written)."""
    limit: Optional[float] = None
    """Seconds before this command counts as a hang, if less than the campaign's --limit."""
    env: Dict[str, str] = field(default_factory=dict)
    """Added to the clean environment (a launcher's variables, SHMLEARN_STRATEGY_PATH)."""
    argv: Optional[List[str]] = None
    """Instead of `-m shmlearn ARGS`: the interpreter's arguments (a script, `-` for stdin)."""
    stdin: Optional[str] = None
    """Text fed to stdin, then closed (default: /dev/null)."""
    pipe: Optional[str] = None
    """'head': stdout is a pipe closed after its first line (`| head -1`); 'closed': a pipe whose
    reader is gone before the first write (`| true`)."""
    cwd: Optional[str] = None
    """The folder it runs in (default: the case's: the repository, or an empty folder of its own)."""
    hold: List[Any] = field(default_factory=list)
    """Objects kept open while it runs, closed after (a socket holding a port)."""
    verify: Optional[Callable[[Dict[str, Any]], List[str]]] = None
    """More of what it must do, given its result: problems (counted as wrong)."""

    def line(self) -> str:
        if self.argv is not None:
            return "python " + " ".join(self.argv) + (" < script" if self.stdin is not None else "")
        return "python -m shmlearn " + " ".join(self.args) + {"head": " | head -1", "closed": " | true"}.get(
            self.pipe or "", "")


def expects(expect: Any, rc: Optional[int]) -> bool:
    return rc in expect if isinstance(expect, (set, frozenset, tuple, list)) else rc == expect


class Running:
    def __init__(self, cmd: Cmd, tag: str, logdir: str, name: str, cwd: Optional[str] = None):
        self.cmd, self.tag = cmd, tag
        self.fault_t: Optional[float] = None
        """monotonic time of the fault, where the campaign knows it."""
        self.fault_how = ""
        self.state: Dict[str, Any] = {}
        self.out_path = os.path.join(logdir, f"{name}.stdout")
        self.err_path = os.path.join(logdir, f"{name}.stderr")
        env = clean_env(tag, {"SHMLEARN_FAULT": cmd.fault} if cmd.fault else None)
        env.update(cmd.env)
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        argv = cmd.argv if cmd.argv is not None else ["-m", "shmlearn", *cmd.args]
        stdout: Any = self._out
        reader = None
        if cmd.pipe == "head":
            stdout = subprocess.PIPE
        elif cmd.pipe == "closed":
            reader, stdout = os.pipe()
        self.t0 = time.monotonic()
        # Its own session: a kill of "the process group" is then ours alone.
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=cmd.cwd or cwd or code(), env=env,
                                     stdin=subprocess.PIPE if cmd.stdin is not None else subprocess.DEVNULL,
                                     stdout=stdout, stderr=self._err, start_new_session=True,
                                     preexec_fn=_child_setup(cmd.fsize))
        if reader is not None:  # the reader is gone before the first write: every write fails
            os.close(reader)
            os.close(stdout)
        if cmd.pipe == "head":
            threading.Thread(target=self._head, daemon=True).start()
        if cmd.stdin is not None:
            try:
                self.proc.stdin.write(cmd.stdin.encode())
                self.proc.stdin.close()
            except BrokenPipeError:
                pass

    def _head(self) -> None:
        """`| head -1`: read one line, write it to the log, close the pipe."""
        line = self.proc.stdout.readline()
        self._out.write(line.decode(errors="replace"))
        self._out.flush()
        self.proc.stdout.close()

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
        for h in self.cmd.hold:
            h.close()
        time.sleep(0.05 if self.cmd.pipe == "head" else 0)  # the reader thread's last write
        self._out.close()
        self._err.close()
        with open(self.out_path) as f:
            stdout = f.read()
        with open(self.err_path, errors="replace") as f:
            stderr = f.read()
        return self._measure(stdout, stderr, t_exit - self.t0, hang, t_exit)

    def _measure(self, stdout: str, stderr: str, wall: float, hang: bool, t_exit: float) -> Dict[str, Any]:
        c = self.cmd
        lines = stderr.strip().splitlines()
        rc = None if hang else self.proc.returncode
        many = isinstance(c.expect, (set, frozenset, tuple, list))
        one_line = c.one_line if c.one_line is not None else (rc == 2 and 2 in c.expect if many else c.expect == 2)
        problems = []
        if not hang and not expects(c.expect, rc):
            problems.append(f"exit {rc}, expected {c.expect}")
        if one_line and len(lines) != 1:
            problems.append(f"stderr has {len(lines)} lines, expected one")
        for s in c.says:
            if s not in stderr:
                problems.append(f"stderr lacks {s!r}")
        for s in c.last_says:
            if not lines or s not in lines[-1]:
                problems.append(f"last stderr line lacks {s!r}")
        res = {
            "command": c.line(),
            "fault": c.fault, "fsize": c.fsize, "env": c.env or None,
            "expected": sorted(c.expect) if isinstance(c.expect, set) else c.expect,
            "exit": rc, "hang": hang, "wall_s": round(wall, 2),
            "fault_to_exit_s": round(t_exit - self.fault_t, 2) if self.fault_t and not hang else None,
            "fault_moment": self.fault_how or None,
            "traceback": any(m in stderr for m in TRACEBACK_MARKS),
            "stderr_lines": len(lines), "stderr_bytes": len(stderr), "stderr_tail": "\n".join(lines[-6:])[-2000:],
            "stdout_tail": "\n".join(stdout.strip().splitlines()[-3:])[-1000:],
            "wrong": problems, "orphans": [], "lost": [],
        }
        if c.verify is not None and not hang:
            problems += c.verify({**res, "stderr": stderr, "stdout": stdout})
        return res


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

