"""A sweep's results: DIR/results.jsonl (one line per finished trial), the winners by the paper's
rule and their table, and the pruning bounds. Read by the sweep and the study that write it
(sweep.py, study.py) and by the report (report/load.py)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from shmlearn.errors import BadInput, count
from shmlearn.record import jsonl, readback, safe_write
from shmlearn.sweeps import winners
from shmlearn.sweeps.winners import metric_value

AXIS_ORDER = ("workers", "batch_size", "lr")
"""Grid order, outermost first: trials of one worker count run together and pack the slots."""


# --- results.jsonl --------------------------------------------------------------------------

class ResultStore:
    """DIR/results.jsonl: one JSON object per finished trial, only ever appended.

    A line cut off by a kill (no newline, not valid JSON) is moved to results.jsonl.torn and its
    trial runs again; a bad line anywhere else is the user's to fix: BadInput, file untouched."""

    def __init__(self, path: str):
        self.path = path
        self.notes: List[str] = []

    def load(self, *, repair: bool = True) -> List[Dict[str, Any]]:
        if not os.path.lexists(self.path):
            return []
        data = readback.read_bytes(self.path)  # a directory, a FIFO: one line naming it
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        rows, ids = [], set()
        for i, line in enumerate(lines, 1):
            if line.strip():
                rows.append(self._parse(line, i))
        if tail.strip():
            try:
                rows.append(self._parse(tail, len(lines) + 1))
                whole = True  # complete but unterminated: ended so the next append starts a line
            except BadInput:
                whole = False
                self.notes.append(f"{self.path}: the last line ({len(tail)} bytes) was cut off by an "
                                  f"interrupted write; " + ("moved it to results.jsonl.torn, its trial "
                                                            "runs again" if repair else "ignored"))
            if repair:
                jsonl.mend_tail(self.path, len(data) - len(tail), tail, whole)
        unique = []
        for r in rows:
            if r["id"] in ids:
                self.notes.append(f"{self.path}: trial {r['id']} appears twice; the first line counts")
                continue
            ids.add(r["id"])
            unique.append(r)
        return unique

    def _parse(self, line: bytes, lineno: int) -> Dict[str, Any]:
        """One row, checked as every reader of it needs it (readback.result_row)."""
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadInput(f"{self.path} line {lineno}: not valid JSON ({e}); fix or remove that line") from None
        return readback.result_row(row, f"{self.path} line {lineno} (a sweep result; fix or remove the line)")

    def append(self, row: Dict[str, Any]) -> None:
        # One write of one line, then fsync: a kill leaves the line whole or (rarely) cut off; a
        # full disk leaves the file as it was.
        jsonl.append_or_cut_back(self.path, (json.dumps(row) + "\n").encode())


# --- winners (the rule and its uncertainty: winners.py) -----------------------------------------

def _entry(row: Dict[str, Any], swept: Sequence[str], target: Optional[float]) -> Dict[str, Any]:
    return winners.entry(winners.Point([(0, row)], "wall"), swept, AXIS_ORDER, target)


def pick_winners(rows: List[Dict[str, Any]], *, threshold: float = 1.8, target_accuracy: Optional[float] = None,
                 swept: Sequence[str] = (), root: Optional[str] = None, metric: Optional[str] = None,
                 goal: Optional[str] = None, time_axis: str = "wall",
                 target_share: Optional[float] = None) -> Dict[str, Any]:
    """Per worker count: the paper's rule (winners.py: survivors, not collapsed, least loss area on
    `time_axis`; a grid point's --repeats merged on their median), its runner-up and the margin
    ('tied within noise' when the areas' noise intervals overlap) and, with a target accuracy (or
    target_share: that share of the best surviving accuracy), the least time to reach it; with a
    metric (a summary.json key, --winner-metric), the best value of it (metric_winners); and the
    overall best of each across worker counts, with each worker count's accuracy, the best trial
    and the worker counts whose winner lags it ('lagging'). Diverged and collapsed runs are results
    but never winners. Ties: see sweep.py's module docstring. With root (the sweep directory the
    rows' run_dir are relative to): also 'curves' (add_curves), what the report and advise draw
    once the trial folders are gone."""
    if time_axis not in winners.TIME_AXES:
        raise BadInput(f"--time-axis {time_axis}: expected one of {', '.join(winners.TIME_AXES)}")
    best = winners.best_accuracy(rows, threshold)
    if target_accuracy is None and target_share is not None and best is not None:
        target_accuracy = round(target_share * best["test_accuracy"], 4)
    pts = winners.points(rows, time_axis)
    by_w: Dict[int, List[winners.Point]] = {}
    for p in pts:
        by_w.setdefault(int(p.row["config"]["workers"]), []).append(p)
    out: Dict[str, Any] = {"threshold": threshold, "target_accuracy": target_accuracy, "target_share": target_share,
                           "time_axis": time_axis, "repeats": max((p.repeats for p in pts), default=1),
                           "by_workers": {}, "overall": None, "overall_runner_up": None, "overall_margin": None,
                           "best_trial": best, "lagging": [], "by_target": None, "overall_by_target": None}
    firsts, fastest = [], []
    targets: Dict[str, Any] = {}
    for w in sorted(by_w):
        group = by_w[w]
        runs = [r for p in group for r in p.rows]
        done = [p for p in group if p.row["status"] == "completed" and p.area is not None]
        diverged = sum(r["status"] == "diverged" for r in runs)
        pruned = sum(r["status"] == "pruned" for r in runs)
        fell = sum(winners.status(r) == "collapsed" for r in runs)
        survivors = winners.ranked(done, threshold)
        info: Dict[str, Any] = {"trials": len(runs), "points": len(group),
                                "completed": sum(r["status"] == "completed" for r in runs),
                                "diverged": diverged, "pruned": pruned, "collapsed": fell,
                                "survivors": len(survivors), "reason": None,
                                **winners.ranked_verdict([(winners.entry(p, swept, AXIS_ORDER, target_accuracy),
                                                          p.area, p.noise) for p in survivors])}
        if survivors:
            firsts.append((winners.overall_key(survivors[0]), info["winner"], survivors[0].noise))
        elif not done:
            info["reason"] = f"all {len(runs)} diverged" if diverged == len(runs) else "no completed run"
            # (pruning never leaves a worker count without a completed run: the bound comes from one)
        elif any(p.row["summary"]["min_loss"] <= threshold for p in done):
            info["reason"] = (f"every run that reached min loss <= {threshold:g} collapsed" if fell else
                              f"every point that reached min loss <= {threshold:g} had a repeat that did not")
        else:
            low = min(p.row["summary"]["min_loss"] for p in done)
            info["reason"] = f"no run reached min loss <= {threshold:g} (best {low:.4g})"
        out["by_workers"][str(w)] = info
        if target_accuracy is not None:
            reached = winners.by_target(done, target_accuracy, time_axis)
            targets[str(w)] = {"reason": None, **winners.ranked_verdict(
                [(winners.entry(p, swept, AXIS_ORDER, target_accuracy), t, p.step_noise)
                 for t, p in reached])}
            if reached:
                fastest.append(((reached[0][0], reached[0][1].index), targets[str(w)]["winner"], reached[0][1]))
            else:
                targets[str(w)]["reason"] = f"no completed run reached test accuracy {target_accuracy:g}"
    firsts.sort(key=lambda kv: kv[0])
    if firsts:
        v = winners.ranked_verdict([(e, k[0], n) for k, e, n in firsts])
        out["overall"], out["overall_runner_up"], out["overall_margin"] = v["winner"], v["runner_up"], v["margin"]
    out["lagging"] = winners.lagging(out["by_workers"], best)
    out["collapsed"] = [{"id": r["id"], "why": winners.collapsed(r["summary"])} for r in rows
                        if winners.status(r) == "collapsed"]
    if target_accuracy is not None:
        out["by_target"] = targets
        out["overall_by_target"] = min(fastest, key=lambda kv: kv[0])[1] if fastest else None
    if metric is not None:
        out.update(metric_winners(rows, metric, goal or winner_goal(metric), swept))
    return out if root is None else add_curves(out, rows, root)


def winner_goal(metric: str) -> str:
    """--winner-goal's default: runs.metric_goal of the metric's name, read past a best_ prefix
    (best_test_f1 is best when largest, as test_f1 is)."""
    from shmlearn.record.runs import metric_goal  # lazy: runs.py imports config (torch); the report reads results without
    return metric_goal(metric[len("best_"):] if metric.startswith("best_") else metric)


def metric_winners(rows: List[Dict[str, Any]], metric: str, goal: str, swept: Sequence[str] = ()) -> Dict[str, Any]:
    """winners.json's metric verdict: per worker count the completed trial (not diverged, not
    pruned) with the least (goal 'min') or most ('max') value of summary.json's `metric`, and
    the overall best. Ties: the least loss area, then grid order (the row's index). Keys:
    winner_metric, winner_goal, by_metric {workers: {winner, reason}}, overall_by_metric, and
    metric_missing (one line naming the keys trials do report) when no completed trial reports it."""
    by_w: Dict[int, List[Tuple[tuple, Dict[str, Any]]]] = {}
    groups: Dict[int, int] = {}  # completed trials per worker count
    for i, r in enumerate(rows):
        w = int(r["config"]["workers"])
        groups[w] = groups.get(w, 0) + (r["status"] == "completed")
        v = winners.metric_score(r, metric)
        if v is not None:
            by_w.setdefault(w, []).append((winners.metric_key(v, goal, r, i), r))
    by_metric: Dict[str, Any] = {}
    best = []
    for w in sorted(groups):
        if w in by_w:
            key, r = min(by_w[w], key=lambda kr: kr[0])
            e = {**_entry(r, swept, None), "metric_value": metric_value(r, metric)}
            by_metric[str(w)] = {"winner": e, "reason": None}
            best.append((key, e))
        else:
            by_metric[str(w)] = {"winner": None, "reason": f"no completed run reports {metric}" if groups[w]
                                 else "no completed run"}
    out = {"winner_metric": metric, "winner_goal": goal, "by_metric": by_metric,
           "overall_by_metric": min(best, key=lambda kv: kv[0])[1] if best else None, "metric_missing": None}
    done = [r for r in rows if r["status"] == "completed"]
    if done and not best:
        out["metric_missing"] = metric_missing(done, metric)
    return out


def metric_missing(done: List[Dict[str, Any]], metric: str) -> str:
    """One line: no completed trial reports `metric`; the numbers they do report, evaluation's first."""
    keys = set().union(*({k for k in r["summary"] if metric_value(r, k) is not None} for r in done))
    first = sorted(k for k in keys if k.startswith(("val_", "test_", "best_")))
    rest = sorted(k for k in keys if k in ("loss_area", "min_loss", "final_loss", "samples_per_s", "wall_time_s"))
    return (f"--winner-metric {metric}: no completed trial reports it in summary.json; they report "
            f"{', '.join(first + rest) or 'no number'}" + (" (and the other numbers of summary.json)"
                                                           if len(keys) > len(first) + len(rest) else ""))


# --- the curves a report and advise draw, kept in winners.json --------------------------------

CURVE_POINTS = 400
"""A winner's loss curve is kept at most this many points (first, last and minimum always): the
report's lines look the same and winners.json stays small, so the trial folders need not be kept."""


def _thin(points: List[list], n: int = CURVE_POINTS) -> List[list]:
    """At most n (+2) points, evenly spaced by index, keeping the first, last and the least loss."""
    if len(points) <= n:
        return points
    keep = {round(i * (len(points) - 1) / (n - 1)) for i in range(n)}
    keep.add(min(range(len(points)), key=lambda i: points[i][2]))
    return [points[i] for i in sorted(keep)]


def trial_curves(run_dir: str, *, winner: bool) -> Dict[str, List[list]]:
    """From a run directory: 'noise' [[step, time_s, loss, b_simple]] where --noise-scale logged
    (advise reads every trial's, unthinned: it smooths consecutive rows); for a winner also 'loss'
    [[step, time_s, loss]] (thinned) and 'eval' [[time_s, test_accuracy, test_loss]]."""
    metrics = readback.run_metrics(run_dir, missing_ok=True)
    out: Dict[str, List[list]] = {}
    noise = [[m["step"], m["time_s"], m["loss"], m["noise_scale"]["b_simple"]] for m in metrics
             if (m.get("noise_scale") or {}).get("b_simple") is not None]
    if noise:
        out["noise"] = noise
    if winner:
        out["loss"] = _thin([[m["step"], m["time_s"], m["loss"]] for m in metrics])
        out["eval"] = [[e["time_s"], e.get("test_accuracy"), e.get("test_loss")]
                       for e in readback.run_evals(run_dir)]
    return out


def winner_ids(w: Dict[str, Any]) -> List[str]:
    """The ids of every winner in a winners dict (per worker count, and per target if any)."""
    ids = [i["winner"]["id"] for i in w["by_workers"].values() if i["winner"]]
    ids += [i["winner"]["id"] for i in (w.get("by_target") or {}).values() if i["winner"]]
    ids += [i["winner"]["id"] for i in (w.get("by_metric") or {}).values() if i["winner"]]
    return list(dict.fromkeys(ids))


def add_curves(w: Dict[str, Any], rows: List[Dict[str, Any]], root: str) -> Dict[str, Any]:
    """w with 'curves' {trial id: trial_curves} read from each finished trial's folder under root
    (a sweep directory); trials whose folder is gone are left out."""
    wins = set(winner_ids(w))
    curves = {}
    for r in rows:
        d = os.path.join(root, r.get("run_dir") or "")
        if r.get("run_dir") and os.path.isfile(os.path.join(d, "metrics.jsonl")):
            c = trial_curves(d, winner=r["id"] in wins)
            if c:
                curves[r["id"]] = c
    return {**w, "curves": curves}


def keep_curves(sweep_dir: str, *, source: Optional[str] = None) -> Dict[str, Any]:
    """Add 'curves' to an existing DIR/winners.json from the trial folders (every other key kept
    as it is), so that the folders can be deleted: for sweeps written before winners.json kept
    them (and while sweep.py's pick_winners call does not pass root). source: the sweep directory
    whose results.jsonl and trial folders to read, if not sweep_dir (a slimmed copy's original).
    Returns the new winners."""
    path = os.path.join(sweep_dir, "winners.json")
    w = readback.need(readback.read_json(path), {"by_workers": dict}, path)
    kept = w.pop("curves", None) or {}
    src = source or sweep_dir
    w = add_curves(w, ResultStore(os.path.join(src, "results.jsonl")).load(repair=False), src)
    w["curves"] = {**kept, **w["curves"]}  # a trial whose folder is already gone keeps its curves
    safe_write.write(path, winners_text(w), root=sweep_dir)
    return w


def winners_text(w: Dict[str, Any]) -> str:
    """winners.json's text: indented as sweep.py writes it (runs.write_json_atomic), but each
    trial's curves on one line, not one number per line (5x smaller, a readable diff)."""
    text = json.dumps({k: v for k, v in w.items() if k != "curves"}, indent=2)
    if "curves" not in w:
        return text
    lines = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in w["curves"].items())
    return text[:-2] + ',\n  "curves": {\n' + lines + "\n  }\n}\n"

def fmt(v, spec: str) -> str:
    """v formatted by spec, or '-' for None (a number a run did not report)."""
    return "-" if v is None else format(v, spec)


def winners_table(w: Dict[str, Any]) -> str:
    """The winners as the paper's Table 5.1 (#Workers, Batch Size, Learn Rate), with the
    numbers that chose them."""
    axis = w.get("time_axis", "wall")
    lines = [f"Winners: least loss area ({winners.axis_name(axis)}) among runs with min loss <= {w['threshold']:g} "
             f"that did not collapse (paper Table 5.1)",
             f"{'#Workers':>8}  {'Batch Size':>10}  {'Learn Rate':>10}  {'Loss area':>10}  {'Min loss':>8}  "
             f"{'Test acc':>8}  {'Train s':>8}  {'Survivors':>9}  {'Pruned':>6}  Other"]
    for k, info in w["by_workers"].items():
        e = info["winner"]
        surv = f"{info['survivors']}/{info.get('points', info['trials'])}"  # grid points (repeats merged)
        surv = f"{surv:>9}  {info.get('pruned', 0):>6}"
        if e is None:
            lines.append(f"{k:>8}  {'-':>10}  {'-':>10}  {'-':>10}  {'-':>8}  {'-':>8}  {'-':>8}  {surv}  "
                         f"{info['reason']}")
            continue
        other = " ".join(f"{a}={v}" for a, v in e["axes"].items())
        lines.append(f"{k:>8}  {e['batch_size']:>10}  {e['lr']:>10g}  {fmt(e.get('area', e['loss_area']), '.4g'):>10}  "
                     f"{fmt(e['min_loss'], '.4f'):>8}  {fmt(e['test_accuracy'], '.4f'):>8}  "
                     f"{fmt(e['wall_time_s'], '.2f'):>8}  {surv}  {other}")
    lines += winners.verdict_lines(w) if "overall_margin" in w else [old_overall_line(w)]
    if w.get("by_target") is not None:
        a = w["target_accuracy"]
        lines += ["", f"Winners: least training time to test accuracy {a:g}",
                  f"{'#Workers':>8}  {'Batch Size':>10}  {'Learn Rate':>10}  {'Time to ' + format(a, 'g') + ' (s)':>16}  "
                  f"{'Final acc':>9}"]
        for k, info in w["by_target"].items():
            e = info["winner"]
            if e is None:
                lines.append(f"{k:>8}  {'-':>10}  {'-':>10}  {'-':>16}  {'-':>9}  {info['reason']}")
            else:
                lines.append(f"{k:>8}  {e['batch_size']:>10}  {e['lr']:>10g}  {e['time_to_target_s']:>16.3f}  "
                             f"{fmt(e['test_accuracy'], '.4f'):>9}  " + winners.margin_text(
                                 info.get("margin"), info.get("runner_up"),
                                 winners.point_name(info["runner_up"]) if info.get("runner_up") else "", "s"))
        o = w["overall_by_target"]
        lines.append("Overall fastest to target: " + ("none" if o is None else
                     f"{count(o['workers'], 'worker')}, batch {o['batch_size']}, lr {o['lr']:g} "
                     f"({o['time_to_target_s']:.3f} s)"))
    if w.get("by_metric") is not None:
        lines += ["", metric_table(w)]
    return "\n".join(lines)


def old_overall_line(w: Dict[str, Any]) -> str:
    """The overall line of a winners.json written before verdicts had margins."""
    o = w["overall"]
    return "Overall best: " + ("none" if o is None else
                               f"{count(o['workers'], 'worker')}, batch {o['batch_size']}, lr {o['lr']:g} "
                               f"(loss area {o['loss_area']:.4g}, test accuracy {fmt(o['test_accuracy'], '.4f')})")


def metric_title(w: Dict[str, Any]) -> str:
    """'least val_loss' or 'most test_accuracy': the metric verdict's name."""
    return f"{'least' if w['winner_goal'] == 'min' else 'most'} {w['winner_metric']}"


def metric_table(w: Dict[str, Any]) -> str:
    """The metric verdict (--winner-metric) as its own table, after the paper's."""
    m = w["winner_metric"]
    col = max(10, len(m))
    lines = [f"Winners: {metric_title(w)} (--winner-metric)",
             f"{'#Workers':>8}  {'Batch Size':>10}  {'Learn Rate':>10}  {m:>{col}}  {'Loss area':>10}  Other"]
    for k, info in w["by_metric"].items():
        e = info["winner"]
        if e is None:
            lines.append(f"{k:>8}  {'-':>10}  {'-':>10}  {'-':>{col}}  {'-':>10}  {info['reason']}")
            continue
        other = " ".join(f"{a}={v}" for a, v in e["axes"].items())
        lines.append(f"{k:>8}  {e['batch_size']:>10}  {e['lr']:>10g}  {e['metric_value']:>{col}.6g}  "
                     f"{fmt(e['loss_area'], '.4g'):>10}  {other}")
    o = w["overall_by_metric"]
    lines.append(f"Overall {metric_title(w)}: " + ("none" if o is None else
                 f"{count(o['workers'], 'worker')}, batch {o['batch_size']}, lr {o['lr']:g} "
                 f"({m} {o['metric_value']:.6g})"))
    return "\n".join(lines)
