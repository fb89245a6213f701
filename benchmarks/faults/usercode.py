"""The newcomer's runs (issue 53): --resume of a finished run, a sweep or a run pointed at the
other's folder, a folder named `shmlearn` in the current folder, the Python API from stdin or
without a main guard, a user loss that exits or returns the wrong thing, labels whose dtype
changes mid-stream, an abbreviated flag."""
from __future__ import annotations

import functools
import os
import tomllib
from typing import Dict, List

from benchmarks.faults import registry
from benchmarks.faults.core import BASE, TINY, Cmd, code
from benchmarks.faults.registry import FIXTURES, fixture, out_of, write
from benchmarks.faults.written import changes, completed, digest, run_dir_problems

case = functools.partial(registry.case, klass="usercode")
SNAPSHOTS: Dict[str, Dict[str, str]] = {}
"""tmp -> the run directory's digest between its first and second command."""


def _snapshot(t: str) -> None:
    SNAPSHOTS[t] = digest(out_of(t))


def _unchanged_since_first(t, results) -> List[str]:
    before = SNAPSHOTS.pop(t, {})
    return [f"the finished run's {x}" for x in changes(before, digest(out_of(t)), added_ok=True)]


def _prints(text: str):
    """`text` printed, on stdout or stderr: "already completed" is a note of a command that
    succeeded (exit 0), and the program prints such notes on stdout."""
    def verify(res) -> List[str]:
        return [] if text in res["stdout"] + res["stderr"] else [f"prints no '{text}'"]
    return verify


@case("resume-finished-w1", "53", "--resume of a finished 1-worker run without checkpoints (it trained again "
      "from step 0 and rewrote its files)", keep=lambda t: [out_of(t)])
def _(t):
    run = fixture(t, "run")
    return [Cmd(FIXTURES["run"] + ["--resume", "--out", run], 0, verify=_prints("already completed"), limit=120)]


for _ckpt in (False, True):
    @case(f"resume-finished-w2{'-checkpoints' if _ckpt else ''}", "53", f"a 2-worker run "
          f"{'with checkpoints every 50 steps ' if _ckpt else ''}to its end, then --resume twice",
          between=_snapshot, check=_unchanged_since_first)
    def _(t, ckpt=_ckpt):
        args = BASE + ["--workers", "2", *(["--checkpoint-every", "50"] if ckpt else []), "--out", out_of(t)]
        return [Cmd(args, 0), Cmd(args + ["--resume"], 0, verify=_prints("already completed")),
                Cmd(args + ["--resume"], 0, verify=_prints("already completed"))]


@case("sweep-out-into-train-run", "53", "sweep --out RUN, RUN a finished train run (train refuses the reverse)",
      keep=lambda t: [out_of(t)])
def _(t):
    return [Cmd(["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
                 "--lr", "0.1,0.2", "--no-report", "--no-progress", "--out", fixture(t, "run")], 2)]


@case("train-out-into-sweep", "53", "train --out S, S a finished sweep", keep=lambda t: [out_of(t, "s")])
def _(t):
    return [Cmd(TINY + ["--out", fixture(t, "sweep", "s")], 2)]


def _completed(t, results):
    return run_dir_problems(out_of(t)) + completed(out_of(t))


SHADOWS = {"runs": ["runs"], "bare": [], "sync": ["sync", "report"]}
"""Folders inside the `shmlearn/` folder of the cwd (the clone's parent folder, or a user's)."""
EDITABLE = """import sys
from importlib.machinery import PathFinder


class Editable:
    \"\"\"What `pip install -e` installs: shmlearn found by name, not through sys.path, so a
    folder named shmlearn on sys.path (the cwd) is taken for a namespace package first.\"\"\"
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        return PathFinder.find_spec(fullname, path=[{repo!r}]) if fullname == "shmlearn" else None


sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, Editable)
"""
CONSOLE = "from {module} import {func}\n{func}()\n"
"""The `shmlearn` console script: its folder, not the cwd, is sys.path[0] in the launcher."""


def console_script() -> str:
    """The console script pip writes for the checkout under test, from its pyproject.toml's
    `[project.scripts] shmlearn = "MODULE:FUNC"` (an older checkout's entry point differs)."""
    with open(os.path.join(code(), "pyproject.toml"), "rb") as f:
        module, func = tomllib.load(f)["project"]["scripts"]["shmlearn"].split(":")
    return CONSOLE.format(module=module, func=func)


def installed(t: str, cwd: str, args: List[str], expect=0, **kw) -> Cmd:
    """`shmlearn ARGS` run from `cwd` as an editable install of this tree runs it."""
    site = out_of(t, "site")
    write(os.path.join(site, "sitecustomize.py"), EDITABLE.format(repo=code()))
    script = write(out_of(t, "bin/shmlearn"), console_script())
    return Cmd(args, expect, argv=[script, *args], cwd=cwd, env={"PYTHONPATH": site}, **kw)


for _shadow, _subs in SHADOWS.items():
    for _w in ((1, 2) if _shadow == "runs" else (2,)):
        @case(f"cwd-shmlearn-folder-{_shadow}-w{_w}", "53", f"shmlearn train --workers {_w} (an editable install) "
              f"from a folder holding shmlearn/{'/'.join(_subs)} (every worker died: cannot import RunDir)",
              check=_completed)
        def _(t, subs=_subs, w=_w):
            cwd = out_of(t, "here")
            os.makedirs(os.path.join(cwd, "shmlearn", *subs), exist_ok=True)
            args = TINY[:-5] + ["--workers", str(w), "--eval-points", "1", "--no-progress", "--out", out_of(t)]
            return [installed(t, cwd, args, limit=150)]


@case("cwd-shmlearn-folder-sweep", "53", "a sweep from a folder holding shmlearn/runs/")
def _(t):
    cwd = out_of(t, "here")
    os.makedirs(os.path.join(cwd, "shmlearn", "runs"))
    return [installed(t, cwd, ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers",
                               "2", "--lr", "0.1,0.2", "--no-report", "--no-progress", "--out", out_of(t, "s")],
                      limit=150)]


API = """import shmlearn
from shmlearn import TrainConfig
{guard}r = shmlearn.train(TrainConfig(dataset="digits", model="softmax", samples=1024, workers={w}, eval_points=1,
{ind}                               progress=False, out={out!r}))
{ind}print("status", r.summary["status"])
"""


def api(out: str, w: int, guard: bool) -> str:
    return API.format(guard='if __name__ == "__main__":\n    ' if guard else "", ind="    " if guard else "",
                      w=w, out=out)


def _status_printed(res) -> List[str]:
    return [] if "status completed" in res["stdout"] else ["stdout lacks 'status completed'"]


for _w in (1, 2):
    @case(f"api-from-stdin-w{_w}", "53", f"python - <<EOF (shmlearn.train, {_w} worker{'s' if _w > 1 else ''})",
          check=_completed)
    def _(t, w=_w):
        return [Cmd([], 0, argv=["-"], stdin=api(out_of(t), w, guard=False), verify=_status_printed, limit=150)]


@case("api-python-c-w2", "53", "python -c '...shmlearn.train(...)' with 2 workers", check=_completed)
def _(t):
    return [Cmd([], 0, argv=["-c", api(out_of(t), 2, guard=False)], verify=_status_printed, limit=150)]


def _said_main_guard(res) -> List[str]:
    if res["exit"] == 0:
        return _status_printed(res)
    probs = [] if "__main__" in res["stderr"] else ["a failure that does not name the __main__ guard"]
    return probs + (["misleading: 'another run is writing there'"] if "another run is writing" in res["stderr"] else [])


for _w, _out, _spawn in ((1, True, False), (2, True, False), (2, False, False), (2, True, True), (2, False, True)):
    @case(f"script-without-main-guard-w{_w}{'' if _out else '-default-out'}{'-spawn' if _spawn else ''}", "53",
          f"python script.py calling shmlearn.train at top level, {_w} worker{'s' if _w > 1 else ''}"
          f"{'' if _out else ', the default run directory'}"
          f"{', spawned workers (SHMLEARN_FORKSERVER=0)' if _spawn else ''}"
          f": runs, or one line naming the guard (it said 'another run is writing there')")
    def _(t, w=_w, out=_out, spawn=_spawn):
        script = write(out_of(t, "script.py"), api(out_of(t) if out else None, w, guard=False))
        return [Cmd([], {0, 1, 2}, argv=[script], verify=_said_main_guard, env={"SHMLEARN_FORKSERVER": "0"} if spawn
                    else {}, limit=150)]


LOSSES = {
    "sys-exit-3": "import sys\nimport torch.nn.functional as F\n\n\ndef loss(out, y):\n    sys.exit(3)\n",
    "sys-exit-0": "import sys\n\n\ndef loss(out, y):\n    sys.exit(0)\n",
    "returns-float": "import torch.nn.functional as F\n\n\ndef loss(out, y):\n"
                     "    return float(F.cross_entropy(out, y))\n",
    "non-scalar": "import torch.nn.functional as F\n\n\ndef loss(out, y):\n"
                  "    return F.cross_entropy(out, y, reduction='none')\n",
}
for _how, _body in LOSSES.items():
    for _w in ((1, 2) if _how.startswith("sys-exit") else (2,)):
        @case(f"user-loss-{_how}-w{_w}", "53", f"train --loss FILE.py:loss that {_how.replace('-', ' ')} "
              f"({_w} worker{'s' if _w > 1 else ''})")
        def _(t, body=_body, w=_w):
            path = write(out_of(t, "my_loss.py"), body)
            args = TINY[:-5] + ["--workers", str(w), "--eval-points", "1", "--no-progress"]
            # exit 2: one line; exit 1 (the rank's failure): its line, then the user's own frames
            # below it ("in your code:", launch/worker.describe), which is no traceback
            return [Cmd(args + ["--loss", f"{path}:loss", "--out", out_of(t)], {1, 2}, says=["loss"], limit=150)]


DTYPE_DATA = """import numpy as np
import torch


class Drifting(torch.utils.data.Dataset):
    def __init__(self, n):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):  # labels turn float halfway through the set
        y = int(self.y[i]) if i < len(self.x) // 2 else float(self.y[i])
        return torch.from_numpy(self.x[i]), y


def data():
    return Drifting(1024), Drifting(64)
"""


@case("user-data-label-dtype-drift", "53", "a streamed Dataset whose label dtype changes mid-stream (it trained on "
      "silently)")
def _(t):
    path = write(out_of(t, "drift.py"), DTYPE_DATA)
    return [Cmd(["train", "--dataset", f"{path}:data", "--model", "mlp", "--loader", "stream", "--workers", "1",
                 "--batch-size", "16", "--samples", "2048", "--eval-points", "1", "--no-progress", "--out", out_of(t)],
                {1, 2}, one_line=True, says=["label"], limit=150)]


for _cmd, _flag in (("train", "--worker"), ("train", "--sampl"), ("sweep", "--paral")):
    @case(f"abbrev-{_cmd}{_flag}", "53", f"{_cmd} {_flag} 1: a prefix is not taken for the flag it starts")
    def _(t, cmd=_cmd, flag=_flag):
        base = TINY if cmd == "train" else ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024",
                                            "--lr", "0.1,0.2", "--no-report", "--no-progress"]
        return [Cmd(base + [flag, "1", "--out", out_of(t)], 2, says=[flag])]


def _no_flag_help(flag: str):
    """The help paragraph of `flag` (a --no-X switch) says what the switch does, naming it; it
    read "Save the final weights ...", the opposite."""
    def verify(res) -> List[str]:
        text = res["stdout"]
        start = text.find(f"\n  {flag} ")
        if start < 0:
            return [f"the help has no {flag} paragraph"]
        end = text.find("\n  -", start + 1)
        para = " ".join(text[start:end if end > 0 else None].split()[1:])
        return [] if flag in para and not para.startswith("Save") else [f"{flag}'s help says: {para[:80]!r}"]
    return verify


@case("help-no-save-model", "53", "train --help: the --no-save-model paragraph says what the flag does (it said "
      "the opposite: 'Save the final weights')")
def _(t):
    return [Cmd(["train", "--help"], 0, verify=_no_flag_help("--no-save-model"))]
