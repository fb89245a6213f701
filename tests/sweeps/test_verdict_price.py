"""Issue 55, acceptance 1: the steps axis's step price, which another job on the machine does not
move. On the CPU a step is priced by CPU time (winners.py's module docstring): the training
thread's p10, pooled over the trials of one step cost, plus what the process's other threads
(Gloo's) add, pooled over the trials that sync the same gradients. Summaries are built with the
loop's own runs.step_clock from per-step clocks, so the verdict reads what a trial writes."""
import json
import math

import pytest

from cli_inproc import run_main
from shmlearn.record.runs import loss_area, step_clock
from shmlearn.sweeps import winners
from shmlearn.sweeps.results import pick_winners


def summary_of(losses, wall, thread, proc, *, device="cpu"):
    """summary.json's verdict fields of a run with these per-step losses and per-step wall,
    training-thread CPU and process CPU seconds."""
    times, t = [], 0.0
    for d in wall:
        t += d
        times.append(t)
    return {"status": "completed", "min_loss": min(losses), "final_loss": sum(losses[-10:]) / len(losses[-10:]),
            "start_loss": losses[0], "loss_area": loss_area([0.0] + times, losses[:1] + losses),
            "wall_time_s": times[-1], "steps": len(losses), "test_accuracy": 0.9, "chance_accuracy": 0.1,
            "device": device, **step_clock(times, losses, proc, thread)}


def row(w, b, lr, summary, threads=1):
    tid = f"w{w}-b{b}-lr{lr}"
    return {"id": tid, "status": "completed", "summary": summary, "run_dir": f"trials/{tid}", "eval_curve": [],
            "config": {"workers": w, "batch_size": b, "lr": lr, "threads": threads, "model": "mlp"}}


def flat(n, thread_s, sync_s, wall_s=None):
    """n steps of `thread_s` CPU seconds on the training thread, the other threads adding `sync_s`."""
    return dict(wall=[wall_s or thread_s + sync_s] * n, thread=[thread_s] * n, proc=[thread_s + sync_s] * n)


# --- the price against known numbers ---------------------------------------------------------------

CLASSES = [  # (batch, lr, training thread's s per step, other threads' s per step)
    (32, 0.1, 1.0e-3, 1.0e-3), (32, 0.3, 1.2e-3, 1.5e-3),
    (64, 0.1, 1.5e-3, 0.4e-3), (64, 0.3, 1.4e-3, 0.9e-3), (64, 0.5, 1.9e-3, 2.0e-3)]


def _rows(threads=1, **wall):
    return [row(2, b, lr, summary_of([2.0, 1.0, 0.5, 0.4], **flat(4, t, s, wall.get(str(b)))), threads)
            for b, lr, t, s in CLASSES]


def test_cpu_parts_are_the_threads_p10_and_what_the_other_threads_add():
    s = summary_of([1.0] * 10, wall=[5e-3] * 10, thread=[1e-3 * i for i in range(1, 11)],
                   proc=[2e-3 * i for i in range(1, 11)])
    assert s["step_thread_cpu_s"] == pytest.approx({"p10": 1.9e-3, "p25": 3.25e-3, "median": 5.5e-3,
                                                    "p75": 7.75e-3, "n": 10})
    assert winners.cpu_parts(s) == pytest.approx((1.9e-3, 11e-3 - 5.5e-3))
    assert winners.run_price(s) == pytest.approx(1.9e-3 + 5.5e-3)
    assert winners.cpu_parts({**s, "device": "cuda:0"}) is None  # a GPU's work is not the host's CPU time
    assert winners.run_price({**s, "device": "cuda:0"}) == pytest.approx(5e-3)  # its p10 wall step
    # other threads never make a step cheaper than the training thread's own CPU
    assert winners.cpu_parts({**s, "step_cpu_s": {"median": 1e-3}})[1] == 0.0


def _by_batch(rows):
    """batch size -> its pooled price (every row here has 2 workers)."""
    batch = {winners.cost_key(r["config"]): r["config"]["batch_size"] for r in rows}
    return {batch[k]: v for k, v in winners.pooled_step_times(rows).items()}


def test_the_price_pools_compute_by_step_cost_and_sync_over_the_batch_sizes():
    rows = _rows()
    assert winners.price_clock(rows) == "cpu"
    got = _by_batch(rows)
    # compute: b32 median(1.0, 1.2) = 1.1 ms, b64 median(1.5, 1.4, 1.9) = 1.5 ms;
    # sync: one gradient for both batches, median(1.0, 1.5, 0.4, 0.9, 2.0) = 1.0 ms
    assert got == pytest.approx({32: 2.1e-3, 64: 2.5e-3})
    # with intra-op threads the other threads compute too: their part is pooled per step cost
    got = _by_batch(_rows(threads=2))
    assert got == pytest.approx({32: 1.1e-3 + 1.25e-3, 64: 1.5e-3 + 0.9e-3})
    # one run without the CPU clocks (results written before them): every price from the wall p10
    old = _rows(**{"32": 4e-3, "64": 6e-3})
    for k in ("step_cpu_s", "step_thread_cpu_s"):
        del old[0]["summary"][k]
    assert winners.price_clock(old) == "wall"
    assert sorted(winners.pooled_step_times(old).values()) == pytest.approx([4e-3, 6e-3])


# --- what load does: the wall clock stretches, the CPU clocks do not -----------------------------

def _curve(n, rate):
    return [2.3 * math.exp(-rate * i) + 0.02 for i in range(n)]


BASE = {  # (workers, batch): steps, training thread's s, other threads' s (one gradient: the same at any batch), loss decay
    (1, 16): (400, 0.0040, 0.0, 0.020), (1, 32): (200, 0.0075, 0.0, 0.045), (1, 64): (100, 0.016, 0.0, 0.08),
    (2, 16): (200, 0.0010, 0.004, 0.040), (2, 32): (100, 0.0055, 0.004, 0.085), (2, 64): (50, 0.016, 0.004, 0.15)}
LRS = {0.1: 1.0, 0.3: 0.8}  # lr -> how fast its loss falls, relative


def _sweep(load=None, cpu_factor=1.0, sync_factor=1.0):
    """The grid's rows. load {(w, b): f}: that trial's steps took f x as long in wall seconds for 40%
    of the run (another job took the cores); cpu_factor, sync_factor: the CPU clocks scaled (the
    load's cache misses, the ranks' waits: every trial of one kind alike)."""
    rows = []
    for (w, b), (n, t, s, rate) in BASE.items():
        for lr, rel in LRS.items():
            f = (load or {}).get((w, b), 1.0)
            wall = [(t + s) * (f if 0.3 * n <= i < 0.7 * n else 1.0) for i in range(n)]
            thread = [t * cpu_factor] * n
            proc = [t * cpu_factor + s * sync_factor] * n
            rows.append(row(w, b, lr, summary_of(_curve(n, rate * rel), wall, thread, proc)))
    return rows


def _verdict(rows, axis):
    w = pick_winners(rows, time_axis=axis)
    name = (lambda e: None if e is None else (e["workers"], e["batch_size"], e["lr"]))
    out = {k: (name(i["winner"]), name(i["runner_up"]), i["margin"]["tied"], round(i["margin"]["relative"], 9))
           for k, i in w["by_workers"].items()}
    out["overall"] = (name(w["overall"]), name(w["overall_runner_up"]), w["overall_margin"]["tied"],
                      round(w["overall_margin"]["relative"], 9))
    return out


LOAD = {(1, 16): 1.0, (1, 32): 3.0, (1, 64): 1.2, (2, 16): 1.5, (2, 32): 3.0, (2, 64): 1.0}


def test_the_steps_verdict_is_the_same_whatever_load_does_to_the_wall_clock():
    quiet = _verdict(_sweep(), "steps")
    assert _verdict(_sweep(), "wall") != _verdict(_sweep(LOAD), "wall")  # the load moved the wall verdict
    assert _verdict(_sweep(LOAD), "steps") == quiet
    # and it is the quiet machine's: there a step's wall time is its price, so the wall verdict agrees
    assert {k: v[:2] for k, v in _verdict(_sweep(), "wall").items()} == {k: v[:2] for k, v in quiet.items()}


@pytest.mark.parametrize("factor", [0.8, 1.3, 2.0])
def test_the_steps_verdict_is_unchanged_when_the_step_prices_are_scaled_by_a_load_factor(factor):
    """Every CPU clock scaled alike (a busy machine's cache misses, a slower core), on top of the
    wall clock's bursts: every area scales by the factor, so the winners, runner-ups, calls and
    relative margins stay."""
    quiet = _verdict(_sweep(), "steps")
    assert _verdict(_sweep(LOAD, factor, factor), "steps") == quiet
    # (a factor on one part only moves the prices apart: the verdict may change, as it should)
    assert _verdict(_sweep(LOAD, 1.0, 20.0), "steps") != quiet


# --- a real run records its CPU clocks -------------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 2])
def test_a_real_run_records_its_cpu_clocks_per_step(tmp_path, monkeypatch, capfd, workers):
    """Gloo ranks on the CPU: every step has a wall, a process CPU and a training thread CPU time;
    a thread's CPU time cannot exceed the wall time it ran in, and the process's includes it."""
    out = tmp_path / "r"
    r = run_main(["train", "--dataset", "digits", "--model", "mlp", "--workers", str(workers), "--threads", "1",
                  "--samples", "4096", "--batch-size", "32", "--device", "cpu", "--out", str(out)], monkeypatch, capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.load(open(out / "summary.json"))
    wall, proc, main = s["step_time_s"], s["step_cpu_s"], s["step_thread_cpu_s"]
    assert wall["n"] == proc["n"] == main["n"] == s["steps"] == 4096 // (32 * workers)
    assert 0 < main["p10"] <= main["median"] <= wall["median"] * 1.05
    assert proc["median"] >= main["median"] * 0.99
    parts = winners.cpu_parts(s)
    assert parts is not None and parts[0] == main["p10"]
