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
* Winners by the paper's rule (winners.py states it): per worker count, drop runs whose minimum
  training loss is above the threshold (1.8 in the paper) and runs that collapsed, then take the
  least loss area (loss integrated over training seconds, or with --time-axis steps over the
  steps times a step's price: winners.py). Ties: lower minimum loss, then shorter training time, then grid
  order. Each verdict names its runner-up and margin, tied within noise or not; --repeats N
  trains each point N times and judges the median. Optionally,
  the least training time to reach a test accuracy, and (--winner-metric NAME, --winner-goal)
  the best value of a summary.json key (val_loss, test_accuracy, a --compute-loss metric) among
  completed trials; ties: least loss area, then grid order.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from shmlearn.config.train_config import TrainConfig
from shmlearn.record import safe_write
from shmlearn.errors import count
from shmlearn.sweeps.pruning import bound_key, post_bound
from shmlearn.sweeps.results import ResultStore, pick_winners, winners_table  # noqa: F401 - re-exported
from shmlearn.sweeps.grid import (MAX_TRIALS, NOT_SWEPT, PRUNERS, SEARCHES, SweepConfig,  # noqa: F401 - re-exported
                                 check_search, expand_grid, field_kind, ordered_axes, parse_values, split_axes,
                                 trial_id, trials_at_once)
from shmlearn.sweeps.trials import TRIAL_TIMES, Running, TrialRunner, raise_interrupt  # noqa: F401 - re-exported
from shmlearn.sweeps.winners import best_bounds


class Sweep(TrialRunner):
    """The grid sweep: the grid's trials in order, results.jsonl their store (trials.py runs them)."""

    def run_trials(self, trials: List[TrainConfig]) -> int:
        rows = self.store.load()  # BadInput on a corrupt file, before anything is touched
        for n in self.store.notes:
            print(f"sweep: {n}", flush=True)
        self.write_spec(trials)
        done = {r["id"] for r in rows}
        shutil.rmtree(self.tmp_dir, ignore_errors=True)  # attempts of a killed sweep
        self.total, self.finished = len(trials), 0
        pending = []
        for cfg in trials:
            tid = trial_id(cfg)
            if tid in done:
                continue
            final = os.path.join(self.trials_dir, tid)
            if os.path.isdir(final) and self.record(cfg, tid, final, None, adopted=True):
                done.add(tid)
                continue
            shutil.rmtree(final, ignore_errors=True)
            pending.append(cfg)
        self.finished = self.total - len(pending)
        # How many of these trials can run at once: --parallel, and as many of the smallest as
        # the slots hold (two 2-worker trials do not fit on 2 GPUs: one at a time).
        at_once = max(1, min(self.parallel, self.nslots // min([self.need(c) for c in pending] or [1])))
        print(f"sweep: {count(len(trials), 'trial')} ({self.finished} done, {len(pending)} to run), "
              f"{'up to ' if len({self.need(c) for c in pending}) > 1 else ''}{at_once} at a time on "
              f"{self.nslots} {'GPUs' if self.cuda else 'CPU cores'} | {self.dir}", flush=True)
        too_big = {self.need(c) for c in pending if self.need(c) > self.nslots}
        if too_big:
            print(f"sweep: trials needing {max(too_big)} slots > {self.nslots} run alone "
                  f"(oversubscribed); use fewer workers or threads", flush=True)
        if pending:
            t0 = time.monotonic()
            self._schedule(pending)
            self.mark("trials_done")  # the pool stopped: its workers leave while the winners are made
            self.write_timing(time.monotonic() - t0)
        self.finish(trials)
        if self.pool is not None:
            self.pool.close()  # reaps the workers, gone by now
        return self.exit_code("failed (not recorded; the same command retries them)")

    def _schedule(self, pending: List[TrainConfig]) -> None:
        """Run the pending trials in grid order on one pool; a failed one is retried once, next."""
        safe_write.makedirs(self.tmp_dir, root=self.dir)
        queue: List[Tuple[TrainConfig, int]] = [(c, 1) for c in pending]
        free = list(range(self.nslots))
        running: Dict[int, Running] = {}
        prev = signal.signal(signal.SIGTERM, raise_interrupt)
        self.open_pool(pending, max(self.procs(c) for c in pending),
                       warm_report=self.sc.report and self.report_helper is None)
        ended: List[Tuple[Running, object, float]] = []
        clean = False

        def start_queued() -> None:
            nonlocal free
            while queue and len(running) < self.parallel:
                cfg, attempt = queue[0]
                need = self.slots_for(cfg, free, busy=bool(running))
                if need is None:
                    break  # in grid order: no trial jumps the queue, so none starves
                queue.pop(0)
                slots, free = free[:need], free[need:]
                r = self.start(cfg, slots, attempt)
                running[r.job.id] = r

        try:
            self.post_bounds()
            while queue or running or ended:
                start_queued()
                # The trials that ended are published and recorded after the next ones started:
                # their slots do not wait for the bookkeeping (~10-30 ms a trial). A failed one
                # is retried next.
                for r, job, t_end in ended:
                    if self.done(r, job, ended=t_end):
                        queue.insert(0, (r.cfg, r.attempt + 1))
                ended = []
                if queue and len(running) < self.parallel:
                    start_queued()
                for job in self.pool.poll(0.5) if running else []:
                    r = running.pop(job.id)
                    free = sorted(free + r.slots)
                    ended.append((r, job, time.monotonic()))
            clean = True
        except KeyboardInterrupt:
            n = len(running) + len(ended)  # those that ended are not recorded yet
            self.pool.close()
            print(f"sweep: interrupted; {n} trial{'s' if n != 1 else ''} in flight will run again on the next run",
                  file=sys.stderr, flush=True)
            raise
        finally:
            signal.signal(signal.SIGTERM, prev)
            # Every trial recorded: the idle workers are told to leave and reaped after the winners
            # and the report (run_trials), their teardown overlapping them; else closed now.
            self.pool.stop() if clean else self.pool.close()

    # -- hooks (trials.py) -----------------------------------------------------------------------
    def prune_key(self, cfg: TrainConfig, tid: str) -> Optional[str]:
        """One bound per worker count, posted by this process (--prune)."""
        return bound_key("sweep", cfg.workers) if self.sc.prune else None

    def bounds(self) -> Dict[int, Tuple[float, Optional[float]]]:
        return best_bounds(self.store.load(repair=False), self.sc.threshold, self.sc.target_accuracy)

    def post_bounds(self) -> None:
        """Post each worker count's bound: the least area of a finished survivor, and the least
        time to the target accuracy (with --target-accuracy)."""
        if not self.sc.prune or self.pool is None:
            return
        target = self.sc.target_accuracy
        for w, (area, t) in self.bounds().items():
            post_bound(self.pool.store, bound_key("sweep", w), area, target=target is not None, time_to_target=t)

    def save(self, row: Dict[str, Any]) -> None:
        """One line appended to results.jsonl."""
        self.store.append(row)
