"""matplotlib, headless (Agg), and a figure's PNG bytes: the only place reports touch the backend.

Figures are plain `matplotlib.figure.Figure`s on their own Agg canvas, never pyplot's: nothing
is registered globally (nothing to close), and a user's pyplot backend and style are left alone.

What a figure costs (docs/performance.md, "Behind the code") goes mostly to making tick objects
(~0.4 ms each, ~250 a sweep's report) and laying out and drawing text; a sweep draws its report's
figures after its last trial, in its wall time, so what follows is chosen for speed where it
changes nothing visible: one draw per figure, a layout measured from the few texts outside the
axes instead of `tight_layout`, axis labels placed where that layout measured (matplotlib would
measure every tick label and the spines again as it draws), unhinted text, unfiltered PNG rows."""
from __future__ import annotations

import math
import struct
import zlib
from typing import Iterable, List, Sequence, Tuple

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator
from matplotlib.transforms import ScaledTranslation

DPI = 100
AXES_RC = {"axes.titley": 1.0}
"""Titles at the top of their axes, not placed automatically: automatic placement measures every
tick label again on each pass (~10% of a figure) to dodge ticks at the top, which we never draw."""
DRAW_RC = {"text.hinting": "none"}
"""Unhinted glyphs: matplotlib runs each glyph through FreeType's hinter as it draws, and text is
most of a figure's cost; unhinted, a figure draws ~10% faster and looks the same at 100 dpi."""
ZLIB_LEVEL = 3
"""The PNG's zlib level: 3 encodes as fast as 1 here, and files ~6% smaller (6: ~2x the time)."""
PAD = 0.08
"""inches of white between the outermost text and the figure's edge, and between panels"""


def _figure(w: float, h: float) -> Figure:
    fig = Figure(figsize=(w, h), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def figure(w: float = 7.0, h: float = 4.2, **kw):
    """A figure and its axes (`Figure.subplots` keywords: nrows, ncols, squeeze, ...)."""
    fig = _figure(w, h)
    with matplotlib.rc_context(AXES_RC):
        ax = fig.subplots(**kw)
    return fig, ax


def panels(n: int, cols: int, w_each: float, h_each: float, extra_h: float = 0.0) -> Tuple[Figure, List]:
    """n axes on a grid `cols` wide, row by row; the grid's empty cells get no axes at all
    (an axes turned off still costs as much to make as a drawn one)."""
    cols = max(1, min(cols, n))
    rows = math.ceil(n / cols)
    fig = _figure(w_each * cols, h_each * rows + extra_h)
    gs = fig.add_gridspec(rows, cols)
    with matplotlib.rc_context(AXES_RC):
        axes = [fig.add_subplot(gs[k // cols, k % cols]) for k in range(n)]
    return fig, axes


def png(fig, above: Sequence = ()) -> bytes:
    """Lay out (`layout`), draw once, encode. `above`: texts over all the axes (a suptitle)."""
    with matplotlib.rc_context(DRAW_RC):
        layout(fig, above)
        # one draw; savefig would draw a second time after tight_layout (which leaves
        # matplotlib's PlaceholderLayoutEngine set: any engine costs savefig a dry-run draw)
        fig.canvas.draw()
    w, h = fig.canvas.get_width_height(physical=True)
    return encode(fig.canvas.buffer_rgba(), w, h, fig.dpi)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode(rgba, w: int, h: int, dpi: float = DPI) -> bytes:
    """A PNG of 8-bit RGBA pixels (h rows of w, top first), as matplotlib's print_png writes
    them less its Software text: unfiltered rows at ZLIB_LEVEL. Pillow's encoder (print_png's)
    tries each of PNG's five row filters on every row, 2.3x this one's time (~10% of a report's
    figures) for files ~6% smaller; a figure's flat colours compress well unfiltered."""
    rows = np.empty((h, 4 * w + 1), np.uint8)
    rows[:, 0] = 0  # each row's filter: none
    rows[:, 1:] = np.frombuffer(rgba, np.uint8).reshape(h, 4 * w)
    ppm = round(dpi / 0.0254)  # pixels per metre: the dpi, for tools that read it
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0))
            + _chunk(b"pHYs", struct.pack(">IIB", ppm, ppm, 1))
            + _chunk(b"IDAT", zlib.compress(rows.data, ZLIB_LEVEL)) + _chunk(b"IEND", b""))


# -- layout ---------------------------------------------------------------------------------------
# tight_layout measures every artist of every axes (spines, each tick label's box, siblings' tick
# boxes), then the draw measures and places them all again: ~10% of a report. Here the margins
# come from the few texts outside the axes: tick labels, axis labels and titles. Their sizes land
# in matplotlib's text-metrics cache, so the draw that follows measures nothing twice. Everything
# else a report draws stays inside its axes (legends, bar labels, annotations, cell texts);
# tests/report/test_mpl.py checks that every drawn text is inside the figure and off other axes.


def _size(texts: Iterable, renderer) -> Tuple[float, float]:
    """Widest and tallest of `texts` as drawn (rotation included), inches; 0 for none."""
    w = h = 0.0
    for t in texts:
        if t.get_visible() and t.get_text():
            bb = t.get_window_extent(renderer)
            w, h = max(w, bb.width), max(h, bb.height)
    return w / DPI, h / DPI


def _tick_labels(axis) -> dict:
    """The tick labels the axis will draw, major and minor (a log axis labels some minor ticks):
    those of its ticks in view (a locator gives a tick past each end as well, whose label is made
    but not drawn)."""
    axis.get_majorticklabels()  # makes the tick objects the draw uses anyway, and sets their labels
    kinds = {"major": (axis.get_majorticklocs(), axis.get_major_ticks)}
    if not isinstance(axis.get_minor_locator(), NullLocator):
        kinds["minor"] = (axis.get_minorticklocs(), axis.get_minor_ticks)
    scale = axis.get_transform()
    lo, hi = sorted(scale.transform(axis.get_view_interval()))
    tol = 1e-10 * (hi - lo)  # matplotlib's own tolerance for a tick on the view's edge
    return {kind: [label for tick, x in zip(ticks(len(locs)), scale.transform(locs) if len(locs) else [])
                   if lo - tol <= x <= hi + tol for label in (tick.label1, tick.label2)]
            for kind, (locs, ticks) in kinds.items()}


def _sides(ax, renderer) -> Tuple[dict, list]:
    """Inches of text each side of `ax` (left, right, bottom, top) outside its frame, and where
    each axis label goes: (axis, side, inches from the frame)."""
    pt = 1 / 72
    rc = matplotlib.rcParams
    side = {"left": 0.0, "right": 0.0, "bottom": 0.0, "top": 0.0}
    overhang = dict(side)  # the first and last tick labels, centred on the frame's corners
    labels = []
    for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
        if not axis.get_visible():
            continue
        where = axis.get_ticks_position()
        out = rc[f"{name}tick.major.size"] * pt if rc[f"{name}tick.direction"] == "out" else 0.0
        depth = w = h = 0.0  # inches from the frame to the tick labels' far side; the largest label
        for kind, texts in _tick_labels(axis).items():
            kw, kh = _size(texts, renderer)
            if kw or kh:  # a minor tick is shorter, so its label nearer
                tick = (rc[f"{name}tick.{kind}.size"] + rc[f"{name}tick.{kind}.pad"]) * pt
                depth, w, h = max(depth, (kh if name == "x" else kw) + tick), max(w, kw), max(h, kh)
        if depth:
            if name == "x":
                side["top" if where == "top" else "bottom"] += depth
                overhang["left"] = overhang["right"] = w / 2
            else:
                side["right" if where == "right" else "left"] += depth
                overhang["bottom"] = overhang["top"] = h / 2
        pos = axis.get_label_position()
        # the label clears the tick labels on its side (or the ticks), as matplotlib places it
        ticks_here = where != {"bottom": "top", "top": "bottom", "left": "right", "right": "left"}[pos]
        beside = (depth or out) if ticks_here else 0.0
        labels.append((axis, pos, beside + rc["axes.labelpad"] * pt))
        lw, lh = _size([axis.label], renderer)
        if lw or lh:
            side[pos] += (lh if name == "x" else lw) + rc["axes.labelpad"] * pt
        _, oh = _size([axis.get_offset_text()], renderer)  # '1e6' or '+0.5' by the tick labels
        if oh:
            side["bottom" if name == "x" else "top"] += oh
    _, th = _size([ax.title], renderer)
    if th:
        side["top"] += th + rc["axes.titlepad"] * pt
    return {k: max(v, overhang[k]) for k, v in side.items()}, labels


def _place_labels(fig, labels: list) -> None:
    """Each axis label at its measured distance from its axes' frame (`_sides`): matplotlib would
    measure every tick label and the spines again as it draws, to place it the same way."""
    for axis, pos, inches in labels:
        x, y = axis.label.get_position()  # along its axis in axes units (an x label's x, a y label's y)
        d = {"bottom": (0, -inches), "top": (0, inches), "left": (-inches, 0), "right": (inches, 0)}[pos]
        along = {"bottom": (x, 0), "top": (x, 1), "left": (0, y), "right": (1, y)}[pos]
        axis.set_label_coords(*along, transform=axis.axes.transAxes + ScaledTranslation(*d, fig.dpi_scale_trans))


def _adjust(fig, above: Sequence, r) -> list:
    """Measure, and set the margins and spacing (`subplots_adjust`) that fit the axes' outside
    texts; the axis labels to place (`_sides`)."""
    grid, labels = {}, []
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        if spec is None:
            continue
        top_spec = spec.get_topmost_subplotspec()  # a colorbar shares its axes' grid cell
        sides, ax_labels = _sides(ax, r)
        grid.setdefault((top_spec.rowspan.start, top_spec.colspan.start), []).append(sides)
        labels += ax_labels
    if not grid:
        return labels
    nrows, ncols = fig.axes[0].get_subplotspec().get_topmost_subplotspec().get_gridspec().get_geometry()
    # a cell holding an axes and its colorbar: the axes' left, the colorbar's right
    cells = {rc: {"left": ss[0]["left"], "right": ss[-1]["right"], "bottom": max(s["bottom"] for s in ss),
                  "top": max(s["top"] for s in ss)} for rc, ss in grid.items()}

    def most(side, where):
        return max((c[side] for rc, c in cells.items() if where(rc)), default=0.0)
    left, right = most("left", lambda rc: rc[1] == 0), most("right", lambda rc: rc[1] == ncols - 1)
    bottom, top = most("bottom", lambda rc: rc[0] == nrows - 1), most("top", lambda rc: rc[0] == 0)
    fw, fh = fig.get_size_inches()
    for text in above:  # a suptitle: as far down from the figure's top as its lowest point
        if text.get_visible() and text.get_text():
            top += fh - text.get_window_extent(r).y0 / DPI
    gap_w = most("right", lambda rc: rc[1] < ncols - 1) + most("left", lambda rc: rc[1] > 0) + PAD
    gap_h = most("bottom", lambda rc: rc[0] < nrows - 1) + most("top", lambda rc: rc[0] > 0) + PAD
    l, rr, b, t = left + PAD, right + PAD, bottom + PAD, top + PAD
    aw = max(0.5, (fw - l - rr - (ncols - 1) * gap_w) / ncols)
    ah = max(0.5, (fh - b - t - (nrows - 1) * gap_h) / nrows)
    fig.subplots_adjust(left=l / fw, right=1 - rr / fw, bottom=b / fh, top=1 - t / fh,
                        wspace=gap_w / aw, hspace=gap_h / ah)
    return labels


def _locs(axis) -> np.ndarray:
    return np.concatenate([axis.get_majorticklocs(), axis.get_minorticklocs()])


def layout(fig, above: Sequence = ()) -> None:
    """Fixed margins and spacing that fit the axes' outside texts (`_adjust`), with the ticks and
    axis labels drawn where they were measured.

    An auto locator picks its ticks by the axis' length (`Axis.get_tick_space`): measured at first
    margins (a guess), an axes that `_adjust` then resized may draw other ticks, and other labels
    than those measured. Where an axis' ticks moved, the figure is measured once more at the new
    lengths, and each axis keeps the tick space it was measured with as it draws."""
    r = fig.canvas.get_renderer()
    axes = [a for ax in fig.axes for a in (ax.xaxis, ax.yaxis)]
    # Margins near those most figures end up with (matplotlib's defaults leave 12% of the width on
    # the left and 10% on the right): measured at lengths near their final ones, the axes mostly
    # keep their ticks (the 8-trial sweep's 10 figures and 3 of its runs' 9: 19 measures, 20 from
    # the defaults)
    fw, fh = fig.get_size_inches()
    fig.subplots_adjust(left=min(0.7 / fw, 0.3), right=max(1 - 0.25 / fw, 0.7), bottom=min(0.6 / fh, 0.3),
                        top=max(1 - 0.4 / fh, 0.7), wspace=0.3, hspace=0.4)
    for _ in range(2):
        spaces = [a.get_tick_space() for a in axes]
        ticks = [_locs(a) for a in axes]  # the ticks whose labels _adjust measures
        labels = _adjust(fig, above, r)
        if all(np.array_equal(_locs(a), t) for a, t in zip(axes, ticks)):
            break
    for a, space in zip(axes, spaces):
        a.get_tick_space = lambda space=space: space  # this figure's axis only (an instance's)
    _place_labels(fig, labels)
