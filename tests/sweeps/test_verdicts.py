"""Issue 55, studies a user can trust: verdicts with their runner-up, margin and noise; collapsed
runs named and never survivors; an area on the steps axis that a busy machine does not move; an
overall verdict that says why a worker count's winner lags; --repeats merged on the median.

Summaries are built with the loop's own functions (runs.loss_area, runs.step_clock) from
per-step losses and step times, so the verdict reads what a trial writes."""
import json
import math

import pytest

from cli_inproc import run_main
from shmlearn.sweeps import winners
from shmlearn.errors import BadInput
from shmlearn.sweeps.results import pick_winners, winners_table
from shmlearn.record.runs import loss_area, step_clock
from shmlearn.sweeps.grid import SweepConfig, check_verdict, trial_id, with_repeats


def summary_of(losses, durations, *, acc=0.9, chance=0.1):
    """summary.json's verdict fields of a run with these per-step losses and step seconds."""
    times, t = [], 0.0
    for d in durations:
        t += d
        times.append(t)
    return {"status": "completed", "min_loss": min(losses), "final_loss": sum(losses[-10:]) / len(losses[-10:]),
            "loss_area": loss_area([0.0] + times, losses[:1] + losses), "wall_time_s": times[-1],
            "steps": len(losses), "test_accuracy": acc, "chance_accuracy": chance, **step_clock(times, losses)}


def row(w, b, lr, summary, *, point=None, seed=0, curve=None):
    tid = f"w{w}-b{b}-lr{lr}" + (f"-s{seed}" if seed else "")
    r = {"id": tid, "status": summary["status"], "config": {"workers": w, "batch_size": b, "lr": lr},
         "summary": summary, "run_dir": f"trials/{tid}", "eval_curve": curve or []}
    if point:
        r["point"] = point
    return r


def hand(w, b, lr, area, *, spread=0.1, acc=0.9, min_loss=0.5, **extra):
    """A hand-made summary: loss area `area`, step times median 0.01 s with IQR `spread` x median."""
    s = {"status": "completed", "min_loss": min_loss, "final_loss": min_loss, "start_loss": 2.3, "loss_area": area,
         "wall_time_s": 1.0, "steps": 100, "test_accuracy": acc, "chance_accuracy": 0.1,
         "step_time_s": {"median": 0.01, "p25": 0.01 * (1 - spread / 2), "p75": 0.01 * (1 + spread / 2), "n": 100},
         **extra}
    return row(w, b, lr, s)


# --- runner-up, margin, tied within noise ---------------------------------------------------------

def test_each_winner_names_its_runner_up_and_margin_and_whether_the_noise_covers_it():
    rows = [hand(1, 16, 0.1, 1.00), hand(1, 32, 0.1, 1.02), hand(1, 64, 0.1, 3.0),
            hand(2, 16, 0.1, 0.50), hand(2, 32, 0.1, 1.00)]
    w = pick_winners(rows)
    one, two = w["by_workers"]["1"], w["by_workers"]["2"]
    assert (one["winner"]["batch_size"], one["runner_up"]["batch_size"]) == (16, 32)
    # half-widths: half the step times' IQR over their median = 0.05 of each area
    assert one["margin"]["value"] == pytest.approx(0.02) and one["margin"]["relative"] == pytest.approx(0.02)
    assert one["margin"]["noise"] == pytest.approx(0.05 * 1.00 + 0.05 * 1.02) and one["margin"]["tied"] is True
    assert two["margin"]["value"] == pytest.approx(0.5) and two["margin"]["tied"] is False
    # overall: 2 workers (0.5) against the runner-up worker count's winner (1 worker, 1.0)
    assert (w["overall"]["workers"], w["overall_runner_up"]["workers"]) == (2, 1)
    assert w["overall_margin"]["value"] == pytest.approx(0.5) and w["overall_margin"]["tied"] is False
    lines = winners_table(w).splitlines()
    assert any(x.startswith("1 worker: batch 16, lr 0.1; runner-up batch 32, lr 0.1 by 0.02") and
               "tied within noise" in x for x in lines)
    assert any(x.startswith("2 workers: batch 16, lr 0.1; runner-up batch 32, lr 0.1 by 0.5") and
               "clear of the noise" in x for x in lines)
    assert any(x.startswith("Overall best: 2 workers, batch 16, lr 0.1") and "runner-up 1 worker, batch 16" in x
               for x in lines)


def test_a_margin_without_step_times_says_the_noise_was_not_measured():
    rows = [hand(1, 16, 0.1, 1.0), hand(1, 32, 0.1, 1.5)]
    for r in rows:
        del r["summary"]["step_time_s"]
    w = pick_winners(rows)
    assert w["by_workers"]["1"]["margin"]["tied"] is None
    assert "noise not measured" in winners_table(w)
    assert "no runner-up" in winners_table(pick_winners(rows[:1]))


def test_repeats_are_merged_on_their_median_and_their_spread_joins_the_noise():
    p = [row(1, 16, 0.1, hand(1, 16, 0.1, a, spread=0.0)["summary"], point="P", seed=k)
         for k, a in enumerate([1.0, 1.4, 1.2])]
    q = hand(1, 32, 0.1, 1.3)  # step noise 0.05
    w = pick_winners(p + [q])
    info = w["by_workers"]["1"]
    assert info["winner"]["area"] == 1.2 and info["winner"]["repeats"] == 3
    assert info["winner"]["id"] == "w1-b16-lr0.1-s2"  # the repeat of median area stands for the point
    assert info["winner"]["noise"] == pytest.approx(0.4 / 2 / 1.2)  # half the repeats' range over the median
    assert info["margin"]["noise"] == pytest.approx(0.2 + 0.065) and info["margin"]["tied"] is True
    assert info["trials"] == 4 and w["repeats"] == 3
    assert "median of 3 repeats, 1-1.4" in winners_table(w)
    # one collapsed repeat: the point is not a survivor
    p[1]["summary"].update(final_loss=2.3, min_loss=0.01)
    info = pick_winners(p + [q])["by_workers"]["1"]
    assert info["winner"]["batch_size"] == 32 and info["survivors"] == 1 and info["collapsed"] == 1


def test_repeats_train_seed_plus_k_under_the_points_id_and_refuse_what_cannot_merge_them():
    from shmlearn.config.train_config import TrainConfig
    cfg = TrainConfig(dataset="digits", model="mlp", workers=1, batch_size=16, lr=0.1, seed=3)
    trials, point_of = with_repeats([cfg], 3)
    assert [c.seed for c in trials] == [3, 4, 5] and len({trial_id(c) for c in trials}) == 3
    assert [point_of[trial_id(c)] for c in trials] == [(trial_id(cfg), 0), (trial_id(cfg), 1), (trial_id(cfg), 2)]
    assert with_repeats([cfg], 1) == ([cfg], {})
    for sc, flag in ((SweepConfig(repeats=2, prune=True), "--repeats 2 --prune: pruning bounds one run's area"),
                     (SweepConfig(repeats=3, storage="sqlite:///x.db", study="s"), "--repeats 3 --storage: an Optuna"),
                     (SweepConfig(time_axis="steps", prune=True), "--prune --time-axis steps"),
                     (SweepConfig(repeats=2, axes={"seed": [1, 2]}), "--repeats 2 --seed 1,2"),
                     (SweepConfig(time_axis="cpu"), "--time-axis cpu: expected one of wall, steps"),
                     (SweepConfig(repeats=0), "--repeats 0"), (SweepConfig(target_share=1.5), "--target-share 1.5")):
        with pytest.raises(BadInput, match=flag):
            check_verdict(sc)


# --- the steps axis does not drift with machine load -----------------------------------------

def _curve(n, rate):
    return [2.3 * math.exp(-rate * i) + 0.02 for i in range(n)]


def _burst(durations, factor):
    """Another program took the cores for 40% of the run: those steps took `factor` x as long."""
    n = len(durations)
    return [d * factor if 0.3 * n <= i < 0.7 * n else d for i, d in enumerate(durations)]


def test_steps_axis_names_the_same_winners_when_load_moves_the_wall_clock():
    # Per worker count three points; their step times and how fast their loss falls differ.
    base = {(1, 16): (400, 0.004, 0.020), (1, 32): (200, 0.0075, 0.045), (1, 64): (100, 0.016, 0.08),
            (2, 16): (200, 0.005, 0.040), (2, 32): (100, 0.0095, 0.085), (2, 64): (50, 0.02, 0.15)}
    quiet = {k: summary_of(_curve(n, rate), [st] * n) for k, (n, st, rate) in base.items()}
    # The same runs on a busy machine: each met a burst of load of its own size.
    load = {(1, 16): 1.0, (1, 32): 3.0, (1, 64): 1.2, (2, 16): 1.5, (2, 32): 3.0, (2, 64): 1.0}
    busy = {k: summary_of(_curve(n, rate), _burst([st] * n, load[k])) for k, (n, st, rate) in base.items()}

    def verdict(summaries, axis):
        w = pick_winners([row(wk, b, 0.1, s) for (wk, b), s in summaries.items()], time_axis=axis)
        return {k: i["winner"]["batch_size"] for k, i in w["by_workers"].items()}, w["overall"]["id"]

    assert verdict(quiet, "wall") != verdict(busy, "wall")  # the wall clock moved the verdict
    assert verdict(quiet, "steps") == verdict(busy, "steps") == verdict(quiet, "wall")
    # the wall-clock verdict on the busy machine sees the burst as noise: its call is a tie
    w = pick_winners([row(wk, b, 0.1, s) for (wk, b), s in busy.items()], time_axis="wall")
    assert w["by_workers"]["1"]["margin"]["tied"] is True


def test_step_clock_is_the_loops_steps_and_their_quartiles():
    s = step_clock([0.1, 0.3, 0.4, 0.8], [2.0, 1.0, 1.0, 3.0])  # steps of 0.1, 0.2, 0.1, 0.4 s
    assert s["start_loss"] == 2.0 and s["loss_area_steps"] == pytest.approx(2.0 + 1.5 + 1.0 + 2.0)
    assert s["step_time_s"] == pytest.approx({"p10": 0.1, "p25": 0.1, "median": 0.15, "p75": 0.25, "n": 4})
    assert s["step_cpu_s"] is None and s["step_thread_cpu_s"] is None  # not given: a run from before them
    assert winners.area({**s, "loss_area": 9.9}, "steps") == pytest.approx(6.5 * 0.1)
    assert winners.area({**s, "loss_area": 9.9}, "wall") == 9.9


# --- collapsed runs -------------------------------------------------------------------------------

def test_a_run_whose_loss_comes_back_up_is_collapsed_and_never_a_survivor():
    fine = hand(1, 32, 0.1, 2.0)
    # lr too high: down to 1e-6, then back to the start's 2.3 without a NaN; the least area
    blew = hand(1, 16, 0.1, 1.0, min_loss=1.6e-7, final_loss=2.31, acc=0.097)
    near = hand(1, 64, 0.1, 3.0, min_loss=0.01, final_loss=0.8 * 2.3)  # 80% of the start: not collapsed
    w = pick_winners([blew, fine, near])
    info = w["by_workers"]["1"]
    assert info["winner"]["batch_size"] == 32 and info["survivors"] == 2 and info["collapsed"] == 1
    assert info["runner_up"]["batch_size"] == 64
    assert [c["id"] for c in w["collapsed"]] == ["w1-b16-lr0.1"]
    assert winners.status(blew) == "collapsed" and winners.status(near) == "completed"
    assert "collapsed, not a survivor: w1-b16-lr0.1 (loss back to 2.31 after 1.6e-07" in winners_table(w)
    assert winners.constraint(blew, 1.8) == math.inf and winners.best_bounds([blew, fine], 1.8, None) == {1: (2.0, None)}
    # accuracy at chance (1/10 classes) collapses a run too, whatever its loss did
    chance = hand(1, 128, 0.1, 0.5, acc=0.11)
    assert winners.collapsed(chance["summary"]) == "test accuracy 0.11 at chance (0.1)"
    alone = pick_winners([blew])["by_workers"]["1"]
    assert alone["winner"] is None and alone["reason"] == "every run that reached min loss <= 1.8 collapsed"


def test_a_real_run_that_blows_up_late_is_marked_collapsed_in_the_sweep_table_and_report(tmp_path, monkeypatch,
                                                                                         capfd):
    """digits mlp at batch 16: lr 0.3 falls to a min loss of ~0.6 (a survivor by the paper's 1.8),
    then climbs back to ~2.3 with no NaN and ends at chance; lr 0.05 trains."""
    out = tmp_path / "s"
    r = run_main(["sweep", "--dataset", "digits", "--model", "mlp", "--samples", "12800", "--lr-schedule",
                  "constant", "--workers", "1", "--batch-size", "16", "--lr", "0.05,0.3", "--eval-points", "2",
                  "--device", "cpu", "--out", str(out)], monkeypatch, capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {x["config"]["lr"]: x for x in map(json.loads, open(out / "results.jsonl"))}
    s = rows[0.3]["summary"]
    assert s["status"] == "completed" and math.isfinite(s["final_loss"]) and s["min_loss"] <= 1.8
    assert s["final_loss"] >= 0.9 * s["start_loss"] and winners.status(rows[0.3]) == "collapsed"
    w = json.load(open(out / "winners.json"))
    info = w["by_workers"]["1"]
    assert info["collapsed"] == 1 and info["survivors"] == 1 and info["winner"]["lr"] == 0.05
    assert f"collapsed, not a survivor: {rows[0.3]['id']}" in r.stdout and "COLLAPSED" in r.stdout
    html = (out / "report.html").read_text()
    assert "1 completed, 1 collapsed" in html and "collapsed, not a survivor" in html


# --- the overall verdict ---------------------------------------------------------------------------

def test_overall_names_each_worker_counts_accuracy_and_why_one_lags_with_the_time_to_accuracy_winner():
    rows = [hand(1, 256, 0.3, 2.0, acc=0.86), hand(1, 64, 0.3, 2.5, acc=0.88),
            hand(4, 256, 0.4, 0.46, acc=0.3867), hand(4, 64, 0.1, 0.9, acc=0.85)]
    rows[1]["eval_curve"] = [[0.5, 0.5], [1.0, 0.88]]
    rows[3]["eval_curve"] = [[0.2, 0.5], [0.6, 0.85]]
    w = pick_winners(rows, target_share=0.9)
    assert w["target_accuracy"] == round(0.9 * 0.88, 4) and w["best_trial"]["test_accuracy"] == 0.88
    assert w["overall"]["workers"] == 4 and w["lagging"] == ["4"]
    assert w["by_target"]["4"]["winner"]["batch_size"] == 64
    text = winners_table(w)
    assert "Test accuracy of each worker count's winner: 1 worker 0.8600, 4 workers 0.3867; best trial 0.8800" in text
    assert ("4 workers: its winner ends at test accuracy 0.3867, 0.49 below the best trial: the rule rewards short "
            "runs (least area), and this budget leaves 4 workers under-trained. The time-to-accuracy winner there: "
            "batch 64, lr 0.1 (test accuracy 0.8500).") in text
    assert "Winners: least training time to test accuracy 0.792" in text


def test_a_sweep_with_repeats_on_the_steps_axis_merges_each_points_runs(tmp_path, monkeypatch, capfd):
    out = tmp_path / "s"
    r = run_main(["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "2048", "--workers", "1",
                  "--batch-size", "32", "--lr", "0.1,0.5", "--eval-points", "1", "--repeats", "2", "--time-axis",
                  "steps", "--device", "cpu", "--no-report", "--out", str(out)], monkeypatch, capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(x) for x in open(out / "results.jsonl")]
    assert sorted((x["config"]["lr"], x["config"]["seed"], x["repeat"]) for x in rows) == [
        (0.1, 0, 0), (0.1, 1, 1), (0.5, 0, 0), (0.5, 1, 1)]
    assert all(x["point"] == x["id"] for x in rows if x["repeat"] == 0)
    spec = json.load(open(out / "sweep.json"))
    assert (spec["time_axis"], spec["repeats"]) == ("steps", 2)
    w = json.load(open(out / "winners.json"))
    e = w["by_workers"]["1"]["winner"]
    assert w["time_axis"] == "steps" and e["repeats"] == 2 and len(e["repeat_areas"]) == 2
    price = winners.pooled_step_times(rows)  # every run here costs the same a step: one price for all
    assert len(price) == 1
    areas = sorted(winners.area(x["summary"], "steps", *price.values()) for x in rows if x["config"]["lr"] == e["lr"])
    assert e["area"] == pytest.approx(sum(areas) / 2)  # the median of two
    assert "least loss area (steps x step price)" in r.stdout and "median of 2 repeats" in r.stdout


def _row(i, lr, batch, area_steps, p10, iqr=0.0, workers=1):
    cfg = {"workers": workers, "batch_size": batch, "lr": lr, "seed": 0, "model": "mlp"}
    summ = {"status": "completed", "loss_area": area_steps * p10, "loss_area_steps": area_steps, "steps": 100,
            "wall_time_s": 100 * p10, "min_loss": 0.01, "final_loss": 0.02, "start_loss": 2.3, "test_accuracy": 0.9,
            "step_time_s": {"p10": p10, "p25": p10 * (1 - iqr), "median": p10, "p75": p10 * (1 + iqr), "n": 100}}
    return {"id": f"t{i}", "status": "completed", "config": cfg, "summary": summ}


def test_steps_axis_prices_learning_rates_of_one_batch_alike_so_load_cannot_flip_them():
    """Two learning rates at one batch size cost the same a step: on the steps axis both are priced
    at their pooled p10, so the one with less loss per step wins however the load slowed it, and the
    call is clear (the step-time spread cancels). Each run's own p10 would have flipped it."""
    rows = [_row(0, 0.1, 64, area_steps=100.0, p10=0.030, iqr=0.4),   # less loss per step, slowed by load
            _row(1, 0.3, 64, area_steps=104.0, p10=0.010, iqr=0.4),
            _row(2, 0.5, 64, area_steps=150.0, p10=0.012, iqr=0.4),
            _row(3, 0.1, 16, area_steps=400.0, p10=0.004, iqr=0.1)]   # another batch: its own price
    assert winners.area(rows[0]["summary"], "steps") > winners.area(rows[1]["summary"], "steps")  # unpooled: lr 0.3
    price = winners.pooled_step_times(rows)
    assert sorted(price.values()) == [0.004, 0.012]  # b16's own; b64's median of 0.010, 0.012, 0.030
    w = pick_winners(rows, threshold=0.1, time_axis="steps")["by_workers"]["1"]
    assert (w["winner"]["lr"], w["winner"]["batch_size"]) == (0.1, 64)
    assert w["winner"]["area"] == pytest.approx(100.0 * 0.012)
    assert (w["runner_up"]["lr"], w["runner_up"]["batch_size"]) == (0.3, 64)
    assert w["margin"]["relative"] == pytest.approx(0.04) and w["margin"]["tied"] is False
    assert w["margin"]["noise"] == 0.0
    # On the wall axis each run keeps its own clock: the slowed run loses, within noise.
    wall = pick_winners(rows, threshold=0.1, time_axis="wall")["by_workers"]["1"]
    assert wall["winner"]["lr"] == 0.3 and wall["margin"]["tied"] is True


def test_trials_of_different_step_cost_keep_the_step_time_noise():
    rows = [_row(0, 0.1, 64, area_steps=100.0, p10=0.010, iqr=0.4), _row(1, 0.1, 32, area_steps=190.0, p10=0.005, iqr=0.4)]
    w = pick_winners(rows, threshold=0.1, time_axis="steps")["by_workers"]["1"]
    assert w["winner"]["batch_size"] == 32  # 0.95 against 1.00 loss x s: 5% apart, inside 40% noise
    assert w["margin"]["tied"] is True and w["margin"]["noise"] > 0
