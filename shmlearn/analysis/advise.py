"""`shmlearn advise RUN_OR_SWEEP`: how many workers and which batch, from the gradient noise scale.

McCandlish et al. 2018 (arXiv:1812.06162): to reach a given loss, steps S and samples E = B S
trade off as (S/S_min - 1)(E/E_min - 1) = 1, i.e. S(B) = S_min (1 + B_crit / B), and the
critical batch B_crit = E_min / S_min is close to the gradient noise scale. advise takes
B_crit = B_simple, as --noise-scale measured it at the step where the run reached the target
loss (docs/noise-scale.md says why and when to trust it), and S_min from the measured steps (one
free scale: a run's, or the least-squares one over a sweep's batch sizes in log space).

Time to the target at W workers and global batch B = S(B) x step_s(W, B/W). step_s: measured where
runs measured it (the step time of the run, or of a sweep's trials at that W, linear in the
per-worker batch); elsewhere simulate's model (shmlearn/analysis/simulate/main.py: the one-worker compute,
linear in batch, and the communication fitted to a `bench comm` JSON, --comm; on a CPU run by
default the repository's measurement of the path the run's collectives took: shared memory, or
Gloo where summary.json's `collectives` says gloo or it ran with --shared-memory off; advise's
--shared-memory picks instead). The recommendation is the (W, B) of least predicted time.

Given a sweep, every (W, B) it trained is set beside the prediction: the measured steps and time
to the target (the best learning rate of each), the measured winner per W against the predicted
one, and a free fit of B_crit to the measured steps (what B_simple should have said).
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from shmlearn.analysis.simulate.comm import CPU_COMM, RESULTS, collectives_of, cpu_path, default_comm
from shmlearn.record import readback

from shmlearn.record import safe_write
from shmlearn.errors import BadInput
from shmlearn.config.limits import usable_cores
from shmlearn.sweeps.results import ResultStore

SMOOTH = 5
"""metrics.jsonl rows (one step's loss each) averaged, trailing, before the target is sought."""
COMM_PHASES = ("allreduce", "gather", "average", "broadcast", "push", "pull", "wait")


# --- reading runs --------------------------------------------------------------------------------

def load_run(run_dir: str) -> Optional[Dict[str, Any]]:
    """A run's summary and its smoothed loss curve with the noise scale per logged step; None if
    it did not complete or has no noise-scale rows (--noise-scale was off). Its files are read
    through readback: a missing or malformed one is one line naming it."""
    s = readback.run_summary(run_dir)
    readback.run_config(run_dir, missing_ok=True)  # a damaged run directory is refused whole, not read around
    rows = readback.run_metrics(run_dir)
    noise = [[r["step"], r["time_s"], r["loss"], r["noise_scale"]["b_simple"]] for r in rows
             if isinstance(r.get("noise_scale"), dict) and r["noise_scale"].get("b_simple") is not None]
    for r in noise:
        if not isinstance(r[3], readback.NUMBER) or isinstance(r[3], bool) or r[2] is None:
            raise BadInput(f"{os.path.join(run_dir, 'metrics.jsonl')}: step {r[0]}: noise_scale b_simple "
                           f"{readback.shown(r[3])} or loss {readback.shown(r[2])} is not a number")
    return _run(run_dir, s, noise)


def _run(run_dir: str, s: Dict[str, Any], noise: List[list]) -> Optional[Dict[str, Any]]:
    """load_run from a summary and the noise-scale rows [[step, time_s, loss, b_simple]] (a run's
    metrics.jsonl, or the curves a sweep's winners.json keeps: results.trial_curves)."""
    if s.get("status") != "completed" or not noise or not all(math.isfinite(r[2]) for r in noise):
        return None
    readback.need(s, {**readback.RESULT, "strategy": str}, os.path.join(run_dir, "summary.json"),
                  optional={"accumulate": int, "phase_s": (dict, None)})
    if s["steps"] < 1:
        raise BadInput(f"{os.path.join(run_dir, 'summary.json')}: a completed run of {s['steps']} steps")
    loss = [r[2] for r in noise]
    smooth = [float(np.mean(loss[max(0, i - SMOOTH + 1):i + 1])) for i in range(len(loss))]
    return {"dir": run_dir, "summary": s, "workers": s["workers"], "batch": s["batch_size"],
            "global": s["workers"] * s["batch_size"] * s.get("accumulate", 1), "lr": s["lr"], "steps": [r[0] for r in noise],
            "time": [r[1] for r in noise], "smooth": smooth, "b_simple": [r[3] for r in noise],
            "step_s": s["wall_time_s"] / s["steps"], "strategy": s["strategy"], "device": s.get("device", "cpu"),
            "phase_s": s.get("phase_s") or {}}


def sweep_runs(path: str, ids: Sequence[str]) -> List[Dict[str, Any]]:
    """A sweep's trials as load_run reads them, in `ids` order: from each trial's folder, or, the
    folder removed, from its results.jsonl row and the noise-scale rows winners.json keeps."""
    rows = {r["id"]: r for r in ResultStore(os.path.join(path, "results.jsonl")).load(repair=False)}
    wpath = os.path.join(path, "winners.json")
    kept = readback.read_json(wpath) if os.path.lexists(wpath) else {}
    curves = readback.need(kept, {}, wpath, optional={"curves": (dict, None)}).get("curves") or {}
    runs = []
    for i in ids:
        d = os.path.join(path, "trials", i)
        if os.path.exists(os.path.join(d, "metrics.jsonl")):
            runs.append(load_run(d))
        elif i in rows and "noise" in curves.get(i, {}):
            runs.append(_run(d, rows[i]["summary"], curves[i]["noise"]))
    return [r for r in runs if r is not None]


def reach(run: Dict[str, Any], target: float) -> Optional[Dict[str, float]]:
    """First logged step whose smoothed loss is <= target: steps, seconds and B_simple there."""
    for i, v in enumerate(run["smooth"]):
        if v <= target:
            return {"steps": run["steps"][i], "time_s": run["time"][i], "b_simple": run["b_simple"][i]}
    return None


# --- the model -----------------------------------------------------------------------------------

def steps_curve(s_min: float, b_crit: float, batch) -> np.ndarray:
    return s_min * (1 + b_crit / np.asarray(batch, dtype=float))


def fit_s_min(points: Sequence[tuple], b_crit: float) -> float:
    """S_min with B_crit fixed: least squares of log S over the (global batch, steps) points."""
    return float(np.exp(np.mean([math.log(s) - math.log(1 + b_crit / b) for b, s in points])))


def fit_b_crit(points: Sequence[tuple]) -> Optional[float]:
    """B_crit and S_min both free (log-space least squares over a grid); None under 2 batches."""
    if len({b for b, _ in points}) < 2:
        return None
    grid = np.exp(np.linspace(math.log(0.1), math.log(1e6), 2000))
    err = [np.mean([(math.log(s) - math.log(fit_s_min(points, bc)) - math.log(1 + bc / b)) ** 2
                    for b, s in points]) for bc in grid]
    return float(grid[int(np.argmin(err))])


class StepTime:
    """Seconds per step at (W, per-worker batch b): measured lines per W (a + c b, least squares over
    the runs at that W; one run: its data+compute scale with b), else simulate's model."""

    def __init__(self, runs: List[Dict[str, Any]], comm: Optional[str], after: Optional[str], slots):
        self.lines: Dict[int, tuple] = {}
        for w in sorted({r["workers"] for r in runs}):
            pts = {}
            for r in runs:
                if r["workers"] == w:
                    pts.setdefault(r["batch"], []).append(r["step_s"])
            bs = sorted(pts)
            t = [float(np.median(pts[b])) for b in bs]
            if len(bs) >= 2:
                c, a = np.polyfit(bs, t, 1)
                self.lines[w] = (max(a, 0.0), max(c, 0.0))
            else:  # one batch: the phases that grow with the batch (data, compute) scale with it
                r = next(r for r in runs if r["workers"] == w)
                grow = r["phase_s"].get("data", 0.0) + r["phase_s"].get("compute", 0.0)
                self.lines[w] = (t[0] - grow, grow / bs[0])
        self.machine, self.strategy, self.source = None, runs[0]["strategy"], "measured"
        self.collectives: Optional[str] = None
        one = self.lines.get(1)
        if one is None:  # one worker's step from a run of several: its step without communication
            r = min(runs, key=lambda r: r["workers"])
            talk = sum(v for k, v in r["phase_s"].items() if k in COMM_PHASES)
            a, c = self.lines[r["workers"]]
            one = (max(a - talk, 0.0), c)
        self.one = one
        if comm and one:
            from shmlearn.analysis.simulate import main as simulate  # lazy: torch (simulate reads bench.common), for the cost model only
            doc = simulate._read_json("--comm", comm)
            self.collectives = collectives_of(doc)
            net = simulate.Network.from_comm(doc, comm)
            wake = simulate.Wake.from_comm(doc, simulate._read_json("--comm-after-compute", after), after) if after else None
            r = min(runs, key=lambda r: r["workers"])
            s = r["summary"]
            params = simulate.parameter_count(s["model"], s["dataset"])
            self.machine = simulate.Machine(compute=simulate.Compute(
                data_s=0.0, compute_s=0.0, update_s=r["phase_s"].get("update", 0.0), other_s=0.0, batch_size=1,
                parameters=params, model=s["model"], device=r["device"], source=r["dir"]), net=net, slots=slots, wake=wake)
            self.source = (f"measured at W in {sorted(self.lines)}; elsewhere simulate with {_short(comm)} "
                           f"({self.collectives} collectives" + (f", after compute: {_short(after)})" if after else ")"))

    def __call__(self, w: int, b: float) -> Optional[float]:
        if w in self.lines:
            a, c = self.lines[w]
            return a + c * b
        if self.machine is None:
            return None
        from dataclasses import replace
        from shmlearn.analysis.simulate import main as simulate  # lazy: torch (simulate reads bench.common), for the cost model only
        a, c = self.one
        upd = self.machine.compute.update_s
        m = replace(self.machine, compute=replace(self.machine.compute, compute_s=max(a - upd, 0.0) + c * b,
                                                  batch_size=max(int(b), 1)))
        return simulate.predict(m, self.strategy, w)["step_s"]


def _short(path: str) -> str:
    """A path inside this repository relative to its root (advise.json is committed), else as given."""
    root = os.path.dirname(RESULTS)
    full = os.path.abspath(path)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else path


def run_path(run: Dict[str, Any], shared_memory: Optional[str] = None) -> tuple:
    """(the path a CPU run's collectives take, why): advise's --shared-memory where given; else what
    the run's summary.json says they took (`collectives`, since shared memory exists); else its
    config's --shared-memory (one worker, or an older run), auto when it has none."""
    if shared_memory is not None:
        return cpu_path(shared_memory), f"advise --shared-memory {shared_memory}"
    took = run["summary"].get("collectives")
    if took in CPU_COMM:
        return took, f"{_short(os.path.join(run['dir'], 'summary.json'))}: collectives {took}"
    cfg = readback.run_config(run["dir"], missing_ok=True) or {}
    flag = cfg.get("shared_memory") if isinstance(cfg, dict) else None
    flag = "off" if flag is False else flag if flag in ("auto", "off") else None  # YAML reads a bare off as false
    return cpu_path(flag), f"the run's --shared-memory {flag or 'auto'}" + ("" if flag else " (train's default)")


# --- advise --------------------------------------------------------------------------------------

def advise(path: str, *, target_loss: Optional[float] = None, workers: Sequence[int] = (1, 2, 4, 8, 16),
           comm: Optional[str] = None, comm_after_compute: Optional[str] = None,
           shared_memory: Optional[str] = None) -> Dict[str, Any]:
    sweep = os.path.exists(os.path.join(path, "sweep.json"))
    if sweep:
        spec = readback.sweep_spec(path, missing_ok=False)
        runs, slots = sweep_runs(path, spec["trials"]), spec.get("slots")
    elif os.path.exists(os.path.join(path, "summary.json")):
        runs, slots = [r for r in [load_run(path)] if r is not None], usable_cores()
    else:
        raise BadInput(f"advise {path}: neither a run directory (summary.json) nor a sweep directory (sweep.json)")
    if not runs:
        raise BadInput(f"advise {path}: no completed run with noise-scale rows in metrics.jsonl "
                       f"(train or sweep with --noise-scale)")
    # The target: one given, else the run's final loss, else what every global batch's best run reaches.
    by_global: Dict[int, List[Dict[str, Any]]] = {}
    for r in runs:
        by_global.setdefault(r["global"], []).append(r)
    target_from = "--target-loss"
    if target_loss is None and not sweep:
        target_loss = runs[0]["smooth"][-1]
        target_from = f"the run's final training loss, smoothed (the mean of its last {SMOOTH} logged steps)"
    if target_loss is None:
        target_loss = max(min(min(r["smooth"]) for r in rs) for rs in by_global.values())
        target_from = (f"the lowest smoothed training loss (mean of {SMOOTH} logged steps) that every global batch's "
                       "best run reaches")
    measured = []
    for r in runs:
        hit = reach(r, target_loss)
        if hit:
            measured.append({"workers": r["workers"], "batch": r["batch"], "global": r["global"], "lr": r["lr"],
                             "run": os.path.relpath(r["dir"], path) if sweep else ".", **hit})
    if not measured:
        raise BadInput(f"--target-loss {target_loss:g}: no run reaches it")
    # Per (W, b): the best learning rate (fewest steps to the target), as the model assumes.
    best: Dict[tuple, Dict[str, Any]] = {}
    for m in measured:
        k = (m["workers"], m["batch"])
        if k not in best or m["steps"] < best[k]["steps"]:
            best[k] = m
    best_rows = sorted(best.values(), key=lambda m: (m["workers"], m["batch"]))
    b_simple = float(np.median([m["b_simple"] for m in best_rows]))
    pts = [(m["global"], m["steps"]) for m in best_rows]
    s_min = fit_s_min(pts, b_simple)
    b_fit = fit_b_crit(pts)
    chosen = "--comm" if comm is not None or comm_after_compute is not None else None
    if chosen is None and str(runs[0]["device"]).startswith("cpu"):
        took, why = run_path(runs[0], shared_memory)
        comm, comm_after_compute = default_comm(runs[0]["device"], "off" if took == "gloo" else "auto")
        chosen = f"the repository's {took} measurement ({why})" if comm else None
    step_time = StepTime(runs, comm, comm_after_compute, slots)
    grid = sorted({2 ** k for k in range(2, 15)} | {m["global"] for m in best_rows})
    preds = []
    for w in sorted(set(workers) | {m["workers"] for m in best_rows}):
        for g in grid:
            if g % w or g // w < (2 if w == 1 else 1):
                continue
            st = step_time(w, g // w)
            steps = float(steps_curve(s_min, b_simple, g))
            preds.append({"workers": w, "global": g, "batch": g // w, "steps": steps, "samples": steps * g,
                          "step_s": st, "time_s": steps * st if st is not None else None})
    timed = [p for p in preds if p["time_s"] is not None]
    rec = min(timed, key=lambda p: p["time_s"]) if timed else None
    if rec is not None:  # a prediction; say whether a measured run had that setup
        rec = {**rec, "measured": any((m["workers"], m["batch"]) == (rec["workers"], rec["batch"]) for m in best_rows)}
    for m in best_rows:
        m["predicted_steps"] = float(steps_curve(s_min, b_simple, m["global"]))
        st = step_time(m["workers"], m["batch"])
        m["predicted_time_s"] = m["predicted_steps"] * st if st is not None else None
    winners = {}
    for w in sorted({m["workers"] for m in best_rows}):
        mine = [m for m in best_rows if m["workers"] == w]
        meas = min(mine, key=lambda m: m["time_s"])
        pred = min((m for m in mine if m["predicted_time_s"] is not None), key=lambda m: m["predicted_time_s"], default=None)
        winners[str(w)] = {"measured_batch": meas["batch"], "measured_time_s": meas["time_s"],
                           "predicted_batch": pred["batch"] if pred else None,
                           "predicted_time_s": pred["predicted_time_s"] if pred else None}
    err = [abs(m["predicted_steps"] / m["steps"] - 1) for m in best_rows]
    return {"schema": 1, "source": path, "kind": "sweep" if sweep else "run", "target_loss": target_loss,
            "target_from": target_from,
            "b_simple": b_simple, "b_crit_fit": b_fit, "s_min": s_min, "runs_used": len(runs),
            "step_time": step_time.source, "comm": _short(comm) if comm else None,
            "comm_after_compute": _short(comm_after_compute) if comm and comm_after_compute else None,
            "collectives": step_time.collectives, "comm_chosen": chosen if comm else None,
            "measured": best_rows, "winners": winners,
            "steps_error": {"median": float(np.median(err)), "max": float(np.max(err))},
            "predictions": preds, "recommendation": rec}


def plot(doc: Dict[str, Any], out: str, root: Optional[str] = None) -> Optional[str]:
    try:
        from shmlearn.report.mpl import figure, png  # lazy: matplotlib
    except ImportError:
        return None
    fig, (a1, a2) = figure(11.0, 4.2, ncols=2)
    ms = doc["measured"]
    colors = {w: f"C{i}" for i, w in enumerate(sorted({m["workers"] for m in ms} | {p["workers"] for p in doc["predictions"]}))}
    for i, w in enumerate(sorted({m["workers"] for m in ms})):
        mine = [m for m in ms if m["workers"] == w]
        # W workers x B and 1 x W B read the same samples: their steps coincide, so rings over dots
        kw = dict(color=colors[w], label=f"measured W={w}", zorder=3 + i, s=30 + 40 * i)
        if i:
            kw.update(facecolors="none", edgecolors=colors[w], color=None, linewidths=1.5)
        a1.scatter([m["global"] for m in mine], [m["steps"] for m in mine], **kw)
        a2.scatter([m["global"] for m in mine], [m["time_s"] for m in mine], **kw)
    g = np.array(sorted({p["global"] for p in doc["predictions"]}))
    a1.plot(g, steps_curve(doc["s_min"], doc["b_simple"], g), "k-", label=f"predicted, B_crit = B_simple = {doc['b_simple']:.0f}")
    if doc["b_crit_fit"]:
        pts = [(m["global"], m["steps"]) for m in ms]
        a1.plot(g, steps_curve(fit_s_min(pts, doc["b_crit_fit"]), doc["b_crit_fit"], g), "k:",
                label=f"fit to measured, B_crit = {doc['b_crit_fit']:.0f}")
    a1.axvline(doc["b_simple"], color="grey", lw=0.8)
    a1.set(xscale="log", yscale="log", xlabel="global batch (W x B)", ylabel=f"steps to loss {doc['target_loss']:.3g}",
           title="steps to the target")
    for w in sorted({p["workers"] for p in doc["predictions"]}):
        pp = [p for p in doc["predictions"] if p["workers"] == w and p["time_s"] is not None]
        if pp:
            a2.plot([p["global"] for p in pp], [p["time_s"] for p in pp], "-", color=colors[w], label=f"predicted W={w}")
    a2.set(xscale="log", yscale="log", xlabel="global batch (W x B)", ylabel="seconds to the target",
           title="time to the target")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7, ncol=2)
    safe_write.write(out, png(fig), root=root)  # whole or as it was; never through a link out of root
    return out


def register(sub) -> None:
    p = sub.add_parser("advise", help="workers and batch size from the measured gradient noise scale",
                       description="Predict steps and time to a run's loss at other batch sizes and worker counts "
                                   "from the gradient noise scale (--noise-scale) and the measured step time, and "
                                   "recommend one; given a sweep, set the prediction beside what it measured.")
    p.add_argument("path", metavar="RUN_OR_SWEEP", help="a run directory or a sweep directory, trained with --noise-scale")
    p.add_argument("--target-loss", type=float, default=None,
                   help="training loss to reach [a run: its final loss; a sweep: the lowest loss every batch size reaches]")
    p.add_argument("--workers", default="1,2,4,8,16", help="worker counts to predict [1,2,4,8,16]")
    p.add_argument("--comm", default=None, help="bench comm JSON for the communication at unmeasured worker counts "
                                                "[CPU runs: the repository's measurement of the path the run took]")
    p.add_argument("--shared-memory", choices=("auto", "off"), default=None,
                   help="CPU runs without --comm: the path to predict, as train's flag (auto: shared memory, off: "
                        "Gloo) [the run's: summary.json collectives, else its --shared-memory]")
    p.add_argument("--comm-after-compute", default=None, help="its after-compute JSON (simulate --comm-after-compute)")
    p.add_argument("--out", default=None, help="directory for advise.json and advise.png [RUN_OR_SWEEP/advise]")
    p.set_defaults(func=cmd_advise)


def cmd_advise(ns) -> int:
    from shmlearn.bench.common import MAX_WORKERS, parse_int_list  # lazy: torch (bench.common), after the cheap checks
    if ns.target_loss is not None and not (ns.target_loss > 0 and math.isfinite(ns.target_loss)):
        raise BadInput(f"--target-loss {ns.target_loss}: must be a positive number")
    for flag, f in (("--comm", ns.comm), ("--comm-after-compute", ns.comm_after_compute)):
        if f is not None and not os.path.isfile(f):
            raise BadInput(f"{flag} {f}: no such file")
    doc = advise(ns.path, target_loss=ns.target_loss, comm=ns.comm, comm_after_compute=ns.comm_after_compute,
                 workers=parse_int_list(ns.workers, flag="--workers", most=MAX_WORKERS),
                 shared_memory=ns.shared_memory)
    out = ns.out or os.path.join(ns.path, "advise")
    # The default folder is the run's (or sweep's): a RUN/advise link that leads out of it is
    # refused. An --out given is where the user asked the files to go, a link or not.
    root = out if ns.out else ns.path
    with safe_write.cli_output("advise"):  # a full disk, a read-only folder: one line, earlier files kept
        safe_write.makedirs(out, root=root)
        safe_write.write_json(os.path.join(out, "advise.json"), doc, root=root, indent=1)
    fit = f"; a free fit to the measured steps gives {doc['b_crit_fit']:.0f}" if doc["b_crit_fit"] else ""
    print(f"target loss {doc['target_loss']:.4g} ({doc['target_from']}); B_simple at the target {doc['b_simple']:.1f} "
          f"(= predicted critical batch){fit}; S_min {doc['s_min']:.0f} steps")
    print(f"step time: {doc['step_time']}")
    if doc["comm_chosen"]:
        print(f"communication: {doc['comm_chosen']}")
    print(f"{'W':>3} {'B':>5} {'W*B':>6} {'steps':>7} {'pred':>7} {'time s':>8} {'pred s':>8}")
    for m in doc["measured"]:
        pt = f"{m['predicted_time_s']:8.3f}" if m["predicted_time_s"] is not None else f"{'-':>8}"
        print(f"{m['workers']:>3} {m['batch']:>5} {m['global']:>6} {m['steps']:>7} {m['predicted_steps']:>7.0f} "
              f"{m['time_s']:>8.3f} {pt}")
    print(f"steps to the target, predicted vs measured: median error {doc['steps_error']['median']:.0%}, "
          f"max {doc['steps_error']['max']:.0%}")
    if doc["kind"] == "sweep":
        for w, v in doc["winners"].items():
            print(f"W={w}: fastest to the target measured at batch {v['measured_batch']}, predicted at {v['predicted_batch']}")
    r = doc["recommendation"]
    if r:
        print(f"recommendation: {r['workers']} worker{'s' if r['workers'] > 1 else ''} x batch {r['batch']} "
              f"(global {r['global']}): {r['steps']:.0f} steps, {r['time_s']:.2f} s predicted to the target"
              + ("" if r["measured"] else " (predicted from the noise scale and step times; no run above "
                                          "measured this setup: train it to check)"))
    print(f"wrote {os.path.join(out, 'advise.json')}")
    with safe_write.cli_output("advise"):
        png = plot(doc, os.path.join(out, "advise.png"), root)
    print(f"wrote {png}" if png else "no plot: matplotlib is not installed")
    return 0
