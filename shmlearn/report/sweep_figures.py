"""A sweep's figures: per worker count the batch x lr heat map of loss areas (paper Fig. 5.5-5.8)
and of the --winner-metric, and the areas sorted by minimum loss (Fig. 5.1-5.4); across worker
counts the winners' phase times (Fig. 6.4-6.6), and throughput with scaling efficiency."""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
from matplotlib.patches import Rectangle

from shmlearn.sweeps import winners
from shmlearn.sweeps.winners import metric_value

from .html import worker_count
from .load import Run
from .mpl import figure, panels, png
from .run_figures import PHASE_ORDER

Row = Dict[str, Any]


def _wide(values: np.ndarray) -> bool:
    """A run that blew up (finite but huge loss) would flatten every other cell: go log."""
    values = values[values > 0]
    return len(values) > 1 and values.max() / values.min() > 100


def run_kind(r: Row) -> str:
    """'completed' (a full loss area), 'collapsed' (completed, then its loss came back up or its
    accuracy ended at chance: winners.collapsed; a full area, never a survivor), 'pruned' (stopped
    early by `sweep --prune` once it could no longer win: its area is the area so far, a lower
    bound), or the row's status otherwise ('diverged', ...). Only completed and collapsed areas
    are drawn on the loss-area scale."""
    if r["status"] == "completed" and r["summary"].get("loss_area") is not None:
        return winners.status(r)
    return r["status"]


FULL = ("completed", "collapsed")
"""Kinds with a full loss area."""


def area_so_far(r: Row) -> Optional[float]:
    """A pruned trial's loss area when it stopped (loss x s): what the full run would have
    exceeded, never its area."""
    a = r["summary"].get("loss_area")
    return a if a is not None else (r.get("pruned") or {}).get("area_so_far")


class Cell(NamedTuple):
    row: Row
    kind: str
    """run_kind(row)"""
    text: str
    over: bool
    """a completed run whose minimum loss is above the threshold"""


def _grid(rows: List[Row]):
    """A heat map's axes: the batch sizes and learning rates of `rows`, sorted; an all-NaN
    [batches, lrs] array (NaN: an empty cell); and a row's (i, j) in it."""
    batches = sorted({r["config"]["batch_size"] for r in rows})
    lrs = sorted({r["config"]["lr"] for r in rows})

    def at(r: Row) -> Tuple[int, int]:
        return batches.index(r["config"]["batch_size"]), lrs.index(r["config"]["lr"])

    return batches, lrs, np.full((len(batches), len(lrs)), np.nan), at


def _grid_png(fig, ax, batches: List[int], lrs: List[float], title: str) -> bytes:
    """A heat map's axes labelled (learning rate across, batch size down) and the figure as PNG."""
    labels, style = lr_ticks(lrs)
    ax.set_xticks(range(len(lrs)), labels, **style)
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set(title=title, xlabel="learning rate", ylabel="batch size per worker")
    return png(fig)


def heat_cells(rows: List[Row], *, threshold: float, axis: str = "wall"):
    """The heat map without drawing: batch sizes, learning rates, the colored areas on `axis`
    (completed and collapsed runs only, NaN elsewhere) and each cell's Cell. Pruned cells read
    'pruned' and '>area so far'; collapsed cells read 'collapsed' under their area."""
    batches, lrs, area, at = _grid(rows)
    cells: Dict[tuple, Cell] = {}
    for r in rows:
        i, j = at(r)
        kind = run_kind(r)
        if kind in FULL:
            area[i, j] = winners.area(r["summary"], axis)
            over = not _under(r, threshold) or kind == "collapsed"
            cells[i, j] = Cell(r, kind, f"{area[i, j]:.3g}" + ("\ncollapsed" if kind == "collapsed" else
                                                                "\n>thr" if over else ""), over)
        elif kind == "pruned":
            a = area_so_far(r)
            cells[i, j] = Cell(r, kind, "pruned" + (f"\n>{a:.3g}" if a is not None else ""), False)
        else:
            cells[i, j] = Cell(r, kind, kind, False)
    return batches, lrs, area, cells


def heatmap(rows: List[Row], *, threshold: float, winner_id: Optional[str], title: str,
            axis: str = "wall") -> Optional[bytes]:
    """Batch size (rows) x learning rate (columns), cell = loss area on `axis`. Diverged runs are
    empty cells, as in the paper; pruned runs are grey hatched cells with their partial area; runs
    above the loss threshold and collapsed runs are shown but marked (red text)."""
    if not rows:
        return None
    batches, lrs, area, cells = heat_cells(rows, threshold=threshold, axis=axis)
    fig, ax = figure(max(5.0, 1.0 + 0.9 * len(lrs)), max(3.2, 1.2 + 0.55 * len(batches)))
    finite = area[np.isfinite(area)]
    log = _wide(finite)
    top = color_top(finite)
    norm = None
    if log or top is not None:
        from matplotlib.colors import LogNorm, Normalize
        lo = float(finite[finite > 0].min()) if log else None
        norm = (LogNorm if log else Normalize)(vmin=lo, vmax=top, clip=True)
    im = ax.imshow(np.ma.masked_invalid(area), cmap="viridis_r", aspect="auto", norm=norm)
    fig.colorbar(im, ax=ax, label="loss area (loss x s" + (", steps x step price" if axis == "steps" else "")
                 + ")" + (", log scale" if log else ""))
    for (i, j), c in cells.items():
        if c.kind == "pruned":
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fc="0.92", ec="0.6", hatch="///", lw=0))
            ax.text(j, i, c.text, ha="center", va="center", fontsize=7, color="0.3",
                    bbox=dict(fc="0.92", ec="none", pad=1))
        elif c.kind not in FULL:
            ax.text(j, i, c.text, ha="center", va="center", fontsize=7, color="0.4")
        else:
            light = im.norm(area[i, j]) < 0.5  # viridis_r: small areas are yellow, large dark
            off = top is not None and area[i, j] > top
            ax.text(j, i, c.text + ("\noff scale" if off else ""), ha="center", va="center", fontsize=7,
                    color="red" if c.over else "black" if light else "white")
        if c.row["id"] == winner_id:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2.5))
    return _grid_png(fig, ax, batches, lrs, title)


def metric_cells(rows: List[Row], metric: str):
    """metric_heatmap without drawing: batch sizes, learning rates, the values (completed runs
    that report the metric; NaN elsewhere: an empty cell) and each cell's (row, label): the value,
    'n/a' (completed, no value), or the row's status ('diverged', 'pruned')."""
    batches, lrs, vals, at = _grid(rows)
    cells: Dict[tuple, tuple] = {}
    for r in rows:
        i, j = at(r)
        v = metric_value(r, metric) if r["status"] == "completed" else None
        if v is not None:
            vals[i, j] = v
        cells[i, j] = (r, f"{v:.4g}" if v is not None else "n/a" if r["status"] == "completed" else r["status"])
    return batches, lrs, vals, cells


def metric_heatmap(rows: List[Row], *, metric: str, goal: str, winner_id: Optional[str],
                   title: str) -> Optional[bytes]:
    """Batch size (rows) x learning rate (columns), cell = the completed trial's summary.json
    `metric` (--winner-metric). The colours run from worst (dark) to best (yellow) by `goal`;
    diverged runs are empty cells, pruned runs grey hatched (never metric winners), a completed
    run without the metric reads 'n/a'. Red outline: the metric's winner."""
    if not rows:
        return None
    batches, lrs, vals, cells = metric_cells(rows, metric)
    fig, ax = figure(max(5.0, 1.0 + 0.9 * len(lrs)), max(3.2, 1.2 + 0.55 * len(batches)))
    finite = vals[np.isfinite(vals)]
    norm = None
    if goal == "min" and _wide(finite) and (finite > 0).all():  # a loss that blew up: go log
        from matplotlib.colors import LogNorm
        norm = LogNorm(vmin=float(finite.min()), vmax=float(finite.max()))
    im = ax.imshow(np.ma.masked_invalid(vals), cmap="viridis_r" if goal == "min" else "viridis",
                   aspect="auto", norm=norm)
    fig.colorbar(im, ax=ax, label=f"{metric} ({'least' if goal == 'min' else 'most'} is best)"
                 + (", log scale" if norm is not None else ""))
    for (i, j), (r, text) in cells.items():
        if r["status"] == "pruned":
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fc="0.92", ec="0.6", hatch="///", lw=0))
        if np.isfinite(vals[i, j]):
            best = im.norm(vals[i, j]) >= 0.5 if goal == "max" else im.norm(vals[i, j]) < 0.5
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="black" if best else "white")
        else:
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="0.4")
        if r["id"] == winner_id:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2.5))
    return _grid_png(fig, ax, batches, lrs, title)


OFF_SCALE = 1000.0
"""The heat map's colours span at most this factor above the least area: a run that blew up
(loss 1e13, area 2e15: issue 38, 12) is drawn in the darkest colour, labelled, not allowed to
squeeze every other cell into one shade."""


def color_top(areas: np.ndarray) -> Optional[float]:
    """The colour scale's top: None (the largest area) unless some area exceeds OFF_SCALE times
    the least; then the largest area within that factor."""
    pos = areas[areas > 0]
    if len(pos) < 2 or pos.max() <= OFF_SCALE * pos.min():
        return None
    return float(pos[pos <= OFF_SCALE * pos.min()].max())


def lr_ticks(lrs: List[float]):
    """The heat map's learning-rate labels and their rotation: a grid's few values as given; a
    search's (random, tpe: every trial its own lr, '0.0399544') at 3 digits, upright once there
    are more than 6, so that they do not run together (issue 38, 12)."""
    if len(lrs) <= 6:
        return [f"{v:g}" for v in lrs], {}
    return [f"{v:.3g}" for v in lrs], {"rotation": 90}


def heat_note(rows: List[Row]) -> str:
    """The heat maps' caption. A diverged run's cell is blank and reads 'diverged'; a cell with
    no label had no trial, which only a search (random, tpe) leaves."""
    grids = {}
    for r in rows:
        grids.setdefault(r["config"]["workers"], set()).add((r["config"]["batch_size"], r["config"]["lr"]))
    sparse = any(len(cells) < len({b for b, _ in cells}) * len({lr for _, lr in cells}) for cells in grids.values())
    return ("Blank cells reading 'diverged' diverged" + ("; blank cells without a label had no trial (the search "
                                                           "did not pick that batch size and learning rate together)"
                                                           if sparse else "")
            + ". Grey hatched cells were pruned: '>area' is the loss area so far, a lower bound, not on the color "
              "scale. Red outline: the winner. '>thr': minimum loss above the threshold; 'collapsed': the loss came back "
              "to within 10% of its start, or the accuracy ended at chance (never a survivor). 'off scale': an area over "
              f"{OFF_SCALE:g} times the least (a run that blew up), drawn in the darkest colour.")


def _under(r: Row, threshold: float) -> bool:
    ml = r["summary"].get("min_loss")
    return ml is not None and ml <= threshold


def histogram_order(rows: List[Row]) -> List[Row]:
    """Completed runs by minimum loss, then pruned runs (by minimum loss so far), then the rest."""
    def by_min_loss(rs):
        return sorted(rs, key=lambda r: (r["summary"].get("min_loss") is None, r["summary"].get("min_loss") or 0))
    return (by_min_loss(r for r in rows if run_kind(r) in FULL)
            + by_min_loss(r for r in rows if run_kind(r) == "pruned")
            + [r for r in rows if run_kind(r) not in (*FULL, "pruned")])


def area_histogram(rows: List[Row], *, threshold: float, winner: Optional[Dict[str, Any]], workers: int) -> Optional[bytes]:
    """Loss areas of one worker count's runs, sorted by minimum training loss (lowest first);
    then pruned runs as hollow hatched bars of their area so far (a lower bound, not an area);
    diverged runs last with no bar. The winner is named in the title, as in the paper."""
    if not rows:
        return None
    order = histogram_order(rows)
    kinds = [run_kind(r) for r in order]
    fig, ax = figure(max(6.0, 1.5 + 0.32 * len(order)), 4.4)
    x = np.arange(len(order))
    full = [(xi, r) for xi, r, k in zip(x, order, kinds) if k in FULL]
    part = [(xi, area_so_far(r)) for xi, r, k in zip(x, order, kinds) if k == "pruned" and area_so_far(r)]
    if full:
        ax.bar([xi for xi, _ in full], [r["summary"]["loss_area"] for _, r in full],
               color=["tab:orange" if winner and r["id"] == winner["id"] else "tab:red"
                      if run_kind(r) == "collapsed" else "tab:blue" if _under(r, threshold) else "0.7" for _, r in full])
    if part:
        ax.bar([xi for xi, _ in part], [a for _, a in part], fill=False, hatch="///", ec="0.55", lw=0.8,
               label="pruned: loss area so far (a lower bound)")
        ax.legend(fontsize=7, loc="upper left")
    if _wide(np.array([r["summary"]["loss_area"] for _, r in full] + [a for _, a in part])):
        ax.set_yscale("log")
    for xi, r, k in zip(x, order, kinds):
        if k != "completed":  # collapsed, pruned, diverged: say so on the bar
            # y in axes units: on a log scale y=0 in data units would be off the plot
            ax.text(xi, 0.01, k, rotation=90, ha="center", va="bottom", fontsize=7, color="0.4",
                    transform=ax.get_xaxis_transform(), bbox=dict(fc="white", ec="none", pad=1))
    ax.set_xticks(x, [f"b{r['config']['batch_size']} lr{r['config']['lr']:g}" for r in order],
                  rotation=90, fontsize=7)
    win = (f"winner: batch {winner['batch_size']}, lr {winner['lr']:g} (area {winner['loss_area']:.3g})"
           if winner else "no winner")
    ax.set(title=f"{worker_count(workers)}: {win}",
           xlabel=f"runs sorted by minimum training loss, lowest first\n(grey: min loss > {threshold:g}; "
                  f"red: collapsed)",
           ylabel="loss area (loss x s)" + (", log scale" if ax.get_yscale() == "log" else ""))
    ax.grid(axis="y", alpha=0.3)
    return png(fig)


def phases_vs_workers(runs: Dict[int, Run]) -> Optional[bytes]:
    """Mean milliseconds per step of each phase against the worker count, one panel per phase,
    from each worker count's winning run (paper Fig. 6.4-6.6: average, gather, broadcast)."""
    runs = {w: r for w, r in runs.items() if r.summary.get("phase_s")}
    if not runs:
        return None
    names = [p for p in PHASE_ORDER if any(p in r.summary["phase_s"] for r in runs.values())]
    fig, axes = panels(len(names), 3, 3.2, 2.7, extra_h=0.4)
    ws = sorted(runs)
    for ax, name in zip(axes, names):
        pts = [(w, 1e3 * runs[w].summary["phase_s"][name]) for w in ws if name in runs[w].summary["phase_s"]]
        ax.plot(*zip(*pts), marker="o")
        for w, v in pts:
            ax.annotate(f"b{runs[w].summary.get('batch_size')}", (w, v), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        ax.set(title=name, xlabel="workers", ylabel="ms per step")
        ax.set_xticks(ws)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    title = fig.suptitle("Mean phase time per step, each worker count's winner (label: batch per worker)")
    return png(fig, above=[title])


def throughput_vs_workers(rows: List[Row]) -> Optional[bytes]:
    """Training samples/s against workers, one line per batch size (median over the lrs), and
    scaling efficiency = throughput(W) / (W / W0 x throughput(W0)), W0 the fewest workers."""
    pts: Dict[int, Dict[int, List[float]]] = {}
    for r in rows:
        s = r["summary"]
        if r["status"] == "completed" and s.get("samples_per_s"):
            pts.setdefault(r["config"]["batch_size"], {}).setdefault(r["config"]["workers"], []).append(s["samples_per_s"])
    if not pts:
        return None
    fig, (a1, a2) = figure(10.0, 4.2, ncols=2)
    all_w = sorted({w for by_w in pts.values() for w in by_w})
    for b in sorted(pts):
        ws = sorted(pts[b])
        thr = [float(np.median(pts[b][w])) for w in ws]
        a1.plot(ws, thr, marker="o", label=f"batch {b}")
        eff = [100 * t / (w / ws[0] * thr[0]) for w, t in zip(ws, thr)]
        a2.plot(ws, eff, marker="o", label=f"batch {b}")
    a1.set(title="Throughput (median over learning rates)", xlabel="workers", ylabel="training samples/s")
    a2.set(title=f"Scaling efficiency vs {worker_count(all_w[0])}", xlabel="workers", ylabel="efficiency (%)")
    a2.axhline(100, color="0.6", lw=0.8, ls="--")
    for a in (a1, a2):
        a.set_xticks(all_w)
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    return png(fig)
