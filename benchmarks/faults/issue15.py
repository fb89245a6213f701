"""Issue 15's faults (items 1-15 and the cosmetic ones), the classic ones, and the cases beyond
that issue's list: stopped, hung and killed ranks, killed launchers, kills mid-checkpoint, dying
sweep trials, unusable data, extreme values, two runs on one --out, a full disk."""
from __future__ import annotations

import functools
import os
import signal
import struct

from benchmarks.faults import registry
from benchmarks.faults.core import BASE, FSIZE, LONG, SWEEP, Cmd, Running, workers_of
from benchmarks.faults.during import (kill_launcher_after, last_row_moment, once_training, signal_group,
                                      signal_rank, watch_stopped, when_exists)
from benchmarks.faults.registry import out_of
from benchmarks.faults.written import completed, sha, jsonl_problems, rows, run_dir_problems, summary

case = functools.partial(registry.case, klass="issue15")


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
    now = sha(path)
    return [] if before and before == now else [f"results.jsonl changed by the failed report ({before} -> {now})"]


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

