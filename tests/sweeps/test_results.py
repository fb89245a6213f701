"""results.py's kept curves (issue 40): a sweep's report and `advise` read the same once its trial
folders are deleted, from what winners.json keeps; a winners.json from before still works through
the trial folders."""
import json
import re
import shutil

from shmlearn.analysis.advise import advise
from shmlearn.report.load import load_sweep
from shmlearn.report.pages import sweep_page
from shmlearn.sweeps.results import CURVE_POINTS, ResultStore, _thin, keep_curves, pick_winners, winner_ids
from tests.cli_inproc import run_main


def _snapshot(d):
    """The sweep page's text and figures (PNG bytes) and advise's document, as data to compare."""
    page, figs = sweep_page(load_sweep(str(d)))
    doc = advise(str(d))
    doc.pop("source")
    return re.sub(r"Written [0-9: -]+\.", "", "\n".join(page.parts)), figs, doc


def test_report_and_advise_are_the_same_without_the_trial_folders(tmp_path, monkeypatch, capfd):
    d = tmp_path / "s"
    r = run_main(["sweep", "--dataset", "digits", "--model", "mlp", "--samples", "4096", "--workers", "1,2",
                  "--batch-size", "32", "--lr", "0.1,0.3", "--noise-scale", "true", "--parallel", "2",
                  "--no-report", "--out", str(d)], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    old = json.loads((d / "winners.json").read_text())
    old.pop("curves", None)  # the format before curves: drawn from the trial folders
    (d / "winners.json").write_text(json.dumps(old))
    html, figs, doc = _snapshot(d)
    assert {"winners-loss", "winners-accuracy"} <= set(figs)

    new = keep_curves(str(d))
    assert json.loads((d / "winners.json").read_text()) == new
    assert {k: v for k, v in new.items() if k != "curves"} == old  # every other key as it was
    assert all({"loss", "eval"} <= set(new["curves"][i]) for i in winner_ids(new))
    assert any("noise" in c for c in new["curves"].values())
    rows = ResultStore(str(d / "results.jsonl")).load(repair=False)  # what a sweep passing root= writes
    assert pick_winners(rows, root=str(d))["curves"] == new["curves"]
    shutil.rmtree(d / "trials")
    html2, figs2, doc2 = _snapshot(d)
    assert html2 == html and figs2 == figs and doc2 == doc
    assert keep_curves(str(d))["curves"] == new["curves"]  # run again without the folders: nothing lost


def test_a_long_loss_curve_is_thinned_keeping_first_last_and_least():
    pts = [[s, 0.1 * s, 1.0 + (s % 7) / 10] for s in range(3000)]
    pts[1234][2] = 0.01
    kept = _thin(pts)
    assert len(kept) <= CURVE_POINTS + 1 and kept[0] == pts[0] and kept[-1] == pts[-1] and pts[1234] in kept
    assert _thin(pts[:CURVE_POINTS]) == pts[:CURVE_POINTS]
