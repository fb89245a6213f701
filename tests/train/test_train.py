"""train.py: its process-wide settings, and what summary.json says of the run."""
import os

import torch

from inductor import ran_eagerly
from shmlearn.launch.placement import set_determinism


def test_set_determinism_sets_and_clears_torch_flags():
    cpu = torch.device("cpu")
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    try:
        set_determinism(True, cpu)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic
        set_determinism(True, cpu)  # again: unchanged
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        set_determinism(False, cpu)  # a pool worker's next config clears them
        assert not torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.deterministic
        torch.use_deterministic_algorithms(True)  # set elsewhere without warn_only: made warn_only
        set_determinism(True, cpu)
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=True)
        torch.backends.cudnn.deterministic = before[1]


def test_a_dedicated_servers_summary_tells_how_its_workers_stepped(tmp_path):
    """ps --ps-dedicated: rank 0 only serves (no model step, no compile, no batch read), so
    summary.json's account of the step must be a worker's. It was rank 0's: compile_s None and
    compile_read False for a run whose workers compiled both."""
    import shmlearn
    from shmlearn.config.train_config import TrainConfig

    res = shmlearn.train(TrainConfig(model="mlp", dataset="digits", workers=2, strategy="ps", ps_dedicated=True,
                                     device="cpu", samples=64 * 6, batch_size=64, compile="default",
                                     eval_points=1, progress=False, out=str(tmp_path / "psd")))
    s = res.summary
    assert s["status"] == "completed" and s["processes"] == 3 and s["workers"] == 2
    assert s["step_mode"] == "fast-eager"
    if ran_eagerly(s["step_note"]):  # Inductor cannot build here (tests/inductor.py): every rank ran eagerly,
        # and the note is still a worker's: the server's says its step was not built "on 2 other rank(s)"
        assert s["compile"] == "off" and s["compile_s"] is None and s["compile_read"] is False
        assert "could not build the step's code on this machine (CppCompileError: " in s["step_note"], s["step_note"]
        return
    assert s["compile"] == "default"
    assert s["compile_s"] is not None and s["compile_s"] > 0
    assert s["compile_read"] is True


def test_two_runs_started_in_the_same_second_get_their_own_run_directories(tmp_path, monkeypatch):
    """The default run directory is claimed when it is named: a second run in the same second
    (two shards of a script, a loop) takes NAME-2 instead of being refused as 'already holds a run'."""
    import time as _time
    from shmlearn.config.train_config import TrainConfig
    from shmlearn.record.runs import default_run_dir
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_time, "strftime", lambda fmt, *a: "20261126-212327")
    cfg = TrainConfig(model="mlp", dataset="digits")
    first, second = default_run_dir(cfg, 2, claim=True), default_run_dir(cfg, 2, claim=True)
    assert first == "runs/20261126-212327-mlp-digits-allreduce-w2" and second == first + "-2"
    assert os.path.isdir(first) and os.path.isdir(second)
    assert default_run_dir(cfg, 2) == first  # unclaimed (a launcher's ranks): the plain name


def test_an_in_process_run_leaves_the_callers_thread_count_as_it_was(tmp_path):
    """A 1-worker run trains in the caller's process and sets the rank's intra-op threads
    (--threads here); the caller's own count must come back after it, done or failed: it leaked
    and made whatever the caller ran next single- or many-threaded behind its back."""
    import pytest

    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    from shmlearn.errors import BadInput

    before = torch.get_num_threads()
    want = 2 if before != 2 else 3
    try:
        torch.set_num_threads(want)
        cfg = TrainConfig(model="mlp", dataset="digits", workers=1, device="cpu", threads=1, samples=64,
                          batch_size=32, eval_points=1, progress=False, out=str(tmp_path / "one"))
        assert shmlearn.train(cfg).summary["status"] == "completed"
        assert torch.get_num_threads() == want
        with pytest.raises(BadInput):  # fails inside the rank, after it set its threads
            shmlearn.train(TrainConfig(**{**cfg.to_dict(), "samples": 16, "out": str(tmp_path / "two")}))
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
