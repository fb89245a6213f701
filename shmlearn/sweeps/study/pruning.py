"""A study's pruning, as one process of it drives it (study/sweep.py's StudySweep holds one).

At each eval point of a running trial (rank 0 writes eval.jsonl) the process reports a value to
the study (trial.report) and asks its pruner (trial.should_prune): the loss area so far for
AreaPruner, the test loss (or --winner-metric's val_/test_ key) for median and halving. AreaPruner's
bound (winners.best_bounds over the study's finished trials) is also posted to each trial's rank 0,
which stops at the step it can no longer win; median and halving stop a trial through the same
post, at its next step. Which rule prunes and how a study's pruner is built: search.py.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput
from shmlearn.record.runs import read_jsonl
from shmlearn.sweeps.grid import SweepConfig
from shmlearn.sweeps.pruning import bound_key, post_bound
from shmlearn.sweeps.study.book import Owned, StudyBook
from shmlearn.sweeps.study.search import finished_rows
from shmlearn.sweeps.winners import best_bounds


class StudyPruning:
    """name: the pruner (area, median, halving; None: none); sign: +1 or -1, the objective's
    direction (median's verdict reads the best value so far by it). `book` is set once the study
    is open (StudySweep.run_trials); `pool`, passed to what posts a bound, is None before the
    pool starts."""

    def __init__(self, sc: SweepConfig, name: Optional[str], sign: float):
        self.sc, self.name, self.sign = sc, name, sign
        self.eval_key = eval_key(sc.winner_metric)
        """What median and halving compare at an eval point: test_loss, or --winner-metric's key in eval.jsonl."""
        if name in ("median", "halving") and self.eval_key is None:
            raise BadInput(f"--pruner {name} --winner-metric {sc.winner_metric}: the pruner compares the "
                           f"metric at evaluation points, which report val_ and test_ keys only; give such a key "
                           f"(val_loss, test_accuracy, best_val_loss, ...) or no pruner")
        self.book: Optional[StudyBook] = None

    def key(self, cfg: TrainConfig, tid: str) -> Optional[str]:
        """Where a trial's rank 0 reads its bound: one key per trial (None without a pruner)."""
        return bound_key(f"study-{tid}", cfg.workers) if self.name else None

    def bounds(self) -> Dict[int, Tuple[float, Optional[float]]]:
        return best_bounds(finished_rows(self.book.trials()), self.sc.threshold, self.sc.target_accuracy)

    def post_bounds(self, pool, owned: Optional[List[Owned]] = None) -> None:
        """The area rule's bound goes to each trial's rank 0 (before it starts, and whenever a trial
        finishes), which checks it every step."""
        if self.name != "area" or pool is None:
            return
        bounds = self.bounds()
        for o in self.book.owned.values() if owned is None else owned:
            if o.cfg.workers in bounds and not o.pruned:
                area, t = bounds[o.cfg.workers]
                post_bound(pool.store, self.key(o.cfg, o.tid), area,
                           target=self.sc.target_accuracy is not None, time_to_target=t)

    def progress(self, pool, running) -> None:
        """Report each new eval point to the study and ask its pruner. AreaPruner gets the loss
        area so far (its rule); median and halving get the test loss (or --winner-metric) there: Optuna's pruners
        compare a trial's best value so far with its peers', which a growing area never is."""
        for o in running:
            if self.name is not None and not o.pruned:
                self.report(pool, o, o.run.tmp, decide=True)
        self.post_bounds(pool)

    def report(self, pool, o: Owned, run_dir: str, *, decide: bool) -> None:
        """Report the eval points of `run_dir` not reported yet; with `decide`, ask the pruner and
        stop the trial if it says so. A trial that ends between two looks gets the rest reported
        without deciding, so that its peers have values at every point."""
        try:
            evals = [e for e in read_jsonl(os.path.join(run_dir, "eval.jsonl")) if e.get("samples")]
            metrics = (read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
                       if self.name == "area" and len(evals) > o.evals_seen else [])
        except (OSError, ValueError, BadInput):
            return  # not written yet, or a line being written
        seen = len(evals)
        for k in range(o.evals_seen, len(evals)):
            t = evals[k]["time_s"]
            if self.name == "area":
                pts = [(m["time_s"], m["loss"]) for m in metrics if m["time_s"] <= t + 1e-9]
                value = sum((t1 - t0) * (l0 + l1) / 2 for (t0, l0), (t1, l1) in zip(pts, pts[1:]))
            else:
                value = evals[k].get(self.eval_key)
            if value is None or not math.isfinite(value):
                continue
            try:
                o.trial.set_user_attr("shmlearn_progress", {"step": k + 1, "train_s": t, "value": value})
                o.trial.report(value, k + 1)
                stop = decide and o.trial.should_prune()
            except UpdateFinishedTrialError:  # taken as lost by another process
                break
            if stop and self.name == "area":
                # Its values here are areas over the logged steps, not exact: rank 0 applies the
                # same rule to the exact area at every step (the bound posted), and stops there.
                continue
            if stop:
                mine = [evals[j][self.eval_key] for j in range(k + 1) if evals[j].get(self.eval_key) is not None]
                o.pruned = {"pruner": self.name, "step": k + 1, "value": value,
                            "metric": "test loss" if self.eval_key == "test_loss" else self.eval_key,
                            "best_so_far": (max if self.sign < 0 else min)(mine) if mine else value,
                            "peers": self._peer_value(o, k + 1)}
                post_bound(pool.store, self.key(o.cfg, o.tid), -math.inf, target=False,
                           time_to_target=None)  # (-inf, -inf): stop at the next step
                seen = k + 1  # the rest are reported if the trial completes before it stops
                break
        o.evals_seen = seen

    def _peer_value(self, o: Owned, step: int) -> Optional[float]:
        """What the pruner compared with, for the record: the bound's area (area), else the
        median of the completed trials' values at that eval point (Optuna's PercentilePruner takes
        COMPLETE trials only: one still running, or pruned, was not among them)."""
        if self.name == "area":
            b = self.bounds().get(o.cfg.workers)
            return b[0] if b else None
        vals = sorted(t.intermediate_values[step] for t in self.book.trials(fresh=True)
                      if t.state == TrialState.COMPLETE and t.number != o.trial.number
                      and step in t.intermediate_values)
        if not vals:
            return None
        n = len(vals)
        return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2

    def why(self, row: Dict[str, Any]) -> str:
        """Why a pruned row was stopped, for its progress line and the end's list."""
        p = row.get("pruned") or {}
        peers = p.get("peers")
        if p.get("pruner") == "median" and p.get("step"):
            worse = "<" if self.sign < 0 else ">"
            return (f"median pruner at eval point {p['step']}: best {p.get('metric', 'test loss')} so far "
                    f"{p['best_so_far']:.4g}"
                    + (f" {worse} the others' median {peers:.4g}" if peers is not None else ""))
        if p.get("pruner") == "halving" and p.get("step"):
            return (f"successive-halving pruner at eval point {p['step']}: {p.get('metric', 'test loss')} "
                    f"{p['value']:.4g}, not in the best third at its rung")
        b = p.get("bound_area", peers)
        return (f"area so far {row['summary']['loss_area']:.4g} > best {b:.4g}" if b is not None
                else f"area so far {row['summary']['loss_area']:.4g}")


def eval_key(metric: Optional[str]) -> Optional[str]:
    """The eval.jsonl key median and halving compare: test_loss without --winner-metric; the
    metric (less a best_ prefix: the pruner takes the best so far itself) when it is a val_ or
    test_ key; else None (no eval point reports it)."""
    if metric is None:
        return "test_loss"
    key = metric[len("best_"):] if metric.startswith("best_") else metric
    return key if key.startswith(("val_", "test_")) else None
