"""The one owner of the winner rule (paper §5, seed 000) and of how sure its verdicts are.

    rows (results.jsonl) -> points (a grid point's repeats merged, on the median area)
      -> survivors: completed, min loss <= threshold, not collapsed
      -> per worker count: winner = least area, runner-up, margin, "tied within noise"?
      -> overall: the best worker count's winner, each worker count's accuracy, why one lags

results.py (the verdicts and their table), pruning.py (the bound a running trial is held to),
study/sweep.py and study/search.py (the study's objective, constraint and pruner), sweep.py,
trials.py and the report all ask here; nothing else states the rule or its order.

* **The orders** (`ranked`, `overall_key`, `by_target`, `metric_key`): within a worker count, least
  area, then lower min loss, shorter training, grid order; across worker counts the same without
  grid order (earlier worker counts first on a full tie); to a target accuracy, least time, then
  higher final accuracy, then the area order; by --winner-metric, its best value, then least area,
  then grid order.
* **Pruning** (`prune_bound`, `cannot_win`): a trial is stopped only when it can no longer win any
  ranking the sweep reports (pruning.py has the argument).

* **Collapsed** (issue 55): a completed run whose final loss came back to within 10% of its
  starting loss after reaching half of it or less (a late blow-up without NaN: lr too high), or
  whose final test accuracy is at chance (within 0.02 of 1/classes). It is a result, never a
  survivor: the winner rule, the pruning bound and the study's constraint skip it.
* **Time axis** (`--time-axis`): `wall`, the paper's, integrates the loss over training seconds
  as the clock measured them; `steps` integrates it over the step index (summary.json
  loss_area_steps) and multiplies by a **step price** that another job on the machine does not
  move. Each trial's price is **pooled** over the trials whose step costs the same (`cost_key`:
  every setting but those that only change the numbers a step computes, lr and seed among them),
  so two learning rates at one batch size compare by their loss per step alone.
  On the CPU (every run recorded its CPU clocks: `price_clock`) the price is CPU time, which a
  job beside does not add to: the median over the cost's runs of the training thread's p10 CPU
  seconds per step (its compute), plus the median over the runs that sync the same gradients
  (`sync_key`: the cost without the batch size) of what the process's other threads (Gloo's)
  add per step. The sync part is pooled that widely because it is the noisy one: a 2-worker
  step's CPU time moved by +-25% between runs of one setting, quiet or loaded, with how often
  the ranks waited on each other, while the training thread's moved by a few per cent between
  the trials of one sweep; pooled, the price ratio of batch 32 to 64 at 2 workers stayed
  0.93-1.00 over 10 sweeps of the README's digits grid (quiet, and beside one or two 2-process
  jobs), against 0.82-1.18 for the wall-clock p10 (results/sweep-digits/NOTES.md).
  Elsewhere (a GPU's work is not the host's CPU time; results from before the CPU clocks) the
  price is the median of the runs' 10th-percentile wall step times. The wall axis keeps each
  run's own clock.
* **Noise**: each area carries a relative half-width, half the interquartile spread over the
  median of the run's step clock (wall seconds; the training thread's CPU seconds on a steps
  axis priced by CPU time): how far the machine moved a step. On the steps axis two points of
  one step cost share their price, so only their repeats' spread is noise between them
  (`margin`'s same_cost). With `--repeats N`
  (the same grid point trained N times, seeds seed..seed+N-1) the area is the median of the
  repeats and the half-width is at least half their range over the median. Two areas are **tied
  within noise** when their intervals area x (1 +- half-width) overlap.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

TIME_AXES = ("wall", "steps")
COST_FREE = ("lr", "seed", "lr_schedule", "warmup", "warmup_fraction", "label_smoothing", "staleness_lr", "init",
             "samples", "epochs", "eval_every", "eval_points", "eval_at_start", "log_every", "timeout",
             "checkpoint_every", "save_model", "monitor", "early_stop", "save_best", "tensorboard")
"""Settings that change what a step computes but not what it costs (`cost_key`): the values of
the learning rate and its schedule, the seed, and when the run evaluates, logs or saves (outside
the steps the step time measures). Momentum and weight decay stay in the key: zero or not changes
the update's work."""
COLLAPSE_RETURN = 0.9
"""Collapsed: the final loss is at least this share of the starting loss (within 10% of it) ..."""
COLLAPSE_DROP = 0.5
"""... after the minimum loss reached this share of the starting loss or less (far below it)."""
CHANCE_MARGIN = 0.02
"""Collapsed: the final test accuracy is at most chance + this (chance: summary chance_accuracy)."""
FAR_BELOW_BEST = 0.05
"""The overall verdict explains a worker count whose winner's test accuracy is this far (absolute)
or more below the best trial's."""
PRUNE_SLACK = 1e-9
"""Relative margin of `cannot_win`: an area equal to the bound (to rounding) is not pruned; a tie
might win."""
TARGET_SHARE = 0.9
"""Experiments' default time-to-accuracy target: this share of the best test accuracy any
surviving trial reached (rounded to 4 digits; `--target-accuracy` fixes it instead)."""


# --- one run ----------------------------------------------------------------------------------

def _num(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def collapsed(summary: Dict[str, Any]) -> Optional[str]:
    """Why a completed run collapsed (module docstring), or None."""
    start, final, low = (_num(summary.get(k)) for k in ("start_loss", "final_loss", "min_loss"))
    if start is not None and final is not None and low is not None and start > 0 \
            and low <= COLLAPSE_DROP * start and final >= COLLAPSE_RETURN * start:
        return f"loss back to {final:.3g} after {low:.3g} (start {start:.3g})"
    chance, acc = _num(summary.get("chance_accuracy")), _num(summary.get("test_accuracy"))
    if chance is not None and acc is not None and acc <= chance + CHANCE_MARGIN:
        return f"test accuracy {acc:.3g} at chance ({chance:.3g})"
    return None


def status(row: Dict[str, Any]) -> str:
    """The row's status as verdicts show it: 'collapsed' for a completed run that collapsed."""
    if row["status"] == "completed" and collapsed(row["summary"]):
        return "collapsed"
    return row["status"]


def survivor(row: Dict[str, Any], threshold: float) -> bool:
    """The paper's filter: completed with a loss area, minimum loss <= threshold; and not collapsed."""
    s = row["summary"]
    return (row["status"] == "completed" and s.get("loss_area") is not None and s.get("min_loss") is not None
            and s["min_loss"] <= threshold and collapsed(s) is None)


def constraint(row: Dict[str, Any], threshold: float) -> float:
    """The study's constraint (TPE: feasible when <= 0): min loss - threshold for a completed run
    that did not collapse, else inf."""
    s = row["summary"]
    if row["status"] != "completed" or s.get("min_loss") is None or collapsed(s):
        return math.inf
    return s["min_loss"] - threshold


def step_time(summary: Dict[str, Any]) -> Optional[float]:
    """A run's own wall seconds per step: summary step_time_s p10 (its median where a run kept no p10)."""
    st = summary.get("step_time_s") or {}
    return st.get("p10", st.get("median"))


def cpu_parts(summary: Dict[str, Any]) -> Optional[Tuple[float, float]]:
    """(compute, sync) CPU seconds of a step of a run on the CPU: the training thread's p10
    (step_thread_cpu_s) and the median of what the process's other threads add (step_cpu_s
    median - step_thread_cpu_s median, at least 0: Gloo's threads, what the sync costs); None for
    a run on another device (a GPU's work is not the host's CPU time) or from before they were kept."""
    if summary.get("device") != "cpu":
        return None
    proc, main = summary.get("step_cpu_s") or {}, summary.get("step_thread_cpu_s") or {}
    if proc.get("median") is None or main.get("p10") is None or main.get("median") is None:
        return None
    return main["p10"], max(0.0, proc["median"] - main["median"])


def clock_scale(summary: Dict[str, Any], axis: str, step_s: Optional[float] = None) -> Optional[float]:
    """Seconds on `axis` per wall-clock training second: 1 on wall; the step price (`step_s`, the
    pooled one; else the run's own run_price) x steps / wall time on steps (None where the run
    predates step times)."""
    if axis == "wall":
        return 1.0
    st = step_s if step_s is not None else run_price(summary)
    steps, wall = summary.get("steps"), summary.get("wall_time_s")
    if st is None or not steps or not wall:
        return None
    return st * steps / wall


def _key(config: Dict[str, Any], free: Sequence[str]) -> str:
    import hashlib
    import json
    text = json.dumps({k: v for k, v in config.items() if k not in free}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cost_key(config: Dict[str, Any]) -> str:
    """What a trial's step costs depends on: its config without COST_FREE (12 hex digits of its
    JSON's hash; winners.json records it as each entry's step_cost)."""
    return _key(config, COST_FREE)


def sync_key(config: Dict[str, Any]) -> str:
    """What a trial's sync costs depends on: its cost_key's settings without the batch size (the
    gradients synced are the same at any batch), where its ranks run one thread each (the
    sweep's CPU default): with intra-op threads, the process's other threads compute too, so
    the cost_key itself."""
    return _key(config, COST_FREE + (("batch_size",) if config.get("threads") == 1 else ()))


def _median(v: List[float]) -> float:
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def price_clock(rows: List[Dict[str, Any]]) -> str:
    """'cpu' where every completed run has cpu_parts (runs on the CPU, recorded with them), else
    'wall' (a GPU sweep, or one resumed from results written before they were kept)."""
    done = [r for r in rows if r.get("status") == "completed"]
    return "cpu" if done and all(cpu_parts(r.get("summary") or {}) for r in done) else "wall"


def pooled_step_times(rows: List[Dict[str, Any]]) -> Dict[str, float]:
    """cost_key -> the step price of the completed runs of that cost (module docstring). On the
    CPU (price_clock): the median compute part of the runs of that cost plus the median sync part
    of the runs of its sync_key (cpu_parts); elsewhere the median of their p10 step times."""
    done = [r for r in rows if r.get("status") == "completed"]
    if price_clock(rows) == "cpu":
        compute: Dict[str, List[float]] = {}
        sync: Dict[str, List[float]] = {}
        sync_of = {}
        for r in done:
            c, s = cpu_parts(r["summary"])
            k = cost_key(r["config"])
            compute.setdefault(k, []).append(c)
            sync_of[k] = sync_key(r["config"])
            sync.setdefault(sync_of[k], []).append(s)
        return {k: _median(v) + _median(sync[sync_of[k]]) for k, v in compute.items()}
    times: Dict[str, List[float]] = {}
    for r in done:
        st = step_time(r.get("summary") or {})
        if st is not None:
            times.setdefault(cost_key(r["config"]), []).append(st)
    return {k: _median(v) for k, v in times.items()}


def run_price(summary: Dict[str, Any]) -> Optional[float]:
    """A run's own step price, unpooled: its cpu_parts' sum on the CPU, else its p10 step time."""
    parts = cpu_parts(summary)
    return sum(parts) if parts else step_time(summary)


def area(summary: Dict[str, Any], axis: str = "wall", step_s: Optional[float] = None) -> Optional[float]:
    """The loss area on `axis`: wall, summary loss_area (loss x s); steps, loss_area_steps x the
    step price (loss x s): `step_s` (the pooled one: pooled_step_times), else the run's own
    (run_price). A run from before step times were kept: its wall area."""
    if axis == "steps":
        st, a = (step_s if step_s is not None else run_price(summary)), summary.get("loss_area_steps")
        if a is not None and st is not None and summary.get("loss_area") is not None:
            return a * st
    return summary.get("loss_area")


def step_noise(summary: Dict[str, Any], axis: str = "wall", clock: str = "wall") -> Optional[float]:
    """The area's relative half-width from the run's own step times (module docstring): half the
    interquartile spread over the median of the clock that prices it (wall seconds; on the steps
    axis priced by CPU time, the training thread's CPU seconds); None where they were not kept."""
    key = "step_thread_cpu_s" if axis == "steps" and clock == "cpu" else "step_time_s"
    st = summary.get(key) or {}
    med, q1, q3 = st.get("median"), st.get("p25"), st.get("p75")
    if not med or q1 is None or q3 is None:
        return None
    return (q3 - q1) / med / 2


def time_to_accuracy(row: Dict[str, Any], target: float, axis: str = "wall",
                     step_s: Optional[float] = None) -> Optional[float]:
    """Training seconds (on `axis`; `step_s` as clock_scale's) at the first evaluation whose test
    accuracy reached `target`."""
    scale = clock_scale(row["summary"], axis, step_s) or 1.0
    for t, acc in row.get("eval_curve") or []:
        if acc is not None and acc >= target:
            return t * scale
    return None


# --- grid points (repeats merged) ----------------------------------------------------------------

class Point:
    """One grid point: its repeats' rows (one row without --repeats), in grid order."""

    def __init__(self, rows: List[Tuple[int, Dict[str, Any]]], axis: str, pooled: Optional[Dict[str, float]] = None,
                 clock: str = "wall"):
        self.index = rows[0][0]
        self.rows = [r for _, r in rows]
        self.axis = axis
        self.clock = clock
        """What prices its steps on the steps axis: 'cpu' or 'wall' (price_clock)."""
        self.cost = cost_key(self.rows[0]["config"]) if axis == "steps" else None
        """The step cost this point shares with others (steps axis; None on wall)."""
        self.step_s = (pooled or {}).get(self.cost) if self.cost is not None else None
        """The pooled step price of its steps (None: each run's own)."""
        done = sorted((area(r["summary"], axis, self.step_s), i) for i, r in enumerate(self.rows)
                      if r["status"] == "completed" and area(r["summary"], axis, self.step_s) is not None)
        self.areas = [a for a, _ in done]
        # The repeat with the median area stands for the point (its accuracy, its curves).
        self.row = self.rows[done[(len(done) - 1) // 2][1]] if done else self.rows[0]

    @property
    def repeats(self) -> int:
        return len(self.rows)

    @property
    def area(self) -> Optional[float]:
        a = self.areas
        if not a or len(a) < self.repeats:
            return area(self.row["summary"], self.axis, self.step_s) if len(self.rows) == 1 else None
        n = len(a)
        return a[n // 2] if n % 2 else (a[n // 2 - 1] + a[n // 2]) / 2

    @property
    def repeat_spread(self) -> Optional[float]:
        """Half the range of the repeats' areas over their median; None without repeats."""
        if len(self.areas) < 2 or not self.area:
            return None
        return (self.areas[-1] - self.areas[0]) / 2 / self.area

    @property
    def step_noise(self) -> Optional[float]:
        """Its representative run's step_noise on its axis and clock."""
        return step_noise(self.row["summary"], self.axis, self.clock)

    @property
    def noise(self) -> Optional[float]:
        parts = [x for x in (self.step_noise, self.repeat_spread) if x is not None]
        return max(parts) if parts else None

    def survives(self, threshold: float) -> bool:
        """Every repeat survives (one that collapsed or diverged makes the point unreliable)."""
        return all(survivor(r, threshold) for r in self.rows)

    @property
    def collapsed(self) -> Optional[str]:
        why = [collapsed(r["summary"]) for r in self.rows if r["status"] == "completed"]
        why = [w for w in why if w]
        if not why:
            return None
        return why[0] + (f" (in {len(why)} of {self.repeats} repeats)" if self.repeats > 1 else "")

    def key(self) -> tuple:
        """The rule's order: least area; ties: lower min loss, shorter training, grid order."""
        s = self.row["summary"]
        return (self.area, s["min_loss"], s.get("wall_time_s") or math.inf, self.index)


def points(rows: List[Dict[str, Any]], axis: str = "wall") -> List[Point]:
    """The rows as grid points in grid order; a row's point is its 'point' (trials.py writes it for
    --repeats) or its own id."""
    groups: Dict[str, List[Tuple[int, Dict[str, Any]]]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r.get("point") or r["id"], []).append((i, r))
    pooled = pooled_step_times(rows) if axis == "steps" else None
    clock = price_clock(rows) if axis == "steps" else "wall"
    return [Point(g, axis, pooled, clock) for g in groups.values()]


# --- the orders ---------------------------------------------------------------------------------

def ranked(done: List[Point], threshold: float) -> List[Point]:
    """The paper's rule within one worker count: of its completed points, those that survive, best
    first (Point.key)."""
    return sorted((p for p in done if p.survives(threshold)), key=Point.key)


def overall_key(p: Point) -> tuple:
    """A worker count's winner's place among the others': its Point.key without the grid index
    (a full tie keeps worker-count order)."""
    return p.key()[:3]


def by_target(done: List[Point], target: float, axis: str) -> List[Tuple[float, Point]]:
    """(time to `target` test accuracy on `axis`, point) of the points that reached it and did not
    collapse, fastest first; ties: the higher final test accuracy, then Point.key."""
    reached = [(time_to_accuracy(p.row, target, axis, p.step_s), p) for p in done if not p.collapsed]
    return sorted(((t, p) for t, p in reached if t is not None),
                  key=lambda tp: (tp[0], -(tp[1].row["summary"].get("test_accuracy") or 0), tp[1].key()))


def metric_value(row: Dict[str, Any], metric: str) -> Optional[float]:
    """The row's summary value of `metric` when it is a finite number (not a bool), else None."""
    v = row["summary"].get(metric)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def metric_score(row: Dict[str, Any], metric: str) -> Optional[float]:
    """The value --winner-metric ranks a row by: its metric_value where it completed and did not
    collapse, else None (never a candidate)."""
    return metric_value(row, metric) if status(row) == "completed" else None


def metric_key(value: float, goal: str, row: Dict[str, Any], index: int) -> tuple:
    """The metric verdict's order: the best value (least for goal 'min', most for 'max'), then the
    least loss area, then grid order (the row's index)."""
    a = row["summary"].get("loss_area")
    return ((1.0 if goal == "min" else -1.0) * value, math.inf if a is None else a, index)


def objective(row: Dict[str, Any], threshold: float, axis: str,
              metric: Optional[str] = None) -> Tuple[Optional[float], float]:
    """(value, constraint) a study is told of a finished row. The paper's rule: the loss area on
    `axis` of a completed run (None otherwise: the study gives it the worst value) and `constraint`
    (<= 0: a survivor's min loss). With --winner-metric: metric_score, and a constraint of 0 where
    there is one (every completed run that reports it counts), inf where not."""
    if metric is None:
        value = area(row["summary"], axis) if row["status"] == "completed" else None
        return value, constraint(row, threshold)
    value = metric_score(row, metric)
    return value, 0.0 if value is not None else math.inf


def prune_bound(area_bound: float, time_to_target: Optional[float], target: bool) -> Tuple[float, float]:
    """The bound a running trial is held to, from best_bounds' (area, time to target): the time is
    -inf without a target (time never saves a run), inf while no run reached it."""
    return area_bound, -math.inf if not target else math.inf if time_to_target is None else time_to_target


def cannot_win(area_so_far: float, train_s: float, bound: Tuple[float, float]) -> bool:
    """Whether a running trial can no longer win: its area so far (which only grows) is above the
    bound's area and its training time is past the bound's time to target (prune_bound)."""
    a, best_time = bound
    return area_so_far > a * (1 + PRUNE_SLACK) and train_s > best_time * (1 + PRUNE_SLACK)


# --- verdicts ---------------------------------------------------------------------------------------

def margin(first: Tuple[float, Optional[float]], second: Tuple[float, Optional[float]],
           same_cost: Optional[Tuple[Optional[float], Optional[float]]] = None) -> Dict[str, Any]:
    """(value, relative half-width) of the winner and the runner-up: their margin, absolute and
    relative to the winner's value, the noise it is judged against (the half-widths' sum, in the
    value's unit) and whether it is within it ('tied': None where neither noise was measured).
    same_cost: the two share one pooled step price (steps axis), so the step-time spread cancels
    and only their repeats' spreads (given here, None without repeats) are noise."""
    (a, na), (b, nb) = first, second
    if same_cost is not None:
        na, nb = same_cost[0] or 0.0, same_cost[1] or 0.0
    noise = None if na is None and nb is None else a * (na or 0.0) + b * (nb or 0.0)
    return {"value": b - a, "relative": (b - a) / a if a else None, "noise": noise,
            "tied": None if noise is None else (b - a) <= noise}


def entry(p: Point, swept: Sequence[str], axes_order: Sequence[str], target: Optional[float]) -> Dict[str, Any]:
    """What a verdict says of a point: its representative run, its area on the axis and noise."""
    row = p.row
    s, c = row["summary"], row["config"]
    e = {"id": row["id"], "workers": c["workers"], "batch_size": c["batch_size"], "lr": c["lr"],
         "loss_area": s.get("loss_area"), "area": p.area, "noise": p.noise, "repeats": p.repeats,
         "repeat_areas": p.areas if p.repeats > 1 else None, "repeat_spread": p.repeat_spread,
         "step_cost": p.cost, "min_loss": s.get("min_loss"),
         "final_loss": s.get("final_loss"), "test_accuracy": s.get("test_accuracy"),
         "wall_time_s": s.get("wall_time_s"), "step_time_s": step_time(s), "step_price_s": p.step_s,
         "samples_per_s": s.get("samples_per_s"), "run_dir": row.get("run_dir"),
         "axes": {a: c.get(a) for a in swept if a not in axes_order}}
    if target is not None:
        e["time_to_target_s"] = time_to_accuracy(row, target, p.axis, p.step_s)
    return e


def ranked_verdict(ranked: List[Tuple[Dict[str, Any], float, Optional[float]]]) -> Dict[str, Any]:
    """From (entry, value, noise) best first: winner, runner_up and margin (None without a second)."""
    out: Dict[str, Any] = {"winner": ranked[0][0] if ranked else None, "runner_up": None, "margin": None}
    if len(ranked) > 1:
        first, second = ranked[0][0], ranked[1][0]
        out["runner_up"] = second
        same = (first.get("step_cost") is not None and first.get("step_cost") == second.get("step_cost"))
        out["margin"] = margin(ranked[0][1:], ranked[1][1:],
                               (first.get("repeat_spread"), second.get("repeat_spread")) if same else None)
    return out


def best_accuracy(rows: List[Dict[str, Any]], threshold: float) -> Optional[Dict[str, Any]]:
    """The surviving run with the highest final test accuracy: {id, workers, batch_size, lr, test_accuracy}."""
    best = None
    for r in rows:
        acc = _num(r["summary"].get("test_accuracy"))
        if acc is not None and survivor(r, threshold) and (best is None or acc > best["test_accuracy"]):
            c = r["config"]
            best = {"id": r["id"], "workers": c["workers"], "batch_size": c["batch_size"], "lr": c["lr"],
                    "test_accuracy": acc}
    return best


def lagging(by_workers: Dict[str, Any], best: Optional[Dict[str, Any]]) -> List[str]:
    """Worker counts whose winner's test accuracy is FAR_BELOW_BEST or more below the best trial's."""
    if best is None:
        return []
    return [k for k, info in by_workers.items() if info["winner"] is not None
            and (_num(info["winner"].get("test_accuracy")) or 0.0) <= best["test_accuracy"] - FAR_BELOW_BEST]


def best_bounds(rows: List[Dict[str, Any]], threshold: float,
                target: Optional[float]) -> Dict[int, Tuple[float, Optional[float]]]:
    """The pruning bounds (pruning.py) per worker count: the least wall-clock area of a finished
    survivor and, with a target accuracy, the least time to reach it (a run that did not collapse).
    Pruning is exact on the wall axis only (trials.py refuses it with --time-axis steps or --repeats)."""
    best: Dict[int, Tuple[float, Optional[float]]] = {}
    for row in rows:
        s = row["summary"]
        if row["status"] != "completed" or s.get("loss_area") is None:
            continue
        w = int(row["config"]["workers"])
        a, t = best.get(w, (math.inf, None))
        if survivor(row, threshold):
            a = min(a, s["loss_area"])
        if target is not None and collapsed(s) is None:
            tt = time_to_accuracy(row, target)
            if tt is not None and (t is None or tt < t):
                t = tt
        best[w] = (a, t)
    return {w: v for w, v in best.items() if math.isfinite(v[0])}


# --- the verdict in words (the CLI's table, winners.json's readers, the report) -------------------

def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def point_name(e: Dict[str, Any]) -> str:
    """'batch 64, lr 0.1' (and any other swept flag) of an entry."""
    return ", ".join([f"batch {e['batch_size']}", f"lr {e['lr']:g}", *(f"{a} {v}" for a, v in e["axes"].items())])


def margin_text(m: Optional[Dict[str, Any]], runner: Optional[Dict[str, Any]], name: str, unit: str) -> str:
    """'runner-up NAME by 0.0021 loss x s (5.9%): tied within noise (+-0.0040)'."""
    if runner is None or m is None:
        return "no runner-up"
    rel = f" ({100 * m['relative']:.1f}%)" if m["relative"] is not None else ""
    judged = ("noise not measured" if m["tied"] is None else
              f"{'tied within noise' if m['tied'] else 'clear of the noise'} (+-{m['noise']:.3g})")
    return f"runner-up {name} by {m['value']:.3g} {unit}{rel}: {judged}"


def axis_name(axis: str) -> str:
    return "wall-clock seconds" if axis == "wall" else "steps x step price"


def verdict_lines(w: Dict[str, Any]) -> List[str]:
    """The verdict's sentences under the winners table: per worker count its runner-up and
    margin, the collapsed runs, the overall best with its runner-up, each worker count's accuracy,
    and why a worker count's winner lags the best trial."""
    unit = "loss x s"
    lines = []
    for k, info in w["by_workers"].items():
        e = info["winner"]
        if e is None:
            continue
        rep = ""
        if e.get("repeats", 1) > 1:
            areas = e["repeat_areas"] or []
            rep = f" [median of {e['repeats']} repeats, {min(areas):.4g}-{max(areas):.4g}]" if areas else ""
        lines.append(f"{_count(int(k), 'worker')}: {point_name(e)}{rep}; "
                     + margin_text(info.get("margin"), info.get("runner_up"),
                                   point_name(info["runner_up"]) if info.get("runner_up") else "", unit))
    for c in w.get("collapsed") or []:
        lines.append(f"collapsed, not a survivor: {c['id']} ({c['why']})")
    o = w.get("overall")
    if o is None:
        return lines + ["Overall best: none"]
    r = w.get("overall_runner_up")
    lines.append(f"Overall best: {_count(o['workers'], 'worker')}, {point_name(o)} (loss area {o['area']:.4g}, "
                 f"test accuracy {_fmt(o['test_accuracy'])}); "
                 + margin_text(w.get("overall_margin"), r, f"{_count(r['workers'], 'worker')}, {point_name(r)}"
                               if r else "", unit))
    accs = [f"{_count(int(k), 'worker')} {_fmt(i['winner']['test_accuracy'])}"
            for k, i in w["by_workers"].items() if i["winner"]]
    best = w.get("best_trial")
    lines.append("Test accuracy of each worker count's winner: " + ", ".join(accs)
                 + (f"; best trial {best['test_accuracy']:.4f} ({_count(best['workers'], 'worker')}, "
                    f"batch {best['batch_size']}, lr {best['lr']:g})" if best else ""))
    for k in w.get("lagging") or []:
        e = w["by_workers"][k]["winner"]
        t = (w.get("by_target") or {}).get(k, {}).get("winner")
        lines.append(f"  {_count(int(k), 'worker')}: its winner ends at test accuracy {_fmt(e['test_accuracy'])}, "
                     f"{best['test_accuracy'] - (e['test_accuracy'] or 0):.2f} below the best trial: the rule "
                     f"rewards short runs (least area), and this budget leaves {_count(int(k), 'worker')} "
                     f"under-trained. "
                     + (f"The time-to-accuracy winner there: {point_name(t)} (test accuracy "
                        f"{_fmt(t['test_accuracy'])})." if t else
                        "Rank by time to an accuracy (--target-accuracy) to choose for accuracy."))
    return lines


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}"
