"""Sweeps on an Optuna study: `shmlearn sweep --storage URL --study NAME` (DESIGN X5).

    any number of processes, on any machines --ask--> one study (RDB or journal storage) <--tell--
      each: its trials on its own pool (trials.TrialRunner's) -> DIR/trials/<id>/ -> the study's trial
      at the end: DIR/results.jsonl, winners.json, figures/ and report.html, from the study

* The trials come from the study. A grid is Optuna's GridSampler over the axes' values;
  `--search tpe|random --trials N` samples between each axis's smallest and largest value
  (distributions(): floats and ints log-scaled when max/min >= 10, workers and words
  categorical) until the study holds N trials, counted over all its processes.
* Each trial runs once. A trial carries its shmlearn id (sweep_grid.trial_id, a hash of its config).
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
  did not learn does not steer it. With --winner-metric NAME the objective is NAME from the
  trial's summary.json instead, in its --winner-goal's direction (a diverged trial, or one that
  does not report NAME, gets the worst value, inf or -inf), with no threshold constraint (the
  metric's verdict has none); median and halving then compare NAME at the eval points (a val_ or
  test_ key: eval.jsonl has them), not the test loss.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import optuna  # noqa: F401 - first: without optuna, ImportError.name is "optuna" (sweep_cli says so)
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput, count
from shmlearn.record import readback, safe_write
from shmlearn.record.runs import lock_dir
from shmlearn.sweeps import winners
from shmlearn.sweeps.grid import SweepConfig, expand_grid, trial_id
from shmlearn.sweeps.study.book import BEAT_S, CLAIM_WAIT_S, HOST, LOOK_S, Owned, StudyBook  # noqa: F401 - re-exported
from shmlearn.sweeps.study.pruning import StudyPruning
from shmlearn.sweeps.study.search import (SPEC, AreaPruner, distributions, finished_rows, make_pruner,  # noqa: F401
                                          make_sampler, open_study, space_size, study_spec)
from shmlearn.sweeps.study.storage import open_storage, redact, unwritable
from shmlearn.sweeps.trials import TrialRunner, raise_interrupt, sweep_goal


class StudySweep(TrialRunner):
    """A sweep whose trials come from, and go back to, an Optuna study (module docstring); which
    trial runs next, heartbeats and lost trials: study_book.StudyBook."""

    def __init__(self, sc: SweepConfig):
        if sc.prune and sc.pruner not in (None, "area"):
            raise BadInput(f"--prune --pruner {sc.pruner}: --prune is the area pruner; give one of them")
        self.pruner_name = sc.pruner or ("area" if sc.prune else None)
        super().__init__(replace(sc, prune=self.pruner_name is not None))
        self.sign = -1.0 if sweep_goal(sc) == "max" else 1.0
        """+1 or -1: the objective's worst value is sign * inf."""
        self.pruning = StudyPruning(self.sc, self.pruner_name, self.sign)
        """Eval points reported to the study, its pruner asked, bounds posted (study/pruning.py)."""
        self.book: Optional[StudyBook] = None
        """The study's trials as this process sees them (run_trials opens the study)."""

    def lock(self):
        """A shared lock on --out/.lock: every process of the study shares --out (results go
        through the study), a pooled sweep's exclusive lock keeps it out and it keeps that sweep
        out; an --out whose results.jsonl is another sweep's (a pooled one, another study) is
        refused, since the study's end rewrites results.jsonl whole."""
        f = lock_dir(self.dir, f"--out {self.dir}: a sweep without --storage is running in this directory",
                     shared=True)
        try:
            _refuse_another_sweeps(self.dir, self.store.path, self.sc)
        except BaseException:
            f.close()
            raise
        return f

    def attempt_dir(self, tid: str, attempt: int) -> str:
        """Each process's own: one that took a trial over as lost must not delete the folder
        where the process it took it from (stopped, not dead) may still finish it."""
        return os.path.join(self.tmp_dir, f"{tid}-{HOST}-{os.getpid()}-{attempt}")

    # -- the run -------------------------------------------------------------------------------
    def _config(self, params: Dict[str, Any]) -> TrainConfig:
        return expand_grid(self.sc.fixed, {a: [v] for a, v in params.items()}, cuda=self.cuda)[0]

    def run_trials(self, trials: List[TrainConfig]) -> int:
        self.space = distributions(self.sc)
        self.grid_ids = [trial_id(c) for c in trials] if self.sc.search == "grid" else None
        storage = open_storage(self.sc.storage)
        study = open_study(self.sc, storage, make_pruner(self.pruner_name, self.sc))
        os.makedirs(self.tmp_dir, exist_ok=True)
        self.book = StudyBook(self.sc, study, storage, self.space, self.grid_ids, self._config, self.failures)
        self.pruning.book = self.book
        start = self.book.trials()
        done = len(finished_rows(start))
        what = (f"grid of {count(len(self.grid_ids), 'trial')}" if self.grid_ids is not None
                else f"{self.sc.search} search, {count(self.sc.trials, 'trial')}")
        print(f"sweep: study {self.sc.study} on {redact(self.sc.storage)}: {what} ({done} done), "
              f"{self.parallel} at a time here on {self.nslots} {'GPUs' if self.cuda else 'CPU cores'}"
              + (f", pruner {self.pruner_name}" if self.pruner_name else "") + f" | {self.dir}", flush=True)
        self.total, self.finished = (len(self.grid_ids) if self.grid_ids is not None else self.sc.trials), done
        points = self.book.points = space_size(self.space) if self.grid_ids is None else None
        if points is not None and points < (self.sc.trials or 0):
            print(f"sweep: the search space holds {count(points, 'distinct point')}, fewer than --trials "
                  f"{self.sc.trials}: the search ends once each has been asked for", flush=True)
            self.total = points
        widest = max(self.procs(c) for c in trials)
        t0 = time.monotonic()
        # From the first trial claimed on, Ctrl-C or SIGTERM (scancel, a preemption) gives this
        # process's trials back to the study before it leaves.
        prev = signal.signal(signal.SIGTERM, raise_interrupt)
        try:
            if self.book.want(busy=False) == "done":  # nothing to run or wait for: no pool to start
                return self._end()
            try:  # the pool starts before the first trial is claimed: a claimed trial beats
                self._loop(trials, widest, [])
            finally:
                if self.pool is not None:
                    self.write_timing(time.monotonic() - t0)
        except KeyboardInterrupt:
            n = len(self.book.owned)
            self.book.release(list(self.book.owned.values()))
            print(f"sweep: interrupted; {count(n, 'trial')} of this process went back to the study",
                  file=sys.stderr, flush=True)
            raise
        finally:
            signal.signal(signal.SIGTERM, prev)
        return self._end()

    def _loop(self, trials: List[TrainConfig], widest: int, ready: List[Tuple[Owned, int]]) -> None:
        self.open_pool(trials, widest)
        free = list(range(self.nslots))
        running: Dict[int, Owned] = {}  # ready: claimed (or to retry), waiting for slots
        try:
            while True:
                for job in self.pool.poll(0.5) if running else []:
                    o = running.pop(job.id)
                    free = sorted(free + o.run.slots)
                    failures = len(self.failures)
                    if self.done(o.run, job):
                        ready.insert(0, (o, o.run.attempt + 1))
                    elif len(self.failures) > failures:
                        self.book.tell_failed(o, self.failures[-1][1])
                self.book.beat()
                self.pruning.progress(self.pool, running.values())
                while len(running) < self.parallel:
                    if not ready:
                        nxt = self._next(busy=bool(running))
                        if nxt == "done" and not running:
                            return
                        if not isinstance(nxt, Owned):
                            break
                        ready.append((nxt, 1))
                    o, attempt = ready[0]
                    need = self.slots_for(o.cfg, free, busy=bool(running))
                    if need is None:
                        break
                    ready.pop(0)
                    slots, free = free[:need], free[need:]
                    shutil.rmtree(self.attempt_dir(o.tid, attempt), ignore_errors=True)
                    self.post_bounds([o])
                    o.run = self.start(o.cfg, slots, attempt)
                    o.evals_seen = 0
                    running[o.run.job.id] = o
                if not running:
                    time.sleep(LOOK_S if not ready else 0.05)
        finally:
            self.pool.close()

    # -- asking ----------------------------------------------------------------------------------
    def _next(self, *, busy: bool):
        """A claimed trial to run, or 'wait' (others still run trials), or 'done'."""
        want = self.book.want(busy=busy)
        if want != "ask":
            return want
        o = self.book.claim()
        if o is None:
            return "wait"
        final = os.path.join(self.trials_dir, o.tid)
        if os.path.isdir(final):
            # Finished and published before its process died, not yet told: record it as it is.
            if self.record(o.cfg, o.tid, final, None, adopted=True):
                return "wait"
            shutil.rmtree(final, ignore_errors=True)
        return o

    # -- pruning (hooks of trials.py; the work: study/pruning.py) -------------------------------
    def prune_key(self, cfg: TrainConfig, tid: str) -> Optional[str]:
        return self.pruning.key(cfg, tid)

    def bounds(self) -> Dict[int, Tuple[float, Optional[float]]]:
        return self.pruning.bounds()

    def post_bounds(self, owned: Optional[List[Owned]] = None) -> None:
        self.pruning.post_bounds(self.pool, owned)

    def pruned_why(self, row: Dict[str, Any]) -> str:
        return self.pruning.why(row)

    # -- telling -------------------------------------------------------------------------------
    def save(self, row: Dict[str, Any]) -> None:
        o = self.book.owned.pop(row["id"], None)
        if o is None:
            return
        if row["status"] == "pruned" and o.pruned:
            row["pruned"].update(o.pruned)
        elif row["status"] == "pruned":
            row["pruned"]["pruner"] = self.pruner_name
        # A trial told to stop that completed first (a short one) is COMPLETE: it gets the rest of
        # its eval points, as every completed trial has.
        if self.pruner_name is not None and (not o.pruned or row["status"] != "pruned") and row.get("run_dir"):
            self.pruning.report(self.pool, o, os.path.join(self.dir, row["run_dir"]), decide=False)
        value, constraint = winners.objective(row, self.sc.threshold, self.sc.time_axis, self.sc.winner_metric)
        try:
            o.trial.set_user_attr("row", row)
            o.trial.set_user_attr("shmlearn_constraint", constraint)
            if hasattr(o.trial, "set_constraint"):
                o.trial.set_constraint("min_loss_minus_threshold", constraint)
            if row["status"] == "pruned":
                self.book.study.tell(o.trial, state=TrialState.PRUNED)
            else:
                self.book.study.tell(o.trial, self.sign * math.inf if value is None else value)
        except UpdateFinishedTrialError:
            print(f"sweep: trial #{o.trial.number} ({o.tid}) finished here after another process took it as "
                  f"lost; its rerun's result counts", file=sys.stderr, flush=True)
        # The counter of finished trials is the study's: other processes finish trials too.
        self.finished = len(finished_rows(self.book.trials(fresh=True))) - 1

    # -- the end -------------------------------------------------------------------------------
    def _end(self) -> int:
        """results.jsonl, sweep.json, winners and report, from the whole study."""
        trials = self.book.trials(fresh=True)
        rows = finished_rows(trials)
        by_id = {r["id"]: r for r in rows}
        order = ([i for i in self.grid_ids if i in by_id] if self.grid_ids is not None else [r["id"] for r in rows])
        path = self.store.path
        # a view of the study: rewritten whole, by whichever process ends
        safe_write.write(path, "".join(json.dumps(by_id[i]) + "\n" for i in order), root=self.dir)
        pruned = [{"trial": t.number, "id": t.user_attrs["row"]["id"], **t.user_attrs["row"].get("pruned", {})}
                  for t in trials if t.state == TrialState.PRUNED and t.user_attrs.get("row")]
        lost = [{"trial": t.number, "why": t.user_attrs["shmlearn_lost"]} for t in trials
                if "shmlearn_lost" in t.user_attrs]
        repeats = [{"trial": t.number, "repeat_of": t.user_attrs["shmlearn_repeat_of"]} for t in trials
                   if "shmlearn_repeat_of" in t.user_attrs]
        configs = [self._config({a: self.book.params_by_id(trials, i)[a] for a in self.space}) for i in order]
        self.write_spec(configs, extra={
            "storage": redact(self.sc.storage or ""), "study": self.sc.study, "search": self.sc.search,
            "trials_wanted": self.sc.trials, "pruner": self.pruner_name, "study_trials": len(trials),
            "pruned": pruned, "lost": lost, "repeats": repeats})
        if pruned:
            print(f"sweep: the {self.pruner_name} pruner stopped {count(len(pruned), 'trial')} of {len(rows)}:",
                  flush=True)
            for p in pruned:
                r = by_id.get(p["id"])
                print(f"  #{p['trial']} {p['id']}: {self.pruned_why(r) if r else ''}", flush=True)
        if repeats or lost:
            print(f"sweep: {count(len(repeats), 'repeated trial')} dropped, {count(len(lost), 'lost trial')} "
                  f"run again", flush=True)
        self.finish(configs)
        return self.exit_code("failed here (in the study as FAIL; the same command runs a grid's again)")


def _refuse_another_sweeps(out: str, results: str, sc: SweepConfig) -> None:
    """BadInput when --out holds the results.jsonl of a pooled sweep or of another study."""
    spec_path = os.path.join(out, "sweep.json")
    if not os.path.exists(results) or not os.path.exists(spec_path):
        return
    spec = readback.sweep_spec(out)  # malformed: one line naming it, never a guess that it is ours
    n = sum(1 for line in readback.read_bytes(results).split(b"\n") if line.strip())
    if "storage" not in spec:
        raise BadInput(f"--out {out}: holds a sweep without --storage ({count(n, 'result')} in "
                       f"results.jsonl), which this study would replace; give the study another --out")
    if (spec.get("storage"), spec.get("study")) != (redact(sc.storage or ""), sc.study):
        raise BadInput(f"--out {out}: holds study {spec.get('study')} on {spec.get('storage')} "
                       f"({count(n, 'result')} in results.jsonl), which this study would replace; give it "
                       f"another --out")


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
        why = unwritable(e)
        if why is None:
            raise
        raise BadInput(f"--storage {redact(sc.storage or '')}: {why}; free space and run the same command "
                       f"again (the study keeps what was committed)") from None
