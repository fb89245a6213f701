"""Sweep winners by a user metric (issue 51, acceptance 5): `sweep --winner-metric NAME
[--winner-goal min|max]` picks, per worker count and overall, the completed trial with the best
summary.json value of NAME, beside the paper's rule; the report draws NAME over batch x lr.

References: the winner each test expects is computed here from the rows themselves (hand-made
rows, or results.jsonl of a real sweep of a tiny LM given by file, as a user gives it)."""
import json
import os
import shutil

import pytest

from cli_inproc import run_main
from shmlearn.sweeps.results import metric_winners, pick_winners, winner_goal, winners_table


def row(w, b, lr, status="completed", area=1.0, **metrics):
    summary = {"status": status, "workers": w, "batch_size": b, "lr": lr, "min_loss": 0.5,
               "loss_area": area if status == "completed" else None, "test_accuracy": 0.5, **metrics}
    return {"id": f"w{w}-b{b}-lr{lr}", "status": status, "config": {"workers": w, "batch_size": b, "lr": lr},
            "summary": summary, "run_dir": f"trials/w{w}-b{b}-lr{lr}", "eval_curve": []}


def winner(w, workers):
    e = w["by_metric"][str(workers)]["winner"]
    return e and (e["batch_size"], e["lr"])


# --- the verdict on hand-made rows ----------------------------------------------------------

ROWS = [row(1, 16, 0.1, val_loss=0.9, test_f1=0.2),
        row(1, 32, 0.1, val_loss=0.4, test_f1=0.7),
        row(1, 64, 0.1, val_loss=0.6, test_f1=0.9),
        row(1, 128, 0.1, "diverged", val_loss=0.01, test_f1=1.0),  # better values, but not completed
        row(1, 256, 0.1, "pruned", val_loss=0.02, test_f1=0.99),
        row(2, 16, 0.1, val_loss=0.5, test_f1=0.95),
        row(2, 32, 0.1, val_loss=float("nan"), test_f1=0.1),       # a NaN is no value
        row(4, 16, 0.1, "diverged", val_loss=0.1)]


def test_least_and_most_by_the_metric_per_worker_count_and_overall():
    w = pick_winners(ROWS, metric="val_loss")
    assert (w["winner_metric"], w["winner_goal"]) == ("val_loss", "min")
    assert (winner(w, 1), winner(w, 2), winner(w, 4)) == ((32, 0.1), (16, 0.1), None)
    assert w["by_metric"]["1"]["winner"]["metric_value"] == 0.4
    assert w["by_metric"]["4"]["reason"] == "no completed run"  # its one trial diverged
    assert pick_winners([row(1, 16, 0.1)], metric="val_loss")["by_metric"]["1"]["reason"] == \
        "no completed run reports val_loss"
    assert (w["overall_by_metric"]["workers"], w["overall_by_metric"]["metric_value"]) == (1, 0.4)
    # the goal reversed: the most val_loss
    w = pick_winners(ROWS, metric="val_loss", goal="max")
    assert (winner(w, 1), winner(w, 2), w["overall_by_metric"]["metric_value"]) == ((16, 0.1), (16, 0.1), 0.9)
    # an f1 is best when largest, by default
    w = pick_winners(ROWS, metric="test_f1")
    assert w["winner_goal"] == "max" and (winner(w, 1), winner(w, 2)) == ((64, 0.1), (16, 0.1))
    assert (w["overall_by_metric"]["workers"], w["overall_by_metric"]["metric_value"]) == (2, 0.95)
    # the paper's rule is the same with or without a metric
    plain = pick_winners(ROWS)
    assert {k: v for k, v in w.items() if k in plain} == plain and plain.get("by_metric") is None


def test_default_goals_read_past_best_and_eval_prefixes():
    assert [winner_goal(k) for k in ("val_loss", "best_val_loss", "test_accuracy", "best_test_f1", "val_auc",
                                     "test_perplexity", "final_loss")] == ["min", "min", "max", "max", "max",
                                                                           "min", "min"]


def test_ties_go_to_the_least_loss_area_then_grid_order():
    rows = [row(1, 16, 0.1, area=3.0, val_loss=0.5), row(1, 32, 0.1, area=2.0, val_loss=0.5),
            row(1, 64, 0.1, area=2.0, val_loss=0.5), row(1, 128, 0.1, area=1.0, val_loss=0.6)]
    assert winner(pick_winners(rows, metric="val_loss"), 1) == (32, 0.1)
    # the same rows in another order: the verdict is the rows', not the order's, but for grid order
    assert winner(pick_winners(rows[::-1], metric="val_loss"), 1) == (64, 0.1)
    # across worker counts: the overall tie goes to the least area too
    tie = [row(1, 16, 0.1, area=2.0, test_accuracy=0.9), row(2, 16, 0.1, area=1.0, test_accuracy=0.9)]
    assert pick_winners(tie, metric="test_accuracy")["overall_by_metric"]["workers"] == 2


def test_a_metric_no_trial_reports_names_the_keys_they_do():
    w = metric_winners(ROWS, "val_los", "min")
    assert w["overall_by_metric"] is None and all(i["winner"] is None for i in w["by_metric"].values())
    line = w["metric_missing"]
    assert line.startswith("--winner-metric val_los: no completed trial reports it") and "\n" not in line
    assert "they report test_accuracy, test_f1, val_loss, loss_area, min_loss (and the other numbers" in line
    assert metric_winners(ROWS, "val_loss", "min")["metric_missing"] is None


def test_the_table_says_the_verdict():
    table = winners_table(pick_winners(ROWS, metric="val_loss"))
    assert "Winners: least loss area" in table  # the paper's first
    part = table[table.index("Winners: least val_loss (--winner-metric)"):].splitlines()
    assert part[1].split() == ["#Workers", "Batch", "Size", "Learn", "Rate", "val_loss", "Loss", "area", "Other"]
    assert part[2].split()[:4] == ["1", "32", "0.1", "0.4"]
    assert "no completed run" in part[4]
    assert part[-1] == "Overall least val_loss: 1 worker, batch 32, lr 0.1 (val_loss 0.4)"
    assert "Winners: most test_accuracy" in winners_table(pick_winners(ROWS, metric="test_accuracy"))


def test_the_heat_map_leaves_diverged_pruned_and_unreported_cells_empty():
    sf = pytest.importorskip("shmlearn.report.sweep_figures", reason="matplotlib is not installed")
    rows = [row(2, 16, 0.1, val_loss=0.3), row(2, 16, 0.5, "diverged", val_loss=0.1),
            row(2, 32, 0.1, "pruned", val_loss=0.2), row(2, 32, 0.5)]
    batches, lrs, vals, cells = sf.metric_cells(rows, "val_loss")
    assert (batches, lrs, vals[0, 0]) == ([16, 32], [0.1, 0.5], 0.3)
    assert [vals[i, j] != vals[i, j] for i, j in ((0, 1), (1, 0), (1, 1))] == [True] * 3  # NaN: no colour
    assert [cells[k][1] for k in sorted(cells)] == ["0.3", "diverged", "pruned", "n/a"]
    png = sf.metric_heatmap(rows, metric="val_loss", goal="min", winner_id=rows[0]["id"], title="t")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


# --- refusals before anything runs ---------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--winner-goal", "up", "--winner-metric", "val_loss"], "--winner-goal up: expected min or max"),
    (["--winner-goal", "max"], "--winner-goal max: needs --winner-metric NAME"),
    (["--winner-metric", "val loss"], "--winner-metric val loss: expected a summary.json key"),
    (["--winner-metric", "val_loss", "--prune"], "--prune --winner-metric val_loss: --prune stops trials"),
])
def test_bad_winner_flags_are_one_line_and_exit_2(tmp_path, capfd, monkeypatch, args, says):
    r = run_main(["sweep", "--dataset", "digits", "--model", "softmax", "--workers", "1", "--lr", "0.1,0.2",
                  "--device", "cpu", "--out", str(tmp_path / "s"), *args], monkeypatch, capfd)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert not (tmp_path / "s").exists()


# --- a real sweep of a user's LM -------------------------------------------------------------

LM_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "results",
                     "sweep-lm-metric", "lm.py")
"""The user's file of docs/sweeps.md's example: a tiny LM over a deterministic token sequence,
items (ids int64, next ids int64), a (train, val, test) split, compute_loss -> (loss, {accuracy})."""

LM_SWEEP = ["sweep", "--model", "lm.py:Net", "--dataset", "lm.py:data", "--compute-loss", "lm.py:fn", "--workers", "2",
            "--lr", "0.01,0.1", "--batch-size", "16,32", "--samples", "1024", "--eval-points", "2", "--device", "cpu",
            "--out", "sw"]


def test_a_sweep_of_a_users_lm_picks_the_least_val_loss_and_the_report_plots_it(tmp_path, monkeypatch, capfd):
    shutil.copy(LM_PY, tmp_path / "lm.py")
    monkeypatch.chdir(tmp_path)
    r = run_main([*LM_SWEEP, "--winner-metric", "val_loss"], monkeypatch, capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in open("sw/results.jsonl")]
    assert len(rows) == 4 and all(x["status"] == "completed" for x in rows)
    # the reference: the least val_loss of the rows (no two equal here), and its value
    best = min(rows, key=lambda x: x["summary"]["val_loss"])
    assert sorted(x["summary"]["val_loss"] for x in rows)[1] > best["summary"]["val_loss"]
    w = json.load(open("sw/winners.json"))
    assert (w["winner_metric"], w["winner_goal"]) == ("val_loss", "min")
    assert w["by_metric"]["2"]["winner"]["id"] == w["overall_by_metric"]["id"] == best["id"]
    assert w["overall_by_metric"]["metric_value"] == best["summary"]["val_loss"]
    assert best["id"] in w["curves"]  # the metric winner's curves are kept with the paper's winners'
    assert "Winners: least val_loss (--winner-metric)" in r.stdout
    assert f"Overall least val_loss: 2 workers, batch {best['config']['batch_size']}" in r.stdout
    assert os.path.getsize("sw/figures/metric-val_loss-w2.png") > 5000
    html = open("sw/report.html").read()
    assert "val_loss by batch size and learning rate (--winner-metric)" in html
    assert "Winners: least val_loss (--winner-metric)" in html
    # the report again, from the sweep directory: the same verdict, the same figure
    os.remove("sw/figures/metric-val_loss-w2.png")
    r = run_main(["report", "sw"], monkeypatch, capfd)
    assert r.returncode == 0 and os.path.getsize("sw/figures/metric-val_loss-w2.png") > 5000, r.stderr
    # the same grid again by another metric runs no trial; a name no trial reports is one line, exit 2
    r = run_main([*LM_SWEEP, "--winner-metric", "test_acuracy"], monkeypatch, capfd)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith("sweep: --winner-metric test_acuracy: no completed trial reports it"), last
    assert "test_accuracy" in last and "val_loss" in last and "best_val_loss" in last
    assert len(open("sw/results.jsonl").readlines()) == 4
    w = json.load(open("sw/winners.json"))
    assert w["winner_metric"] == "test_acuracy" and w["metric_missing"] == last[len("sweep: "):]


# --- an Optuna study optimizes the metric ---------------------------------------------------

def test_a_study_optimizes_the_metric_in_its_direction(tmp_path, monkeypatch, capfd):
    optuna = pytest.importorskip("optuna", reason="optuna is not installed (pip install -e '.[test]')")
    db = f"sqlite:///{tmp_path}/s.db"
    args = ["sweep", "--dataset", "digits", "--model", "softmax", "--samples", "1024", "--workers", "1",
            "--device", "cpu", "--eval-points", "1", "--no-report", "--batch-size", "64", "--lr", "0.05,0.5",
            "--storage", db, "--study", "s", "--out", str(tmp_path / "a")]
    r = run_main([*args, "--winner-metric", "test_accuracy"], monkeypatch, capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    study = optuna.load_study(study_name="s", storage=db)
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    rows = {x["id"]: x for x in (json.loads(line) for line in open(tmp_path / "a" / "results.jsonl"))}
    told = {t.user_attrs["row"]["id"]: t.value for t in study.trials}
    assert told == {i: x["summary"]["test_accuracy"] for i, x in rows.items()} and len(told) == 2
    # another objective is another study; a pruner that compares eval points needs an eval key
    for more, says in ((["--winner-metric", "test_loss"],
                        "created with another grid (--winner-metric test_accuracy --winner-goal max there, "
                        "--winner-metric test_loss --winner-goal min here)"),
                       (["--study", "t", "--search", "random", "--trials", "2", "--pruner", "median",
                         "--winner-metric", "loss_area"], "--pruner median --winner-metric loss_area: the pruner")):
        r = run_main([*args, *more], monkeypatch, capfd)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
