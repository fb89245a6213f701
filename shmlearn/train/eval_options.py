"""The evaluation's section of the run's config (EvalOptions): when the test (and validation)
split is evaluated, in what batches, and what early stopping and the best weights watch.
TrainConfig is composed of it (config/train_config.py); train/evaluation.py and the loop read it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from shmlearn.config.flags import Section


@dataclass(kw_only=True)
class EvalOptions(Section):
    """When and how the run evaluates, and what it keeps of the best evaluation."""

    eval_every: Optional[float] = None
    """Evaluate the full test set every this many seconds of training."""
    eval_points: Optional[int] = None
    """Evaluate the full test set at exactly this many evenly spaced steps (the last at the end),
    plus the pass before training if --eval-at-start is on. Default (neither this nor
    --eval-every): as many as keep evaluation under ~10% of the run's time, at most 10 and at
    least the one at the end, rank 0 judging from the cost of an evaluation (measured, or until
    one is measured estimated from the step time) against the run's projected training time."""
    eval_at_start: Literal["on", "off"] = "on"
    """on: evaluate the full test set before the first step (step 0 of the accuracy curve; its
    cost counts in eval_time_s); off: skip it."""
    eval_batch_size: int = 1024
    """Samples per forward pass when evaluating (test and validation splits)."""
    monitor: Optional[str] = None
    """What --early-stop and --save-best watch: a key of eval.jsonl's rows (val_loss, test_loss,
    test_accuracy, val_NAME for a metric of --compute-loss). Default val_loss where the data has a
    validation split, else test_loss. Its best is the least, or the most for accuracy-like names
    (accuracy, f1, auc, ...)."""
    early_stop: Optional[int] = None
    """Stop when --monitor has not improved for this many evaluations in a row (every rank stops
    at the same step; summary.json says stopped_early). Evaluations come from --eval-points or
    --eval-every, or the default schedule (up to 10)."""
    save_best: bool = False
    """Also keep the weights of the best evaluation by --monitor as best.safetensors (or best.pt)
    beside the final ones; shmlearn.load_model(RUN_DIR, best=True) returns them."""
