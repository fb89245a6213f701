"""The three pages: one run, several runs side by side, one sweep. Each names its figures as it
lays the page out (draw.Later), draws them all at the end, side by side where it can (Page.draw),
and returns the Page and the named PNGs it drew (written beside the page as PATH/figures/NAME.png
by write_report)."""
from __future__ import annotations

import os
import time
from typing import Dict, List, Tuple

from shmlearn.sweeps.results import old_overall_line, metric_title
from shmlearn.sweeps.winners import margin_text, point_name, points, status, verdict_lines

from . import run_figures as rf
from . import sweep_figures as sf
from .draw import Later
from .html import Page, fmt, rate, worker_count
from .load import Run, SweepData

Figs = Dict[str, Later]


def _drawn(page: Page, figs: Figs) -> Dict[str, bytes]:
    """Draw the page's figures; the named ones that have bytes."""
    page.draw()
    return {name: fig.data for name, fig in figs.items() if fig.data}
SUMMARY_ROWS = (("status", "status"), ("strategy", "strategy"), ("workers", "workers"), ("model", "model"),
                ("dataset", "dataset"), ("batch per worker", "batch_size"), ("learning rate", "lr"),
                ("optimizer", "optimizer"), ("steps", "steps"), ("samples seen", "samples_seen"),
                ("training time (s)", "wall_time_s"), ("samples/s", "samples_per_s"),
                ("final loss", "final_loss"), ("min loss", "min_loss"), ("loss area (loss x s)", "loss_area"),
                ("test accuracy", "test_accuracy"), ("best test accuracy", "best_test_accuracy"),
                ("test loss", "test_loss"), ("device", "device"), ("torch", "torch_version"))


def _area(status: str, summary) -> str:
    """A pruned run's loss area is the area so far, a lower bound of the full run's: '>area'."""
    a = fmt(summary.get("loss_area"))
    return f">{a}" if status == "pruned" and summary.get("loss_area") is not None else a


def _cell(key: str, r: Run) -> str:
    v = r.summary.get(key, r.config.get(key))
    return _area(r.status, r.summary) if key == "loss_area" else rate(v) if key == "samples_per_s" else fmt(v)


def _keep(figs: Figs, name: str, fig: Later) -> Later:
    """Keep `fig` as figures/NAME.png (write_report: where it has bytes once drawn)."""
    figs[name] = fig
    return fig


def runs_page(runs: List[Run]) -> Tuple[Page, Dict[str, bytes]]:
    one = len(runs) == 1
    page = Page(f"shmlearn run {os.path.basename(os.path.normpath(runs[0].path))}" if one
                else f"shmlearn: {len(runs)} runs side by side")
    figs: Figs = {}
    page.h2("Summary")
    page.table(["", *(r.label for r in runs)],
               [[name, *(_cell(key, r) for r in runs)] for name, key in SUMMARY_ROWS])
    for r in runs:
        if r.status == "diverged":
            page.p(f"{r.label}: diverged at step {r.summary.get('diverged_step')} "
                   f"(rank {r.summary.get('diverged_rank')}); no loss area.", "note")
        elif r.status == "pruned":
            page.p(f"{r.label}: pruned at step {r.summary.get('steps')} of {r.summary.get('planned_steps')} "
                   f"(sweep --prune: it could no longer win); its loss area is the area so far, a lower bound.",
                   "note")
        elif r.status == "incomplete":
            page.p(f"{r.label}: no summary.json (still running, or stopped); curves as far as they go.", "note")
    page.h2("Curves and phases")
    page.figures([(_keep(figs, "loss", Later(rf.loss_vs_time, runs)), "training loss against training time"),
                  (_keep(figs, "accuracy", Later(rf.accuracy_vs_time, runs)), "test accuracy against training time"),
                  (_keep(figs, "phases", Later(rf.phases, runs)), "mean time per step by phase (rank 0)"),
                  (_keep(figs, "noise-scale", Later(rf.noise_scale, runs)),
                   "gradient noise scale B_simple against the step (dashed: the global batch)"),
                  (_keep(figs, "staleness", Later(rf.staleness, runs)),
                   "async-ps: gradients applied per worker by lag (summary.json staleness_histogram)")])
    page.h2("Configuration")
    keys = sorted({k for r in runs for k in r.config})
    page.table(["", *(r.label for r in runs)], [[k, *(fmt(r.config.get(k)) for r in runs)] for k in keys])
    page.p(f"Run directories: {', '.join(r.path for r in runs)}. Written {time.strftime('%Y-%m-%d %H:%M:%S')}.", "note")
    return page, _drawn(page, figs)


def _group_key(row, others):
    return tuple(row["config"].get(a) for a in others)


def _heatmaps(figs: Figs, by_w: Dict[int, list], others: List[str], name: str, draw, verdict) -> list:
    """One heat map per worker count (and value of each other swept flag): draw(rows, winner id,
    title) kept as figures/NAME-w<W>[-<flag><value>...].png, the winner that of `verdict`."""
    items = []
    for wk in sorted(by_w):
        win = verdict[str(wk)]["winner"]
        groups: Dict[tuple, list] = {}
        for r in by_w[wk]:
            groups.setdefault(_group_key(r, others), []).append(r)
        for g, rs in groups.items():
            tag = "".join(f"-{a}{v}" for a, v in zip(others, g))
            extra = "".join(f", {a} {v}" for a, v in zip(others, g))
            items.append((_keep(figs, f"{name}-w{wk}{tag}", Later(draw, rs, win and win["id"], f"{worker_count(wk)}{extra}")),
                          f"{worker_count(wk)}{extra}"))
    return items


def _metric_winners(page: Page, w) -> None:
    """The winners by --winner-metric (results.metric_winners), under the paper's."""
    m = w["winner_metric"]
    page.h3(f"Winners: {metric_title(w)} (--winner-metric)")
    page.table(["#Workers", "Batch Size", "Learn Rate", m, "loss area (loss x s)", "test accuracy"],
               [[k, fmt((i["winner"] or {}).get("batch_size")), fmt((i["winner"] or {}).get("lr")),
                 fmt(i["winner"]["metric_value"]) if i["winner"] else i["reason"],
                 fmt((i["winner"] or {}).get("loss_area")), fmt((i["winner"] or {}).get("test_accuracy"))]
                for k, i in w["by_metric"].items()], left=0)
    o = w["overall_by_metric"]
    page.p(f"Overall {metric_title(w)}: " + ("none" if not o else
                                              f"{worker_count(o['workers'])}, batch {o['batch_size']}, "
                                              f"lr {o['lr']:g} ({m} {o['metric_value']:.6g})."))
    if w.get("metric_missing"):
        page.p(w["metric_missing"], "note")


def sweep_page(sw: SweepData) -> Tuple[Page, Dict[str, bytes]]:
    spec, w = sw.spec, sw.winners
    fixed = spec.get("fixed", {})
    page = Page(f"shmlearn sweep: {fixed.get('model', '')} on {fixed.get('dataset', '')}".strip())
    figs: Figs = {}
    n = {s: sum(status(r) == s for r in sw.rows) for s in ("completed", "collapsed", "pruned", "diverged")}
    pruned = n["pruned"] > 0
    counts = (f"{n['completed']} completed, " + (f"{n['collapsed']} collapsed, " if n["collapsed"] else "")
              + (f"{n['pruned']} pruned, " if pruned else "") + f"{n['diverged']} diverged")
    page.p(f"{len(sw.rows)} of {len(spec.get('trials', sw.rows))} trials finished ({counts}) on "
           f"{spec.get('device', '?')}, {spec.get('parallel', '?')} at a time. "
           f"Winner rule (paper §5): per worker count, drop runs whose minimum training loss is above "
           f"{w['threshold']:g}, then take the least loss area (training loss integrated over "
           + ("training seconds" if w.get("time_axis", "wall") == "wall" else
              "the steps, times a step's price (--time-axis steps: its CPU time on a CPU)") + "). "
           "Collapsed runs (the loss came back to within 10% of its start after falling far below it, or "
           "the test accuracy ended at chance) are never survivors. Each verdict names its runner-up and the "
           "margin; 'tied within noise' where the margin is within the timing noise (half the spread of the "
           "runs' step times" + (f", and of their {w['repeats']} repeats" if w.get("repeats", 1) > 1 else "")
           + ")."
           + (" Pruned trials were stopped early because they could no longer win (sweep --prune); their "
              "loss area is the area so far, a lower bound, and they are never winners."
              if pruned and spec.get("pruner") in (None, "area") else "")
           + (f" Also, per worker count, the completed trial with the {metric_title(w)} (--winner-metric; "
              f"ties: least loss area, then grid order)." if w.get("by_metric") is not None else ""), "note")
    if spec.get("study"):  # an Optuna study (study.py): its trials came from every process sharing it
        page.p(f"Optuna study {spec['study']} on {spec.get('storage')}: {spec.get('search')} search, "
               f"{spec.get('study_trials')} trials in the study; {len(spec.get('repeats') or [])} repeated "
               f"trials dropped, {len(spec.get('lost') or [])} lost trials run again. Its objective: "
               + (f"{spec['winner_metric']} ({spec.get('winner_goal')}imized)." if spec.get("winner_metric")
                  else "the loss area (minimized)."), "note")
    if pruned and spec.get("pruner") in ("median", "halving"):
        what = (spec.get("pruned") or [{}])[0].get("metric") or "test loss"
        page.p(f"Pruned trials were stopped by Optuna's {spec['pruner']} pruner (--pruner {spec['pruner']}): their "
               f"{what} at an evaluation point was worse than their peers'. Unlike --prune, such a trial might "
               f"have won. Their loss area is the area so far, a lower bound, and they are never winners.", "note")
        page.table(["trial", "stopped at eval point", f"its best {what}", "the others' median"],
                   [[p.get("id"), fmt(p.get("step")), fmt(p.get("best_so_far")), fmt(p.get("peers"))]
                    for p in spec.get("pruned") or []])
    if spec.get("command"):
        page.pre("shmlearn " + " ".join(spec["command"][1:]))
    for note in sw.notes:
        page.p(note, "note")
    axes = spec.get("axes", {})
    page.table(["flag", "values"], [[k, ", ".join(map(str, v))] for k, v in axes.items()]
               + [[k, str(v)] for k, v in fixed.items()])

    page.h2("Winners (paper Table 5.1)")
    header = ["#Workers", "Batch Size", "Learn Rate", "loss area (loss x s)", "min loss", "test accuracy",
              "training s", "survivors"]
    rows = []
    for k, info in w["by_workers"].items():
        e = info["winner"] or {}
        rows.append([k, fmt(e.get("batch_size")), fmt(e.get("lr")), fmt(e.get("area", e.get("loss_area"))),
                     fmt(e.get("min_loss")),
                     fmt(e.get("test_accuracy")), fmt(e.get("wall_time_s"), ".2f"),
                     f"{info['survivors']}/{info.get('points', info['trials'])}"
                     + (f" ({info['reason']})" if info["reason"] else "")])
    page.table(header, rows, left=0)
    for line in verdict_lines(w) if "overall_margin" in w else [old_overall_line(w)]:
        page.p(line, "note" if line.startswith("collapsed") else None)
    if w.get("by_target") is not None:
        a = w["target_accuracy"]
        page.h3(f"Least training time to test accuracy {a:g}")
        if w.get("target_share") is not None and w.get("target_accuracy") is not None:
            page.p(f"Target: {w['target_share']:g} x the best surviving test accuracy.", "note")
        page.table(["#Workers", "Batch Size", "Learn Rate", f"seconds to {a:g}", "final test accuracy", "runner-up"],
                   [[k, fmt((i["winner"] or {}).get("batch_size")), fmt((i["winner"] or {}).get("lr")),
                     fmt((i["winner"] or {}).get("time_to_target_s"), ".3f") if i["winner"] else i["reason"],
                     fmt((i["winner"] or {}).get("test_accuracy")),
                     margin_text(i.get("margin"), i.get("runner_up"),
                                 point_name(i["runner_up"]) if i.get("runner_up") else "", "s")]
                    for k, i in w["by_target"].items()], left=0)

    if w.get("by_metric") is not None:
        _metric_winners(page, w)

    others = [a for a in spec.get("axis_order", []) if a not in ("workers", "batch_size", "lr")]
    by_w: Dict[int, list] = {}
    axis = w.get("time_axis", "wall")
    for p in points(sw.rows, axis):  # a grid point's repeats: the one of median area stands for it
        by_w.setdefault(p.row["config"]["workers"], []).append(p.row)
    page.h2("Loss areas by batch size and learning rate (paper Fig. 5.5-5.8)")
    page.p(sf.heat_note(sw.rows), "note")
    # Each figure is drawn at the page's end (Page.draw): what its function reads is bound now.
    page.figures(_heatmaps(figs, by_w, others, "heatmap", lambda rs, win, title, w=w, axis=axis: sf.heatmap(
        rs, threshold=w["threshold"], winner_id=win, title=f"Loss area, {title}", axis=axis), w["by_workers"]))
    if w.get("by_metric") is not None:
        m, goal = w["winner_metric"], w["winner_goal"]
        page.h2(f"{m} by batch size and learning rate (--winner-metric)")
        page.p(f"Each completed trial's {m} (summary.json); {'least' if goal == 'min' else 'most'} is best. "
               f"Blank cells reading 'diverged' diverged; grey hatched cells were pruned; 'n/a': the trial does "
               f"not report {m}. Red outline: the trial with the best {m} of its worker count.", "note")
        page.figures(_heatmaps(figs, by_w, others, f"metric-{m}", lambda rs, win, title, m=m, goal=goal: sf.metric_heatmap(
            rs, metric=m, goal=goal, winner_id=win, title=f"{m}, {title}"), w["by_metric"]))
    page.h2("Loss areas sorted by minimum loss (paper Fig. 5.1-5.4)")
    if pruned:
        page.p("After the completed runs: pruned runs, as hollow hatched bars of their loss area so far (a lower "
               "bound); then diverged runs, with no bar.", "note")
    page.figures([(_keep(figs, f"areas-w{wk}", Later(
        sf.area_histogram, by_w[wk], threshold=w["threshold"], winner=w["by_workers"][str(wk)]["winner"], workers=wk)),
        worker_count(wk)) for wk in sorted(by_w)])

    winner_runs: Dict[int, Run] = {}
    for k, info in w["by_workers"].items():
        if info["winner"]:
            row = next(r for r in sw.rows if r["id"] == info["winner"]["id"])
            run = sw.run(row)
            if run:
                winner_runs[int(k)] = run
    page.h2("Each worker count's winner (paper Fig. 6.2-6.6)")
    wr = [winner_runs[k] for k in sorted(winner_runs)]
    page.figures([(_keep(figs, "winners-loss", Later(rf.loss_vs_time, wr, "Training loss of each worker count's winner")),
                   "training loss against time"),
                  (_keep(figs, "winners-accuracy", Later(rf.accuracy_vs_time, wr, "Test accuracy of each worker count's winner")),
                   "test accuracy against time"),
                  (_keep(figs, "phases-vs-workers", Later(sf.phases_vs_workers, winner_runs)),
                   "mean phase time per step against workers"),
                  (_keep(figs, "throughput-vs-workers", Later(sf.throughput_vs_workers, sw.rows)),
                   "throughput and scaling efficiency against workers (all completed runs)")])
    for k in sorted(winner_runs):
        r = winner_runs[k]
        page.h3(f"{r.label}: its own plots ({os.path.relpath(r.path, sw.path)})")
        page.figures([(Later(rf.own_plots, r), "loss, test accuracy and phases")])

    page.h2("All trials")
    m = [w["winner_metric"]] if w.get("by_metric") is not None and w["winner_metric"] != "test_accuracy" else []
    page.table(["trial", "status", "workers", "batch", "lr", *others, "min loss", "loss area", *m, "test acc",
                "training s", "samples/s"],
               [[r["id"], status(r), r["config"]["workers"], r["config"]["batch_size"], fmt(r["config"]["lr"]),
                 *(r["config"].get(a) for a in others), fmt(r["summary"].get("min_loss")),
                 _area(r["status"], r["summary"]), *(fmt(r["summary"].get(k)) for k in m),
                 fmt(r["summary"].get("test_accuracy")),
                 fmt(r["summary"].get("wall_time_s"), ".2f"), rate(r["summary"].get("samples_per_s"))]
                for r in sw.rows], left=2)
    page.p(f"Sweep directory: {sw.path}. Written {time.strftime('%Y-%m-%d %H:%M:%S')}.", "note")
    return page, _drawn(page, figs)
