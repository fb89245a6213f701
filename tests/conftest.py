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
    per worker. The files go out in the order the workers collected them (longest first:
    pytest_collection_modifyitems), not xdist's (most tests first). An explicit --dist other than
    xdist's default `load` is kept."""
    if config.getvalue("dist") == "load":
        from xdist.scheduler import LoadFileScheduling
        config.option.loadscopereorder = False
        return LoadFileScheduling(config, log)
    return None


FILE_SECONDS = {
    "test_reliability.py": 143, "test_ports.py": 113, "sweeps/test_study.py": 105, "step/test_fast.py": 87,
    "experiments/test_experiments.py": 79, "launch/test_launch.py": 76, "sync/test_async_ps.py": 63,
    "train/test_noise.py": 63, "bench/test_throughput.py": 53, "step/test_compile_cache.py": 52,
    "launch/test_pool.py": 48, "launch/test_pool_fork.py": 45, "data/test_stream.py": 41,
    "launch/test_lean.py": 38, "cli/test_signals.py": 37, "launch/test_pool_start.py": 36,
    "cli/test_cli.py": 35, "sync/test_new_strategy.py": 34, "cli/test_cli_start.py": 29,
    "launch/test_pool_forkserver.py": 28, "test_readme.py": 25, "sync/test_equivalence.py": 24,
    "nn/test_conv_pool.py": 24, "nn/test_image_conv.py": 24, "nn/test_conv_overlap.py": 20,
    "user/test_user_main.py": 19, "sync/test_clip_accumulate.py": 19, "data/test_tree_parts.py": 18,
    "step/test_flat_sgd.py": 17, "sweeps/test_sweep.py": 17, "launch/test_launch_env.py": 17,
    "step/test_user_optimizers.py": 17, "test_mnist_recipe.py": 16, "train/test_compute_loss.py": 14,
    "user/test_own_model.py": 14, "train/test_early.py": 14, "train/test_train.py": 13,
    "data/test_lazy.py": 13, "nn/test_max_pool.py": 12, "bench/test_ps_sim.py": 12,
}
"""Seconds of the test files that take longest under -n 2 on the 2-core CI machine (the sum of
each file's --durations=0 rows, 2026-11-29); any other file is taken as 0.05 s a test. Only the
order in which -n hands out whole files comes from it (pytest_collection_modifyitems): a stale
figure costs balance, never a test."""


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, for each worker: whether the scheduler hands out files as they are
    collected (a worker's --dist is "no")."""
    if node.config.getvalue("dist") == "load":
        node.workerinput["shmlearn_longest_first"] = True


def pytest_collection_modifyitems(session, config, items):
    """Under -n (an xdist worker's collection, which the scheduler hands out file by file in this
    order), the files longest first, each file's tests in their own order: a long file handed out
    last (xdist's own order is the most tests first, and the longest files have few tests) ran on
    one worker while the other had nothing left. Without -n, the order is pytest's."""
    if not getattr(config, "workerinput", {}).get("shmlearn_longest_first"):
        return
    import os
    root = os.path.join(str(config.rootpath), "tests")
    files = {}
    for item in items:
        files.setdefault(os.path.relpath(str(item.fspath), root), []).append(item)
    order = sorted(files, key=lambda f: -FILE_SECONDS.get(f.replace(os.sep, "/"), 0.05 * len(files[f])))
    items[:] = [item for f in order for item in files[f]]


def pytest_configure(config):
    """CPU pools fork from a forkserver that imported torch once, as the `shmlearn` program's CPU
    runs do (shmlearn/launch/forkserver.py): a worker of a test's `train()` then starts in ~0.3 s, not
    ~3 s (a 2-worker train() of 640 samples took 0.7 s against 6.5 s spawned). The pool still
    spawns where the program's would (CUDA, an import-time variable changed by a test), and
    tests/launch/test_pool_forkserver.py checks both ways. SHMLEARN_TEST_SPAWN=1: every pool spawns. Under
    -n, each worker starts its own; xdist's controller, which runs no test, none; nor does the
    pytest process that runs a module's tests in Triton's interpreter (tests/triton_interp.py,
    TRITON_INTERPRET=1): most of those never start a pool, and one that does starts the
    forkserver then (forkserver.context), where each such process imported torch in a forkserver
    of its own for nothing."""
    import os
    if os.environ.get("SHMLEARN_TEST_SPAWN"):
        os.environ["SHMLEARN_FORKSERVER"] = "0"  # else the first pool would start it (forkserver.context)
    elif not _xdist_controller(config) and os.environ.get("TRITON_INTERPRET") != "1":
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
