"""limits.rank_threads: how many intra-op threads each rank of a host gets, out of the cores this
process may run on (limits.usable_cores)."""
import os

import pytest

from shmlearn.config import limits


def test_a_cpu_rank_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(limits, "usable_cores", lambda: 64)
    monkeypatch.setattr(limits, "busy_cores", lambda: 0.0)  # a quiet host (the load's rule: test_launch_env.py)
    assert limits.rank_threads("cpu", 1) == 64
    assert limits.rank_threads("cpu", 4) == 16
    assert limits.rank_threads("cpu", 100) == 1  # at least one


def test_a_busy_host_takes_threads_away_unless_the_run_is_deterministic(monkeypatch):
    monkeypatch.setattr(limits, "usable_cores", lambda: 8)
    monkeypatch.setattr(limits, "busy_cores", lambda: 5.4)
    assert limits.rank_threads("cpu", 1) == 3
    assert limits.rank_threads("cpu", 2) == 3  # the share (4) less what is busy: 8 - 5
    assert limits.rank_threads("cpu", 1, fixed=True) == 8  # --deterministic: the bits must not follow the load
    assert limits.rank_threads("cpu", 2, fixed=True) == 4
    assert limits.rank_threads("cpu", 1, 2, fixed=True) == 2  # --threads still wins
    monkeypatch.setattr(limits, "busy_cores", lambda: 9.0)
    assert limits.rank_threads("cpu", 1) == 1  # at least one


def test_a_gpu_rank_gets_few_threads_however_many_cores(monkeypatch):
    # 4 ranks x 64 threads on a 64-core host slowed each GPU's step 2-7x (issue 42, H200 x4).
    monkeypatch.setattr(limits, "usable_cores", lambda: 64)
    assert limits.rank_threads("cuda", 4) == limits.GPU_RANK_THREADS == 4
    assert limits.rank_threads("cuda", 1) == 4
    monkeypatch.setattr(limits, "usable_cores", lambda: 6)
    assert limits.rank_threads("cuda", 4) == 1  # never more than the rank's share of the cores


def test_threads_given_win(monkeypatch):
    monkeypatch.setattr(limits, "usable_cores", lambda: 64)
    assert limits.rank_threads("cuda", 4, 12) == 12
    assert limits.rank_threads("cpu", 4, 3) == 3


def test_the_cores_are_those_of_the_affinity_not_the_hosts():
    """taskset, a container's cpuset or a Slurm allocation: os.cpu_count() still says the host's."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(mine)})
        assert limits.usable_cores() == 1
        assert limits.rank_threads("cpu", 1) == 1
    finally:
        os.sched_setaffinity(0, mine)
    assert limits.usable_cores() == len(mine)
