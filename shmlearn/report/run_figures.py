"""A run's own figures, for one run or several overlaid: loss and test accuracy against training
time (paper Fig. 6.2-6.3 when given each worker count's winner), and mean time per step by phase."""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from .load import Run
from .mpl import figure, png

PHASE_ORDER = ("data", "compute", "allreduce", "gather", "average", "update", "broadcast")


def loss_vs_time(runs: List[Run], title: str = "Training loss") -> Optional[bytes]:
    runs = [r for r in runs if r.metrics]
    if not runs:
        return None
    fig, ax = figure()
    for r in runs:
        ax.plot([m["time_s"] for m in r.metrics], [m["loss"] for m in r.metrics], label=r.label, lw=1.4)
    ax.set(title=title, xlabel="training time (s, evaluation excluded)", ylabel="training loss (mean over workers)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)


def accuracy_vs_time(runs: List[Run], title: str = "Test accuracy (full test set)") -> Optional[bytes]:
    runs = [r for r in runs if any(e.get("test_accuracy") is not None for e in r.evals)]
    if not runs:
        return None
    fig, ax = figure()
    for r in runs:
        pts = [(e["time_s"], 100 * e["test_accuracy"]) for e in r.evals if e.get("test_accuracy") is not None]
        ax.plot(*zip(*pts), marker="o", ms=3, label=r.label, lw=1.4)
    ax.set(title=title, xlabel="training time (s, evaluation excluded)", ylabel="test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)


def phases(runs: List[Run], title: str = "Mean time per step by phase") -> Optional[bytes]:
    runs = [r for r in runs if r.summary.get("phase_s")]
    if not runs:
        return None
    names = [p for p in PHASE_ORDER if any(p in r.summary["phase_s"] for r in runs)]
    names += sorted({p for r in runs for p in r.summary["phase_s"]} - set(names) - {"eval"})
    fig, ax = figure(7.0, 0.9 + 0.45 * len(names) * max(1, len(runs) ** 0.5))
    y = np.arange(len(names))
    h = 0.8 / len(runs)
    for i, r in enumerate(runs):
        ms = [1e3 * r.summary["phase_s"].get(p, 0.0) for p in names]
        bars = ax.barh(y + (i - (len(runs) - 1) / 2) * h, ms, height=h, label=r.label)
        ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=2)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set(title=title, xlabel="milliseconds per step (rank 0)")
    ax.margins(x=0.15)
    ax.grid(axis="x", alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=8)
    return png(fig)
