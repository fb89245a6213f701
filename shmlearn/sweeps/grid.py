"""The grid of a sweep: SweepConfig, the flags' values ('A,B,C', 'START:STOP:STEP'), the grid's
trials in order, and each trial's id (a hash of its config). Nothing here runs a trial (trials.py,
sweep.py, study.py do)."""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Dict, List, Optional, Tuple

from shmlearn.config.train_config import TrainConfig, options, validate
from shmlearn.errors import BadInput, count
from shmlearn.config.flags import BOOL_WORDS
from shmlearn.sweeps.results import AXIS_ORDER
from shmlearn.sweeps.winners import TIME_AXES

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
    time_axis: str = "wall"
    """The clock the loss area is integrated over: wall (the paper's: training seconds as measured)
    or steps (the step index times the run's 10th-percentile step time, a step the machine's other
    work hardly slowed: a busy machine moves it far less, so a rerun reaches the same verdict). Every verdict names its runner-up and margin, and says
    'tied within noise' where the margin is within the timing noise (docs/sweeps.md)."""
    repeats: int = 1
    """Train each grid point this many times (seeds seed, seed+1, ...): the verdict takes the
    median area of a point's repeats, and their spread joins the noise that decides 'tied within
    noise'. A point is a survivor only when every repeat is."""
    target_share: Optional[float] = None
    """Without --target-accuracy: also rank by the least time to this share of the best test
    accuracy a surviving trial reached (0.9: 90% of it), known once the trials are done (so not
    used by --prune). Experiments set it to 0.9."""
    winner_metric: Optional[str] = None
    """Winners also by this summary.json key (val_loss, test_loss, best_val_loss, test_accuracy,
    test_<metric> of --compute-loss, ...): per worker count the completed trial with its best
    value; ties go to the least loss area. An Optuna study (--storage) optimizes it."""
    winner_goal: Optional[str] = None
    """min or max: which value of --winner-metric is best. Default: max for accuracy-like names
    (accuracy, acc, f1, precision, recall, auc, ...), else min (a loss, perplexity, MSE)."""
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

def field_kind(name: str) -> type:
    """bool, int, float or str: the option's annotation, resolved (flags.scalar_type)."""
    return options()[name].kind


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
    kind = field_kind(name)
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
                if part.lower() not in ("1", "0", *BOOL_WORDS):
                    raise BadInput(f"--{name.replace('_', '-')} {part}: expected true or false")
                values.append(part.lower() == "1" or BOOL_WORDS.get(part.lower(), False))
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

GOALS = ("min", "max")
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


SEARCHES = ("grid", "tpe", "random")
PRUNERS = ("area", "median", "halving")


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
