"""A sweep's results: DIR/results.jsonl (one line per finished trial), the winners by the paper's
rule and their table, and the pruning bounds. Read by the sweep and the study that write it
(sweep.py, study.py) and by the report (report/load.py)."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from shmlearn import jsonl, readback
from shmlearn.errors import BadInput, count

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


# --- winners --------------------------------------------------------------------------------

def _area_key(row: Dict[str, Any], index: int):
    s = row["summary"]
    return (s["loss_area"], s["min_loss"], s.get("wall_time_s") or math.inf, index)


def time_to_accuracy(row: Dict[str, Any], target: float) -> Optional[float]:
    """Training seconds at the first evaluation whose test accuracy reached `target`."""
    for t, acc in row.get("eval_curve") or []:
        if acc is not None and acc >= target:
            return t
    return None


def _entry(row: Dict[str, Any], swept: Sequence[str], target: Optional[float]) -> Dict[str, Any]:
    s, c = row["summary"], row["config"]
    e = {"id": row["id"], "workers": c["workers"], "batch_size": c["batch_size"], "lr": c["lr"],
         "loss_area": s.get("loss_area"), "min_loss": s.get("min_loss"), "final_loss": s.get("final_loss"),
         "test_accuracy": s.get("test_accuracy"), "wall_time_s": s.get("wall_time_s"),
         "samples_per_s": s.get("samples_per_s"), "run_dir": row.get("run_dir"),
         "axes": {a: c.get(a) for a in swept if a not in AXIS_ORDER}}
    if target is not None:
        e["time_to_target_s"] = time_to_accuracy(row, target)
    return e


def pick_winners(rows: List[Dict[str, Any]], *, threshold: float = 1.8, target_accuracy: Optional[float] = None,
                 swept: Sequence[str] = (), root: Optional[str] = None, metric: Optional[str] = None,
                 goal: Optional[str] = None) -> Dict[str, Any]:
    """Per worker count: the paper's rule (min loss <= threshold, then least loss area) and,
    with a target, the least time to reach it; with a metric (a summary.json key, --winner-metric),
    the best value of it (by_metric, metric_winners); and the overall best of each across worker
    counts. Diverged runs are results but never winners. Ties: see sweep.py's module docstring.
    With root (the sweep directory the rows' run_dir are relative to): also 'curves' (add_curves),
    what the report and advise draw once the trial folders are gone."""
    by_w: Dict[int, List[Tuple[int, Dict[str, Any]]]] = {}
    for i, r in enumerate(rows):
        by_w.setdefault(int(r["config"]["workers"]), []).append((i, r))
    out: Dict[str, Any] = {"threshold": threshold, "target_accuracy": target_accuracy,
                           "by_workers": {}, "overall": None, "by_target": None, "overall_by_target": None}
    best_area, best_time = [], []
    targets: Dict[str, Any] = {}
    for w in sorted(by_w):
        group = by_w[w]
        done = [(i, r) for i, r in group if r["status"] == "completed" and r["summary"].get("loss_area") is not None]
        diverged = sum(r["status"] == "diverged" for _, r in group)
        pruned = sum(r["status"] == "pruned" for _, r in group)
        survivors = [(i, r) for i, r in done if r["summary"].get("min_loss") is not None
                     and r["summary"]["min_loss"] <= threshold]
        info: Dict[str, Any] = {"trials": len(group), "completed": len(done), "diverged": diverged, "pruned": pruned,
                                "survivors": len(survivors), "winner": None, "reason": None}
        if survivors:
            i, r = min(survivors, key=lambda ir: _area_key(ir[1], ir[0]))
            info["winner"] = _entry(r, swept, target_accuracy)
            best_area.append((_area_key(r, i), info["winner"]))
        elif not done:
            info["reason"] = f"all {len(group)} diverged" if diverged == len(group) else "no completed run"
            # (pruning never leaves a worker count without a completed run: the bound comes from one)
        else:
            best = min(r["summary"]["min_loss"] for _, r in done)
            info["reason"] = f"no run reached min loss <= {threshold:g} (best {best:.4g})"
        out["by_workers"][str(w)] = info
        if target_accuracy is not None:
            reached = [(time_to_accuracy(r, target_accuracy), i, r) for i, r in group
                       if r["status"] == "completed"]
            reached = [(t, i, r) for t, i, r in reached if t is not None]
            if reached:
                t, i, r = min(reached, key=lambda x: (x[0], -(x[2]["summary"].get("test_accuracy") or 0),
                                                      _area_key(x[2], x[1])))
                targets[str(w)] = {"winner": _entry(r, swept, target_accuracy), "reason": None}
                best_time.append(((t, i), targets[str(w)]["winner"]))
            else:
                targets[str(w)] = {"winner": None, "reason": f"no completed run reached test accuracy "
                                                             f"{target_accuracy:g}"}
    if best_area:
        out["overall"] = min(best_area, key=lambda kv: kv[0][:3])[1]
    if target_accuracy is not None:
        out["by_target"] = targets
        out["overall_by_target"] = min(best_time, key=lambda kv: kv[0])[1] if best_time else None
    if metric is not None:
        out.update(metric_winners(rows, metric, goal or winner_goal(metric), swept))
    return out if root is None else add_curves(out, rows, root)


def winner_goal(metric: str) -> str:
    """--winner-goal's default: runs.metric_goal of the metric's name, read past a best_ prefix
    (best_test_f1 is best when largest, as test_f1 is)."""
    from shmlearn.runs import metric_goal  # lazy: runs.py imports config (torch); the report reads results without
    return metric_goal(metric[len("best_"):] if metric.startswith("best_") else metric)


def metric_value(row: Dict[str, Any], metric: str) -> Optional[float]:
    """The row's summary value of `metric` when it is a finite number (not a bool), else None."""
    v = row["summary"].get(metric)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def metric_winners(rows: List[Dict[str, Any]], metric: str, goal: str, swept: Sequence[str] = ()) -> Dict[str, Any]:
    """winners.json's metric verdict: per worker count the completed trial (not diverged, not
    pruned) with the least (goal 'min') or most ('max') value of summary.json's `metric`, and
    the overall best. Ties: the least loss area, then grid order (the row's index). Keys:
    winner_metric, winner_goal, by_metric {workers: {winner, reason}}, overall_by_metric, and
    metric_missing (one line naming the keys trials do report) when no completed trial reports it."""
    sign = 1.0 if goal == "min" else -1.0
    by_w: Dict[int, List[Tuple[tuple, Dict[str, Any]]]] = {}
    groups: Dict[int, int] = {}  # completed trials per worker count
    for i, r in enumerate(rows):
        w = int(r["config"]["workers"])
        groups[w] = groups.get(w, 0) + (r["status"] == "completed")
        v = metric_value(r, metric) if r["status"] == "completed" else None
        if v is not None:
            area = r["summary"].get("loss_area")
            by_w.setdefault(w, []).append(((sign * v, math.inf if area is None else area, i), r))
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
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(winners_text(w))
    os.replace(tmp, path)
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
    lines = [f"Winners: least loss area among runs with min loss <= {w['threshold']:g} (paper Table 5.1)",
             f"{'#Workers':>8}  {'Batch Size':>10}  {'Learn Rate':>10}  {'Loss area':>10}  {'Min loss':>8}  "
             f"{'Test acc':>8}  {'Train s':>8}  {'Survivors':>9}  {'Pruned':>6}  Other"]
    for k, info in w["by_workers"].items():
        e = info["winner"]
        surv = f"{info['survivors']}/{info['trials']}"
        surv = f"{surv:>9}  {info.get('pruned', 0):>6}"
        if e is None:
            lines.append(f"{k:>8}  {'-':>10}  {'-':>10}  {'-':>10}  {'-':>8}  {'-':>8}  {'-':>8}  {surv}  "
                         f"{info['reason']}")
            continue
        other = " ".join(f"{a}={v}" for a, v in e["axes"].items())
        lines.append(f"{k:>8}  {e['batch_size']:>10}  {e['lr']:>10g}  {fmt(e['loss_area'], '.4g'):>10}  "
                     f"{fmt(e['min_loss'], '.4f'):>8}  {fmt(e['test_accuracy'], '.4f'):>8}  "
                     f"{fmt(e['wall_time_s'], '.2f'):>8}  {surv}  {other}")
    o = w["overall"]
    lines.append("Overall best: " + ("none" if o is None else
                 f"{count(o['workers'], 'worker')}, batch {o['batch_size']}, lr {o['lr']:g} "
                 f"(loss area {o['loss_area']:.4g}, test accuracy {fmt(o['test_accuracy'], '.4f')})"))
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
                             f"{fmt(e['test_accuracy'], '.4f'):>9}")
        o = w["overall_by_target"]
        lines.append("Overall fastest to target: " + ("none" if o is None else
                     f"{count(o['workers'], 'worker')}, batch {o['batch_size']}, lr {o['lr']:g} "
                     f"({o['time_to_target_s']:.3f} s)"))
    if w.get("by_metric") is not None:
        lines += ["", metric_table(w)]
    return "\n".join(lines)


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


def best_bounds(rows: List[Dict[str, Any]], threshold: float,
                target: Optional[float]) -> Dict[int, Tuple[float, Optional[float]]]:
    """The pruning bounds (pruning.py) per worker count: the least area of a finished survivor
    (min loss <= threshold) and, with a target accuracy, the least time to reach it."""
    best: Dict[int, Tuple[float, Optional[float]]] = {}
    for row in rows:
        s = row["summary"]
        if row["status"] != "completed" or s.get("loss_area") is None:
            continue
        w = int(row["config"]["workers"])
        area, t = best.get(w, (math.inf, None))
        if s.get("min_loss") is not None and s["min_loss"] <= threshold:
            area = min(area, s["loss_area"])
        if target is not None:
            tt = time_to_accuracy(row, target)
            if tt is not None and (t is None or tt < t):
                t = tt
        best[w] = (area, t)
    return {w: v for w, v in best.items() if math.isfinite(v[0])}
