"""The Optuna side of a study (study.py): the search space, the sampler, the pruners (AreaPruner is
the pooled sweep's exact rule), opening a study made by shmlearn, and the finished trials' rows."""
from __future__ import annotations

import json
import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from shmlearn.errors import BadInput
from shmlearn.sweeps.winners import cannot_win, prune_bound
from shmlearn.sweeps.results import winner_goal
from shmlearn.sweeps.winners import best_bounds
from shmlearn.sweeps.study.storage import redact, why_not_opened
from shmlearn.sweeps.grid import SweepConfig, field_kind, ordered_axes

optuna.logging.set_verbosity(optuna.logging.ERROR)  # the sweep prints its own lines
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

SPEC = "shmlearn"
"""Study user attr: what defines the study's trials (search, fixed values, axes)."""

def study_spec(sc: SweepConfig) -> Dict[str, Any]:
    """The study's definition; with --winner-metric also its objective (a study's values are one
    objective's: another metric is another study). Without one, as before it existed."""
    spec = {"search": sc.search, "fixed": sc.fixed, "axes": sc.axes}
    if sc.winner_metric is not None:
        spec["objective"] = {"metric": sc.winner_metric, "goal": objective_goal(sc)}
    return json.loads(json.dumps(spec))


def objective_goal(sc: SweepConfig) -> str:
    """min or max: the study's direction (the loss area's min, or --winner-metric's goal)."""
    return "min" if sc.winner_metric is None else sc.winner_goal or winner_goal(sc.winner_metric)


def _spec_diff(theirs: Dict[str, Any], mine: Dict[str, Any]) -> str:
    def show(v):
        return ",".join(map(str, v)) if isinstance(v, list) else str(v)
    if theirs.get("search") != mine.get("search"):
        return f"--search {theirs.get('search')} there, {mine.get('search')} here"
    if theirs.get("objective") != mine.get("objective"):
        def show_objective(o):
            return f"--winner-metric {o['metric']} --winner-goal {o['goal']}" if o else "the loss area"
        return f"{show_objective(theirs.get('objective'))} there, {show_objective(mine.get('objective'))} here"
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
        kind = field_kind(a)
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
    # Optuna 5 reads constraints the trial sets (StudySweep.save); 4 asks constraints_func.
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
        return cannot_win(area, train_s, prune_bound(b[0], b[1], self.target_accuracy is not None))


def make_pruner(name: Optional[str], sc: SweepConfig):
    if name == "area":
        return AreaPruner(sc.threshold, sc.target_accuracy, int(sc.fixed.get("workers") or 2))
    if name == "median":  # eval points are the steps: 10 by default
        return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=2)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=3)
    return optuna.pruners.NopPruner()


def open_study(sc: SweepConfig, storage, pruner) -> "optuna.Study":
    direction = "maximize" if objective_goal(sc) == "max" else "minimize"
    try:
        study = optuna.create_study(storage=storage, study_name=sc.study, sampler=make_sampler(sc), pruner=pruner,
                                    direction=direction, load_if_exists=True)
    except Exception as e:  # noqa: BLE001 - e.g. a study of two objectives under that name
        raise BadInput(f"--study {sc.study}: cannot open it in {redact(sc.storage or '')} ({why_not_opened(e)})") from None
    mine = study_spec(sc)
    attrs = study.user_attrs
    if SPEC not in attrs:
        if study.trials or len(study.directions) != 1 or study.direction.name.lower() != direction:
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
