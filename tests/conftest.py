import sys

import pytest

_torch_threads = None
"""torch's intra-op thread count when the session's tests were collected (None: torch not imported)."""


def pytest_collection_finish(session):
    """The session's final selection, for triton_interp.interpreted_together (one interpreter
    process per module runs that module's selected tests); and torch's thread count before any test."""
    global _torch_threads
    import triton_interp
    triton_interp.collection_finished(session.items)
    if "torch" in sys.modules:
        _torch_threads = sys.modules["torch"].get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_put_back():
    """A test (or a module fixture it set up) that trains in this process leaves torch's thread count
    where the rank set it (run_worker sets the rank's own and keeps it): it is put back after each
    test, so the tests after it run as they do alone."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and _torch_threads is not None and torch.get_num_threads() != _torch_threads:
        torch.set_num_threads(_torch_threads)


def _xdist_controller(config) -> bool:
    """Whether this is pytest-xdist's controller (-n N): it runs no test, its workers do."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With -n (the README's -n 2): each test file goes whole to one worker, so that a file's
    module-scoped setups (a sweep, a study, a trained run several tests read) run once, not once
    per worker. An explicit --dist other than xdist's default `load` is kept."""
    if config.getvalue("dist") == "load":
        from xdist.scheduler import LoadFileScheduling
        return LoadFileScheduling(config, log)
    return None


def pytest_configure(config):
    """CPU pools fork from a forkserver that imported torch once, as the `shmlearn` program's CPU
    runs do (shmlearn/launch/forkserver.py): a worker of a test's `train()` then starts in ~0.3 s, not
    ~3 s (a 2-worker train() of 640 samples took 0.7 s against 6.5 s spawned). The pool still
    spawns where the program's would (CUDA, an import-time variable changed by a test), and
    tests/launch/test_pool_forkserver.py checks both ways. SHMLEARN_TEST_SPAWN=1: every pool spawns. Under
    -n, each worker starts its own; xdist's controller, which runs no test, none."""
    import os
    if os.environ.get("SHMLEARN_TEST_SPAWN"):
        os.environ["SHMLEARN_FORKSERVER"] = "0"  # else the first pool would start it (forkserver.context)
    elif not _xdist_controller(config):
        from shmlearn.launch import forkserver
        forkserver.start()


@pytest.fixture
def spawned_workers(monkeypatch):
    """This test's pools spawn (SHMLEARN_FORKSERVER=0: forkserver.context)."""
    monkeypatch.setenv("SHMLEARN_FORKSERVER", "0")


@pytest.fixture
def one_thread():
    """A test's own steps in this process on one intra-op thread, as its Gloo workers: on tiny
    batches a second thread only waits on the first, and on a loaded 2-core machine OpenMP's spin
    waits made a small convolution's backward take ~30 ms against 0.2 ms. Modules take it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
