"""A sweep's settings: SweepConfig (one typed field per sweep flag, its docstring the flag's
--help) and the names its flags take. Imports nothing heavy, so that `shmlearn sweep --help`
answers without torch (sweeps/cli.py); the grid's expansion and checks are in grid.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

NOT_SWEPT = ("out", "progress", "resume")
"""Set by the sweep: each trial writes its own run directory, fresh, with no progress bar."""
GOALS = ("min", "max")
"""--winner-goal's values."""
SEARCHES = ("grid", "tpe", "random")
"""--search's values."""
PRUNERS = ("area", "median", "halving")
"""--pruner's values."""


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
    or steps (the step index times a step's price, on a CPU its CPU time, which another job on
    the machine does not add to, so a rerun reaches the same verdict). Every verdict names its runner-up and margin, and says
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
    every GPU, a 2-worker trial waits for two: each GPU is a device of its own); on CPU cores, up
    to 2 where they fit (a core per thread of each rank: two 1-worker trials on 2 cores), measured
    not to move a trial's step times, so its wall-clock areas (grid.CPU_AT_ONCE); 1: one at a
    time."""
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
