"""Symlinks placed in --out that point out of it (issue 53): a write of the run must not follow
them. Each case's sentinel folder (tmp/outside) is the target; the runner fails the case as
'outside' if anything there is created or changed. The command may refuse (exit 2, one line) or
write its file in place of the link; either way nothing outside --out may change."""
from __future__ import annotations

import functools
import os

from benchmarks.faults import registry
from benchmarks.faults.core import TINY, Cmd
from benchmarks.faults.registry import fixture, out_of

case = functools.partial(registry.case, klass="symlinks")
EITHER = {0, 2}
"""Written in place of the link (0), or refused in one line (2)."""


def _link(run: str, name: str, target: str) -> None:
    os.makedirs(run, exist_ok=True)
    os.symlink(target, os.path.join(run, name))


def _outside(t: str, name: str) -> str:
    return os.path.join(t, "outside", name)


# A fresh --out holding one dangling link to a file (or folder) that does not exist yet outside.
TRAIN_FILES = ("config.yaml", ".lock", "metrics.jsonl", "eval.jsonl", "summary.json", "trace.json", "model.pt",
               "checkpoints", "tensorboard")
for _n in TRAIN_FILES:
    @case(f"link-train-{_n.strip('.')}-dangling", "53", f"train --out RUN where RUN/{_n} is a link to a new "
          f"path outside RUN")
    def _(t, n=_n):
        _link(out_of(t), n, _outside(t, f"new-{n.strip('.')}"))
        extra = ["--checkpoint-every", "8"] if n == "checkpoints" else ["--tensorboard"] if n == "tensorboard" else []
        return [Cmd(TINY + extra + ["--out", out_of(t)], EITHER)]

# ... and to a file of the user's that exists outside.
for _n in ("config.yaml", ".lock"):
    @case(f"link-train-{_n.strip('.')}-existing", "53", f"train --out RUN where RUN/{_n} is a link to an existing "
          f"file outside RUN")
    def _(t, n=_n):
        _link(out_of(t), n, _outside(t, n))
        return [Cmd(TINY + ["--out", out_of(t)], EITHER)]


@case("link-train-checkpoints-existing-dir", "53", "train --checkpoint-every 8 where RUN/checkpoints is a link to "
      "an existing folder outside RUN")
def _(t):
    _link(out_of(t), "checkpoints", _outside(t, "dir"))
    return [Cmd(TINY + ["--checkpoint-every", "8", "--out", out_of(t)], EITHER)]


# --resume of a stopped run (checkpoints at 20, 40, 60) whose files are links to the user's files
for _n in ("metrics.jsonl", "eval.jsonl", "summary.json", "config.yaml"):
    @case(f"link-resume-{_n.split('.')[0]}", "53", f"--resume of a stopped run whose {_n} was moved out of RUN "
          f"and linked back (--resume truncated the file outside)")
    def _(t, n=_n):
        run = fixture(t, "ckpt")
        if os.path.exists(os.path.join(run, n)):
            os.replace(os.path.join(run, n), _outside(t, n))  # rows past the checkpoint: --resume would cut them
        else:  # a stopped run has no summary.json: the link goes to the user's own file, which must stay
            with open(_outside(t, n), "w") as f:
                f.write('{"status": "failed"}\n')
        os.symlink(_outside(t, n), os.path.join(run, n))
        return [Cmd(registry.FIXTURES["ckpt"] + ["--resume", "--out", run], EITHER)]


for _n in ("metrics.jsonl", "eval.jsonl"):
    @case(f"link-resume-finished-{_n.split('.')[0]}", "53", f"--resume of a finished run without checkpoints whose "
          f"{_n} was moved out of RUN and linked back (it trained again and truncated the file outside)")
    def _(t, n=_n):
        run = fixture(t, "run")
        os.replace(os.path.join(run, n), _outside(t, n))
        os.symlink(_outside(t, n), os.path.join(run, n))
        return [Cmd(registry.FIXTURES["run"] + ["--resume", "--out", run], EITHER)]


# a sweep's own files
for _n, _target in (("results.jsonl", "new-results.jsonl"), ("sweep.json", "new-sweep.json"), ("trials", "dir"),
                    ("report.html", "report.html"), ("figures", "dir")):
    @case(f"link-sweep-{_n.split('.')[0]}", "53", f"sweep --out S where S/{_n} is a link out of S")
    def _(t, n=_n, target=_target):
        _link(out_of(t, "s"), n, _outside(t, target))
        return [Cmd(["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
                     "--lr", "0.1,0.2", "--no-progress", "--out", out_of(t, "s")], EITHER)]


# the tools that write into a run directory
@case("link-report-html", "53", "report RUN where RUN/report.html is a link to a file outside RUN")
def _(t):
    run = fixture(t, "run")
    os.symlink(_outside(t, "report.html"), os.path.join(run, "report.html"))
    return [Cmd(["report", run], EITHER)]


@case("link-report-figures", "53", "report RUN where RUN/figures is a link to a folder outside RUN")
def _(t):
    run = fixture(t, "run")
    os.symlink(_outside(t, "dir"), os.path.join(run, "figures"))
    return [Cmd(["report", run], EITHER)]


@case("link-advise-dir", "53", "advise RUN where RUN/advise is a link to a folder outside RUN")
def _(t):
    run = fixture(t, "run")
    os.symlink(_outside(t, "dir"), os.path.join(run, "advise"))
    return [Cmd(["advise", run], EITHER)]


@case("link-simulate-json", "53", "simulate --out SIM where SIM/simulate.json is a link out of SIM")
def _(t):
    run = fixture(t, "run")
    _link(out_of(t, "sim"), "simulate.json", _outside(t, "new-simulate.json"))
    return [Cmd(["simulate", "--net-bw", "10", "--compute", run, "--out", out_of(t, "sim")], EITHER)]
