"""--tensorboard (issue 41): rank 0 writes RUN/tensorboard/ event files that TensorBoard's own
reader reads back with the run directory's numbers; without the package it is refused in one line."""
import math
import sys

import pytest

from shmlearn import TrainConfig
from shmlearn.config.train_config import validate
from shmlearn.errors import BadInput
from shmlearn.record.runs import read_jsonl

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _scalars(folder):
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def test_cli_run_writes_what_metrics_and_eval_hold(tmp_path, monkeypatch, capfd):
    # main() in this process (tests/cli_inproc.py): the files the command writes are the point, not
    # the program's process; its 2 workers (rank 0 writes the events) are processes either way.
    from cli_inproc import run_main
    out = tmp_path / "run"
    r = run_main(["train", "--workers", "2", "--samples", "1280", "--batch-size", "32", "--log-every", "2",
                  "--eval-points", "2", "--tensorboard", "--no-progress", "--out", str(out)], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    metrics, evals = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "eval.jsonl")
    assert len(metrics) == 10 and len(evals) >= 2
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0's only
    got = _scalars(out / "tensorboard")
    phases = {f"phase_s/{p}" for p in metrics[-1]["phase_s"]}
    assert phases and {"train/loss", "train/lr", "train/samples_per_s", "test/loss", "test/accuracy"} | phases \
        == set(got)
    assert [e.step for e in got["train/loss"]] == [m["step"] for m in metrics]
    for e, m in zip(got["train/loss"], metrics):
        assert math.isclose(e.value, m["loss"], rel_tol=1e-6), (e, m)  # stored as float32
    assert [e.step for e in got["train/lr"]] == [m["step"] for m in metrics]
    assert all(0 <= e.value <= 0.05 for e in got["train/lr"])  # the default linear decay from --lr 0.05
    assert len(got["train/samples_per_s"]) == len(metrics) and all(e.value > 0 for e in got["train/samples_per_s"])
    assert [e.step for e in got["test/accuracy"]] == [v["step"] for v in evals]
    for e, v in zip(got["test/accuracy"], evals):
        assert math.isclose(e.value, v["test_accuracy"], rel_tol=1e-6)
    for e, v in zip(got["test/loss"], evals):
        assert math.isclose(e.value, v["test_loss"], rel_tol=1e-6)
    step_ms = [m for m in metrics if m["phase_s"]]
    for p in metrics[-1]["phase_s"]:
        series = got[f"phase_s/{p}"]
        assert [e.step for e in series] == [m["step"] for m in step_ms if p in m["phase_s"]]
        for e, m in zip(series, [m for m in step_ms if p in m["phase_s"]]):
            assert math.isclose(e.value, m["phase_s"][p], rel_tol=1e-6, abs_tol=1e-12)


def test_without_the_package_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.raises(BadInput) as e:
        validate(TrainConfig(tensorboard=True))
    assert str(e.value) == ("--tensorboard: the tensorboard package is not installed; "
                            "pip install 'shmlearn[tensorboard]'")
    validate(TrainConfig())  # off: nothing to import


def test_cli_refusal_exit_2_before_any_worker(tmp_path, monkeypatch, capfd):
    from cli_inproc import run_main
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    r = run_main(["train", "--tensorboard", "--out", str(tmp_path / "run")], monkeypatch, capfd)
    assert r.returncode == 2
    assert r.stderr == ("shmlearn: error: --tensorboard: the tensorboard package is not installed; "
                        "pip install 'shmlearn[tensorboard]'\n")
    assert not (tmp_path / "run").exists()


def test_sweep_trials_are_runs_of_one_log_dir(tmp_path, monkeypatch, capfd):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    from cli_inproc import run_main
    sweep = tmp_path / "sweep"
    # main() in this process, as above: the trials' event files are the point
    r = run_main(["sweep", "--lr", "0.05,0.1", "--samples", "640", "--tensorboard", "--no-report",
                  "--out", str(sweep)], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    m = EventMultiplexer()
    m.AddRunsFromDirectory(str(sweep))
    m.Reload()
    trials = sorted(p.name for p in (sweep / "trials").iterdir() if not p.name.startswith("."))
    assert sorted(m.Runs()) == [f"trials/{t}/tensorboard" for t in trials] and len(trials) == 2
    for t in trials:
        rows = read_jsonl(sweep / "trials" / t / "metrics.jsonl")
        assert [e.value for e in m.Scalars(f"trials/{t}/tensorboard", "train/loss")] == \
            pytest.approx([row["loss"] for row in rows], rel=1e-6)
