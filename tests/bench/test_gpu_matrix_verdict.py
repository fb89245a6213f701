"""benchmarks/gpu_matrix.py's verdict on a cell that missed its reference once: the cell and the
reference run twice more, and the means decide within the tolerance plus three standard errors,
unless one of the cell's runs lies more than OUTLIER tolerances from the reference (no GPU: the
runs are given)."""
import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def gm():
    spec = importlib.util.spec_from_file_location(
        "gpu_matrix", os.path.join(HERE, "..", "..", "benchmarks", "gpu_matrix.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _verdict(gm, monkeypatch, precision, mine, refs):
    """again_vs_spread on a cell whose first run gave mine[0] against refs[0], its repeats the rest."""
    repeats = iter([{"final_loss": v} for v in refs[1:] + mine[1:]])  # the reference's repeats first
    monkeypatch.setattr(gm, "run_cell", lambda cfg: next(repeats))
    monkeypatch.setattr(gm, "config", lambda c, a, over: None)
    cell = {"precision": precision, "strategy": "ps", "over": {}}
    row = {"verdict": "mismatch"}
    gm.again_vs_spread(cell, None, row, {"final_loss": mine[0]}, {"final_loss": refs[0]})
    return row


def test_a_cell_whose_runs_spread_about_the_reference_passes(gm, monkeypatch):
    # resnet18 fp32 ps --compile on an H200 (2026-11-27): a BatchNorm net on random labels moves.
    row = _verdict(gm, monkeypatch, "fp32", [0.7474, 0.712, 0.742], [0.6878, 0.70, 0.69])
    assert row["verdict"] == "ok" and "3 runs each" in row["note"]


def test_one_run_far_off_fails_the_cell_whatever_the_means(gm, monkeypatch):
    # fashion-net fp32 ps --compile at W=2 on an H200 (2026-11-27): the first run trained badly;
    # its own distance widened the standard error enough for the means to pass.
    row = _verdict(gm, monkeypatch, "fp32", [1.879, 0.426, 0.422], [0.4248, 0.4224, 0.4241])
    assert row["mean_difference"] <= row["bound"]  # what the spread alone would have excused
    assert row["verdict"] == "mismatch" and "more than 5 tolerances" in row["note"]


def test_a_consistent_miss_fails(gm, monkeypatch):
    row = _verdict(gm, monkeypatch, "fp32", [0.66, 0.65, 0.67], [0.555, 0.556, 0.554])
    assert row["verdict"] == "mismatch" and "note" not in row
