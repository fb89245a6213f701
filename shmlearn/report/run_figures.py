"""A run's own figures, for one run or several overlaid: loss and test accuracy against training
time (paper Fig. 6.2-6.3 when given each worker count's winner), and mean time per step by phase;
and the three side by side as one figure (`own_plots`, a sweep's winners)."""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from .load import Run
from .mpl import figure, panels, png

PHASE_ORDER = ("data", "compute", "allreduce", "gather", "average", "update", "broadcast")
TIME = "training time (s, evaluation excluded)"


def _with_loss(runs: List[Run]) -> List[Run]:
    return [r for r in runs if r.metrics]


def _with_accuracy(runs: List[Run]) -> List[Run]:
    return [r for r in runs if any(e.get("test_accuracy") is not None for e in r.evals)]


def _with_phases(runs: List[Run]) -> List[Run]:
    return [r for r in runs if r.summary.get("phase_s")]


def _draw_loss(ax, runs: List[Run], title: str, legend: bool = True) -> None:
    for r in runs:
        ax.plot([m["time_s"] for m in r.metrics], [m["loss"] for m in r.metrics], label=r.label, lw=1.4)
    ax.set(title=title, xlabel=TIME, ylabel="training loss (mean over workers)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)


def _draw_accuracy(ax, runs: List[Run], title: str, legend: bool = True) -> None:
    for r in runs:
        pts = [(e["time_s"], 100 * e["test_accuracy"]) for e in r.evals if e.get("test_accuracy") is not None]
        ax.plot(*zip(*pts), marker="o", ms=3, label=r.label, lw=1.4)
    ax.set(title=title, xlabel=TIME, ylabel="test accuracy (%)")
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)


def _phase_names(runs: List[Run]) -> List[str]:
    names = [p for p in PHASE_ORDER if any(p in r.summary["phase_s"] for r in runs)]
    return names + sorted({p for r in runs for p in r.summary["phase_s"]} - set(names) - {"eval"})


def _draw_phases(ax, runs: List[Run], title: str) -> None:
    names = _phase_names(runs)
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


def _curves(runs: List[Run], draw, title: str) -> Optional[bytes]:
    """One figure of the default size with `draw(ax, runs, title)`; None without a run to draw."""
    if not runs:
        return None
    fig, ax = figure()
    draw(ax, runs, title)
    return png(fig)


def loss_vs_time(runs: List[Run], title: str = "Training loss") -> Optional[bytes]:
    return _curves(_with_loss(runs), _draw_loss, title)


def accuracy_vs_time(runs: List[Run], title: str = "Test accuracy (full test set)") -> Optional[bytes]:
    return _curves(_with_accuracy(runs), _draw_accuracy, title)


def phases(runs: List[Run], title: str = "Mean time per step by phase") -> Optional[bytes]:
    runs = _with_phases(runs)
    if not runs:
        return None
    n = len(_phase_names(runs))
    fig, ax = figure(7.0, 0.9 + 0.45 * n * max(1, len(runs) ** 0.5))
    _draw_phases(ax, runs, title)
    return png(fig)


def _with_noise(runs: List[Run]) -> List[Run]:
    return [r for r in runs if any((m.get("noise_scale") or {}).get("b_simple") is not None for m in r.metrics)]


def noise_scale(runs: List[Run], title: str = "Gradient noise scale (--noise-scale)") -> Optional[bytes]:
    """B_simple = tr(Sigma) / |G|^2 (moving averages of each, their ratio) against the step, and
    each run's global batch as a dashed line: above it, a larger batch would still cut steps
    nearly in proportion (McCandlish et al. 2018; docs/noise-scale.md)."""
    runs = _with_noise(runs)
    if not runs:
        return None
    fig, ax = figure()
    for i, r in enumerate(runs):
        pts = [(m["step"], m["noise_scale"]["b_simple"]) for m in r.metrics
               if (m.get("noise_scale") or {}).get("b_simple") is not None and m["noise_scale"]["b_simple"] > 0]
        if pts:
            ax.plot(*zip(*pts), label=r.label, lw=1.4, color=f"C{i}")
        s = r.summary
        if s.get("workers") and s.get("batch_size"):
            ax.axhline(s["workers"] * s["batch_size"], color=f"C{i}", ls="--", lw=0.8)
    ax.set(title=title, xlabel="step", ylabel="B_simple (samples)", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)


def staleness(runs: List[Run], title: str = "Staleness of applied gradients (async-ps)") -> Optional[bytes]:
    """Per worker, how many of its gradients the server applied with each lag (summary.json
    `staleness_histogram`): grouped bars, one group per lag, one bar per run and worker. A
    straggler's bars sit at higher lags and are shorter (it gave fewer gradients)."""
    runs = [r for r in runs if r.summary.get("staleness_histogram")]
    if not runs:
        return None
    series = [(f"{r.label} w{w}" if len(runs) > 1 else f"worker {w}", h)
              for r in runs for w, h in sorted(r.summary["staleness_histogram"].items(), key=lambda x: int(x[0]))]
    lags = sorted({int(k) for _, h in series for k in h})
    fig, ax = figure()
    width = 0.8 / len(series)
    for i, (label, h) in enumerate(series):
        ax.bar([lag - 0.4 + width * (i + 0.5) for lag in lags], [h.get(str(lag), 0) for lag in lags],
               width=width, label=label, color=f"C{i}")
    ax.set(title=title, xlabel="lag (server updates between the weights a gradient used and its update)",
           ylabel="gradients applied", xticks=lags)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return png(fig)


def own_plots(run: Run) -> Optional[bytes]:
    """One run's loss, test accuracy and phases side by side in one figure: the plots of its own
    report, ~20% cheaper than three figures (a sweep draws one for each worker count's winner;
    the page names the run above it, so no legend)."""
    draw = [(f, t) for f, t, has in ((_draw_loss, "Training loss", _with_loss),
                                     (_draw_accuracy, "Test accuracy (full test set)", _with_accuracy),
                                     (_draw_phases, "Mean time per step by phase", _with_phases)) if has([run])]
    if not draw:
        return None
    fig, axes = panels(len(draw), 3, 4.2, 3.4)
    for ax, (f, title) in zip(axes, draw):
        f(ax, [run], title, **({} if f is _draw_phases else {"legend": False}))
    return png(fig)
