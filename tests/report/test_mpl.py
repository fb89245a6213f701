"""mpl.layout: the fixed layout that replaced tight_layout must still fit every figure's texts."""
import io
import json

import matplotlib

import numpy as np

import pytest
from matplotlib.backends.backend_agg import RendererAgg
from PIL import Image

from shmlearn.report import draw, mpl, run_figures, sweep_figures, write_report


def texts_outside(fig, texts):
    """Of the texts a figure drew: those past the figure's edge, and those of one axes drawn
    over another's frame."""
    r = fig.canvas.get_renderer()
    W, H = fig.bbox.width, fig.bbox.height
    bad = []
    frames = [(ax, ax.get_window_extent(r)) for ax in fig.axes]
    for t in texts:
        bb = t.get_window_extent(r)
        if bb.x0 < -1 or bb.y0 < -1 or bb.x1 > W + 1 or bb.y1 > H + 1:
            bad.append(f"{t.get_text()!r} past the edge: {bb.bounds}")
        owner = t.axes
        for ax, frame in frames:
            # a colorbar shares its axes' grid cell; legends and cell texts lie inside their own axes
            if owner is None or ax is owner or same_cell(ax, owner):
                continue
            if bb.overlaps(frame.shrunk(0.98, 0.98)):
                bad.append(f"{t.get_text()!r} of one axes over another")
    return bad


def same_cell(a, b):
    sa, sb = a.get_subplotspec(), b.get_subplotspec()
    return sa is not None and sb is not None and \
        sa.get_topmost_subplotspec() == sb.get_topmost_subplotspec()


@pytest.fixture
def drawn(monkeypatch):
    """Every figure the report draws, after drawing, with the texts it drew."""
    figs, texts = [], []
    real_png, real_text = mpl.png, RendererAgg.draw_text

    def keep(fig, *a, **kw):
        texts.clear()
        data = real_png(fig, *a, **kw)
        figs.append((fig, list(texts)))
        return data

    def draw_text(self, gc, x, y, s, prop, angle, ismath=False, mtext=None):
        if mtext is not None:
            texts.append(mtext)
        return real_text(self, gc, x, y, s, prop, angle, ismath, mtext)
    monkeypatch.setattr(run_figures, "png", keep)
    monkeypatch.setattr(sweep_figures, "png", keep)
    monkeypatch.setattr(RendererAgg, "draw_text", draw_text)
    monkeypatch.setattr(draw, "_cores", lambda: 1)  # every figure drawn here, where this fixture sees it
    return figs


def test_every_sweep_figure_fits_its_texts(fake_sweep, drawn):
    write_report([str(fake_sweep)])
    assert len(drawn) == 10  # 8 + one per winner
    for fig, texts in drawn:
        assert texts_outside(fig, texts) == [], fig.axes[0].get_title()


def test_every_run_figure_fits_its_texts(fake_runs, tmp_path, drawn):
    write_report([str(fake_runs[0])])
    write_report([str(p) for p in fake_runs], out=str(tmp_path / "both.html"))
    assert len(drawn) == 6
    for fig, texts in drawn:
        assert texts_outside(fig, texts) == [], fig.axes[0].get_title()


def test_wide_and_huge_values_still_fit(tmp_path, make_run, drawn):
    """A loss that blew up to 1e7 (log-scale histogram, sci-notation offsets), long phase names."""
    d = tmp_path / "r"
    s, _ = make_run(d, batch=512, lr=0.000125)
    s["phase_s"]["allreduce_bucketed_overlap"] = 0.0123
    s["samples_per_s"] = 12345678.0
    with open(d / "summary.json", "w") as f:
        json.dump(s, f)
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 70, "samples": 1, "time_s": 0.7, "loss": 1.5e7}) + "\n")
    write_report([str(d)])
    for fig, texts in drawn:
        assert texts_outside(fig, texts) == [], fig.axes[0].get_title()


def test_layout_leaves_no_more_margin_than_tight_layout_would_much(fake_sweep, drawn):
    """The fixed layout is not a generous guess: each axes gets at least 85% of the area
    tight_layout would give it."""
    write_report([str(fake_sweep)])
    for fig, _ in drawn:
        axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
        ours = [ax.get_position().width * ax.get_position().height for ax in axes]
        fig.tight_layout()
        tight = [ax.get_position().width * ax.get_position().height for ax in axes]
        assert all(o >= 0.85 * t for o, t in zip(ours, tight)), (fig.axes[0].get_title(), ours, tight)


def _tpe_rows():
    """Ten trials of a TPE study: each its own batch size and learning rate (the issue's report)."""
    lrs = [0.0399544, 0.0102236, 0.248451, 0.0086207, 0.000497649, 0.186384, 0.000315446, 0.0287455,
           0.00221532, 0.0192537]
    return [{"id": f"t{k}", "status": "completed", "config": {"workers": 1, "batch_size": 16 + 11 * k, "lr": lr},
             "summary": {"loss_area": 1.0 + k, "min_loss": 0.5}} for k, lr in enumerate(lrs)]


def test_a_searchs_learning_rate_labels_do_not_run_together(drawn):
    """Issue 38, 12: a TPE study's heat map has a column per trial; its lr labels ('0.0399544')
    were drawn level and ran into each other."""
    sweep_figures.heatmap(_tpe_rows(), threshold=1.8, winner_id="t0", title="Loss area, 1 worker")
    fig, texts = drawn[-1]
    assert texts_outside(fig, texts) == []
    r = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(r) for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert len(boxes) == 10
    assert not [(a.bounds, b.bounds) for a, b in zip(boxes, boxes[1:]) if a.x1 > b.x0], "labels overlap"


def test_the_heat_maps_caption_says_what_blank_cells_are():
    """Issue 38, 12: 'Empty cells diverged' was said of a search's cells that had no trial."""
    assert "without a label had no trial" in sweep_figures.heat_note(_tpe_rows())
    grid = [{"config": {"workers": 1, "batch_size": b, "lr": lr}} for b in (16, 32) for lr in (0.1, 0.5)]
    note = sweep_figures.heat_note(grid)
    assert note.startswith("Blank cells reading 'diverged' diverged.") and "no trial" not in note


def test_a_run_that_blew_up_does_not_set_the_heat_maps_colour_scale(drawn):
    """Issue 38, 12: a completed trial whose loss blew up (area 2e15) stretched the colour scale to
    1e15 and left every other cell one shade. It is drawn darkest and labelled off scale."""
    rows = _tpe_rows()[:4]
    rows[3]["summary"]["loss_area"] = 2e15
    sweep_figures.heatmap(rows, threshold=1.8, winner_id="t0", title="Loss area, 1 worker")
    fig, texts = drawn[-1]
    im = fig.axes[0].images[0]
    assert im.norm.vmax == 3.0 and im.norm.vmin == 1.0  # the others' areas: 1, 2, 3
    cells = [t.get_text() for t in fig.axes[0].texts]  # multi-line texts are drawn without their Text
    assert "2e+15\noff scale" in cells and "3" in cells, cells
    assert texts_outside(fig, texts) == []
    assert sweep_figures.color_top(np.array([1.0, 2.0, 3.0])) is None


def label_gaps(fig):
    """Each drawn axis label's distance (pixels) from its axis' outermost tick label, which
    matplotlib makes the label pad (4 points at 100 dpi: 5.6 px) where it places labels itself."""
    r = fig.canvas.get_renderer()
    gaps = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            ticks = [t.get_window_extent(r) for t in axis.get_majorticklabels()
                     if t.get_visible() and t.get_text() and axis.get_view_interval()[0] - 1e-9 <=
                     t.get_position()[axis.axis_name == "y"] <= axis.get_view_interval()[1] + 1e-9]
            if not axis.label.get_text() or not ticks:
                continue
            lab = axis.label.get_window_extent(r)
            pos = axis.get_label_position()
            gap = {"bottom": min(b.y0 for b in ticks) - lab.y1, "top": lab.y0 - max(b.y1 for b in ticks),
                   "left": min(b.x0 for b in ticks) - lab.x1, "right": lab.x0 - max(b.x1 for b in ticks)}[pos]
            gaps.append((axis.label.get_text(), gap))
    return gaps


def test_axis_labels_sit_one_label_pad_off_their_tick_labels(fake_sweep, fake_runs, tmp_path, drawn):
    """mpl.layout places each axis label itself, where it measured the tick labels (matplotlib
    would measure them again as it draws): off them by the label pad, neither over them nor
    adrift, also where the figure was measured twice (its ticks moved as the layout resized it)."""
    write_report([str(fake_sweep)])
    write_report([str(p) for p in fake_runs], out=str(tmp_path / "both.html"))
    pad = matplotlib.rcParams["axes.labelpad"] * mpl.DPI / 72
    gaps = [g for fig, _ in drawn for g in label_gaps(fig)]
    assert len(gaps) > 20
    assert [(t, g) for t, g in gaps if abs(g - pad) > 1.5] == []


def test_the_ticks_drawn_are_the_ticks_measured(drawn):
    """The layout measures tick labels at the default margins; an axes it then resizes would let
    an auto locator pick other ticks as it draws (a y axis from 0 to 0.0123 in a short panel:
    more ticks, longer labels). The drawn ticks are those laid out: every label fits."""
    fig, ax = mpl.figure(3.0, 1.6)
    ax.plot([0, 1], [0, 0.0123])
    ax.set(title="t", xlabel="x", ylabel="y")
    mpl.png(fig)
    r = fig.canvas.get_renderer()
    drawn_labels = [t.get_text() for t in ax.yaxis.get_majorticklabels()]
    assert drawn_labels == [t.get_text() for t in ax.yaxis.get_majorticklabels()]
    for t in ax.yaxis.get_majorticklabels():
        assert t.get_window_extent(r).x0 >= 0, t.get_text()


def test_a_log_axis_label_clears_its_minor_tick_labels(drawn):
    """A log axis over less than a decade or two labels minor ticks ('3x10^1'), wider than its
    major ones: the axis label clears them too, as matplotlib places it (analysis/advise.py's plot)."""
    fig, ax = mpl.figure(5.0, 3.0)
    ax.loglog([20, 300], [20, 300])
    ax.set(title="log", xlabel="global batch", ylabel="steps")
    mpl.png(fig)
    assert [t for t in ax.yaxis.get_minorticklabels() if t.get_text()], "no minor labels: the test tests nothing"
    r = fig.canvas.get_renderer()
    ylab = ax.yaxis.label.get_window_extent(r)
    lo, hi = ax.get_ylim()
    labels = [t.get_window_extent(r) for t in ax.yaxis.get_majorticklabels() + ax.yaxis.get_minorticklabels()
              if t.get_text() and lo <= t.get_position()[1] <= hi]
    pad = matplotlib.rcParams["axes.labelpad"] * mpl.DPI / 72
    assert abs(min(b.x0 for b in labels) - ylab.x1 - pad) <= 1.5
    assert ylab.x0 >= 0


def test_the_png_is_the_figure_as_drawn():
    """mpl.encode writes the canvas' own pixels (unfiltered rows): Pillow reads back every pixel,
    and the dpi."""
    fig, ax = mpl.figure(3.0, 2.0)
    ax.imshow(np.arange(12).reshape(3, 4))
    ax.set(title="pixels", xlabel="x", ylabel="y")
    data = mpl.png(fig)
    im = Image.open(io.BytesIO(data))
    assert im.mode == "RGBA" and im.size == (300, 200)
    assert np.array_equal(np.asarray(im), np.asarray(fig.canvas.buffer_rgba()))
    assert round(im.info["dpi"][0]) == mpl.DPI
