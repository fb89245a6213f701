"""shmlearn/train/early.py: a rank's data read and compiler imports started beside its group's
join. The rank gets the very dataset it would have read itself; a read that fails or comes late
changes nothing (the rank reads, and raises its own error); SHMLEARN_EARLY=0 turns it off."""
import json
import threading

import pytest
import torch

import shmlearn
from shmlearn.config.train_config import TrainConfig
from shmlearn.data import load_dataset
from shmlearn.errors import BadInput
from shmlearn.train import early, inputs


@pytest.fixture(autouse=True)
def _clean():
    early._reads.clear()
    inputs._DATA_CACHE.clear()
    yield
    early._reads.clear()
    inputs._DATA_CACHE.clear()


def _same(a, b) -> None:
    assert a.spec == b.spec and (a.mean, a.std) == (b.mean, b.std)
    for x, y in zip((a.train_x, a.train_y, a.test_x, a.test_y), (b.train_x, b.train_y, b.test_x, b.test_y)):
        assert torch.equal(x, y)


def test_the_rank_takes_the_dataset_read_early_and_it_is_the_one_it_would_read():
    t = threading.Thread(target=early.start, args=({"dataset": "digits", "seed": 3, "compile": "off"},))
    t.start()
    got = inputs.cached_dataset("digits", None, 3, torch.device("cpu"))  # waits for the thread's read
    t.join()
    _same(got, load_dataset("digits", None, seed=3))
    assert early._reads == {}  # taken: the worker keeps no second copy


def test_a_rank_that_asks_first_reads_itself_and_the_late_thread_reads_nothing():
    assert early.take_dataset("digits", None, 0) is None
    early.start({"dataset": "digits", "seed": 0, "compile": "off"})
    assert all(r.dataset is None for r in early._reads.values())  # skipped, nothing held


def test_a_read_that_fails_early_is_the_ranks_own_error(tmp_path):
    early.start({"dataset": "fashion-mnist", "data_dir": str(tmp_path), "seed": 0, "compile": "off"})
    with pytest.raises(BadInput, match="fashion"):
        inputs.cached_dataset("fashion-mnist", str(tmp_path), 0, torch.device("cpu"))


def test_a_dataset_reference_or_the_switch_off_starts_nothing(monkeypatch):
    early.start({"dataset": "data.py:load", "seed": 0, "compile": "off"})
    assert early._reads == {}
    monkeypatch.setenv("SHMLEARN_EARLY", "0")
    assert early.task_early({"dataset": "digits"}) is None
    early.start({"dataset": "digits", "seed": 0, "compile": "off"})
    assert early._reads == {}


def test_two_workers_train_alike_with_and_without_it(tmp_path, monkeypatch):
    """Real pool workers and Gloo: the same losses to the bit either way (the same data, read in
    another thread)."""
    losses = []
    for flag in ("1", "0"):
        monkeypatch.setenv("SHMLEARN_EARLY", flag)
        out = tmp_path / f"early{flag}"
        shmlearn.train(TrainConfig(dataset="digits", model="mlp", workers=2, threads=1, samples=4096,
                                   batch_size=32, progress=False, out=str(out)))
        losses.append([json.loads(line)["loss"] for line in open(out / "metrics.jsonl") if '"loss"' in line])
    assert losses[0] and losses[0] == losses[1]


def test_a_compiled_run_imports_the_compiler_and_hashes_its_keys_early():
    """In a fresh process: after start() of a compiled run's config, the modules torch.compile's
    first call imports are imported and the cache keys' source hashes are computed (a compiled
    graph's key reads them); the step's device is left alone (no CUDA call)."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from shmlearn.train import early\n"
            "assert 'torch._inductor.compile_fx' not in sys.modules\n"
            "early.start({'dataset': 'data.py:load', 'compile': 'default'})\n"
            "assert all(m in sys.modules for m in early.COMPILER_MODULES)\n"
            "from torch._inductor import codecache\n"
            "import time; t = time.perf_counter(); codecache.torch_key(); codecache.triton_key()\n"
            "assert time.perf_counter() - t < 0.05, 'not cached'\n"
            "assert not torch.cuda.is_initialized()\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
