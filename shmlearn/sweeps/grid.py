"""The grid of a sweep: SweepConfig (defined in sweep_config.py), the flags' values ('A,B,C',
'START:STOP:STEP'), the grid's trials in order, and each trial's id (a hash of its config).
Nothing here runs a trial (trials.py, sweep.py, study.py do)."""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
from typing import Any, Dict, List, Optional, Tuple

from shmlearn.config.train_config import TrainConfig, options, validate
from shmlearn.errors import BadInput, count
from shmlearn.sweeps import values
from shmlearn.sweeps.results import AXIS_ORDER
from shmlearn.sweeps.values import MAX_TRIALS
from shmlearn.sweeps.winners import TIME_AXES
from shmlearn.sweeps.sweep_config import GOALS, NOT_SWEPT, PRUNERS, SEARCHES, SweepConfig  # noqa: F401 - re-exported



CPU_AT_ONCE = 2
"""Trials at once on CPU cores by default (as many as fit, up to this many): two 1-thread trials,
one per core of a 2-core machine, took the same time a step as each alone, within the noise of
running it alone twice (benchmarks/trials_at_once.py, results/start-cpu-2026-11-28-a4/
trials-at-once.json.gz: medians over 4 repeats of the ratio at once / alone of each trial's p10 and
median step time, digits mlp 1.017 and 1.027, fashion-mnist lenet 1.005 and 1.016, where alone
against alone ranged 0.70-1.10), and a sweep of four such trials took half the wall (lenet 21-23
s against 39-43). More at once, on more cores, is not measured (the cores' shared memory
bandwidth): --parallel asks for it, --parallel 1 gives one at a time."""


def trials_at_once(parallel: Optional[int], cuda: bool, slots: int) -> int:
    """SweepConfig.parallel for this machine: as asked, else every GPU (each its own device), or
    on CPU cores CPU_AT_ONCE (where trials fit: a trial holds a core per thread of each rank)."""
    return parallel or (slots if cuda else min(slots, CPU_AT_ONCE))


# --- grid ----------------------------------------------------------------------------------

def field_kind(name: str) -> type:
    """bool, int, float or str: the option's annotation, resolved (flags.scalar_type)."""
    return options()[name].kind


def parse_values(name: str, raw: Any) -> List[Any]:
    """The values of one flag (values.parse_values) as its option's kind."""
    return values.parse_values(name, raw, field_kind(name))


def split_axes(values: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, List[Any]]]:
    """{flag: raw} -> (fixed values, swept axes): a flag with two or more values is an axis."""
    known = set(options()) - set(NOT_SWEPT)
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
    names = list(options())
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
        if cfg.samples is not None and cfg.samples < cfg.workers * cfg.batch_size * cfg.accumulate:
            raise BadInput(f"--samples {cfg.samples}: smaller than one step of {count(cfg.workers, 'worker')} "
                           f"x {cfg.batch_size} samples" + (f" x {cfg.accumulate} micro-batches"
                                                            if cfg.accumulate > 1 else ""))
        trials.append(cfg)
    return trials

METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_winner(sc: SweepConfig) -> None:
    """--winner-metric and --winner-goal, before any trial: a summary.json key and min|max. An
    area pruner stops trials that cannot win by loss area, which the metric's winner may be."""
    if sc.winner_goal is not None and sc.winner_goal not in GOALS:
        raise BadInput(f"--winner-goal {sc.winner_goal}: expected min or max")
    if sc.winner_metric is None:
        if sc.winner_goal is not None:
            raise BadInput(f"--winner-goal {sc.winner_goal}: needs --winner-metric NAME")
        return
    if not METRIC_NAME.fullmatch(sc.winner_metric):
        raise BadInput(f"--winner-metric {sc.winner_metric}: expected a summary.json key such as val_loss, "
                       f"test_loss, best_val_loss or test_accuracy")
    if sc.prune or sc.pruner == "area":
        flag = "--prune" if sc.prune else "--pruner area"
        raise BadInput(f"{flag} --winner-metric {sc.winner_metric}: {flag} stops trials that cannot win by loss "
                       f"area, which may stop the {sc.winner_metric} winner; give one of them")


def check_verdict(sc: SweepConfig) -> None:
    """--threshold, --time-axis, --repeats and --target-share before any trial: pruning bounds one run's
    wall-clock area, so it goes with neither --time-axis steps nor --repeats; a study runs each
    point once."""
    if not (isinstance(sc.threshold, (int, float)) and math.isfinite(sc.threshold) and sc.threshold >= 0):
        # a loss the winner rule compares is >= 0 (cross-entropy, MSE): below 0 no run survives
        raise BadInput(f"--threshold {sc.threshold}: expected a finite number >= 0 (the highest minimum "
                       f"training loss a winner may have)")
    if sc.time_axis not in TIME_AXES:
        raise BadInput(f"--time-axis {sc.time_axis}: expected one of {', '.join(TIME_AXES)}")
    if not isinstance(sc.repeats, int) or sc.repeats < 1:
        raise BadInput(f"--repeats {sc.repeats}: expected a whole number >= 1")
    if sc.target_share is not None and not 0 < sc.target_share <= 1:
        raise BadInput(f"--target-share {sc.target_share}: expected a fraction in (0, 1]")
    prune = "--prune" if sc.prune else f"--pruner {sc.pruner}" if sc.pruner else None
    if prune and sc.time_axis != "wall":
        raise BadInput(f"{prune} --time-axis {sc.time_axis}: pruning stops a trial by its wall-clock area so far; "
                       f"the steps area is known only at its end; give one of them")
    if sc.repeats > 1 and prune:
        raise BadInput(f"--repeats {sc.repeats} {prune}: pruning bounds one run's area, the verdict judges a "
                       f"point's median of its repeats; give one of them")
    if sc.repeats > 1 and sc.storage:
        raise BadInput(f"--repeats {sc.repeats} --storage: an Optuna study runs each point once; give one of them")
    if sc.repeats > 1 and "seed" in sc.axes:
        raise BadInput(f"--repeats {sc.repeats} --seed {','.join(map(str, sc.axes['seed']))}: repeats already "
                       f"train seeds seed..seed+{sc.repeats - 1}; give one --seed")


def with_repeats(trials: List[TrainConfig], repeats: int) -> Tuple[List[TrainConfig], Dict[str, Tuple[str, int]]]:
    """Each trial and its repeats, and {trial id: (its grid point's id, repeat k)} (empty for one
    repeat): repeat k trains with seed + k, so its id differs; the point id is repeat 0's (the
    trial's id without --repeats)."""
    if repeats <= 1:
        return trials, {}
    out, point_of = [], {}
    for cfg in trials:
        point = trial_id(cfg)
        for k in range(repeats):
            c = cfg if k == 0 else dataclasses.replace(cfg, seed=cfg.seed + k)
            out.append(c)
            point_of[trial_id(c)] = (point, k)
    return out, point_of


def check_search(sc: SweepConfig) -> None:
    """The study flags go together (study.py); a sweep without --storage takes none of them."""
    if sc.search not in SEARCHES:
        raise BadInput(f"--search {sc.search}: expected one of {', '.join(SEARCHES)}")
    if sc.pruner is not None and sc.pruner not in PRUNERS:
        raise BadInput(f"--pruner {sc.pruner}: expected one of {', '.join(PRUNERS)}")
    if not sc.stale_after > 0:  # nan included; checked with or without --storage (a typo is a typo)
        raise BadInput(f"--stale-after {sc.stale_after}: expected seconds > 0")
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
