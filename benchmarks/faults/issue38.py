"""Issue 38's faults: studies on a full journal, async-ps staleness, exhausted searches, nested
configs, Ctrl-C while a sweep starts, user data with a NaN or a read that never returns, a rank
stopped before the rendezvous."""
from __future__ import annotations

import functools
import os
import signal
from typing import List

from benchmarks.faults import registry
from benchmarks.faults.core import BASE, Cmd, Running
from benchmarks.faults.during import after, signal_group, workers
from benchmarks.faults.issue15 import _results_unchanged
from benchmarks.faults.registry import out_of
from stuck_data import STUCK_DATA  # tests/, on the path by benchmarks.faults.core

case = functools.partial(registry.case, klass="issue38")


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
            Cmd(a, 0)]  # stdout says "(2 done)": tests/sweeps/test_study.py checks it


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


@case("i38-ctrl-c-sweep-starting", "38.8", "SIGINT to a sweep's process group while its 2 workers import")
def _(t):
    return [Cmd(TINY_STUDY + ["--samples", "600000", "--parallel", "2", "--out", out_of(t, "s")], 130,
                says=["interrupted"], last_says=["shmlearn: interrupted"],
                during=after(4.0, signal_group(signal.SIGINT)))]


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

