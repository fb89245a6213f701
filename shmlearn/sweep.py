"""Sweeps: the paper's search for the best (workers, batch size, learning rate), seeds 000, 002 §5.

    grid (any TrainConfig field: a list or a range) -> trials, P at a time on free cores or GPUs
      -> DIR/results.jsonl (one line per finished trial) -> winners.json, table -> report

* Each trial is `shmlearn.train.train(cfg)` in its own process, forked from a server that has
  already imported torch (a fresh interpreter costs ~8 s on 2 slow cores; a fork, milliseconds).
  A trial of W workers (T threads each) holds W x T cores, pinned, or W GPUs, so P trials at once
  never oversubscribe the machine.
* results.jsonl is append-only, written by this process alone, one fsynced line per trial. A
  killed sweep loses only the trials in flight; the same command again skips every trial whose
  id (a hash of its config) has a line, adopts any trial that finished but had no line yet, and
  runs the rest. A trial publishes its run directory (DIR/trials/<id>/) by one rename when done.
* Winners by the paper's rule: per worker count, drop runs whose minimum training loss is above
  the threshold (1.8 in the paper), then take the least loss area (loss integrated over training
  seconds). Ties: lower minimum loss, then shorter training time, then grid order. Optionally,
  the least training time to reach a test accuracy.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import os
import shutil
import signal
import sys
import time
import typing
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Dict, List, Optional, Sequence, Tuple

from shmlearn import jsonl
from shmlearn.config import TrainConfig, load_yaml, validate
from shmlearn.errors import BadInput, count
from shmlearn.pruning import bound_key, post_bound
from shmlearn.sync import registry

AXIS_ORDER = ("workers", "batch_size", "lr")
"""Grid order, outermost first: trials of one worker count run together and pack the slots."""
NOT_SWEPT = ("out", "progress", "resume")
"""Set by the sweep: each trial writes its own run directory, fresh, with no progress bar."""
MAX_TRIALS = 100_000


def trials_at_once(parallel: Optional[int], cuda: bool, slots: int) -> int:
    """SweepConfig.parallel for this machine: as asked, else every GPU (each its own device) or
    one trial at a time on CPU cores (which share memory bandwidth)."""
    return parallel or (slots if cuda else 1)


@dataclass(kw_only=True)
class SweepConfig:
    fixed: Dict[str, Any] = field(default_factory=dict)
    """TrainConfig fields shared by every trial (one value each)."""
    axes: Dict[str, List[Any]] = field(default_factory=dict)
    """TrainConfig fields swept, each with its values in order; the grid is their product."""
    threshold: float = 1.8
    """Winners: drop runs whose minimum training loss is above this (the paper's 1.8)."""
    target_accuracy: Optional[float] = None
    """Winners also by the least training seconds to reach this test accuracy."""
    parallel: Optional[int] = None
    """Trials at once. Default: on GPUs, as many as there are free GPUs (1-worker trials fill
    every GPU, a 2-worker trial waits for two: each GPU is a device of its own); on CPU cores, 1
    (trials that run together share memory bandwidth and caches, which shows in their
    wall-clock areas)."""
    slots: Optional[int] = None
    """CPU cores (or GPUs) the sweep may use. Default: all this process may run on."""
    out: str = ""
    """Sweep directory: results.jsonl, winners.json, trials/, figures/, report.html."""
    report: bool = True
    """Write figures and report.html at the end."""
    prune: bool = False
    """Stop a trial as soon as it can no longer win (its loss area so far exceeds the best
    finished survivor's of its worker count, and with a target accuracy its time passes the
    best time-to-target): the winners equal the full grid's. Off by default: the paper's
    figures need every run's full area."""
    storage: Optional[str] = None
    """Optuna storage shared by every process of the study (study.py): an RDB URL
    (sqlite:///PATH, postgresql://..., mysql://...) or journal:PATH (a JournalFileStorage on a
    shared filesystem). None: the sweep of this one process, results.jsonl its store."""
    study: Optional[str] = None
    """Optuna study name (with storage): every process given the same storage, study and flags
    works on one study."""
    search: str = "grid"
    """grid (every combination, Optuna's GridSampler with storage), tpe or random (with storage:
    `trials` samples between each axis's smallest and largest value)."""
    trials: Optional[int] = None
    """tpe/random: trials in the study, counted over all its processes."""
    pruner: Optional[str] = None
    """With storage: area (the exact rule of `prune`), median or halving (Optuna's
    MedianPruner and SuccessiveHalvingPruner, for tpe/random only: they change the winners)."""
    search_seed: Optional[int] = None
    """Seed of the tpe/random (and grid's order) sampler; processes sharing a study should each
    give another (e.g. the Slurm array index), else their random trials repeat and are dropped."""
    stale_after: float = 60.0
    """With storage: a running trial whose heartbeat has not moved for this many seconds (or
    whose process on this host is gone) is lost; it is failed and run again."""


# --- grid ----------------------------------------------------------------------------------

def _kind(name: str) -> type:
    """bool, int, float or str: the field's annotation, resolved (cli._scalar_type)."""
    from shmlearn.cli import _scalar_type
    return _scalar_type(typing.get_type_hints(TrainConfig)[name])


def _number(name: str, text: str, kind: type):
    try:
        d = Decimal(text)
    except InvalidOperation:
        raise BadInput(f"--{name.replace('_', '-')} {text}: expected a number") from None
    if not d.is_finite():
        raise BadInput(f"--{name.replace('_', '-')} {text}: expected a finite number")
    if kind is int and d != d.to_integral_value():
        raise BadInput(f"--{name.replace('_', '-')} {text}: expected a whole number")
    return d


def _range(name: str, item: str, kind: type) -> List[Any]:
    """A:B:STEP, both ends included when STEP lands on B. Decimal arithmetic, so 0.1:0.9:0.1 is
    exactly the nine values 0.1 ... 0.9 (float steps would give 0.30000000000000004 and may
    drop 0.9)."""
    flag = f"--{name.replace('_', '-')} {item}"
    parts = item.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 2 and kind is not int):
        raise BadInput(f"{flag}: expected a range START:STOP:STEP" + (" or START:STOP" if kind is int else ""))
    a, b = _number(name, parts[0], kind), _number(name, parts[1], kind)
    step = _number(name, parts[2], kind) if len(parts) == 3 else Decimal(1)
    if step == 0 or (b - a) * step < 0:
        raise BadInput(f"{flag}: the step must be nonzero and go from {parts[0]} toward {parts[1]}")
    n = int((b - a) / step) + 1
    if n > MAX_TRIALS:
        raise BadInput(f"{flag}: {n} values; at most {MAX_TRIALS}")
    return [kind(a + i * step) for i in range(n)]


def parse_values(name: str, raw: Any) -> List[Any]:
    """The values of one flag: 'A,B,C', a range 'START:STOP:STEP' (numbers only), a mix of both
    ('16,64:256:64'), or a YAML scalar or list. Duplicates are dropped, order is kept."""
    kind = _kind(name)
    items = raw if isinstance(raw, list) else [raw]
    values: List[Any] = []
    for item in items:
        if isinstance(item, (list, dict, tuple, set)):  # every field is one scalar: a value may not nest
            what = "a mapping" if isinstance(item, dict) else "a list"
            raise BadInput(f"--{name.replace('_', '-')}: {raw!r} holds {what} ({item!r}); expected one value "
                           f"or a list of values")
        if not isinstance(item, str):
            values.append(item)
            continue
        for part in (p.strip() for p in item.split(",")):
            if part == "":
                raise BadInput(f"--{name.replace('_', '-')} {item}: empty value in the list")
            if part.lower() in ("none", "null"):
                values.append(None)
            elif kind is bool:
                if part.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise BadInput(f"--{name.replace('_', '-')} {part}: expected true or false")
                values.append(part.lower() in ("true", "1", "yes"))
            elif kind in (int, float) and ":" in part:
                values.extend(_range(name, part, kind))
            elif kind in (int, float):
                values.append(kind(_number(name, part, kind)))
            else:
                values.append(part)
    seen, out = set(), []
    for v in values:
        if (type(v), v) not in seen:
            seen.add((type(v), v))
            out.append(v)
    return out


def split_axes(values: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, List[Any]]]:
    """{flag: raw} -> (fixed values, swept axes): a flag with two or more values is an axis."""
    known = {f.name for f in dataclasses.fields(TrainConfig)} - set(NOT_SWEPT)
    fixed, axes = {}, {}
    for name, raw in values.items():
        name = name.replace("-", "_")
        if name not in known:
            raise BadInput(f"sweep: unknown flag '{name}'; known: {', '.join(sorted(known))}")
        vals = parse_values(name, raw)
        if not vals:
            raise BadInput(f"--{name.replace('_', '-')}: no values")
        if len(vals) == 1:
            fixed[name] = vals[0]
        else:
            axes[name] = vals
    return fixed, axes


def ordered_axes(axes: Dict[str, List[Any]]) -> List[str]:
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    return sorted(axes, key=lambda a: (AXIS_ORDER.index(a) if a in AXIS_ORDER else len(AXIS_ORDER),
                                       names.index(a)))


def trial_id(cfg: TrainConfig) -> str:
    """Stable id of a trial: readable prefix + hash of the fields that differ from TrainConfig's
    defaults, so a field added to TrainConfig later does not change the ids of a sweep."""
    defaults = TrainConfig().to_dict()
    d = {k: v for k, v in cfg.to_dict().items() if k not in NOT_SWEPT and v != defaults[k]}
    h = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
    return f"w{cfg.workers}-b{cfg.batch_size}-lr{cfg.lr:g}-{h}"


def expand_grid(fixed: Dict[str, Any], axes: Dict[str, List[Any]], *, cuda: bool = False) -> List[TrainConfig]:
    """Every combination of the axes, workers outermost, then batch size, then lr, then the
    others in TrainConfig's order. CPU trials get 1 thread per worker unless --threads is
    given, so the slots they hold are the cores they use."""
    names = ordered_axes(axes)
    total = math.prod(len(axes[a]) for a in names)
    if total > MAX_TRIALS:
        raise BadInput(f"sweep: {total} trials; at most {MAX_TRIALS}")
    trials = []
    for combo in itertools.product(*(axes[a] for a in names)):
        values = {**fixed, **dict(zip(names, combo)), "progress": False}
        values.setdefault("workers", None)
        if values["workers"] is None:
            values["workers"] = 2  # the local default, made explicit so the id says it
        if not cuda and values.get("threads") is None:
            values["threads"] = 1
        cfg = TrainConfig(**values)
        validate(cfg)
        if cfg.samples is not None and cfg.samples < cfg.workers * cfg.batch_size:
            raise BadInput(f"--samples {cfg.samples}: smaller than one step of {_workers(cfg.workers)} "
                           f"x {cfg.batch_size} samples")
        trials.append(cfg)
    return trials


# --- results.jsonl --------------------------------------------------------------------------

class ResultStore:
    """DIR/results.jsonl: one JSON object per finished trial, only ever appended.

    A line cut off by a kill (no newline, not valid JSON) is moved to results.jsonl.torn and its
    trial runs again; a bad line anywhere else is the user's to fix: BadInput, file untouched."""

    def __init__(self, path: str):
        self.path = path
        self.notes: List[str] = []

    def load(self, *, repair: bool = True) -> List[Dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            data = f.read()
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
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadInput(f"{self.path} line {lineno}: not valid JSON ({e}); fix or remove that line") from None
        if not isinstance(row, dict) or not {"id", "status", "config", "summary"} <= row.keys():
            raise BadInput(f"{self.path} line {lineno}: not a sweep result (needs id, status, config, "
                           f"summary); fix or remove that line")
        return row

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


def pick_winners(rows: List[Dict[str, Any]], *, threshold: float = 1.8,
                 target_accuracy: Optional[float] = None, swept: Sequence[str] = ()) -> Dict[str, Any]:
    """Per worker count: the paper's rule (min loss <= threshold, then least loss area) and,
    with a target, the least time to reach it; and the overall best of each across worker
    counts. Diverged runs are results but never winners. See the module docstring for ties."""
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
    return out


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def _fmt(v, spec: str) -> str:
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
        lines.append(f"{k:>8}  {e['batch_size']:>10}  {e['lr']:>10g}  {_fmt(e['loss_area'], '.4g'):>10}  "
                     f"{_fmt(e['min_loss'], '.4f'):>8}  {_fmt(e['test_accuracy'], '.4f'):>8}  "
                     f"{_fmt(e['wall_time_s'], '.2f'):>8}  {surv}  {other}")
    o = w["overall"]
    lines.append("Overall best: " + ("none" if o is None else
                 f"{_workers(o['workers'])}, batch {o['batch_size']}, lr {o['lr']:g} "
                 f"(loss area {o['loss_area']:.4g}, test accuracy {_fmt(o['test_accuracy'], '.4f')})"))
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
                             f"{_fmt(e['test_accuracy'], '.4f'):>9}")
        o = w["overall_by_target"]
        lines.append("Overall fastest to target: " + ("none" if o is None else
                     f"{_workers(o['workers'])}, batch {o['batch_size']}, lr {o['lr']:g} "
                     f"({o['time_to_target_s']:.3f} s)"))
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


# --- running trials -------------------------------------------------------------------------

@dataclass
class _Running:
    cfg: TrainConfig
    tid: str
    job: Any
    slots: List[int]
    tmp: str
    t0: float
    attempt: int


class Sweep:
    """One sweep directory and the trials of one grid."""

    def __init__(self, sc: SweepConfig):
        self.sc = sc
        self.dir = sc.out
        self.trials_dir = os.path.join(self.dir, "trials")
        self.tmp_dir = os.path.join(self.trials_dir, ".tmp")
        self.store = ResultStore(os.path.join(self.dir, "results.jsonl"))
        self.failures: List[Tuple[str, str]] = []
        self.done_now = 0
        self.ran_rows: List[Dict[str, Any]] = []
        self.pool = None
        self._mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()

    # -- setup ---------------------------------------------------------------------------------
    def _device(self) -> Tuple[bool, int]:
        dev = self.sc.fixed.get("device", "auto")
        devs = set(self.sc.axes.get("device", [dev]))
        if devs - {"cpu"}:
            import torch
            if torch.cuda.is_available():
                return True, self.sc.slots or torch.cuda.device_count()
            if "cuda" in devs:
                raise BadInput("--device cuda: no CUDA device is available")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return False, self.sc.slots or cores

    def _need(self, cfg: TrainConfig) -> int:
        procs = registry.spec(cfg).processes(cfg.workers)
        return procs if self.cuda else procs * (cfg.threads or 1)

    def run(self) -> int:
        from shmlearn.launch import detect_env
        if detect_env() is not None:
            raise BadInput("sweep: started under torchrun/mpirun/srun; run it directly, it starts its own trials")
        if self.sc.parallel is not None and self.sc.parallel < 1:
            raise BadInput(f"--parallel {self.sc.parallel}: expected a whole number > 0")
        if self.sc.slots is not None and self.sc.slots < 1:
            raise BadInput(f"--slots {self.sc.slots}: expected a whole number > 0")
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise BadInput(f"--out {self.dir}: exists and is not a directory")
        self.cuda, self.nslots = self._device()
        self.parallel = trials_at_once(self.sc.parallel, self.cuda, self.nslots)
        """Trials at once (SweepConfig.parallel, resolved for this machine)."""
        trials = expand_grid(self.sc.fixed, self.sc.axes, cuda=self.cuda)
        if self.cuda:
            import torch
            big = max(self._procs(c) for c in trials)
            if big > torch.cuda.device_count():
                raise BadInput(f"--workers: a trial needs {big} processes, one GPU each; "
                               f"{torch.cuda.device_count()} GPUs present")
        try:
            os.makedirs(self.trials_dir, exist_ok=True)
        except OSError as e:
            raise BadInput(f"--out {self.dir}: cannot write there ({e.strerror})") from None
        lock = self._lock()
        try:
            return self._run(trials)
        except OSError as e:
            if e.errno not in jsonl.FULL:
                raise
            where = f": {e.filename}" if e.filename else ""
            raise BadInput(f"--out {self.dir}: the disk is full ({e.strerror}{where}); the results so far are in "
                           f"results.jsonl: free space and run the same command again") from None
        finally:
            lock.close()

    def _lock(self):
        import fcntl
        f = open(os.path.join(self.dir, ".lock"), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise BadInput(f"--out {self.dir}: another sweep (or study) is running in this directory") from None
        return f

    def _write_spec(self, trials: List[TrainConfig], extra: Optional[Dict[str, Any]] = None) -> None:
        from shmlearn.runs import write_json_atomic
        write_json_atomic(os.path.join(self.dir, "sweep.json"), {
            "command": sys.argv, "fixed": self.sc.fixed, "axes": self.sc.axes,
            "axis_order": ordered_axes(self.sc.axes), "threshold": self.sc.threshold,
            "target_accuracy": self.sc.target_accuracy, "parallel": self.parallel, "prune": self.sc.prune,
            "slots": self.nslots, "device": "cuda" if self.cuda else "cpu",
            "trials": [trial_id(c) for c in trials], **(extra or {})})

    # -- the loop ------------------------------------------------------------------------------
    def _run(self, trials: List[TrainConfig]) -> int:
        rows = self.store.load()  # BadInput on a corrupt file, before anything is touched
        for n in self.store.notes:
            print(f"sweep: {n}", flush=True)
        self._write_spec(trials)
        done = {r["id"] for r in rows}
        shutil.rmtree(self.tmp_dir, ignore_errors=True)  # attempts of a killed sweep
        self.total, self.finished = len(trials), 0
        pending = []
        for cfg in trials:
            tid = trial_id(cfg)
            if tid in done:
                continue
            final = os.path.join(self.trials_dir, tid)
            if os.path.isdir(final) and self._record(cfg, tid, final, None, adopted=True):
                done.add(tid)
                continue
            shutil.rmtree(final, ignore_errors=True)
            pending.append(cfg)
        self.finished = self.total - len(pending)
        print(f"sweep: {count(len(trials), 'trial')} ({self.finished} done, {len(pending)} to run), "
              f"{self.parallel} at a time on {self.nslots} {'GPUs' if self.cuda else 'CPU cores'} | {self.dir}",
              flush=True)
        too_big = {self._need(c) for c in pending if self._need(c) > self.nslots}
        if too_big:
            print(f"sweep: trials needing {max(too_big)} slots > {self.nslots} run alone "
                  f"(oversubscribed); use fewer workers or threads", flush=True)
        if pending:
            t0 = time.monotonic()
            self._schedule(pending)
            self._write_timing(time.monotonic() - t0)
        self._finish(trials)
        if getattr(self, "report_failed", False) and not self.failures:
            return 1
        if self.failures:
            print(f"sweep: {count(len(self.failures), 'trial')} failed (not recorded; the same command retries them):",
                  file=sys.stderr)
            for tid, msg in self.failures:
                print(f"  {tid}: {msg}", file=sys.stderr)
            return 1
        return 0

    def _schedule(self, pending: List[TrainConfig]) -> None:
        """Run the pending trials on one pool of long-lived workers (pool.py): the processes,
        their imports, the dataset on the device and each rank set's process group outlive a
        trial, so a trial costs its training, not a start-up."""
        from shmlearn.pool import Pool
        os.makedirs(self.tmp_dir, exist_ok=True)
        queue: List[Tuple[TrainConfig, int]] = [(c, 1) for c in pending]
        free = list(range(self.nslots))
        running: Dict[int, _Running] = {}
        width = max([self.nslots] + [self._procs(c) for c in pending])
        prev = signal.signal(signal.SIGTERM, _raise_interrupt)
        from shmlearn.train import preload_data
        datasets = sorted({(c.dataset, c.data_dir, c.seed) for c in pending}, key=repr)[:2]
        self.pool = Pool(width, cuda=self.cuda, init=(preload_data, (datasets, self.cuda)))
        # Start every worker the grid can use now: they import in parallel with the first trial.
        self.pool.warm(range(min(width, max(self.nslots if self.parallel > 1 else 0,
                                             max(self._procs(c) for c in pending)))))
        # Nothing else runs while a trial trains (its areas are wall-clock): the workers start,
        # and matplotlib loads for the report (~0.5 s on a slow core), before the first trial.
        warm = None
        if self.sc.report:
            import threading
            warm = threading.Thread(target=_warm_report, name="sweep-warm-report", daemon=True)
            warm.start()
        self.pool.wait_ready()
        if warm is not None:
            warm.join()
        try:
            self._post_bounds()
            while queue or running:
                while queue and len(running) < self.parallel:
                    cfg, attempt = queue[0]
                    need = min(self._need(cfg), self.nslots)
                    if need > len(free) or (self._need(cfg) > self.nslots and running):
                        break  # in grid order: no trial jumps the queue, so none starves
                    queue.pop(0)
                    slots, free = free[:need], free[need:]
                    r = self._start(cfg, slots, attempt)
                    running[r.job.id] = r
                for job in self.pool.poll(0.5):
                    r = running.pop(job.id)
                    free = sorted(free + r.slots)
                    if self._done(r, job):
                        queue.insert(0, (r.cfg, r.attempt + 1))
        except KeyboardInterrupt:
            n = len(running)
            self.pool.close()
            print(f"sweep: interrupted; {n} trial{'s' if n != 1 else ''} in flight will run again on the next run",
                  file=sys.stderr, flush=True)
            raise
        finally:
            signal.signal(signal.SIGTERM, prev)
            self.pool.close()

    def _procs(self, cfg: TrainConfig) -> int:
        return registry.spec(cfg).processes(cfg.workers)

    def _start(self, cfg: TrainConfig, slots: List[int], attempt: int) -> _Running:
        """Rank r runs on the worker of its first slot and, on CPU, is pinned to its T slots'
        cores. A trial larger than the machine runs alone on workers 0..P-1, unpinned."""
        from shmlearn.train import rank_main
        tid = trial_id(cfg)
        tmp = self._attempt_dir(tid, attempt)
        cfg = dataclasses.replace(cfg, out=tmp)
        procs = self._procs(cfg)
        per = 1 if self.cuda else (cfg.threads or 1)
        if self._need(cfg) <= self.nslots:
            workers = [slots[r * per] for r in range(procs)]
            cores = None if self.cuda else [self._cores(slots[r * per:(r + 1) * per]) for r in range(procs)]
        else:
            workers, cores = list(range(procs)), None
        try:
            with open(tmp + ".log", "a") as f:
                f.write(f"sweep: trial on {'GPUs' if self.cuda else 'cores'} "
                        f"{slots if self.cuda or cores is None else [c for cs in cores for c in cs]}\n")
        except OSError as e:  # a full disk: a write error carries no path
            raise OSError(e.errno, e.strerror, tmp + ".log") from None
        prune_key = self._prune_key(cfg, tid)
        job = self.pool.start(rank_main, (cfg.to_dict(), prune_key), slots=workers,
                              backend="nccl" if self.cuda else "gloo", timeout_s=cfg.timeout,
                              cores=cores, log=tmp + ".log")
        return _Running(cfg, tid, job, slots, tmp, time.monotonic(), attempt)

    def _attempt_dir(self, tid: str, attempt: int) -> str:
        """Where attempt `attempt` of trial `tid` runs before it is published under trials/."""
        return os.path.join(self.tmp_dir, f"{tid}-{attempt}")

    def _prune_key(self, cfg: TrainConfig, tid: str) -> Optional[str]:
        """Where the trial's rank 0 reads its pruning bound: one per worker count."""
        return bound_key("sweep", cfg.workers) if self.sc.prune else None

    def _cores(self, slots: List[int]) -> Optional[List[int]]:
        if not hasattr(os, "sched_getaffinity"):
            return None
        mine = sorted(self._mine)
        return [mine[s % len(mine)] for s in slots]

    def _done(self, r: _Running, job) -> bool:
        """A trial's job ended: record it, or say it failed. Returns True to retry it once."""
        from shmlearn.errors import Diverged, WorkerFailed
        try:
            job.results()
            status, text = "completed", ""
        except Diverged as e:
            status, text = "diverged", str(e)
        except BadInput as e:
            status, text = "bad_input", str(e)
        except WorkerFailed as e:
            status, text = "failed", str(e)
        if status in ("completed", "diverged") and os.path.exists(os.path.join(r.tmp, "summary.json")):
            final = os.path.join(self.trials_dir, r.tid)
            os.replace(r.tmp + ".log", os.path.join(r.tmp, "log.txt"))
            try:
                os.rename(r.tmp, final)  # the run directory appears whole, or not at all
            except OSError:
                if not os.path.isfile(os.path.join(final, "summary.json")):
                    raise
                # A study's other process published the same trial first (it took this one as
                # lost, or this one took its): that run directory counts, this one goes.
                shutil.rmtree(r.tmp, ignore_errors=True)
            self._record(r.cfg, r.tid, final, time.monotonic() - r.t0, group_s=job.group_s())
            return False
        text = text or "no summary.json written"
        if status == "failed" and r.attempt < 2:
            print(f"sweep: {r.tid} failed ({text}); retrying once", file=sys.stderr, flush=True)
            return True
        self.failures.append((r.tid, f"{text} (log {r.tmp}.log)"))
        self.finished += 1
        print(f"[{self.finished}/{self.total}] {r.tid}: FAILED: {text}", flush=True)
        return False

    # -- pruning (pruning.py) -----------------------------------------------------------------------
    def _post_bounds(self) -> None:
        """Post each worker count's bound: the least area of a finished survivor, and the least
        time to the target accuracy (with --target-accuracy)."""
        if not self.sc.prune or getattr(self, "pool", None) is None:
            return
        target = self.sc.target_accuracy
        for w, (area, t) in self._bounds().items():
            post_bound(self.pool.store, bound_key("sweep", w), area, target=target is not None, time_to_target=t)

    def _bounds(self) -> Dict[int, Tuple[float, Optional[float]]]:
        return best_bounds(self.store.load(repair=False), self.sc.threshold, self.sc.target_accuracy)

    def _write_timing(self, wall_s: float) -> None:
        """DIR/timing.json: where this invocation's seconds went. Efficiency = the slot-seconds
        trials spent training (each trial's training seconds times the GPUs or cores it held) over
        the slot-seconds the sweep had (its wall time times its slots): at most 1, also when trials
        run side by side; a 1-worker trial at a time on 2 GPUs is at most 0.5. Overhead of a
        trial = its elapsed time minus its training, evaluation and checkpoint seconds (start-up,
        setup, writing)."""
        from shmlearn.runs import write_json_atomic
        rows = self.ran_rows
        train_s = sum(r["summary"].get("wall_time_s") or 0.0 for r in rows)
        eval_s = sum((r["summary"].get("eval_time_s") or 0.0) + (r["summary"].get("checkpoint_time_s") or 0.0)
                     for r in rows)
        over = [r["elapsed_s"] - (r["summary"].get("wall_time_s") or 0.0) - (r["summary"].get("eval_time_s") or 0.0)
                - (r["summary"].get("checkpoint_time_s") or 0.0) for r in rows]
        used = sum((r["summary"].get("wall_time_s") or 0.0) * r.get("slots", 1) for r in rows)
        info = {"wall_s": wall_s, "trials_run": len(rows), "training_s": train_s, "eval_s": eval_s,
                "efficiency": used / (wall_s * self.nslots) if wall_s > 0 else None, "slots": self.nslots,
                "parallel": self.parallel,
                "prune": self.sc.prune, "pruned": sum(r["status"] == "pruned" for r in rows),
                "workers_started": self.pool.started_workers if self.pool else None,
                "startup": self.pool.startup if self.pool else None,
                "overhead_s": [{"id": r["id"], "workers": r["config"]["workers"], "s": o,
                                "setup_s": r["summary"].get("setup_time_s"), "group_s": r.get("group_s")}
                               for r, o in zip(rows, over)],
                "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
        write_json_atomic(os.path.join(self.dir, "timing.json"), info)
        print(f"sweep: ran {count(len(rows), 'trial')} in {wall_s:.1f} s: {train_s:.1f} s training, {eval_s:.1f} s "
              f"evaluating (efficiency {info['efficiency'] or 0:.2f})"
              + (f"; pruned {info['pruned']}" if self.sc.prune else ""), flush=True)

    def _record(self, cfg: TrainConfig, tid: str, run_dir: str, elapsed: Optional[float], *,
                adopted: bool = False, group_s: Optional[float] = None) -> bool:
        """Append the result line of a finished trial; False if `run_dir` holds no finished run."""
        from shmlearn.runs import read_jsonl
        try:
            with open(os.path.join(run_dir, "summary.json")) as f:
                summary = json.load(f)
        except (OSError, json.JSONDecodeError):
            return False
        if summary.get("status") not in ("completed", "diverged", "pruned"):
            return False
        _fix_out(run_dir)
        try:
            evals = read_jsonl(os.path.join(run_dir, "eval.jsonl"))
        except (OSError, json.JSONDecodeError):
            evals = []
        row = {"id": tid, "status": summary["status"],
               "config": {k: v for k, v in cfg.to_dict().items() if k not in NOT_SWEPT},
               "summary": summary, "run_dir": os.path.relpath(run_dir, self.dir),
               "eval_curve": [[e["time_s"], e.get("test_accuracy")] for e in evals],
               "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
               # The trial's wall time in the sweep (start to recorded); minus the summary's
               # wall_time_s, eval_time_s and checkpoint_time_s, what the sweep spent around it.
               "elapsed_s": elapsed, "group_s": group_s, "slots": min(self._need(cfg), self.nslots)}
        if summary["status"] == "pruned":
            bound = self._bounds().get(int(cfg.workers))
            row["pruned"] = {"area_so_far": summary.get("loss_area"), "time_s": summary.get("wall_time_s"),
                             "bound_area": bound[0] if bound else None}
        self._save(row)
        if not adopted:
            self.ran_rows.append(row)
        self._post_bounds()
        if not adopted:
            self.done_now += 1
            self.finished += 1
            s = summary
            res = (f"area {s['loss_area']:.4g}, min loss {s['min_loss']:.4f}, acc {_fmt(s.get('test_accuracy'), '.4f')}"
                   if s["status"] == "completed" else
                   f"PRUNED at step {s.get('steps')}/{s.get('planned_steps')} ({self._pruned_why(row)})"
                   if s["status"] == "pruned" else
                   f"DIVERGED at step {s.get('diverged_step')}")
            print(f"[{self.finished}/{self.total}] {tid}: {res}, {s['wall_time_s']:.2f} s training"
                  + (f", {elapsed:.1f} s in all" if elapsed else ""), flush=True)
        else:
            print(f"sweep: {tid} had finished before the last sweep was stopped; recorded it", flush=True)
        return True

    def _save(self, row: Dict[str, Any]) -> None:
        """Keep a finished trial's row: one line appended to results.jsonl (study.py: the study)."""
        self.store.append(row)

    def _pruned_why(self, row: Dict[str, Any]) -> str:
        return f"area so far {row['summary']['loss_area']:.4g} > best {row['pruned']['bound_area']:.4g}"

    # -- the end -------------------------------------------------------------------------------
    def _finish(self, trials: List[TrainConfig]) -> None:
        from shmlearn.runs import write_json_atomic
        ids = [trial_id(c) for c in trials]
        by_id = {r["id"]: r for r in self.store.load(repair=False)}
        rows = [by_id[i] for i in ids if i in by_id]
        extra = len(by_id) - len(rows)
        if extra:
            print(f"sweep: {extra} results in results.jsonl are from another grid; left out of the winners")
        w = pick_winners(rows, threshold=self.sc.threshold, target_accuracy=self.sc.target_accuracy,
                         swept=ordered_axes(self.sc.axes))
        write_json_atomic(os.path.join(self.dir, "winners.json"), w)
        print(winners_table(w), flush=True)
        if self.sc.report:
            try:
                from shmlearn.report import write_report
            except ImportError as e:
                print(f"sweep: no report ({e}); pip install matplotlib", file=sys.stderr)
                return
            try:
                path = write_report([self.dir])
            except OSError as e:  # a full disk: the results are safe in results.jsonl
                print(f"sweep: could not write the report ({e}); the results are recorded; "
                      f"`shmlearn report {self.dir}` writes it again", file=sys.stderr, flush=True)
                self.report_failed = True
                return
            print(f"sweep: report {path}", flush=True)


def _warm_report() -> None:
    try:
        from shmlearn.report import mpl
        fig, ax = mpl.figure(2, 2)
        ax.plot([0, 1], [0, 1])
        ax.set(title="warm", xlabel="x", ylabel="y")
        mpl.png(fig)
    except Exception:  # noqa: BLE001 - no matplotlib: the report step says so itself
        pass


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _fix_out(run_dir: str) -> None:
    """config.yaml names the attempt's temporary folder; point it at the published one."""
    import yaml
    path = os.path.join(run_dir, "config.yaml")
    try:
        with open(path) as f:
            d = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return
    if isinstance(d, dict) and d.get("out") != run_dir:
        d["out"] = run_dir
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump(d, f, sort_keys=False)
        os.replace(tmp, path)


def run_sweep(sc: SweepConfig) -> int:
    """Run (or continue) a sweep; returns the CLI's exit code (0, or 1 if trials failed)."""
    check_search(sc)
    if sc.storage is not None:
        try:
            from shmlearn.study import run_study  # optuna, imported only here
        except ImportError as e:
            if (e.name or "").split(".")[0] not in ("optuna", "sqlalchemy"):
                raise
            raise BadInput(f"--storage: optuna is not installed ({e.name}); "
                           f"pip install 'shmlearn[optuna]'") from None
        return run_study(sc)
    return Sweep(sc).run()


SEARCHES = ("grid", "tpe", "random")
PRUNERS = ("area", "median", "halving")


def check_search(sc: SweepConfig) -> None:
    """The study flags go together (study.py); a sweep without --storage takes none of them."""
    if sc.search not in SEARCHES:
        raise BadInput(f"--search {sc.search}: expected one of {', '.join(SEARCHES)}")
    if sc.pruner is not None and sc.pruner not in PRUNERS:
        raise BadInput(f"--pruner {sc.pruner}: expected one of {', '.join(PRUNERS)}")
    if sc.storage is None:
        for flag, v in (("--study", sc.study), ("--search", None if sc.search == "grid" else sc.search),
                        ("--trials", sc.trials), ("--pruner", sc.pruner), ("--search-seed", sc.search_seed)):
            if v is not None:
                raise BadInput(f"{flag} {v}: needs --storage URL (an Optuna study; sqlite:///study.db on one machine)")
        return
    if not sc.study:
        raise BadInput(f"--storage {sc.storage}: needs --study NAME")
    if sc.search == "grid":
        if sc.trials is not None:
            raise BadInput(f"--trials {sc.trials}: only with --search tpe or random; a grid runs every combination")
        if sc.pruner in ("median", "halving"):
            raise BadInput(f"--pruner {sc.pruner}: only with --search tpe or random (it changes a grid's winners); "
                           f"a grid prunes exactly with --prune")
    else:
        if sc.trials is None or sc.trials < 1:
            raise BadInput(f"--search {sc.search}: needs --trials N (N > 0)")
        if not sc.axes:
            raise BadInput(f"--search {sc.search}: no axis to search; give a flag two or more values "
                           f"(its smallest and largest bound the range)")
    if not sc.stale_after > 0:
        raise BadInput(f"--stale-after {sc.stale_after}: expected seconds > 0")


# --- CLI ------------------------------------------------------------------------------------

def register(sub) -> None:
    from shmlearn.cli import field_docs, flag_docs
    p = sub.add_parser("sweep", help="sweep any train flags; pick the best per worker count",
                       description="Run every combination of the given flag values as a training run "
                                   "(each flag takes A,B,C or START:STOP:STEP), P at a time without "
                                   "oversubscribing; pick winners by the paper's rule; write a report. "
                                   "The same command again continues where the last one stopped.")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML of any of these flags; a list is an axis; flags win")
    docs = flag_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in NOT_SWEPT:
            continue
        flag = "--" + f.name.replace("_", "-")
        if _kind(f.name) is bool:
            p.add_argument(flag, dest=f.name, nargs="?", const="true", default=argparse.SUPPRESS,
                           metavar="true,false", help=docs.get(f.name, ""))
        else:
            p.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, metavar="V[,V...]|A:B:S",
                           help=docs.get(f.name, ""))
    g = p.add_argument_group("sweep")
    for name in ("threshold", "target_accuracy", "parallel", "slots", "out"):
        fd = next(f for f in dataclasses.fields(SweepConfig) if f.name == name)
        typ = float if name in ("threshold", "target_accuracy") else int if name in ("parallel", "slots") else str
        g.add_argument("--" + name.replace("_", "-"), dest=f"sweep_{name}", type=typ,
                       default=fd.default if fd.default != "" else None,
                       help=field_docs(SweepConfig).get(name, "") +
                       (" Default: runs/sweep-<model>-<dataset>." if name == "out" else ""))
    g.add_argument("--no-report", dest="sweep_report", action="store_false", help="skip figures and report.html")
    g.add_argument("--no-progress", dest="sweep_no_progress", action="store_true",
                   help="accepted for symmetry with train; trials never draw a progress bar")
    g.add_argument("--prune", dest="sweep_prune", action="store_true",
                   help=field_docs(SweepConfig).get("prune", ""))
    o = p.add_argument_group("study (Optuna; pip install 'shmlearn[optuna]')")
    sd = field_docs(SweepConfig)
    o.add_argument("--storage", dest="sweep_storage", metavar="URL", help=sd.get("storage", ""))
    o.add_argument("--study", dest="sweep_study", metavar="NAME", help=sd.get("study", ""))
    o.add_argument("--search", dest="sweep_search", default="grid", metavar="|".join(SEARCHES),
                   help=sd.get("search", ""))
    o.add_argument("--trials", dest="sweep_trials", type=int, metavar="N", help=sd.get("trials", ""))
    o.add_argument("--pruner", dest="sweep_pruner", metavar="|".join(PRUNERS), help=sd.get("pruner", ""))
    o.add_argument("--search-seed", dest="sweep_search_seed", type=int, metavar="N", help=sd.get("search_seed", ""))
    o.add_argument("--stale-after", dest="sweep_stale_after", type=float, default=60.0, metavar="S",
                   help=sd.get("stale_after", ""))
    p.set_defaults(func=cmd_sweep)


def sweep_config_from_args(ns: argparse.Namespace) -> SweepConfig:
    values = load_yaml(ns.config) if getattr(ns, "config", None) else {}
    values = {k.replace("-", "_"): v for k, v in values.items()}
    for k in NOT_SWEPT:
        if k in values:
            raise BadInput(f"--config {ns.config}: '{k}' is set by the sweep (--out names the sweep directory)")
    values.update({k: v for k, v in vars(ns).items()
                   if k not in ("command", "config", "func") and not k.startswith("sweep_")})
    fixed, axes = split_axes(values)
    if ns.sweep_target_accuracy is not None and not 0 < ns.sweep_target_accuracy <= 1:
        raise BadInput(f"--target-accuracy {ns.sweep_target_accuracy}: expected a fraction in (0, 1]")
    def name(k, default):
        return str(fixed.get(k, default)) if k not in axes else "+".join(map(str, axes[k]))
    out = ns.sweep_out or os.path.join("runs", f"sweep-{name('model', 'mlp')}-{name('dataset', 'digits')}")
    return SweepConfig(fixed=fixed, axes=axes, threshold=ns.sweep_threshold,
                       target_accuracy=ns.sweep_target_accuracy, parallel=ns.sweep_parallel,
                       slots=ns.sweep_slots, out=out, report=ns.sweep_report,
                       prune=getattr(ns, "sweep_prune", False), storage=ns.sweep_storage, study=ns.sweep_study,
                       search=ns.sweep_search, trials=ns.sweep_trials, pruner=ns.sweep_pruner,
                       search_seed=ns.sweep_search_seed, stale_after=ns.sweep_stale_after)


def cmd_sweep(ns: argparse.Namespace) -> int:
    return run_sweep(sweep_config_from_args(ns))
