"""Sweeps on an Optuna study: `shmlearn sweep --storage URL --study NAME` (DESIGN X5).

    any number of processes, on any machines --ask--> one study (RDB or journal storage) <--tell--
      each: its trials on its own pool (sweep.Sweep's) -> DIR/trials/<id>/ -> the study's trial
      at the end: DIR/results.jsonl, winners.json, figures/ and report.html, from the study

* The trials come from the study. A grid is Optuna's GridSampler over the axes' values;
  `--search tpe|random --trials N` samples between each axis's smallest and largest value
  (distributions(): floats and ints log-scaled when max/min >= 10, workers and words
  categorical) until the study holds N trials, counted over all its processes.
* Each trial runs once. A trial carries its shmlearn id (sweep.trial_id, a hash of its config).
  GridSampler can hand one point to two processes that ask at once, and a lost trial is queued
  again: a process handed a config that is done, or waiting or running in a trial with a lower
  number, drops its trial (FAIL, user attr shmlearn_repeat_of). The lower number never defers to
  the higher, so one of them always runs.
* A process that dies (kill -9, a lost node) leaves its trial RUNNING. Each process beats
  (user attr shmlearn_beat) for its trials every BEAT_S seconds; a trial whose beat has not moved
  for --stale-after seconds by the watcher's own clock (no clock is compared across machines),
  or whose process on this host is gone, is failed by the first process that sees it (the
  storage lets one win that transition), which queues its config again: the other processes,
  or the same command again, run it. Optuna's own heartbeat is RDB-only; this one also works on
  JournalStorage.
* Pruning through Optuna's interface: rank 0 of a trial evaluates at eval points (10 by
  default, evenly over the budget); at each, the sweep process reports a value
  (trial.report(value, point)) and asks trial.should_prune(): the loss area so far for
  AreaPruner, the test loss for median and halving (they compare a trial's best value so far
  with its peers', which a growing area never is). AreaPruner is the pooled sweep's
  exact rule (pruning.py) over the study's finished trials; its bound is also posted to the
  trial's rank 0, which prunes at the step it can no longer win, as `sweep --prune` does.
  median / halving are Optuna's MedianPruner and SuccessiveHalvingPruner (tpe/random only: they
  may stop a trial that would have won). A trial told to stop ends at its next step, 'pruned'.
* The objective told to the study is the loss area (minimized); a diverged trial's is inf. TPE
  also gets the paper's threshold as a constraint (min loss <= threshold), so a fast run that
  did not learn does not steer it.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from shmlearn.config import TrainConfig
from shmlearn.errors import BadInput, count
from shmlearn.pruning import bound_key, cannot_win, post_bound
from shmlearn.results import best_bounds
from shmlearn.runs import lock_dir
from shmlearn.study_storage import _unwritable, _why, open_storage, redact
from shmlearn.sweep import (Sweep, SweepConfig, _Running, _kind, _raise_interrupt, expand_grid,
                            ordered_axes, trial_id)

optuna.logging.set_verbosity(optuna.logging.ERROR)  # the sweep prints its own lines
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

BEAT_S = 5.0
"""Seconds between a process's heartbeats for its trials (one storage write per trial)."""
LOOK_S = 1.0
"""Seconds between reads of the whole study while this process waits for others."""
CLAIM_WAIT_S = 30.0
"""A trial with a lower number whose params are not written yet is waited for this long."""
SPEC = "shmlearn"
"""Study user attr: what defines the study's trials (search, fixed values, axes)."""
HOST = socket.gethostname()


# --- storage and study ----------------------------------------------------------------------

def study_spec(sc: SweepConfig) -> Dict[str, Any]:
    return json.loads(json.dumps({"search": sc.search, "fixed": sc.fixed, "axes": sc.axes}))


def _spec_diff(theirs: Dict[str, Any], mine: Dict[str, Any]) -> str:
    def show(v):
        return ",".join(map(str, v)) if isinstance(v, list) else str(v)
    if theirs.get("search") != mine.get("search"):
        return f"--search {theirs.get('search')} there, {mine.get('search')} here"
    for part in ("axes", "fixed"):
        a, b = theirs.get(part, {}), mine.get(part, {})
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return (f"--{k.replace('_', '-')} {show(a[k]) if k in a else '(not given)'} there, "
                        f"{show(b[k]) if k in b else '(not given)'} here")
    return "its flags differ"


def distributions(sc: SweepConfig) -> Dict[str, Any]:
    """The search space. A grid: each axis's values. tpe/random: numbers between the axis's
    smallest and largest value, log-scaled when both are > 0 and max/min >= 10; workers (a
    layout, not a quantity to interpolate), words, booleans and None: the values given."""
    out: Dict[str, Any] = {}
    for a in ordered_axes(sc.axes):
        vals = sc.axes[a]
        kind = _kind(a)
        if sc.search == "grid" or a == "workers" or kind not in (int, float) or any(v is None for v in vals):
            out[a] = CategoricalDistribution(vals)
            continue
        lo, hi = min(vals), max(vals)
        log = lo > 0 and hi / lo >= 10
        out[a] = IntDistribution(int(lo), int(hi), log=log) if kind is int else FloatDistribution(lo, hi, log=log)
    return out


def space_size(space: Dict[str, Any]) -> Optional[int]:
    """How many distinct points the search space holds, or None where a float range makes it endless."""
    n = 1
    for d in space.values():
        if isinstance(d, CategoricalDistribution):
            n *= len(d.choices)
        elif isinstance(d, IntDistribution):
            n *= (d.high - d.low) // (d.step or 1) + 1
        else:
            return None
    return n


def _constraints(t: FrozenTrial) -> Tuple[float]:
    """TPE's constraint: <= 0 when the run's minimum loss reached the paper's threshold."""
    c = t.user_attrs.get("shmlearn_constraint")
    return (math.inf if c is None else c,)


class _GridSampler(optuna.samplers.GridSampler):
    """GridSampler, less its study.stop() when the grid is covered: that is for optimize()'s loop
    (outside it, stop() raises); the sweep knows when its grid is done (StudySweep._next)."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


def make_sampler(sc: SweepConfig):
    if sc.search == "grid":
        return _GridSampler({a: list(v) for a, v in sc.axes.items()}, seed=sc.search_seed)
    if sc.search == "random":
        return optuna.samplers.RandomSampler(seed=sc.search_seed)
    # Optuna 5 reads constraints the trial sets (StudySweep._save); 4 asks constraints_func.
    kw = {} if hasattr(optuna.trial.Trial, "set_constraint") else {"constraints_func": _constraints}
    # Few random trials before TPE models the rest: a quarter of the budget, 2 to 10.
    return optuna.samplers.TPESampler(seed=sc.search_seed, multivariate=True,
                                      n_startup_trials=max(2, min(10, (sc.trials or 0) // 4)), **kw)


class AreaPruner(optuna.pruners.BasePruner):
    """The pooled sweep's exact rule (pruning.py) as an Optuna pruner: prune a trial once its loss
    area so far exceeds the least area of a finished survivor (min loss <= threshold) of its
    worker count, and, with a target accuracy, its training time passes the best time to reach
    it. Loss areas only grow, so a pruned trial could not have won: the winners equal the full
    grid's.

    It reads what shmlearn's sweep writes: intermediate values are the loss area so far,
    user attr shmlearn_progress {train_s} the training seconds at the last report, finished
    trials' user attr row their results.jsonl line. `bound()` is also posted to the running
    trial's rank 0, which applies the same rule at every step."""

    def __init__(self, threshold: float = 1.8, target_accuracy: Optional[float] = None, workers: int = 2):
        self.threshold, self.target_accuracy, self.workers = threshold, target_accuracy, workers

    def bound(self, study: "optuna.Study", workers: int, trials=None) -> Optional[Tuple[float, Optional[float]]]:
        rows = finished_rows(trials if trials is not None else study.get_trials(deepcopy=False))
        return best_bounds(rows, self.threshold, self.target_accuracy).get(int(workers))

    def prune(self, study: "optuna.Study", trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        area = trial.intermediate_values[step]
        train_s = (trial.user_attrs.get("shmlearn_progress") or {}).get("train_s")
        workers = trial.params.get("workers", self.workers)
        b = self.bound(study, workers)
        if b is None or train_s is None or not math.isfinite(area):
            return False
        t = -math.inf if self.target_accuracy is None else math.inf if b[1] is None else b[1]
        return cannot_win(area, train_s, (b[0], t))


def make_pruner(name: Optional[str], sc: SweepConfig):
    if name == "area":
        return AreaPruner(sc.threshold, sc.target_accuracy, int(sc.fixed.get("workers") or 2))
    if name == "median":  # eval points are the steps: 10 by default
        return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=2)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=3)
    return optuna.pruners.NopPruner()


def open_study(sc: SweepConfig, storage, pruner) -> "optuna.Study":
    try:
        study = optuna.create_study(storage=storage, study_name=sc.study, sampler=make_sampler(sc), pruner=pruner,
                                    direction="minimize", load_if_exists=True)
    except Exception as e:  # noqa: BLE001 - e.g. a study of two objectives under that name
        raise BadInput(f"--study {sc.study}: cannot open it in {redact(sc.storage or '')} ({_why(e)})") from None
    mine = study_spec(sc)
    attrs = study.user_attrs
    if SPEC not in attrs:
        if study.trials or len(study.directions) != 1 or study.direction != optuna.study.StudyDirection.MINIMIZE:
            raise BadInput(f"--study {sc.study}: an Optuna study that shmlearn did not create; give another --study")
        study.set_user_attr(SPEC, mine)
        attrs = storage.get_study_user_attrs(study._study_id)  # two started at once: the last write holds
    if attrs[SPEC] != mine:
        raise BadInput(f"--study {sc.study}: created with another grid ({_spec_diff(attrs[SPEC], mine)}); "
                       f"give the same flags or another --study")
    return study


def finished_rows(trials) -> List[Dict[str, Any]]:
    """results.jsonl rows of the study's finished trials, in trial order, one per shmlearn id."""
    rows, seen = [], set()
    for t in sorted(trials, key=lambda t: t.number):
        row = t.user_attrs.get("row")
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and row and row["id"] not in seen:
            seen.add(row["id"])
            rows.append(row)
    return rows


# --- processes ------------------------------------------------------------------------------

def _proc_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc), so a reused pid is not it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return None if rest[0] == "Z" else rest[19]  # a zombie has died
    except (OSError, IndexError):
        return None


def _alive(owner: Dict[str, Any]) -> bool:
    pid = owner.get("pid")
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    start = _proc_start(int(pid))
    if os.path.isdir("/proc"):
        return start is not None and (owner.get("start") is None or start == owner["start"])
    return True


@dataclass
class _Owned:
    """One of this process's study trials."""
    trial: "optuna.trial.Trial"
    cfg: TrainConfig
    tid: str
    run: Optional[_Running] = None
    evals_seen: int = 0
    pruned: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)


# --- the sweep ------------------------------------------------------------------------------

class StudySweep(Sweep):
    """A sweep whose trials come from, and go back to, an Optuna study (module docstring)."""

    def __init__(self, sc: SweepConfig):
        if sc.prune and sc.pruner not in (None, "area"):
            raise BadInput(f"--prune --pruner {sc.pruner}: --prune is the area pruner; give one of them")
        self.pruner_name = sc.pruner or ("area" if sc.prune else None)
        super().__init__(replace(sc, prune=self.pruner_name is not None))
        self.owned: Dict[str, _Owned] = {}
        self.seen_beats: Dict[int, Tuple[Any, float]] = {}
        self.tids: Dict[int, Optional[str]] = {}
        self.cached: Optional[List[FrozenTrial]] = None
        self.cached_at = -math.inf
        self.beat_at = 0.0
        self.beats = 0
        self.owner = {"host": HOST, "pid": os.getpid(), "start": _proc_start(os.getpid())}
        self.points: Optional[int] = None
        """How many distinct points a tpe/random search space holds, where that is finite."""

    def _lock(self):
        """A shared lock on --out/.lock: every process of the study shares --out (results go
        through the study), a pooled sweep's exclusive lock keeps it out and it keeps that sweep
        out; an --out whose results.jsonl is another sweep's (a pooled one, another study) is
        refused, since the study's end rewrites results.jsonl whole."""
        f = lock_dir(self.dir, f"--out {self.dir}: a sweep without --storage is running in this directory",
                     shared=True)
        try:
            self._check_theirs()
        except BaseException:
            f.close()
            raise
        return f

    def _check_theirs(self) -> None:
        spec_path = os.path.join(self.dir, "sweep.json")
        if not os.path.exists(self.store.path) or not os.path.exists(spec_path):
            return
        try:
            with open(spec_path) as f:
                spec = json.load(f)
        except (OSError, ValueError):
            return
        n = sum(1 for line in open(self.store.path, "rb") if line.strip())
        if "storage" not in spec:
            raise BadInput(f"--out {self.dir}: holds a sweep without --storage ({count(n, 'result')} in "
                           f"results.jsonl), which this study would replace; give the study another --out")
        if (spec.get("storage"), spec.get("study")) != (redact(self.sc.storage or ""), self.sc.study):
            raise BadInput(f"--out {self.dir}: holds study {spec.get('study')} on {spec.get('storage')} "
                           f"({count(n, 'result')} in results.jsonl), which this study would replace; give it "
                           f"another --out")

    def _attempt_dir(self, tid: str, attempt: int) -> str:
        """Each process's own: one that took a trial over as lost must not delete the folder
        where the process it took it from (stopped, not dead) may still finish it."""
        return os.path.join(self.tmp_dir, f"{tid}-{HOST}-{os.getpid()}-{attempt}")

    # -- study reads ---------------------------------------------------------------------------
    def _trials(self, fresh: bool = False) -> List[FrozenTrial]:
        if fresh or self.cached is None or time.monotonic() - self.cached_at > LOOK_S:
            self.cached = self.study.get_trials(deepcopy=False)
            self.cached_at = time.monotonic()
        return self.cached

    def _config(self, params: Dict[str, Any]) -> TrainConfig:
        return expand_grid(self.sc.fixed, {a: [v] for a, v in params.items()}, cuda=self.cuda)[0]

    def _tid(self, t: FrozenTrial) -> Optional[str]:
        """The shmlearn id of a trial's config: from its params, or its queued params; None while
        they are not written yet; 'invalid' for a config that fails validation."""
        if t.number in self.tids:
            return self.tids[t.number]
        params = t.params if set(t.params) >= set(self.space) else t.system_attrs.get("fixed_params")
        if params is None or not set(params) >= set(self.space):
            return t.user_attrs.get("shmlearn_id")
        try:
            tid = trial_id(self._config({a: params[a] for a in self.space}))
        except BadInput:
            tid = "invalid"
        self.tids[t.number] = tid
        return tid

    # -- the run -------------------------------------------------------------------------------
    def _run(self, trials: List[TrainConfig]) -> int:
        self.space = distributions(self.sc)
        self.grid_ids = [trial_id(c) for c in trials] if self.sc.search == "grid" else None
        self.storage = open_storage(self.sc.storage)
        self.study = open_study(self.sc, self.storage, make_pruner(self.pruner_name, self.sc))
        os.makedirs(self.tmp_dir, exist_ok=True)
        start = self._trials(fresh=True)
        # Trials that failed before this command: their configs run again (a grid), as the same
        # sweep command retries a failed trial; failures from now on are not retried here.
        self.failed_before = {t.number for t in start if "shmlearn_failed" in t.user_attrs}
        done = len(finished_rows(start))
        what = (f"grid of {count(len(self.grid_ids), 'trial')}" if self.grid_ids is not None
                else f"{self.sc.search} search, {count(self.sc.trials, 'trial')}")
        print(f"sweep: study {self.sc.study} on {redact(self.sc.storage)}: {what} ({done} done), "
              f"{self.parallel} at a time here on {self.nslots} {'GPUs' if self.cuda else 'CPU cores'}"
              + (f", pruner {self.pruner_name}" if self.pruner_name else "") + f" | {self.dir}", flush=True)
        self.total, self.finished = (len(self.grid_ids) if self.grid_ids is not None else self.sc.trials), done
        self.points = space_size(self.space) if self.grid_ids is None else None
        if self.points is not None and self.points < (self.sc.trials or 0):
            print(f"sweep: the search space holds {count(self.points, 'distinct point')}, fewer than --trials "
                  f"{self.sc.trials}: the search ends once each has been asked for", flush=True)
            self.total = self.points
        widest = max(self._procs(c) for c in trials)
        t0 = time.monotonic()
        # From the first trial claimed on, Ctrl-C or SIGTERM (scancel, a preemption) gives this
        # process's trials back to the study before it leaves.
        prev = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            if self._want(busy=False) == "done":  # nothing to run or wait for: no pool to start
                return self._end()
            try:  # the pool starts before the first trial is claimed: a claimed trial beats
                self._loop(trials, widest, [])
            finally:
                if self.pool is not None:
                    self._write_timing(time.monotonic() - t0)
        except KeyboardInterrupt:
            n = len(self.owned)
            self._release(list(self.owned.values()))
            print(f"sweep: interrupted; {count(n, 'trial')} of this process went back to the study",
                  file=sys.stderr, flush=True)
            raise
        finally:
            signal.signal(signal.SIGTERM, prev)
        return self._end()

    def _loop(self, trials: List[TrainConfig], widest: int, ready: List[Tuple[_Owned, int]]) -> None:
        from shmlearn.pool import Pool
        from shmlearn.train import preload_data
        width = max(self.nslots, widest)
        datasets = sorted({(c.dataset, c.data_dir, c.seed) for c in trials}, key=repr)[:2]
        self.pool = Pool(width, cuda=self.cuda, init=(preload_data, (datasets, self.cuda)))
        self.pool.warm(range(min(width, max(self.nslots if self.parallel > 1 else 0, widest))))
        self.pool.wait_ready()
        free = list(range(self.nslots))
        running: Dict[int, _Owned] = {}  # ready: claimed (or to retry), waiting for slots
        try:
            while True:
                for job in self.pool.poll(0.5) if running else []:
                    o = running.pop(job.id)
                    free = sorted(free + o.run.slots)
                    failures = len(self.failures)
                    if self._done(o.run, job):
                        ready.insert(0, (o, o.run.attempt + 1))
                    elif len(self.failures) > failures:
                        self._tell_failed(o, self.failures[-1][1])
                self._beat()
                self._progress(running.values())
                while len(running) < self.parallel:
                    if not ready:
                        nxt = self._next(busy=bool(running))
                        if nxt == "done" and not running:
                            return
                        if not isinstance(nxt, _Owned):
                            break
                        ready.append((nxt, 1))
                    o, attempt = ready[0]
                    need = min(self._need(o.cfg), self.nslots)
                    if need > len(free) or (self._need(o.cfg) > self.nslots and running):
                        break
                    ready.pop(0)
                    slots, free = free[:need], free[need:]
                    shutil.rmtree(self._attempt_dir(o.tid, attempt), ignore_errors=True)
                    self._post_bounds([o])
                    o.run = self._start(o.cfg, slots, attempt)
                    o.evals_seen = 0
                    running[o.run.job.id] = o
                if not running:
                    time.sleep(LOOK_S if not ready else 0.05)
        finally:
            self.pool.close()

    # -- asking ----------------------------------------------------------------------------------
    def _next(self, *, busy: bool):
        """A claimed trial to run, or 'wait' (others still run trials), or 'done'."""
        want = self._want(busy=busy)
        return (self._claim() or "wait") if want == "ask" else want

    def _want(self, *, busy: bool) -> str:
        """'ask' (the study wants a trial run), 'wait' (others still run trials) or 'done'; lost
        trials are failed and queued again, and a grid's points that GridSampler counts as
        visited but nobody finished are queued."""
        trials = self._trials(fresh=True)
        if self._reap(trials):
            trials = self._trials(fresh=True)
        done = {r["id"] for r in finished_rows(trials)}
        live, waiting, failed = set(), False, set()
        others_running = False
        for t in trials:
            if t.state == TrialState.WAITING:
                waiting = True
                live.add(self._tid(t))
            elif t.state == TrialState.RUNNING:
                live.add(self._tid(t))
                others_running |= all(o.trial.number != t.number for o in self.owned.values())
            elif t.state == TrialState.FAIL and "shmlearn_failed" in t.user_attrs and t.number not in self.failed_before:
                failed.add(self._tid(t))
        if self.grid_ids is not None:
            todo = [i for i in self.grid_ids if i not in done and i not in live and i not in failed]
            tried = {self._tid(t) for t in trials if "grid_id" in t.system_attrs}
            for i in todo:
                if i in tried:  # GridSampler counts a failed or lost point as visited: queue it
                    self.study.enqueue_trial(self._params_of(i), user_attrs={"shmlearn_id": i})
                    waiting = True
            want = bool(todo)
        else:
            failed_all = sum(1 for t in trials if "shmlearn_failed" in t.user_attrs)
            want = len(done) + len({i for i in live if i}) + failed_all < (self.sc.trials or 0)
            if want and self.points is not None:  # every point asked for once (repeats too): the search is over
                seen = {tuple(sorted(t.params.items())) for t in trials if set(t.params) >= set(self.space)}
                want = len(seen) < self.points
        if want or waiting:
            return "ask"
        return "wait" if (busy or others_running) else "done"

    def _params_of(self, tid: str) -> Dict[str, Any]:
        for t in self._trials():
            if self._tid(t) == tid and set(t.params) >= set(self.space):
                return {a: t.params[a] for a in self.space}
        raise RuntimeError(f"no params known for {tid}")

    def _claim(self) -> Optional[_Owned]:
        """Ask the study for a trial and keep it unless it repeats one done, queued or running."""
        trial = self.study.ask(self.space)
        try:
            cfg = self._config(trial.params)
        except BadInput as e:
            trial.set_user_attr("shmlearn_failed", str(e))
            self.study.tell(trial, state=TrialState.FAIL)
            self.failures.append((f"trial {trial.number}", str(e)))
            print(f"sweep: trial #{trial.number} {trial.params}: {e}", flush=True)
            return None
        tid = trial_id(cfg)
        self.tids[trial.number] = tid
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            conflict, unknown = None, False
            for t in self._trials(fresh=True):
                if t.number == trial.number:
                    continue
                other = self._tid(t)
                if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and "row" in t.user_attrs and other == tid:
                    conflict = t
                elif t.number < trial.number and t.state in (TrialState.RUNNING, TrialState.WAITING):
                    if other == tid:
                        conflict = t
                    unknown |= other is None and t.state == TrialState.RUNNING
                if conflict is not None:
                    break
            if conflict is not None or not unknown or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if conflict is not None:
            trial.set_user_attr("shmlearn_repeat_of", conflict.number)
            self.study.tell(trial, state=TrialState.FAIL)
            print(f"sweep: trial #{trial.number} repeats {tid} (trial #{conflict.number}, "
                  f"{conflict.state.name.lower()}); dropped", flush=True)
            return None
        trial.set_user_attr("shmlearn_id", tid)
        trial.set_user_attr("shmlearn_owner", self.owner)
        trial.set_user_attr("shmlearn_beat", 0)
        o = _Owned(trial, cfg, tid)
        self.owned[tid] = o
        final = os.path.join(self.trials_dir, tid)
        if os.path.isdir(final):
            # Finished and published before its process died, not yet told: record it as it is.
            if self._record(cfg, tid, final, None, adopted=True):
                return None
            shutil.rmtree(final, ignore_errors=True)
        return o

    # -- liveness --------------------------------------------------------------------------------
    def _beat(self) -> None:
        if time.monotonic() < self.beat_at:
            return
        self.beat_at = time.monotonic() + BEAT_S
        self.beats += 1
        for o in list(self.owned.values()):
            try:
                o.trial.set_user_attr("shmlearn_beat", self.beats)
            except UpdateFinishedTrialError:  # another process judged it lost: it runs again there
                print(f"sweep: trial #{o.trial.number} ({o.tid}) was taken as lost by another process",
                      file=sys.stderr, flush=True)

    def _reap(self, trials: List[FrozenTrial]) -> bool:
        """Fail the running trials of dead processes and queue their configs again."""
        mine = {o.trial.number for o in self.owned.values()}
        reaped = False
        now = time.monotonic()
        for t in trials:
            if t.state != TrialState.RUNNING or t.number in mine:
                continue
            beat, owner = t.user_attrs.get("shmlearn_beat"), t.user_attrs.get("shmlearn_owner")
            last = self.seen_beats.get(t.number)
            if last is None or last[0] != beat:
                self.seen_beats[t.number] = (beat, now)
                last = (beat, now)
            why = None
            if owner and owner.get("host") == HOST and not _alive(owner):
                why = f"its process {owner.get('pid')} on {HOST} is gone"
            elif now - last[1] > self.sc.stale_after:
                why = f"no heartbeat for {now - last[1]:.0f} s"
            if why is None:
                continue
            try:
                t_id = t._trial_id
                self.storage.set_trial_user_attr(t_id, "shmlearn_lost", why)
                won = self.storage.set_trial_state_values(t_id, TrialState.FAIL)
            except (UpdateFinishedTrialError, RuntimeError):
                continue  # finished, or another process failed it first
            if not won:
                continue
            reaped = True
            params = t.params if set(t.params) >= set(self.space) else None
            if params is not None:
                self.study.enqueue_trial({a: params[a] for a in self.space},
                                         user_attrs={"shmlearn_id": self._tid(t), "shmlearn_retry_of": t.number})
            print(f"sweep: trial #{t.number} ({self._tid(t)}) lost: {why}; "
                  + ("queued again" if params is not None else "it had no config yet"), flush=True)
        return reaped

    def _release(self, owned: List[_Owned]) -> None:
        """Interrupted (Ctrl-C, SIGTERM from a scheduler): give our trials back to the study now."""
        for o in owned:
            try:
                o.trial.set_user_attr("shmlearn_lost", "its process was interrupted")
                self.study.tell(o.trial, state=TrialState.FAIL)
                self.study.enqueue_trial({a: o.trial.params[a] for a in self.space},
                                         user_attrs={"shmlearn_id": o.tid, "shmlearn_retry_of": o.trial.number})
            except Exception:  # noqa: BLE001 - the storage may be what failed; the heartbeat covers it
                pass
        self.owned.clear()

    # -- pruning -------------------------------------------------------------------------------
    def _prune_key(self, cfg: TrainConfig, tid: str) -> Optional[str]:
        return bound_key(f"study-{tid}", cfg.workers) if self.pruner_name else None

    def _bounds(self) -> Dict[int, Tuple[float, Optional[float]]]:
        return best_bounds(finished_rows(self._trials()), self.sc.threshold, self.sc.target_accuracy)

    def _post_bounds(self, owned: Optional[List[_Owned]] = None) -> None:
        """The area rule's bound goes to each trial's rank 0 (before it starts, and whenever a trial
        finishes), which checks it every step."""
        if self.pruner_name != "area" or self.pool is None:
            return
        bounds = self._bounds()
        for o in self.owned.values() if owned is None else owned:
            if o.cfg.workers in bounds and not o.pruned:
                area, t = bounds[o.cfg.workers]
                post_bound(self.pool.store, self._prune_key(o.cfg, o.tid), area,
                           target=self.sc.target_accuracy is not None, time_to_target=t)

    def _progress(self, running) -> None:
        """Report each new eval point to the study and ask its pruner. AreaPruner gets the loss
        area so far (its rule); median and halving get the test loss there: Optuna's pruners
        compare a trial's best value so far with its peers', which a growing area never is."""
        for o in running:
            if self.pruner_name is not None and not o.pruned:
                self._report(o, o.run.tmp, decide=True)
        self._post_bounds()

    def _report(self, o: _Owned, run_dir: str, *, decide: bool) -> None:
        """Report the eval points of `run_dir` not reported yet; with `decide`, ask the pruner and
        stop the trial if it says so. A trial that ends between two looks gets the rest reported
        without deciding, so that its peers have values at every point."""
        from shmlearn.runs import read_jsonl
        try:
            evals = [e for e in read_jsonl(os.path.join(run_dir, "eval.jsonl")) if e.get("samples")]
            metrics = (read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
                       if self.pruner_name == "area" and len(evals) > o.evals_seen else [])
        except (OSError, ValueError):
            return  # not written yet, or a line being written
        for k in range(o.evals_seen, len(evals)):
            t = evals[k]["time_s"]
            if self.pruner_name == "area":
                pts = [(m["time_s"], m["loss"]) for m in metrics if m["time_s"] <= t + 1e-9]
                value = sum((t1 - t0) * (l0 + l1) / 2 for (t0, l0), (t1, l1) in zip(pts, pts[1:]))
            else:
                value = evals[k].get("test_loss")
            if value is None or not math.isfinite(value):
                continue
            try:
                o.trial.set_user_attr("shmlearn_progress", {"step": k + 1, "train_s": t, "value": value})
                o.trial.report(value, k + 1)
                stop = decide and o.trial.should_prune()
            except UpdateFinishedTrialError:  # taken as lost by another process
                break
            if stop and self.pruner_name == "area":
                # Its values here are areas over the logged steps, not exact: rank 0 applies the
                # same rule to the exact area at every step (the bound posted), and stops there.
                continue
            if stop:
                mine = [evals[j].get("test_loss") for j in range(k + 1) if evals[j].get("test_loss") is not None]
                o.pruned = {"pruner": self.pruner_name, "step": k + 1, "value": value, "metric": "test loss",
                            "best_so_far": min(mine) if mine else value,
                            "peers": self._peer_value(o, k + 1)}
                post_bound(self.pool.store, self._prune_key(o.cfg, o.tid), -math.inf, target=False,
                           time_to_target=None)  # (-inf, -inf): stop at the next step
                break
        o.evals_seen = len(evals)

    def _peer_value(self, o: _Owned, step: int) -> Optional[float]:
        """What the pruner compared with, for the record: the bound's area (area), else the
        median of the completed trials' values at that eval point (Optuna's PercentilePruner takes
        COMPLETE trials only: one still running, or pruned, was not among them)."""
        if self.pruner_name == "area":
            b = self._bounds().get(o.cfg.workers)
            return b[0] if b else None
        vals = sorted(t.intermediate_values[step] for t in self._trials(fresh=True)
                      if t.state == TrialState.COMPLETE and t.number != o.trial.number
                      and step in t.intermediate_values)
        if not vals:
            return None
        n = len(vals)
        return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2

    # -- telling -------------------------------------------------------------------------------
    def _save(self, row: Dict[str, Any]) -> None:
        o = self.owned.pop(row["id"], None)
        if o is None:
            return
        s = row["summary"]
        if row["status"] == "pruned" and o.pruned:
            row["pruned"].update(o.pruned)
        elif row["status"] == "pruned":
            row["pruned"]["pruner"] = self.pruner_name
        if self.pruner_name is not None and not o.pruned and row.get("run_dir"):
            self._report(o, os.path.join(self.dir, row["run_dir"]), decide=False)
        area = s.get("loss_area")
        ml = s.get("min_loss")
        constraint = ml - self.sc.threshold if ml is not None and row["status"] == "completed" else math.inf
        try:
            o.trial.set_user_attr("row", row)
            o.trial.set_user_attr("shmlearn_constraint", constraint)
            if hasattr(o.trial, "set_constraint"):
                o.trial.set_constraint("min_loss_minus_threshold", constraint)
            if row["status"] == "pruned":
                self.study.tell(o.trial, state=TrialState.PRUNED)
            else:
                value = area if row["status"] == "completed" and area is not None else math.inf
                self.study.tell(o.trial, value)
        except UpdateFinishedTrialError:
            print(f"sweep: trial #{o.trial.number} ({o.tid}) finished here after another process took it as "
                  f"lost; its rerun's result counts", file=sys.stderr, flush=True)
        # The counter of finished trials is the study's: other processes finish trials too.
        self.finished = len(finished_rows(self._trials(fresh=True))) - 1

    def _tell_failed(self, o: _Owned, why: str) -> None:
        self.owned.pop(o.tid, None)
        try:
            o.trial.set_user_attr("shmlearn_failed", why[:2000])
            self.study.tell(o.trial, state=TrialState.FAIL)
        except UpdateFinishedTrialError:
            pass

    def _pruned_why(self, row: Dict[str, Any]) -> str:
        p = row.get("pruned") or {}
        peers = p.get("peers")
        if p.get("pruner") == "median" and p.get("step"):
            return (f"median pruner at eval point {p['step']}: best test loss so far {p['best_so_far']:.4g}"
                    + (f" > the others' median {peers:.4g}" if peers is not None else ""))
        if p.get("pruner") == "halving" and p.get("step"):
            return (f"successive-halving pruner at eval point {p['step']}: test loss {p['value']:.4g}, "
                    f"not in the best third at its rung")
        b = p.get("bound_area", peers)
        return (f"area so far {row['summary']['loss_area']:.4g} > best {b:.4g}" if b is not None
                else f"area so far {row['summary']['loss_area']:.4g}")

    # -- the end -------------------------------------------------------------------------------
    def _end(self) -> int:
        """results.jsonl, sweep.json, winners and report, from the whole study."""
        trials = self._trials(fresh=True)
        rows = finished_rows(trials)
        by_id = {r["id"]: r for r in rows}
        order = ([i for i in self.grid_ids if i in by_id] if self.grid_ids is not None else [r["id"] for r in rows])
        path = self.store.path
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:  # a view of the study: rewritten whole, by whichever process ends
            for i in order:
                f.write(json.dumps(by_id[i]) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        pruned = [{"trial": t.number, "id": t.user_attrs["row"]["id"], **t.user_attrs["row"].get("pruned", {})}
                  for t in trials if t.state == TrialState.PRUNED and t.user_attrs.get("row")]
        lost = [{"trial": t.number, "why": t.user_attrs["shmlearn_lost"]} for t in trials
                if "shmlearn_lost" in t.user_attrs]
        repeats = [{"trial": t.number, "repeat_of": t.user_attrs["shmlearn_repeat_of"]} for t in trials
                   if "shmlearn_repeat_of" in t.user_attrs]
        configs = [self._config({a: self._params_by_id(trials, i)[a] for a in self.space}) for i in order]
        self._write_spec(configs, extra={
            "storage": redact(self.sc.storage or ""), "study": self.sc.study, "search": self.sc.search,
            "trials_wanted": self.sc.trials, "pruner": self.pruner_name, "study_trials": len(trials),
            "pruned": pruned, "lost": lost, "repeats": repeats})
        if pruned:
            print(f"sweep: the {self.pruner_name} pruner stopped {count(len(pruned), 'trial')} of {len(rows)}:",
                  flush=True)
            for p in pruned:
                r = by_id.get(p["id"])
                print(f"  #{p['trial']} {p['id']}: {self._pruned_why(r) if r else ''}", flush=True)
        if repeats or lost:
            print(f"sweep: {count(len(repeats), 'repeated trial')} dropped, {count(len(lost), 'lost trial')} "
                  f"run again", flush=True)
        self._finish(configs)
        if getattr(self, "report_failed", False) and not self.failures:
            return 1
        if self.failures:
            print(f"sweep: {count(len(self.failures), 'trial')} failed here (in the study as FAIL; the same "
                  f"command runs a grid's again):", file=sys.stderr)
            for tid, msg in self.failures:
                print(f"  {tid}: {msg}", file=sys.stderr)
            return 1
        return 0

    def _params_by_id(self, trials: List[FrozenTrial], tid: str) -> Dict[str, Any]:
        for t in trials:
            if t.user_attrs.get("row", {}).get("id") == tid:
                return t.params
        raise RuntimeError(f"no trial for {tid}")


LAUNCHER_RANK = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
"""What makes launch.detect_env take a process for one rank of a job."""


def run_study(sc: SweepConfig) -> int:
    """Run this process's share of the study; every process ends with the study's report.

    Under srun (or mpirun, torchrun) each task is one more process of the study, not a rank of
    one training job: its trials start their own ranks on its pool, so the launcher's rank
    variables are dropped here (the pooled sweep refuses a launcher instead)."""
    for k in LAUNCHER_RANK:
        os.environ.pop(k, None)
    try:
        return StudySweep(sc).run()
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - only a storage that cannot be written becomes one line
        why = _unwritable(e)
        if why is None:
            raise
        raise BadInput(f"--storage {redact(sc.storage or '')}: {why}; free space and run the same command "
                       f"again (the study keeps what was committed)") from None
