"""Sweeps: grid expansion, the paper's winner rule on hand-made results, the result store, and
real sweeps on digits (resume skips finished trials; a SIGKILL mid-sweep loses nothing).

Real sweeps use softmax on digits with a few thousand samples: each 1-worker trial trains in
under a second; a 2-worker trial costs ~10 s, mostly its two fresh worker interpreters."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cli_inproc import run_main
from shmlearn.errors import BadInput
from shmlearn.sweeps.sweep import (ResultStore, expand_grid, parse_values, pick_winners, split_axes, trial_id,
                            winners_table)


def results(path):
    with open(os.path.join(path, "results.jsonl"), "rb") as f:
        data = f.read()
    assert data.endswith(b"\n"), "results.jsonl must end with a whole line"
    return [json.loads(line) for line in data.splitlines()]


# --- grid ----------------------------------------------------------------------------------

def test_float_range_is_exact_and_inclusive():
    assert parse_values("lr", "0.1:0.9:0.1") == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert parse_values("lr", "1e-3:3e-3:1e-3") == [0.001, 0.002, 0.003]
    assert parse_values("lr", "0.5:0.1:-0.2") == [0.5, 0.3, 0.1]
    assert parse_values("lr", "0.1:1:0.4") == [0.1, 0.5, 0.9]  # a step that misses STOP stops before it


def test_int_lists_ranges_and_mixes():
    assert parse_values("batch_size", "16,32:128:32") == [16, 32, 64, 96, 128]
    assert parse_values("workers", "1:4") == [1, 2, 3, 4]
    assert parse_values("workers", "1,2,2,1") == [1, 2]  # duplicates dropped, order kept
    assert parse_values("strategy", "allreduce,ps") == ["allreduce", "ps"]
    assert parse_values("lr", [0.1, "0.2:0.3:0.1"]) == [0.1, 0.2, 0.3]  # YAML list


@pytest.mark.parametrize("name,text", [("lr", "0.1:0.9:0"), ("lr", "0.1:0.9"), ("lr", "0.9:0.1:0.1"),
                                       ("lr", "fast"), ("batch_size", "1.5"), ("lr", "0.1,,0.2"),
                                       ("batch_size", "nan")])
def test_bad_values_are_bad_input(name, text):
    with pytest.raises(BadInput, match="--" + name.replace("_", "-")):
        parse_values(name, text)


def test_grid_order_ids_and_threads():
    fixed, axes = split_axes({"workers": "1,2", "batch_size": "16,32", "lr": "0.1,0.5",
                              "strategy": "allreduce,ps", "samples": "2048", "model": "softmax"})
    assert fixed == {"samples": 2048, "model": "softmax"}
    trials = expand_grid(fixed, axes)
    assert len(trials) == 16
    # workers outermost, then batch, then lr, then the other axes
    assert [(t.workers, t.batch_size, t.lr, t.strategy) for t in trials[:3]] == [
        (1, 16, 0.1, "allreduce"), (1, 16, 0.1, "ps"), (1, 16, 0.5, "allreduce")]
    assert all(t.threads == 1 and t.progress is False and t.samples == 2048 for t in trials)
    ids = [trial_id(t) for t in trials]
    assert len(set(ids)) == 16 and ids == [trial_id(t) for t in expand_grid(fixed, axes)]
    assert ids[0].startswith("w1-b16-lr0.1-")
    other = expand_grid({**fixed, "seed": 1}, axes)
    assert not set(ids) & {trial_id(t) for t in other}  # any field that shapes a run changes the id
    # where the run goes, and fields left at TrainConfig's defaults, do not
    assert ids == [trial_id(t) for t in expand_grid({**fixed, "seed": 0, "weight_decay": 0.0}, axes)]
    assert trial_id(dataclasses.replace(trials[0], out="elsewhere")) == ids[0]


def test_grid_validates_every_trial_up_front():
    with pytest.raises(BadInput, match="--samples 32: smaller than one step of 2 workers x 32"):
        expand_grid({"samples": 32}, {"workers": [1, 2], "batch_size": [16, 32]})
    with pytest.raises(BadInput, match="--samples 16: smaller than one step of 1 worker x 32"):
        expand_grid({"samples": 16}, {"workers": [1], "batch_size": [32]})  # said "1 workers"
    with pytest.raises(BadInput, match="--model"):
        expand_grid({"model": "nope"}, {"lr": [0.1, 0.2]})


# --- winners on hand-made results -----------------------------------------------------------

def row(w, b, lr, status="completed", min_loss=0.5, area=1.0, acc=0.9, wall=10.0, curve=None):
    summary = {"status": status, "workers": w, "batch_size": b, "lr": lr, "min_loss": min_loss,
               "loss_area": area if status == "completed" else None, "test_accuracy": acc, "wall_time_s": wall}
    return {"id": f"w{w}-b{b}-lr{lr}", "status": status, "config": {"workers": w, "batch_size": b, "lr": lr},
            "summary": summary, "run_dir": f"trials/w{w}-b{b}-lr{lr}", "eval_curve": curve or []}


def test_threshold_rule_drops_low_area_runs_that_did_not_learn():
    rows = [row(1, 16, 0.1, min_loss=1.0, area=5.0),
            row(1, 32, 0.1, min_loss=2.0, area=1.0),    # least area, but min loss above 1.8
            row(1, 64, 0.1, min_loss=1.8, area=3.0),    # exactly at the threshold survives
            row(1, 128, 0.1, "diverged", min_loss=0.1)]  # diverged: a result, never a winner
    w = pick_winners(rows, threshold=1.8)
    info = w["by_workers"]["1"]
    assert (info["winner"]["batch_size"], info["survivors"], info["diverged"], info["trials"]) == (64, 2, 1, 4)
    assert pick_winners(rows, threshold=1.0)["by_workers"]["1"]["winner"]["batch_size"] == 16
    assert pick_winners(rows, threshold=10)["by_workers"]["1"]["winner"]["batch_size"] == 32


def test_ties_break_by_min_loss_then_time_then_grid_order():
    tie = [row(2, 16, 0.1, min_loss=0.5, area=2.0), row(2, 32, 0.1, min_loss=0.4, area=2.0)]
    assert pick_winners(tie)["by_workers"]["2"]["winner"]["batch_size"] == 32
    tie = [row(2, 16, 0.1, wall=9.0), row(2, 32, 0.1, wall=8.0)]
    assert pick_winners(tie)["by_workers"]["2"]["winner"]["batch_size"] == 32
    tie = [row(2, 64, 0.1), row(2, 32, 0.1)]
    assert pick_winners(tie)["by_workers"]["2"]["winner"]["batch_size"] == 64


def test_all_diverged_and_no_survivor_have_no_winner_and_say_why():
    rows = [row(1, 16, 0.1, area=3.0), row(2, 16, 0.1, "diverged"), row(2, 32, 0.1, "diverged"),
            row(4, 16, 0.1, min_loss=2.5), row(4, 32, 0.1, min_loss=2.1, area=0.5)]
    w = pick_winners(rows, threshold=1.8)
    assert w["by_workers"]["2"]["winner"] is None and w["by_workers"]["2"]["reason"] == "all 2 diverged"
    assert w["by_workers"]["4"]["winner"] is None
    assert w["by_workers"]["4"]["reason"] == "no run reached min loss <= 1.8 (best 2.1)"
    assert w["overall"]["workers"] == 1  # the only worker count with a winner
    table = winners_table(w)
    assert "#Workers  Batch Size  Learn Rate" in table and "all 2 diverged" in table
    assert pick_winners([row(1, 16, 0.1, "diverged")])["overall"] is None


def test_overall_best_is_least_area_across_worker_counts():
    rows = [row(1, 16, 0.1, area=4.0), row(1, 32, 0.1, area=3.0), row(2, 16, 0.1, area=2.5),
            row(4, 16, 0.1, area=2.0, min_loss=1.9)]
    w = pick_winners(rows)
    assert (w["overall"]["workers"], w["overall"]["loss_area"]) == (2, 2.5)


def test_target_accuracy_picks_least_time_to_reach_it():
    rows = [row(1, 16, 0.1, curve=[[0, 0.1], [2.0, 0.8], [4.0, 0.95]]),
            row(1, 32, 0.1, curve=[[0, 0.1], [3.0, 0.95]], area=0.1),
            row(1, 64, 0.1, curve=[[0, 0.1], [1.0, 0.5]]),                # never reaches it
            row(2, 16, 0.1, "diverged", curve=[[0, 0.1], [0.5, 0.99]]),   # diverged runs don't count
            row(2, 32, 0.1, curve=[[0, 0.1], [2.5, 0.96]])]
    w = pick_winners(rows, target_accuracy=0.95)
    assert w["by_target"]["1"]["winner"]["batch_size"] == 32
    assert w["by_target"]["1"]["winner"]["time_to_target_s"] == 3.0
    assert (w["overall_by_target"]["workers"], w["overall_by_target"]["time_to_target_s"]) == (2, 2.5)
    assert pick_winners(rows, target_accuracy=0.999)["by_target"]["1"]["winner"] is None
    assert "least training time to test accuracy 0.95" in winners_table(w)


# --- the result store -----------------------------------------------------------------------

def test_store_moves_a_torn_last_line_aside_and_keeps_appending(tmp_path):
    path = str(tmp_path / "results.jsonl")
    good = [json.dumps(row(1, b, 0.1)) for b in (16, 32)]
    with open(path, "w") as f:
        f.write(good[0] + "\n" + good[1] + "\n" + good[1][:40])  # a kill mid-write
    store = ResultStore(path)
    assert [r["config"]["batch_size"] for r in store.load()] == [16, 32]
    assert "cut off" in store.notes[0]
    assert open(path + ".torn").read() == good[1][:40] + "\n"
    store.append(row(1, 64, 0.1))
    assert [r["config"]["batch_size"] for r in results(tmp_path)] == [16, 32, 64]


def test_store_ends_a_complete_unterminated_line(tmp_path):
    path = str(tmp_path / "results.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps(row(1, 16, 0.1)))
    store = ResultStore(path)
    assert len(store.load()) == 1 and not store.notes
    store.append(row(1, 32, 0.1))
    assert len(results(tmp_path)) == 2


def test_store_refuses_a_bad_middle_line_and_leaves_the_file_alone(tmp_path):
    path = str(tmp_path / "results.jsonl")
    data = json.dumps(row(1, 16, 0.1)) + "\n{oops\n" + json.dumps(row(1, 32, 0.1)) + "\n"
    with open(path, "w") as f:
        f.write(data)
    with pytest.raises(BadInput, match="results.jsonl line 2: not valid JSON"):
        ResultStore(path).load()
    assert open(path).read() == data


def in_process(capfd, monkeypatch, *args):
    """(exit code, stdout, stderr) of the CLI's main() in this process (tests/cli_inproc.py)."""
    r = run_main(args, monkeypatch, capfd)
    return r.returncode, r.stdout, r.stderr


def test_cli_bad_input_is_one_line_and_never_touches_results(tmp_path, capfd, monkeypatch):
    code, _, err = in_process(capfd, monkeypatch, "sweep", "--lr", "0.1:0.9:0", "--out", str(tmp_path / "s"))
    assert code == 2 and err.count("\n") == 1 and "--lr 0.1:0.9:0" in err, err
    out = tmp_path / "bad"
    out.mkdir()
    data = ('{"id": "x", "status": "completed", "config": {"workers": 1, "batch_size": 32, "lr": 0.1}, '
            '"summary": {}}\nnot json\n{}\n')  # line 1 whole (readback.RESULT_ROW), line 2 not JSON
    (out / "results.jsonl").write_text(data)
    code, _, err = in_process(capfd, monkeypatch, "sweep", "--dataset", "digits", "--model", "softmax",
                              "--workers", "1", "--samples", "512", "--lr", "0.1,0.2", "--out", str(out))
    assert code == 2 and "line 2: not valid JSON" in err and "Traceback" not in err, err
    assert (out / "results.jsonl").read_text() == data


@pytest.mark.parametrize("args", [["--lr", "-1,0.1"], ["--lr=-1,0.1"], ["--lr", "-1:1:0.5"]])
def test_cli_takes_negative_values_and_refuses_them_in_one_line(tmp_path, capfd, monkeypatch, args):
    # "--lr -1,0.1" was argparse's "expected one argument": a value starting with '-' must parse
    code, _, err = in_process(capfd, monkeypatch, "sweep", *args, "--out", str(tmp_path / "s"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--lr -1.0: expected a finite number > 0" in lines[0], err
    assert not (tmp_path / "s").exists()


# --- real sweeps ----------------------------------------------------------------------------

SMALL = ["--dataset", "digits", "--model", "softmax", "--samples", "2048", "--eval-points", "4",
         "--workers", "1,2", "--batch-size", "16,32", "--lr", "0.1,0.5", "--parallel", "2"]


_small_sweep = {}
"""small_sweep's one sweep, made by the first test that asks for it."""


@pytest.fixture
def small_sweep(tmp_path_factory, monkeypatch, capfd):
    """(--out, the sweep as a CompletedProcess, seconds) of one sweep of SMALL, shared by the tests
    that read it: main() in this process, run by the first of them (capfd is a test's, so this
    fixture is too; a program was ~5 s of two cores importing torch, twice with its forkserver)."""
    if not _small_sweep:
        out = tmp_path_factory.mktemp("sweep") / "s"
        t0 = time.monotonic()
        r = run_main(["sweep", *SMALL, "--out", str(out)], monkeypatch, capfd)
        _small_sweep["run"] = out, r, time.monotonic() - t0
    return _small_sweep["run"]


def test_sweep_writes_every_result_winners_and_report(small_sweep):
    out, r, elapsed = small_sweep
    assert r.returncode == 0, r.stdout + r.stderr
    rows = results(out)
    assert sorted((x["config"]["workers"], x["config"]["batch_size"], x["config"]["lr"]) for x in rows) == [
        (w, b, lr) for w in (1, 2) for b in (16, 32) for lr in (0.1, 0.5)]
    for x in rows:  # each line: config, status, summary, and its run directory, published whole
        assert x["status"] == x["summary"]["status"] == "completed"
        run = out / x["run_dir"]
        assert {"config.yaml", "metrics.jsonl", "eval.jsonl", "summary.json", "log.txt"} <= set(os.listdir(run))
        assert x["summary"]["workers"] == x["config"]["workers"] and len(x["eval_curve"]) == 5
    assert not os.listdir(out / "trials" / ".tmp")
    winners = json.load(open(out / "winners.json"))
    # with each winner's curves (loss and evaluations against time), read from its run directory
    assert winners == pick_winners(rows, threshold=1.8, swept=["workers", "batch_size", "lr"], root=str(out))
    assert all(winners["curves"][w["winner"]["id"]]["loss"] for w in winners["by_workers"].values())
    assert "#Workers  Batch Size  Learn Rate" in r.stdout and "Overall best" in r.stdout
    figs = {f: os.path.getsize(out / "figures" / f) for f in os.listdir(out / "figures")}
    assert {"heatmap-w1.png", "heatmap-w2.png", "areas-w1.png", "areas-w2.png", "winners-loss.png",
            "winners-accuracy.png", "phases-vs-workers.png", "throughput-vs-workers.png"} <= figs.keys()
    assert all(size > 5000 for size in figs.values())
    html = (out / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') >= 8 and "src=\"http" not in html and "<script" not in html


def test_same_command_again_runs_nothing(small_sweep, monkeypatch, capfd):
    out, r, _ = small_sweep
    assert r.returncode == 0
    before = (out / "results.jsonl").read_bytes()
    mtimes = {d: os.stat(out / "trials" / d / "summary.json").st_mtime for d in os.listdir(out / "trials")
              if not d.startswith(".")}
    again = run_main(["sweep", *SMALL, "--out", str(out), "--no-report"], monkeypatch, capfd)
    assert again.returncode == 0, again.stderr
    assert "8 trials (8 done, 0 to run)" in again.stdout and "[1/" not in again.stdout
    assert (out / "results.jsonl").read_bytes() == before
    assert mtimes == {d: os.stat(out / "trials" / d / "summary.json").st_mtime for d in mtimes}


def test_rerun_recovers_a_torn_line_by_adopting_the_finished_trial(small_sweep, tmp_path, monkeypatch, capfd):
    import shutil
    src, r, _ = small_sweep
    assert r.returncode == 0
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    data = (out / "results.jsonl").read_bytes()
    last = data.rstrip(b"\n").rsplit(b"\n", 1)[1]
    (out / "results.jsonl").write_bytes(data[:len(data) - len(last) - 1] + last[:len(last) // 2])
    again = run_main(["sweep", *SMALL, "--out", str(out), "--no-report"], monkeypatch, capfd)
    assert again.returncode == 0, again.stderr
    assert "cut off by an interrupted write" in again.stdout
    assert "had finished before the last sweep was stopped" in again.stdout  # its run dir was whole
    assert "[1/" not in again.stdout  # nothing trained again
    rows = results(out)
    assert len(rows) == 8 and len({x["id"] for x in rows}) == 8
    # Issue 38, 4: the adopted trial keeps the times its sweep measured (they were null).
    torn = results(src)[-1]  # the line cut in half
    adopted = next(x for x in rows if x["id"] == torn["id"])
    assert adopted["elapsed_s"] == torn["elapsed_s"] and adopted["elapsed_s"] > 0, adopted["elapsed_s"]
    assert adopted["group_s"] == torn["group_s"] and adopted["group_s"] is not None, adopted["group_s"]


def test_sigkill_mid_sweep_then_rerun_completes_each_trial_once(tmp_path, monkeypatch, capfd):
    out = tmp_path / "k"
    args = ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "16384", "--workers", "1",
            "--batch-size", "16,32", "--lr", "0.1,0.3,0.5", "--parallel", "2", "--no-report", "--out", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "shmlearn", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 120
    path, tmp = out / "results.jsonl", out / "trials" / ".tmp"
    in_flight = False
    while time.monotonic() < deadline and p.poll() is None:
        # Kill once a result is written AND a trial is in flight. Checking the second only after the
        # first raced: both parallel trials can finish together, and the next pair not yet claimed.
        done = path.exists() and path.read_bytes().count(b"\n") >= 1
        if done and tmp.is_dir() and os.listdir(tmp):
            in_flight = True
            break
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    assert in_flight, "the sweep should have had a trial in flight after its first result"
    p.wait()
    first = results(out)
    assert 1 <= len(first) < 6
    r = run_main(args, monkeypatch, capfd)  # the rerun: main() in this process
    assert r.returncode == 0, r.stdout + r.stderr
    rows = results(out)
    assert len(rows) == 6 and len({x["id"] for x in rows}) == 6
    assert rows[:len(first)] == first  # nothing written before the kill was changed
    assert sorted((x["config"]["batch_size"], x["config"]["lr"]) for x in rows) == [
        (b, lr) for b in (16, 32) for lr in (0.1, 0.3, 0.5)]
    assert all(x["status"] == "completed" for x in rows)


def test_trials_fill_every_gpu_by_default_and_two_cpu_cores():
    """CPU: two at once where they fit (grid.CPU_AT_ONCE: measured on 2 cores), more only asked."""
    from shmlearn.sweeps.sweep import trials_at_once
    assert trials_at_once(None, True, 2) == 2 and trials_at_once(None, True, 4) == 4  # 1-worker trials side by side
    assert trials_at_once(None, False, 2) == 2 and trials_at_once(None, False, 16) == 2
    assert trials_at_once(None, False, 1) == 1 and trials_at_once(1, False, 2) == 1  # --parallel 1: the way back
    assert trials_at_once(3, False, 2) == 3 and trials_at_once(1, True, 2) == 1


def test_efficiency_counts_slot_seconds_and_stays_at_most_one_side_by_side(small_sweep):
    """Two trials at once on 2 cores: efficiency = training slot-seconds over the sweep's
    slot-seconds (it printed 1.06 when it was training seconds over wall seconds)."""
    out, r, _ = small_sweep
    t = json.loads((out / "timing.json").read_text())
    rows = results(out)
    used = sum(x["summary"]["wall_time_s"] * x["slots"] for x in rows)
    assert t["slots"] >= 2 and t["parallel"] == 2 and {x["slots"] for x in rows} == {1, 2}
    assert t["efficiency"] == pytest.approx(used / (t["wall_s"] * t["slots"])) and 0 < t["efficiency"] <= 1


def test_a_sweep_on_a_full_disk_says_so_in_one_line_naming_the_file(tmp_path):
    """Issue 38, 6: a pooled sweep on a full disk printed a 33-line traceback. RLIMIT_FSIZE stands
    in for the full disk (Python ignores SIGXFSZ: the write fails with EFBIG): 500 bytes, less
    than sweep.json; one line naming --out and the file, exit 2, no temporary file left."""
    import resource

    def full():
        resource.setrlimit(resource.RLIMIT_FSIZE, (500, 500))
    out = tmp_path / "s"
    r = subprocess.run([sys.executable, "-m", "shmlearn", "sweep", "--dataset", "digits", "--model", "softmax",
                        "--samples", "2048", "--device", "cpu", "--batch-size", "64", "--lr", "0.1,0.3",
                        "--no-report", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=full)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"--out {out}: the disk is full (File too large: {out}/sweep.json)" in r.stderr, r.stderr
    assert not list(out.glob("sweep.json*"))


def _sigint_as_in_a_terminal() -> None:
    """A shell without job control starts a background command (CI's pytest, run with `&`) with
    SIGINT ignored, and Python then keeps it ignored, in the sweep too: the SIGINT was lost and the
    sweep ran to the end (exit 0, empty stderr). Ctrl-C in a terminal reaches a foreground job
    whose SIGINT has its default handling, so the sweep starts with that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_a_sweep_is_one_line_without_worker_tracebacks(tmp_path):
    """Issue 38, 8: SIGINT to the sweep's whole process group (Ctrl-C in a terminal) printed the
    workers' KeyboardInterrupt tracebacks (from conn.recv(), or from the import a starting worker
    was in). Here it comes while the two workers start: the sweep says it was interrupted, exit
    130, no worker says anything, and no process of the sweep is left."""
    out = tmp_path / "s"
    p = subprocess.Popen([sys.executable, "-m", "shmlearn", "sweep", "--dataset", "digits", "--model", "mlp",
                          "--samples", "600000", "--device", "cpu", "--batch-size", "32", "--lr", "0.1,0.2",
                          "--parallel", "2", "--no-report", "--out", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                         start_new_session=True, preexec_fn=_sigint_as_in_a_terminal)
    try:
        first = p.stdout.readline()  # "sweep: 2 trials ...": the pool starts next
        assert first.startswith("sweep: 2 trials"), first
        time.sleep(1.5)  # the workers are importing torch
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1].startswith("shmlearn: interrupted (Ctrl-C); the same command continues"), err
    deadline = time.monotonic() + 15  # the resource tracker leaves a moment after its owner
    while time.monotonic() < deadline:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("a process of the sweep's group is left")


@pytest.mark.parametrize("text,says", [("lr: [[0.1, 0.2], 0.3]\n", "--lr: [[0.1, 0.2], 0.3] holds a list ([0.1, 0.2])"),
                                       ("lr: {a: 1}\n", "--lr: {'a': 1} holds a mapping ({'a': 1})")])
def test_a_nested_value_in_a_sweep_config_is_one_line_and_exit_2(tmp_path, monkeypatch, capfd, text, says):
    """Issue 38, 8: a list or mapping inside a flag's values was a TypeError traceback (unhashable)."""
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(text)
    r = run_main(["sweep", "--config", str(cfg), "--dataset", "digits", "--model", "softmax", "--samples", "2048",
                  "--out", str(tmp_path / "s")], monkeypatch, capfd)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert says in r.stderr and "expected one value or a list of values" in r.stderr, r.stderr
