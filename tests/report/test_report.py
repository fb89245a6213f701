"""The report: figures for a run, runs side by side and a sweep, in one self-contained page."""
import io
import os
import re
import subprocess
import sys

import pytest
from PIL import Image

from shmlearn.errors import BadInput
from shmlearn.report import write_report
from shmlearn.report.load import load_sweep


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


def test_bad_paths_are_bad_input(tmp_path, fake_sweep, fake_runs):
    with pytest.raises(BadInput, match="no such directory"):
        write_report([str(tmp_path / "nope")])
    with pytest.raises(BadInput, match="neither a run directory"):
        write_report([str(tmp_path)])
    with pytest.raises(BadInput, match="reported on its own"):
        write_report([str(fake_sweep), str(fake_runs[0])])
    r = subprocess.run([sys.executable, "-m", "shmlearn", "report", str(tmp_path / "nope")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such directory" in r.stderr
