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
from shmlearn.config import TrainConfig, validate
from shmlearn.errors import BadInput, count
from shmlearn.flags import scalar_type
from shmlearn.pruning import bound_key, post_bound
from shmlearn.results import AXIS_ORDER, ResultStore, best_bounds, pick_winners, winners_table
from shmlearn.results import fmt as _fmt
from shmlearn.runs import lock_dir, write_json_atomic
from shmlearn.sync import registry

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
    """bool, int, float or str: the field's annotation, resolved (flags.scalar_type)."""
    return scalar_type(typing.get_type_hints(TrainConfig)[name])


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
            raise BadInput(f"--samples {cfg.samples}: smaller than one step of {count(cfg.workers, 'worker')} "
                           f"x {cfg.batch_size} samples")
        trials.append(cfg)
    return trials


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


TRIAL_TIMES = "sweep_times.json"
"""In a trial's run directory: {elapsed_s, group_s}, as the sweep that ran it measured them."""


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
        return lock_dir(self.dir, f"--out {self.dir}: another sweep (or study) is running in this directory")

    def _write_spec(self, trials: List[TrainConfig], extra: Optional[Dict[str, Any]] = None) -> None:
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
            # What only this process measured goes with the run directory: a sweep that dies
            # between publishing and recording it is adopted by the next with its times.
            elapsed, group_s = time.monotonic() - r.t0, job.group_s()
            write_json_atomic(os.path.join(r.tmp, TRIAL_TIMES), {"elapsed_s": elapsed, "group_s": group_s})
            try:
                os.rename(r.tmp, final)  # the run directory appears whole, or not at all
            except OSError:
                if not os.path.isfile(os.path.join(final, "summary.json")):
                    raise
                # A study's other process published the same trial first (it took this one as
                # lost, or this one took its): that run directory counts, this one goes.
                shutil.rmtree(r.tmp, ignore_errors=True)
            self._record(r.cfg, r.tid, final, elapsed, group_s=group_s)
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
        if adopted:  # the times its own sweep measured (none from before they were kept)
            try:
                with open(os.path.join(run_dir, TRIAL_TIMES)) as f:
                    times = json.load(f)
                elapsed, group_s = times.get("elapsed_s"), times.get("group_s")
            except (OSError, ValueError, AttributeError):
                pass
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
