"""The report: figures for a run, runs side by side and a sweep, in one self-contained page."""
import io
import json
import math
import os
import re

import numpy as np
import pytest
from PIL import Image

from shmlearn.errors import BadInput
from shmlearn.report import write_report
from shmlearn.report.load import load_sweep
from shmlearn.report.sweep_figures import heat_cells, histogram_order


def self_contained(html):
    """Every src and href is a data: URI: no file, no network, no script."""
    refs = re.findall(r'\b(?:src|href)\s*=\s*["\']?([^"\' >]+)', html)
    assert refs and all(r.startswith("data:") for r in refs), [r[:40] for r in refs if not r.startswith("data:")]
    assert "<script" not in html.lower() and "url(" not in html
    return len(re.findall(r'<img src="data:image/png;base64,', html))


def png_size(path):
    with Image.open(path) as im:
        im.load()  # decodes the whole image
        return im.size


def test_one_run_gets_its_own_plots_and_page(fake_runs):
    run, _ = fake_runs
    out = write_report([str(run)])
    assert out == os.path.join(str(run), "report.html")
    assert sorted(os.listdir(run / "figures")) == ["accuracy.png", "loss.png", "phases.png"]
    for f in os.listdir(run / "figures"):
        w, h = png_size(run / "figures" / f)
        assert w >= 500 and h >= 200
    html = open(out).read()
    assert self_contained(html) == 3
    assert "w1 b64 lr0.5" in html and "allreduce" in html


def test_runs_side_by_side_share_one_page(fake_runs, tmp_path):
    a, b = fake_runs
    out = write_report([str(a), str(b)], out=str(tmp_path / "both.html"))
    html = open(out).read()
    assert self_contained(html) == 3  # loss, accuracy and phases, both runs on each
    assert "w1 b64 lr0.5 (run-a)" in html and "w4 b16 lr0.1 (run-b)" in html
    assert not (a / "figures").exists()  # several runs: only the page


def test_incomplete_and_diverged_runs_are_shown_not_refused(tmp_path, make_run):
    make_run(tmp_path / "d", status="diverged")
    make_run(tmp_path / "i")
    os.remove(tmp_path / "i" / "summary.json")
    html = open(write_report([str(tmp_path / "d"), str(tmp_path / "i")], out=str(tmp_path / "r.html"))).read()
    assert "diverged at step 25 (rank 1)" in html and "no summary.json" in html


def test_sweep_page_has_every_figure_and_the_winners(fake_sweep):
    out = write_report([str(fake_sweep)])
    figs = sorted(os.listdir(fake_sweep / "figures"))
    assert figs == ["areas-w1.png", "areas-w2.png", "heatmap-w1.png", "heatmap-w2.png", "phases-vs-workers.png",
                    "throughput-vs-workers.png", "winners-accuracy.png", "winners-loss.png"]
    assert all(png_size(fake_sweep / "figures" / f)[0] >= 400 for f in figs)
    html = open(out).read()
    assert self_contained(html) >= len(figs)
    sw = load_sweep(str(fake_sweep))
    # the paper's rule on the hand-made results: w2 b16 lr0.1 has the least area of its worker
    # count but a min loss of 2.0, so the next least area wins
    w2 = sw.winners["by_workers"]["2"]["winner"]
    assert (w2["batch_size"], w2["lr"]) == (32, 0.1)
    assert "Winners (paper Table 5.1)" in html and "Least training time to test accuracy 0.9" in html


PRUNED = "w1-b32-lr0.5-fake"  # fake_sweep's pruned trial


def test_sweep_page_reports_a_pruned_trial_as_pruned_not_as_an_area(fake_sweep):
    html = open(write_report([str(fake_sweep)])).read()
    sw = load_sweep(str(fake_sweep))
    row = next(r for r in sw.rows if r["id"] == PRUNED)
    assert "8 of 8 trials finished (6 completed, 1 pruned, 1 diverged)" in html
    assert "Grey hatched cells were pruned" in html
    # the table: status pruned, and its area marked as a lower bound
    assert re.search(rf"<td class=l>{PRUNED}</td><td class=l>pruned</td>.*?<td>&gt;{row['summary']['loss_area']:.4g}</td>",
                     html)
    assert all(info["winner"]["id"] != PRUNED for info in sw.winners["by_workers"].values())


def test_heat_map_and_histogram_keep_pruned_apart(fake_sweep):
    sw = load_sweep(str(fake_sweep))
    w1 = [r for r in sw.rows if r["config"]["workers"] == 1]
    batches, lrs, area, cells = heat_cells(w1, threshold=1.8)
    i, j = batches.index(32), lrs.index(0.5)
    pruned = cells[i, j]
    assert pruned.row["id"] == PRUNED and pruned.kind == "pruned"
    assert math.isnan(area[i, j])  # a partial area is not on the color scale
    assert pruned.text == f"pruned\n>{pruned.row['summary']['loss_area']:.3g}"
    d = cells[batches.index(16), lrs.index(0.5)]
    assert d.kind == "diverged" and math.isnan(area[batches.index(16), lrs.index(0.5)])
    assert [c.kind for c in cells.values()].count("completed") == 2 == int(np.isfinite(area).sum())
    # sorted by min loss: completed first, then pruned, diverged last
    assert [r["status"] for r in histogram_order(w1)] == ["completed", "completed", "pruned", "diverged"]


def test_a_pruned_run_page_says_where_it_stopped(tmp_path, make_run):
    s, _ = make_run(tmp_path / "p", status="pruned", steps=60)
    html = open(write_report([str(tmp_path / "p")])).read()
    assert "pruned at step 30 of 60" in html and f"&gt;{s['loss_area']:.4g}" in html


def test_bad_paths_are_bad_input(tmp_path, fake_sweep, fake_runs, capfd):
    with pytest.raises(BadInput, match="no such directory"):
        write_report([str(tmp_path / "nope")])
    with pytest.raises(BadInput, match="neither a run directory"):
        write_report([str(tmp_path)])
    with pytest.raises(BadInput, match="reported on its own"):
        write_report([str(fake_sweep), str(fake_runs[0])])
    # the CLI's main() in this process (a fresh interpreter was ~2-3 s of two cores here), fd 2 read
    from shmlearn.cli.main import main
    capfd.readouterr()
    try:
        code = main(["report", str(tmp_path / "nope")])
    except SystemExit as e:
        code = e.code
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no such directory" in err, err


def test_run_page_prints_samples_per_s_as_a_plain_number(tmp_path, make_run):
    """Issue 16: the summary printed 24540.3 samples/s as 2.454e+04."""
    s, _ = make_run(tmp_path / "r")
    s["samples_per_s"] = 24540.3
    with open(tmp_path / "r" / "summary.json", "w") as f:
        json.dump(s, f)
    html = open(write_report([str(tmp_path / "r")])).read()
    assert "<td class=l>samples/s</td><td>24,540</td>" in html
    assert not re.search(r"\de\+0", re.sub(r'src="data:[^"]*"', "", html))  # the images are base64


def test_one_worker_is_singular_everywhere_on_the_sweep_page(fake_sweep):
    """Issue 16: 'Overall best: 1 workers, ...'. fake_sweep cut to its 1-worker trials."""
    with open(fake_sweep / "sweep.json") as f:
        spec = json.load(f)
    spec["trials"] = [t for t in spec["trials"] if t.startswith("w1-")]
    spec["axes"]["workers"] = [1]
    with open(fake_sweep / "sweep.json", "w") as f:
        json.dump(spec, f)
    assert load_sweep(str(fake_sweep)).winners["overall"]["workers"] == 1
    html = open(write_report([str(fake_sweep)])).read()
    assert "Overall best: 1 worker, batch" in html
    assert not re.search(r"\b1 workers\b", html)


def test_write_report_leaves_the_garbage_collector_as_it_found_it(fake_runs):
    """write_report freezes the objects it finds (the figures' garbage then costs no walk of the
    whole process); it must unfreeze them, and leave a caller's own freeze alone."""
    import gc
    frozen_before = gc.get_freeze_count()  # a plugin or an earlier test of this process may have frozen
    gc.unfreeze()
    try:
        write_report([str(fake_runs[0])])
        assert gc.get_freeze_count() == 0
        gc.freeze()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        write_report([str(fake_runs[0])])
        assert gc.get_freeze_count() > frozen // 2  # left frozen (a few frozen objects were freed meanwhile)
    finally:
        gc.unfreeze()
        if frozen_before:
            gc.freeze()


def test_an_async_ps_run_page_draws_each_workers_staleness(tmp_path, make_run):
    make_run(tmp_path / "a", strategy="async-ps")
    path = tmp_path / "a" / "summary.json"
    s = json.load(open(path))
    s["staleness_histogram"] = {"1": {"1": 3, "2": 40}, "2": {"0": 10, "1": 80}, "3": {"0": 9, "1": 78, "2": 3}}
    json.dump(s, open(path, "w"))
    write_report([str(tmp_path / "a")])
    assert "staleness.png" in os.listdir(tmp_path / "a" / "figures")
    w, h = png_size(tmp_path / "a" / "figures" / "staleness.png")
    assert w >= 500 and h >= 200
    html = open(tmp_path / "a" / "report.html").read()
    assert "gradients applied per worker by lag" in html
    make_run(tmp_path / "b")  # no histogram: no staleness figure
    write_report([str(tmp_path / "b")])
    assert "staleness.png" not in os.listdir(tmp_path / "b" / "figures")
