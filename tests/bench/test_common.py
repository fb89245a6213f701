"""bench/common.run_ranks: results by rank, a failing rank named, a taken port retried."""
import os

import pytest

from shmlearn.bench.common import run_ranks
from shmlearn.errors import WorkerFailed


def _port_taken_once(rank, world, port, marker):
    # The first attempt fails the way a port grabbed by another job does; the retry must work.
    if rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already in use")
    return (rank, world, port)


def _always_fails(rank, world, port):
    if rank == 1:
        raise ValueError("broken rank")
    return rank


def test_a_port_taken_by_another_job_is_retried(tmp_path):
    out = run_ranks(_port_taken_once, 2, (str(tmp_path / "m"),), timeout_s=60)
    assert [r for r, _, _ in out] == [0, 1] and len({p for _, _, p in out}) == 1


def test_a_failing_rank_is_named_and_not_retried(tmp_path):
    with pytest.raises(WorkerFailed, match="rank 1: .*broken rank"):
        run_ranks(_always_fails, 2, timeout_s=60)
