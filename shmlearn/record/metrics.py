"""What a metric's best value is: the least or the most (no torch: the report and sweeps read it).
Used by the run's --monitor (evaluation.Monitor), summary.json's best_* values and sweeps'
--winner-metric."""
from __future__ import annotations


MAXIMIZED = ("accuracy", "acc", "f1", "precision", "recall", "auc", "bleu", "r2", "iou", "dice", "map")
"""Metric names (after test_/val_) whose best value is the largest; every other the least (a
loss, perplexity, MSE, KL). A sweep names the direction itself (--winner-goal)."""


def metric_goal(key: str) -> str:
    """'max' or 'min': which value of the metric `key` (test_accuracy, val_loss, ...) is best."""
    name = key.split("_", 1)[1] if key.startswith(("test_", "val_")) else key
    return "max" if name.lower() in MAXIMIZED or name.lower().endswith(MAXIMIZED[:2]) else "min"
