"""A full disk (RLIMIT_FSIZE standing in for it: a write past the limit fails with EFBIG) and
outputs that cannot be written (a folder where a file goes, /proc, /sys), for report, simulate,
advise, checkpoints and a run's first files (issue 53). Owed: one line naming what could not be
written, exit 1 or 2, no temporary file left, and what was there before unchanged."""
from __future__ import annotations

import functools
import os

from benchmarks.faults import registry
from benchmarks.faults.core import Cmd
from benchmarks.faults.registry import fixture, out_of, write
from benchmarks.faults.written import run_dir_problems, tmp_leftovers

case = functools.partial(registry.case, klass="diskfull")
FAILED = {1, 2}


def _clean(*subs: str):
    def check(t, results):
        return [p for s in subs for p in tmp_leftovers(out_of(t, s))]
    return check


def _keep_run(t):
    return [out_of(t)]


@case("full-report-run", "53", "report RUN under RLIMIT_FSIZE 20000 B (its figures do not fit)", check=_clean("run"),
      keep=_keep_run)
def _(t):
    return [Cmd(["report", fixture(t, "run")], FAILED, fsize=20_000, one_line=True)]


@case("full-report-sweep", "53", "report SWEEP under RLIMIT_FSIZE 20000 B", check=_clean("s"),
      keep=lambda t: [out_of(t, "s")])
def _(t):
    return [Cmd(["report", fixture(t, "sweep", "s")], FAILED, fsize=20_000, one_line=True)]


@case("full-report-out-file", "53", "report RUN --out FILE under RLIMIT_FSIZE 20000 B", check=_clean("run", "rep"),
      keep=_keep_run)
def _(t):
    os.makedirs(out_of(t, "rep"))
    return [Cmd(["report", fixture(t, "run"), "--out", out_of(t, "rep/r.html")], FAILED, fsize=20_000,
                one_line=True)]


UNWRITABLE = {"a-directory": "repdir", "proc": "/proc/shmlearn-nowhere/report.html", "sys": "/sys/report.html"}
"""/proc: no such folder can be made; /sys: a read-only file system (the campaign runs as root,
for whom a read-only folder is writable)."""
for _how, _path in UNWRITABLE.items():
    @case(f"full-report-out-{_how}", "53", f"report RUN --out {_path}", check=_clean("run"), keep=_keep_run)
    def _(t, path=_path):
        run = fixture(t, "run")
        out = path if path.startswith("/") else out_of(t, path)
        if not path.startswith("/"):
            os.makedirs(out)
        return [Cmd(["report", run, "--out", out], 2, says=[out])]


@case("full-simulate", "53", "simulate under RLIMIT_FSIZE 3000 B (its JSON and plot do not fit)",
      check=_clean("sim"), keep=_keep_run)
def _(t):
    return [Cmd(["simulate", "--net-bw", "10", "--compute", fixture(t, "run"), "--out", out_of(t, "sim")], FAILED,
                fsize=3000, one_line=True)]


for _how, _make in (("a-file", "file"), ("proc", "/proc/shmlearn-nowhere/sim"), ("sys", "/sys/sim")):
    @case(f"full-simulate-out-{_how}", "53", f"simulate --out {_make}", keep=_keep_run)
    def _(t, make=_make):
        out = make if make.startswith("/") else write(out_of(t, "simfile"), "x")
        return [Cmd(["simulate", "--net-bw", "10", "--compute", fixture(t, "run"), "--out", out], 2, says=[out])]


@case("full-advise", "53", "advise RUN under RLIMIT_FSIZE 3000 B", check=_clean("adv"), keep=_keep_run)
def _(t):
    return [Cmd(["advise", fixture(t, "run"), "--out", out_of(t, "adv")], FAILED, fsize=3000, one_line=True)]


@case("full-advise-out-file", "53", "advise RUN --out FILE (a regular file)", keep=_keep_run)
def _(t):
    f = write(out_of(t, "advfile"), "x")
    return [Cmd(["advise", fixture(t, "run"), "--out", f], 2, says=[f])]


def _no_ckpt_tmp(t, results):
    probs = tmp_leftovers(out_of(t)) + run_dir_problems(out_of(t))
    return probs


for _w in (1, 2):
    @case(f"full-checkpoint-w{_w}", "53", f"a {_w}-worker run under RLIMIT_FSIZE 40000 B with --checkpoint-every 20 "
          f"(a checkpoint does not fit; it left a .ckpt.tmp)", check=_no_ckpt_tmp)
    def _(t, w=_w):
        return [Cmd(["train", "--dataset", "digits", "--model", "mlp", "--samples", "6400", "--batch-size", "32",
                     "--workers", str(w), "--checkpoint-every", "20", "--eval-points", "2", "--no-progress",
                     "--out", out_of(t)], FAILED, fsize=40_000, one_line=True, says=["checkpoint"])]


@case("full-train-first-files", "53", "a run under RLIMIT_FSIZE 300 B (config.yaml does not fit)",
      check=lambda t, r: tmp_leftovers(out_of(t)))
def _(t):
    return [Cmd(["train", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
                 "--no-progress", "--out", out_of(t)], FAILED, fsize=300, one_line=True)]


@case("full-save-model", "53", "a run under RLIMIT_FSIZE 12000 B: trace.json and model.pt fit or not, one line",
      check=lambda t, r: tmp_leftovers(out_of(t)) + run_dir_problems(out_of(t)))
def _(t):
    return [Cmd(["train", "--dataset", "digits", "--model", "mlp", "--samples", "1024", "--workers", "1",
                 "--no-progress", "--out", out_of(t)], FAILED, fsize=12_000, one_line=True)]
