"""Reliability (issue 6, docs/reliability.md): kills, hangs, NaNs, damaged checkpoints, resume,
elastic restart, disagreeing ranks, bad data files, determinism. Real processes, real Gloo."""
import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch

from cli_inproc import run_main
from procs import processes_with_tag
from shmlearn.train import checkpoint as ckpt
from shmlearn.launch.start import free_port

BASE = ["train", "--dataset", "digits", "--model", "mlp", "--samples", "12800", "--batch-size", "32",
        "--eval-points", "2", "--no-progress"]  # 200 steps at 2 workers


def run(args, *, fault=None, timeout=300, tag=None, launcher=None, extra_env=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", SHMLEARN_TEST_TAG=tag or uuid.uuid4().hex, **(extra_env or {}))
    if fault:
        env["SHMLEARN_FAULT"] = fault
    cmd = (launcher or [sys.executable, "-m", "shmlearn"]) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def in_process(args, monkeypatch, capfd, *, tag=None):
    """The CLI's main() in this process (tests/cli_inproc.py), for refusals made before any worker
    trains, tagged so that processes_with_tag finds any process it leaves."""
    return run_main(args, monkeypatch, capfd, tag=tag or uuid.uuid4().hex)


def summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def final_weights(out, rank=0):
    step = ckpt.candidates(str(out))[0]
    return ckpt.read_file(os.path.join(ckpt.step_dir(str(out), step), f"rank{rank}.ckpt"))["model"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def reference_and_killed(tmp_path_factory):
    """The two runs below, independent, started together (~20% less wall time on 2 cores than
    one after the other)."""
    ref, killed = tmp_path_factory.mktemp("ref") / "run", tmp_path_factory.mktemp("killed") / "run"
    runs = run_together(
        reference=(BASE + ["--workers", "2", "--checkpoint-every", "40", "--out", str(ref)], {}),
        killed=(BASE + ["--workers", "2", "--checkpoint-every", "40", "--out", str(killed)],
                dict(fault="kill:1:170")))
    return (ref, runs["reference"][0]), (killed, runs["killed"][0])


@pytest.fixture(scope="module")
def reference(reference_and_killed):
    """An uninterrupted 2-worker run with checkpoints: the weights every recovery must reach."""
    out, r = reference_and_killed[0]
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def killed(reference_and_killed):
    """A 2-worker run with checkpoints every 40 steps whose rank 1 is killed at step 170: the run
    every resume below starts from, copied (--out is not part of what a checkpoint must agree on),
    as one killed run per test would have left it."""
    return reference_and_killed[1]


def _copy_of(killed, out):
    shutil.copytree(killed[0], out)
    return BASE + ["--workers", "2", "--checkpoint-every", "40", "--out", str(out)]


def test_resume_after_a_killed_worker_equals_uninterrupted(reference, killed, tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    r = killed[1]
    assert r.returncode == 1 and "rank 1" in r.stderr, r.stderr
    assert ckpt.candidates(str(killed[0]))[0] == 160
    args = _copy_of(killed, out)
    r = in_process(args + ["--resume"], monkeypatch, capfd)  # the resumed weights are the point: its 2 workers train
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert (s["samples_seen"], s["steps"], s["resumed_from_step"]) == (12800, 200, 160)
    assert_same_weights(final_weights(out), final_weights(reference))
    steps = [json.loads(l)["step"] for l in open(out / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 200  # no duplicate or missing rows


def test_damaged_checkpoints_fall_back_to_the_previous_good_one(reference, killed, tmp_path):
    # The killed run, copied once per damage (the same files three killed runs would leave).
    assert killed[1].returncode == 1
    assert ckpt.candidates(str(killed[0]))[:2] == [160, 120]
    resumes = {}
    for damage in ("truncate", "flip", "unrenamed"):
        out = tmp_path / damage
        args = _copy_of(killed, out)
        newest = ckpt.step_dir(str(out), 160)
        f = os.path.join(newest, "rank1.ckpt")
        raw = open(f, "rb").read()
        if damage == "truncate":
            open(f, "wb").write(raw[: len(raw) // 2])
        elif damage == "flip":
            b = bytearray(raw)
            b[-100] ^= 0x40
            open(f, "wb").write(bytes(b))
        else:
            os.replace(f, f + ".tmp")
        resumes[damage] = (args + ["--resume"], {})
    ran = run_together(**resumes)  # three independent resumes, each in its own copy, at once
    for damage in resumes:
        out = tmp_path / damage
        r = ran[damage][0]
        assert r.returncode == 0, r.stderr
        assert "skipped damaged checkpoints" in r.stdout and "rank1.ckpt" in r.stdout
        assert summary(out)["resumed_from_step"] == 120
        assert_same_weights(final_weights(out), final_weights(reference))


def test_no_good_checkpoint_is_exit_2(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    args = BASE + ["--workers", "1", "--checkpoint-every", "100", "--out", str(out)]
    assert run(args, fault="raise:0:150").returncode == 1
    for step in ckpt.candidates(str(out)):
        p = os.path.join(ckpt.step_dir(str(out), step), "rank0.ckpt")
        open(p, "wb").write(open(p, "rb").read()[:50])
    r = in_process(args + ["--resume"], monkeypatch, capfd)  # the refusal: before any step
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no usable checkpoint" in r.stderr


def test_a_resume_mismatch_names_each_checkpoint_once(killed, tmp_path, monkeypatch, capfd):
    args = _copy_of(killed, tmp_path / "run")
    r = in_process(args + ["--resume", "--lr", "0.1"], monkeypatch, capfd)  # its 2 workers refuse it
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    # both ranks find the same mismatch: each step was listed once per rank
    assert lines[0].endswith("no usable checkpoint (step 160: written with different lr; "
                             "step 120: written with different lr)"), r.stderr


def run_together(**calls):
    """Independent runs at once, {name: (args, run's keywords)} -> {name: (result, seconds, tag)}:
    for runs that spend most of their time waiting out a --timeout (each one's seconds are its own)."""
    from concurrent.futures import ThreadPoolExecutor

    def timed(call):
        args, kw = call
        tag = uuid.uuid4().hex
        t0 = time.monotonic()
        r = run(args, tag=tag, **kw)
        return r, time.monotonic() - t0, tag
    with ThreadPoolExecutor(len(calls)) as ex:
        return dict(zip(calls, ex.map(timed, calls.values())))


@pytest.fixture(scope="module")
def waits(tmp_path_factory):
    """The runs that mostly wait out a --timeout (CPU idle), all five started together, so that
    together they take little more than the longest: a hung rank and a SIGSTOPped rank 0 (each
    waits out --timeout 8) and a killed worker's run, in that idle time ({name: (result, seconds
    from the fault to the end of the run, tag)}: startup and the steps before the fault take 2-4x
    longer on a loaded or slow machine; the timeout does not); and the two lone hung ranks (each
    waits out --timeout 6 and the watch's 10 s for an interrupt that a sleep never takes;
    {name: (result, seconds of the whole run, tag)}: each one's seconds are its own). Two groups
    one after the other took the sum of their waits."""
    from concurrent.futures import ThreadPoolExecutor
    d = tmp_path_factory.mktemp("stalled")
    calls = dict(killed=(["--timeout", "20"], "kill:1:50"), hung=(["--timeout", "8"], "sleep:1:30"),
                 stopped=(["--timeout", "8"], "stop:0:30"))

    def after_the_fault(name):
        extra, fault = calls[name]
        tag, log = uuid.uuid4().hex, d / f"{name}.fault"
        r = run(BASE + ["--workers", "2", *extra, "--out", str(d / name)], fault=fault, tag=tag, timeout=240,
                extra_env={"SHMLEARN_FAULT_LOG": str(log)})
        ended = time.time()
        return r, (ended - float(log.read_text().split()[0]) if log.exists() else math.inf), tag
    lone = dict(
        train=(BASE + ["--workers", "1", "--timeout", "6", "--out", str(d / "lone-run")],
               dict(fault="sleep:0:30", timeout=120)),
        sweep=(["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "12800", "--workers", "1",
                "--lr", "0.1", "--timeout", "6", "--no-report", "--no-progress", "--out", str(d / "lone-s")],
               dict(fault="sleep:0:30", timeout=120)))

    def whole_run(name):
        args, kw = lone[name]
        tag = uuid.uuid4().hex
        t0 = time.monotonic()
        r = run(args, tag=tag, **kw)
        return r, time.monotonic() - t0, tag
    with ThreadPoolExecutor(len(calls) + len(lone)) as ex:
        stalled = {name: ex.submit(after_the_fault, name) for name in calls}
        lone_hung = {name: ex.submit(whole_run, name) for name in lone}
        done = ({k: f.result() for k, f in stalled.items()}, {k: f.result() for k, f in lone_hung.items()})
    time.sleep(1)  # as each test did after its run: then no process of any of them may be left
    return done


@pytest.fixture(scope="module")
def stalled(waits):
    """A hung rank, a SIGSTOPped rank 0 and a killed worker's run (`waits`)."""
    return waits[0]


def test_killed_worker_without_restarts_ends_the_run_naming_it(stalled):
    r, after, tag = stalled["killed"]
    assert r.returncode == 1 and "rank 1" in r.stderr and "signal 9" in r.stderr, r.stderr
    assert after < 20, after  # the pool sees the death at once, not after --timeout 20
    assert processes_with_tag(tag) == []


def test_a_hung_rank_is_named_within_the_timeout(stalled):
    r, after, tag = stalled["hung"]
    assert r.returncode == 1, r.stderr
    assert "rank 1 (never reached the sync of step 30, last at step 29" in r.stderr and "stopped responding" in r.stderr, r.stderr
    assert after < 8 + 20, after
    assert processes_with_tag(tag) == []


@pytest.fixture(scope="module")
def beside_a_dying_sweep(tmp_path_factory):
    """A sweep whose trials' workers die (one process training at a time, replacements started
    between: ~1 core of 2 busy), the 3-worker NaN run and the 3-worker test-accuracy run,
    independent, started together: {name: (result, the processes of its tag left 1 s after it
    ended (as the test looked before), tag, --out)}."""
    from concurrent.futures import ThreadPoolExecutor
    d = tmp_path_factory.mktemp("beside")
    outs = {"sweep": d / "s", "nan": d / "nan", "accuracy": d / "accuracy"}

    def sweep():
        tag = uuid.uuid4().hex
        r = run(["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "2048", "--workers", "1",
                 "--lr", "0.1,0.2", "--no-report", "--no-progress", "--out", str(outs["sweep"])],
                fault="kill:0:5", tag=tag)
        time.sleep(1)
        return r, processes_with_tag(tag), tag
    with ThreadPoolExecutor(1) as ex:
        swept = ex.submit(sweep)
        runs = run_together(
            nan=(BASE + ["--workers", "3", "--out", str(outs["nan"])], dict(fault="nan:2:17")),
            accuracy=(["train", "--dataset", "step", "--model", "neuron", "--workers", "3", "--samples", "3000",
                       "--batch-size", "10", "--lr", "0.5", "--checkpoint-every", "1000", "--eval-points", "1",
                       "--no-progress", "--out", str(outs["accuracy"])], {}))
        runs["sweep"] = swept.result()
    return {k: (*v, outs[k]) for k, v in runs.items()}


def test_nan_on_one_rank_stops_every_rank_at_that_step(beside_a_dying_sweep):
    r, _, _, out = beside_a_dying_sweep["nan"]
    assert r.returncode == 3, r.stderr
    s = summary(out)
    assert (s["status"], s["diverged_step"], s["diverged_rank"], s["steps"]) == ("diverged", 17, 2, 17)
    assert "at step 17 on rank 2" in r.stderr


def test_elastic_restart_after_kill_completes_with_the_same_weights(reference, tmp_path):
    out = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "shmlearn"]
    r = run(BASE + ["--checkpoint-every", "40", "--out", str(out)], fault="kill:1:130", launcher=torchrun)
    assert r.returncode == 0, r.stderr[-3000:]
    s = summary(out)
    assert (s["samples_seen"], s["resumed_from_step"], s["launcher"]) == (12800, 120, "torchrun")
    assert_same_weights(final_weights(out), final_weights(reference))


def test_ranks_that_disagree_fail_at_setup_on_every_rank(tmp_path):
    port = str(free_port())
    procs = []
    for rank, model in ((0, "mlp"), (1, "softmax")):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_"))}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "shmlearn", *BASE, "--model", model,
                                       "--out", str(tmp_path / "run")], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2, err
        assert "rank 1 has a different config from rank 0" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("damage", ["truncated", "empty", "magic", "label"])
def test_bad_dataset_files_fail_on_every_rank_before_any_collective(tmp_path, damage):
    d = tmp_path / "mnist"
    d.mkdir()
    rng = np.random.default_rng(0)
    import struct

    def idx(path, arr):
        open(path, "wb").write(struct.pack(">BBBB", 0, 0, 8, arr.ndim)
                               + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(np.uint8).tobytes())
    for split, n in (("train", 64), ("t10k", 16)):
        idx(d / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        idx(d / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, (n,)))
    bad = d / "train-labels-idx1-ubyte"
    raw = bad.read_bytes()
    bad.write_bytes({"truncated": raw[:20], "empty": b"", "magic": b"\x00\x00\x08\x09" + raw[4:],
                     "label": raw[:8] + b"\x0c" + raw[9:]}[damage])
    port = str(free_port())
    procs = []
    for rank in range(2):  # torchrun-shaped: each rank must fail on its own, before the rendezvous
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "shmlearn", "train", "--dataset", "mnist",
                                       "--data-dir", str(d), "--model", "softmax", "--batch-size", "8",
                                       "--out", str(tmp_path / "run")], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert errs[0] == errs[1] and len(errs[0].strip().splitlines()) == 1 and "train-labels-idx1-ubyte" in errs[0]


def test_same_seed_gives_identical_losses(reference, tmp_path, monkeypatch, capfd):
    # The module's reference run and a second run of the same command (a separate pair of runs
    # here was one 2-worker run more than the comparison needs), the second from main() in this
    # process: its 2 workers are processes of their own either way, and the losses are the point.
    again = in_process(BASE + ["--workers", "2", "--checkpoint-every", "40", "--out", str(tmp_path / "run1")],
                       monkeypatch, capfd)
    assert again.returncode == 0, again.stderr
    losses = [[json.loads(l)["loss"] for l in open(out / "metrics.jsonl")] for out in (reference, tmp_path / "run1")]
    assert losses[0] == losses[1] and len(losses[0]) == 20


def test_test_accuracy_counts_each_test_sample_once(beside_a_dying_sweep):
    """step has 1000 test samples: 3 ranks get 334/333/333; the summary must equal a
    single-process evaluation of the final weights over all 1000."""
    r, _, _, out = beside_a_dying_sweep["accuracy"]
    assert r.returncode == 0, r.stderr
    from shmlearn.data import load_dataset
    from shmlearn.models import build_model
    data = load_dataset("step")
    model = build_model("neuron", data.spec)
    model.load_state_dict(final_weights(out))
    with torch.no_grad():
        n_correct = int(((model(data.test_x) >= 0).float() == data.test_y).sum())
    assert len(data.test_x) == 1000
    assert summary(out)["test_accuracy"] == pytest.approx(n_correct / 1000, abs=1e-12)
    assert n_correct > 600


# --- issue 15: the faults a campaign found ------------------------------------------------------

def _one_line(r):
    return r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


def test_a_stopped_rank_0_is_named_and_nothing_is_left(stalled):
    """SIGSTOP of rank 0 (it hosted the store its peer waited on: a hang forever). The pool
    hosts the store now; the run ends naming rank 0."""
    r, _, tag = stalled["stopped"]
    assert r.returncode == 1 and "rank 0" in r.stderr.splitlines()[-1], r.stderr
    assert processes_with_tag(tag) == []


def test_a_kill_during_the_first_checkpoint_leaves_a_resumable_run(tmp_path):
    out = tmp_path / "run"
    # 50 steps, not BASE's 200: the resume writes a checkpoint every 5 steps to its end (10, not 40)
    short = [("3200" if a == "12800" else a) for a in BASE]
    args = short + ["--workers", "2", "--checkpoint-every", "5", "--out", str(out)]
    r = run(args, fault="kill-in-checkpoint:1:5")
    assert r.returncode == 1 and "rank 1" in r.stderr, r.stderr
    assert (out / "checkpoints" / "step-00000005").is_dir() and not ckpt.candidates(str(out))
    r = run(args + ["--resume"])
    assert r.returncode == 0, r.stderr
    assert "no complete checkpoint" in r.stdout
    s = summary(out)
    assert s["status"] == "completed" and s["steps"] == s["planned_steps"] and not s["resumed_from_step"]


@pytest.fixture(scope="module")
def raised(tmp_path_factory):
    """A 1-worker run without checkpoints that fails at step 50: the failure's one line, and the run
    a --resume finds no checkpoint in."""
    out = tmp_path_factory.mktemp("raised") / "run"
    return out, run(BASE + ["--workers", "1", "--out", str(out)], fault="raise:0:50")


def test_resume_without_any_checkpoint_starts_clean(raised, monkeypatch, capfd):
    out, r = raised
    assert r.returncode == 1
    # main() in this process: a 1-worker run's rank 0 is this process, its stdout read from fd 1
    r = in_process(BASE + ["--workers", "1", "--out", str(out), "--resume"], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if "--resume" in line]  # it was silent
    assert said == [f"shmlearn: --resume: no complete checkpoint in {out}; starting from step 0"], r.stdout
    with open(out / "eval.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps[0] == 0 and steps.count(0) == 1, steps


def test_a_failure_at_one_worker_is_one_line(raised):
    r = raised[1]
    assert r.returncode == 1 and _one_line(r) and "rank 0: RuntimeError: injected fault" in r.stderr, r.stderr


def test_a_second_run_on_the_same_out_is_refused(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = subprocess.Popen([sys.executable, "-m", "shmlearn", *BASE[:1], "--workers", "2", "--epochs", "1000",
                              "--no-progress", "--out", str(out)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t_end = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() and time.monotonic() < t_end:
            time.sleep(0.1)
        r = in_process(BASE + ["--workers", "2", "--resume", "--out", str(out)], monkeypatch, capfd)
        assert r.returncode == 2 and _one_line(r) and "another run is writing there" in r.stderr, r.stderr
    finally:
        first.kill()
        first.wait()


@pytest.mark.parametrize("args,says", [
    (["--out", "/proc/shmlearn-nowhere/run"], "--out /proc/shmlearn-nowhere/run: cannot write there"),
    (["--workers", "10000"], "--workers: 10000 processes on"),
    (["--warmup", "100000"], "--warmup 100000: as long as the whole run"),
])
def test_bad_output_paths_and_layouts_are_exit_2_before_any_worker(tmp_path, monkeypatch, capfd, args, says):
    tag = uuid.uuid4().hex
    r = in_process(["train", "--dataset", "digits", "--no-progress", "--out", str(tmp_path / "run"), *args],
                   monkeypatch, capfd, tag=tag)
    assert r.returncode == 2 and _one_line(r) and says in r.stderr, r.stderr
    assert processes_with_tag(tag) == []


def test_a_full_disk_names_the_file_and_keeps_the_summary(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk (Python ignores SIGXFSZ: a write past the limit
    fails with EFBIG): summary.json (small) is written, the Chrome trace (larger) is not, and
    no torn trace.json is left behind."""
    import resource
    out = tmp_path / "run"
    limit = 40_000

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "shmlearn", *BASE, "--workers", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=env, preexec_fn=small_files)
    assert r.returncode == 1 and _one_line(r) and "trace.json" in r.stderr, r.stderr
    assert summary(out)["status"] == "completed"
    assert not (out / "trace.json").exists() and not list(out.glob("trace.json.tmp*"))


def test_a_sweep_whose_trials_die_reports_them_and_exits_1(beside_a_dying_sweep):
    r, left, _, _ = beside_a_dying_sweep["sweep"]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("worker died (killed by signal 9)") >= 2, r.stderr
    assert left == []  # looked for 1 s after the sweep ended


def test_a_sweep_on_an_unwritable_out_is_exit_2(monkeypatch, capfd):
    r = in_process(["sweep", "--lr", "0.1,0.2", "--out", "/proc/shmlearn-nowhere/s"], monkeypatch, capfd)
    assert r.returncode == 2 and _one_line(r) and "cannot write there" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def lone_hung(waits):
    """A lone rank hung in `train --workers 1` and in a sweep's trial (`waits`)."""
    return waits[1]


@pytest.mark.parametrize("how", ["train", "sweep"])
def test_a_lone_rank_hung_in_its_own_code_is_named_within_the_timeout(lone_hung, how):
    # One worker sleeps inside step 30 (a stuck user model): no peer's collective times out on it
    # and its process is alive, so only the watch of the step can end the run. In process for
    # `train --workers 1`; on a pool worker, watched by the pool, for a sweep's trial.
    r, elapsed, tag = lone_hung[how]
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "rank 0" in r.stderr and "no progress for" in r.stderr and "inside step" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert elapsed < 6 + 75, elapsed  # the timeout, plus start-up and teardown on a loaded 2-core machine
    time.sleep(1)
    assert processes_with_tag(tag) == []


# -- writes and --resume (issue 53): nothing outside --out written, nothing finished rewritten -------

RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "summary.json", "trace.json")


def _bytes(out):
    return {n: (out / n).read_bytes() for n in RUN_FILES if (out / n).exists()}


@pytest.mark.parametrize("name", ["config.yaml", ".lock"])
def test_a_link_planted_in_out_is_refused_and_nothing_is_created_where_it_points(tmp_path, monkeypatch, capfd,
                                                                                    name):
    """The run's config.yaml and its .lock were created wherever a link placed in --out pointed."""
    out, target = tmp_path / "run", tmp_path / "away" / name
    out.mkdir()
    target.parent.mkdir()
    (out / name).symlink_to(target)
    tag = uuid.uuid4().hex
    r = in_process(BASE + ["--workers", "1", "--out", str(out)], monkeypatch, capfd, tag=tag)
    assert r.returncode == 2 and _one_line(r), r.stderr
    assert str(out / name) in r.stderr, r.stderr
    assert not target.exists() and processes_with_tag(tag) == []


def test_resume_does_not_truncate_a_file_that_metrics_jsonl_links_to(raised, tmp_path, monkeypatch, capfd):
    """A run without checkpoints, --resume: it starts from step 0 and empties metrics.jsonl,
    which truncated the file outside --out that metrics.jsonl was a link to."""
    out = tmp_path / "run"
    shutil.copytree(raised[0], out)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(victim)
    r = in_process(BASE + ["--workers", "1", "--out", str(out), "--resume"], monkeypatch, capfd)
    assert r.returncode == 2 and _one_line(r) and f"{out / 'metrics.jsonl'}: a symlink to {victim}" in r.stderr, \
        r.stderr
    assert victim.read_text() == "precious\n"


def test_resume_of_a_finished_run_without_checkpoints_changes_nothing(tmp_path, monkeypatch, capfd):
    """It trained the run again from step 0, rewriting summary.json, metrics.jsonl and eval.jsonl."""
    out = tmp_path / "run"
    args = BASE + ["--workers", "1", "--samples", "1280", "--out", str(out)]
    assert in_process(args, monkeypatch, capfd).returncode == 0
    before = _bytes(out)
    assert set(before) == set(RUN_FILES)
    r = in_process(args + ["--resume"], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    assert f"shmlearn: --resume: {out} already completed (40 steps)" in r.stdout, r.stdout
    assert str(out / "summary.json") in r.stdout
    assert _bytes(out) == before


def test_resume_of_a_finished_run_with_checkpoints_changes_nothing_and_starts_no_worker(reference, tmp_path,
                                                                                        monkeypatch, capfd):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = _bytes(out)
    tag = uuid.uuid4().hex
    r = in_process(BASE + ["--workers", "2", "--checkpoint-every", "40", "--out", str(out), "--resume"],
                   monkeypatch, capfd, tag=tag)
    assert r.returncode == 0 and "already completed (200 steps)" in r.stdout, (r.stdout, r.stderr)
    assert _bytes(out) == before and processes_with_tag(tag) == []


def test_resume_of_a_diverged_run_says_so_and_changes_nothing(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    args = BASE + ["--workers", "1", "--samples", "1280", "--out", str(out)]
    r = run(args, fault="nan:0:7")
    assert r.returncode == 3, r.stderr
    before = _bytes(out)
    r = in_process(args + ["--resume"], monkeypatch, capfd)
    assert r.returncode == 3 and _one_line(r) and "already ended: it diverged at step 7" in r.stderr, r.stderr
    assert _bytes(out) == before


def test_a_sweep_into_a_training_run_and_a_run_into_a_sweep_are_refused(raised, tmp_path, monkeypatch, capfd):
    """`sweep --out RUN` wrote into an existing train run directory, where `train` refuses."""
    run_dir = raised[0]
    before = sorted(os.listdir(run_dir))
    r = in_process(["sweep", "--dataset", "digits", "--lr", "0.1,0.2", "--no-progress", "--out", str(run_dir)],
                   monkeypatch, capfd)
    assert r.returncode == 2 and _one_line(r) and "holds a training run" in r.stderr, r.stderr
    assert sorted(os.listdir(run_dir)) == before
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text("")
    r = in_process(BASE + ["--workers", "1", "--out", str(sweep)], monkeypatch, capfd)
    assert r.returncode == 2 and _one_line(r) and "holds a sweep, study or experiment" in r.stderr, r.stderr
    assert sorted(os.listdir(sweep)) == ["results.jsonl"]


def test_a_full_disk_at_checkpoint_time_leaves_no_temporary_file(tmp_path):
    """A checkpoint (~400 kB: the weights and their momentum) past the file size limit: one line
    naming it, exit 1, and no rank0.ckpt.tmp left (it was)."""
    import resource
    out = tmp_path / "run"

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "shmlearn", *BASE, "--workers", "1", "--checkpoint-every", "40",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, env=env,
                       preexec_fn=small_files)
    assert r.returncode == 1 and _one_line(r) and "rank0.ckpt" in r.stderr, r.stderr
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    assert ckpt.candidates(str(out)) == []


# --- issue 53: processes ------------------------------------------------------------------------

@pytest.mark.parametrize("workers", ["1", "2"])
def test_sys_exit_in_a_user_loss_is_a_failure_naming_the_rank(tmp_path, workers):
    """sys.exit(0) inside the user's loss ended a 1-worker run (in the program's own process) with
    exit 0 and no summary: it is the rank's failure, and the line says the user code called it."""
    (tmp_path / "quits.py").write_text("import sys\n\ndef loss(outputs, targets):\n    sys.exit(0)\n")
    r = run(BASE + ["--workers", workers, "--loss", str(tmp_path / "quits.py") + ":loss", "--out", str(tmp_path / "r")])
    assert r.returncode == 1, r.stderr[-2000:]
    first = r.stderr.strip().splitlines()[-4:]
    assert any("rank 0: the user code called sys.exit(0)" in line for line in first), r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_strategy_file_that_calls_sys_exit_at_import_is_one_line_before_any_worker(tmp_path):
    """sys.exit(3) at the top of a strategy file ended the program with 3 and no line."""
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(3)\n")
    r = run(BASE + ["--out", str(tmp_path / "r")], extra_env={"SHMLEARN_STRATEGY_PATH": str(tmp_path)})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"shmlearn: error: strategy file {tmp_path / 'quits.py'}: called "
                                             f"sys.exit(3) (at {tmp_path / 'quits.py'}:2 in <module>)"], r.stderr
    assert not (tmp_path / "r").exists()


def test_a_strategy_file_that_raises_at_import_is_one_line_before_any_worker(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('not ready yet')\n")
    r = run(BASE + ["--out", str(tmp_path / "r")], extra_env={"SHMLEARN_STRATEGY_PATH": str(tmp_path)})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert "broken.py: raised at import: RuntimeError: not ready yet" in r.stderr
    assert not (tmp_path / "r").exists()


_STDIN = """
import shmlearn, torch.nn as nn
from shmlearn import TrainConfig
cfg = TrainConfig(dataset="digits", model="mlp", workers=2, samples=2000, progress=False, out={out!r})
print("status", shmlearn.train(cfg).status)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))

try:
    shmlearn.train(TrainConfig(dataset="digits", workers=2, samples=2000, progress=False, out={out!r} + "2"), model=Net)
except shmlearn.BadInput as e:
    print("refused:", e)
"""


def test_the_python_api_from_stdin_trains_or_refuses_in_one_line(tmp_path):
    """`python - <<EOF`: workers cannot import a script read from stdin ('<stdin>' is no file): a run
    of built-in parts trains, a class defined in it is refused before any worker starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-"], input=_STDIN.format(out=str(tmp_path / "r")), capture_output=True,
                       text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "status completed" in r.stdout and "Traceback" not in r.stderr, r.stderr[-3000:]
    refused = [line for line in r.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 1 and "Net" in refused[0] and "stdin" in refused[0], r.stdout
