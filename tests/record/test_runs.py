"""shmlearn/record/runs.py: the run directory's JSON files are JSON for every reader; no write follows a
symlink out of --out; a run and a sweep do not share a folder."""
import contextlib
import json
import math
import os

import pytest

from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput
from shmlearn.record.runs import RunDir, check_out_dir, check_sweep_out, finished, lock_out_dir, published


def _strict(text):
    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_nan_and_inf_are_written_as_null_in_summary_and_eval(tmp_path):
    """Issue 38, 10: a NaN test loss was written as a bare NaN token into summary.json and
    eval.jsonl (invalid JSON outside Python). It is null; finite values are kept."""
    rd = RunDir(str(tmp_path / "run"), TrainConfig(out=str(tmp_path / "run")))
    rd.log_eval({"step": 10, "test_loss": math.nan, "test_accuracy": None, "other": [math.inf, 1.5]})
    rd.write_summary({"status": "completed", "test_loss": math.nan, "min_loss": -math.inf, "final_loss": 0.25,
                      "phase_s": {"compute": math.nan}})
    rd.close()
    row = _strict((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[0])
    assert row == {"step": 10, "test_loss": None, "test_accuracy": None, "other": [None, 1.5]}
    s = _strict((tmp_path / "run" / "summary.json").read_text())
    assert (s["test_loss"], s["min_loss"], s["final_loss"], s["phase_s"]) == (None, None, 0.25, {"compute": None})


# -- writes (issue 53): no symlink followed out of --out; a run's and a sweep's folders kept apart --


def _planted(tmp_path, name, *, existing=True):
    """--out holding NAME, a symlink to a file outside it (existing, or one that does not exist yet)."""
    out, away = tmp_path / "run", tmp_path / "away"
    out.mkdir()
    away.mkdir()
    target = away / "victim"
    if existing:
        target.write_text("keep me\n")
    (out / name).symlink_to(target)
    return out, target


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "eval.jsonl"])
@pytest.mark.parametrize("resumed", [None, 0, 20])
def test_a_run_directory_writes_through_no_symlink_out_of_it(tmp_path, name, resumed):
    """config.yaml was created where a link in --out pointed; a --resume (without a checkpoint:
    keep_until None, the files emptied) truncated the file metrics.jsonl linked to."""
    out, target = _planted(tmp_path, name)
    with pytest.raises(BadInput) as e:
        RunDir(str(out), TrainConfig(out=str(out)), keep_until=resumed)
    assert f"{out / name}: a symlink to {target}" in str(e.value)
    assert target.read_text() == "keep me\n"


def test_a_dangling_link_in_out_creates_nothing_where_it_points(tmp_path):
    out, target = _planted(tmp_path, "config.yaml", existing=False)
    with pytest.raises(BadInput):
        RunDir(str(out), TrainConfig(out=str(out)))
    assert not target.exists()


def test_the_lock_is_not_taken_through_a_link_out_of_out(tmp_path):
    out, target = _planted(tmp_path, ".lock", existing=False)
    with pytest.raises(BadInput) as e:
        with lock_out_dir(str(out)):
            pass
    assert ".lock: a symlink to" in str(e.value) and not target.exists()


def test_a_run_and_a_sweep_do_not_share_a_folder(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text("")
    with pytest.raises(BadInput, match="holds a sweep, study or experiment"):
        check_out_dir(str(sweep))
    run = tmp_path / "run"
    RunDir(str(run), TrainConfig(out=str(run))).close()
    with pytest.raises(BadInput, match="holds a training run"):
        check_sweep_out(str(run))
    check_sweep_out(str(tmp_path / "new"))  # a new folder, or one of a sweep, is the sweep's own
    check_sweep_out(str(sweep))


def test_finished_is_a_run_that_completed_or_diverged(tmp_path):
    rd = RunDir(str(tmp_path / "r"), TrainConfig(out=str(tmp_path / "r")))
    assert finished(rd.path) is None  # started, no summary yet
    for status, done in (("failed", False), ("completed", True), ("diverged", True)):
        rd.write_summary({"status": status, "steps": 3})
        assert (finished(rd.path) is not None) == done
    (tmp_path / "r" / "summary.json").write_text("[1, 2]")  # damaged: refused, never resumed over (issue 53)
    with pytest.raises(BadInput, match="summary.json: expected an object at the top, got a list"):
        finished(rd.path)
    rd.close()
    assert not [n for n in os.listdir(rd.path) if ".tmp" in n]


def test_an_experiment_is_not_claimed_into_a_training_run(tmp_path):
    """`experiment --out RUN` wrote its experiment.json into a training run's folder."""
    from shmlearn.experiments import _claim
    run = tmp_path / "run"
    RunDir(str(run), TrainConfig(out=str(run))).close()
    with pytest.raises(BadInput, match="holds a training run"):
        _claim(str(run), {"experiment": "linreg", "quick": True})
    assert not (run / "experiment.json").exists()


def _step_summary(**changes):
    from shmlearn.step.summary import StepSummary
    fields = dict(step_mode="cuda-graph", check_every=8, step_note=None, compile="off", compile_s=None,
                  compile_read=False, image_conv="cudnn", image_convs=0, max_pool="aten", max_pools=0,
                  conv_pool="torch", conv_pools=0, mlp_head="torch", mlp_heads=0, kernels=[], kernel_notes=[],
                  conv_overlap="off", conv_overlaps=0, conv_overlap_deferred=False, combo_kernels=False,
                  update_kernel="flat", update_in_backward=False, weight_copy=False, grad_buckets=3,
                  graph_memsets_replaced=2, phase_sample_every=50)
    return StepSummary(**{**fields, **changes})


def test_phase_timing_says_how_the_steps_summary_was_timed():
    from types import SimpleNamespace
    from shmlearn.record.runs import phase_timing
    timer = SimpleNamespace(timed_steps=4, steps=200)
    assert phase_timing(_step_summary(), timer, "cuda") == (
        "CUDA events on 4 eager steps (one in 50); the other 196 were CUDA graph replays")
    assert phase_timing(_step_summary(step_mode="fast-eager", phase_sample_every=None), timer, "cpu") == (
        "perf_counter on every step")


def test_summary_json_holds_the_steppers_summary_field_for_field(tmp_path):
    """A run's summary.json has each StepSummary field under its own name, in its order, with the
    value the step ran with (a 1-worker CPU run, fast step read every 3 steps)."""
    import dataclasses
    import shmlearn
    from shmlearn.step.summary import StepSummary
    res = shmlearn.train(TrainConfig(model="mlp", dataset="digits", workers=1, device="cpu", samples=64 * 6,
                                     batch_size=64, check_every=3, eval_points=1, progress=False,
                                     out=str(tmp_path / "run")))
    with open(tmp_path / "run" / "summary.json") as f:
        s = json.load(f)
    names = [f.name for f in dataclasses.fields(StepSummary)]
    keys = list(s)
    assert keys[keys.index(names[0]):keys.index(names[0]) + len(names)] == names
    assert (s["step_mode"], s["check_every"], s["compile"], s["grad_buckets"], s["phase_sample_every"]) == (
        "fast-eager", 3, "off", 0, None)
    assert s["phase_timing"] == "perf_counter on every step" and res.summary["step_mode"] == "fast-eager"


def test_a_fork_of_a_run_does_not_keep_its_out_locked(tmp_path):
    """flock's lock belongs to the open file, which a fork shares: a worker forked from the run's
    process (train()'s caller fork) that outlives it must not keep the next run out."""
    import time
    out = str(tmp_path / "run")
    with lock_out_dir(out):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the fork: hold on past the run's end
            os.close(r)
            os.write(w, b"x")
            time.sleep(5)
            os._exit(0)
        os.close(w)
        os.read(r, 1)
        os.close(r)
        with pytest.raises(BadInput):  # held while the run is
            with lock_out_dir(out):
                pass
    try:
        with lock_out_dir(out):  # the run ended; the fork, still alive, holds nothing
            pass
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def _synced(monkeypatch):
    """The files os.fsync is called on from now (their names, from /proc/self/fd)."""
    names = []
    real = os.fsync

    def fsync(fd):
        names.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return names


@pytest.mark.parametrize("in_sweep", [False, True])
def test_a_published_run_directory_leaves_its_fsyncs_to_the_publisher(tmp_path, monkeypatch, in_sweep):
    """A run fsyncs config.yaml and summary.json (each to a temporary name, then renamed); a sweep's
    trial (runs.published) writes the same bytes without, and the sweep fsyncs them before it
    publishes the folder (sweeps/trials.py done; tests/sweeps/test_sweep.py checks that side)."""
    synced = _synced(monkeypatch)
    out = tmp_path / "run"
    cfg = TrainConfig(out=str(out))
    with published() if in_sweep else contextlib.nullcontext():
        rd = RunDir(str(out), cfg)
        rd.write_summary({"status": "completed", "final_loss": 0.25})
        rd.write_summary({"status": "completed", "final_loss": 0.25, "weights": "model.pt"})
        rd.close()
    assert [n.split(".tmp.")[0] for n in synced] == ([] if in_sweep else ["config.yaml", "summary.json",
                                                                          "summary.json"])
    assert RunDir(str(tmp_path / "after"), cfg).fsync  # the flag does not outlive the block
    assert json.loads((out / "summary.json").read_text())["weights"] == "model.pt"
    assert "out: " + str(out) in (out / "config.yaml").read_text()
