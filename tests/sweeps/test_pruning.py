"""Exact pruning (pruning.py, `sweep --prune`): the rule against hand-made bounds, and a real
sweep that prunes at least a third of its grid yet picks the full grid's winners."""
import json
import math

import torch.distributed as dist

from cli_inproc import run_main
from shmlearn.sweeps.pruning import Watch, cannot_win, post_bound
from shmlearn.sweeps.sweep import pick_winners


def test_a_run_is_pruned_only_once_its_area_passes_the_best_survivors():
    assert not cannot_win(1.0, 5.0, (1.0, -math.inf))        # a tie may still win: never pruned
    assert cannot_win(1.0 + 1e-6, 5.0, (1.0, -math.inf))
    assert not cannot_win(0.5, 50.0, (1.0, -math.inf))


def test_with_a_target_a_run_must_also_be_slower_than_the_best_time_to_target():
    assert not cannot_win(2.0, 3.0, (1.0, 4.0))   # may still reach the target first
    assert cannot_win(2.0, 4.5, (1.0, 4.0))
    assert not cannot_win(2.0, 100.0, (1.0, math.inf))  # no run reached the target yet


def test_the_watch_reads_the_bound_the_sweep_posts():
    store = dist.HashStore()
    w = Watch(store, "k", every_s=0.0)
    assert not w.should_stop(10.0, 1.0)  # nothing posted: never prune on a guess
    post_bound(store, "k", 2.0, target=False, time_to_target=None)
    assert w.should_stop(2.5, 0.1) and not w.should_stop(1.5, 99.0)
    post_bound(store, "k", 2.0, target=True, time_to_target=None)
    assert not w.should_stop(2.5, 0.1)


def _sweep(out, monkeypatch, capfd, *extra):
    """A sweep's results and stdout: main() in this process (its trials in the pool's workers)."""
    args = ["sweep", "--dataset", "digits", "--model", "mlp", "--samples", "8192", "--workers", "1,2",
            "--batch-size", "64", "--lr", "0.1,0.003,0.002,0.001", "--lr-schedule", "constant",
            "--no-report", "--out", str(out), *extra]
    r = run_main(args, monkeypatch, capfd)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out / "results.jsonl") as f:
        return [json.loads(line) for line in f], r.stdout


def test_prune_picks_the_full_grids_winners_and_prunes_a_third(tmp_path, monkeypatch, capfd):
    full, _ = _sweep(tmp_path / "full", monkeypatch, capfd)
    pruned, stdout = _sweep(tmp_path / "pruned", monkeypatch, capfd, "--prune")
    swept = ["workers", "batch_size", "lr"]
    wf, wp = pick_winners(full, swept=swept), pick_winners(pruned, swept=swept)
    for w in ("1", "2"):
        assert wf["by_workers"][w]["winner"]["id"] == wp["by_workers"][w]["winner"]["id"]
    cut = [r for r in pruned if r["status"] == "pruned"]
    assert len(cut) >= len(pruned) / 3, stdout
    for r in cut:  # the exactness argument, checked: each stopped run was already beaten
        best = wp["by_workers"][str(r["config"]["workers"])]["winner"]["loss_area"]
        assert r["pruned"]["area_so_far"] > best
        assert r["summary"]["steps"] < r["summary"]["planned_steps"]
    assert "PRUNED at step" in stdout and json.load(open(tmp_path / "pruned" / "timing.json"))["pruned"] == len(cut)
    assert not any(r["status"] == "pruned" for r in full)
