"""Benchmark ranks run on the pool (pool.run_local): group ready, results by rank, a failing rank named."""
import pytest
import torch

from shmlearn.bench.common import rank_device
from shmlearn.errors import WorkerFailed
from shmlearn.launch.pool import run_local
from shmlearn.launch.pool import Pool, using


def _sums(env):
    import torch.distributed as dist
    t = torch.ones(1, device=rank_device(env, "gloo"))
    dist.all_reduce(t)  # no init_process_group: the pool's group is ready
    return env.rank, env.world_size, t.device.type, t.item()


def _always_fails(env):
    if env.rank == 1:
        raise ValueError("broken rank")
    return env.rank


def test_bench_ranks_run_on_the_pool_and_a_failing_rank_is_named():
    with Pool(2) as pool, using(pool):
        assert run_local(_sums, (), 2, cuda=False, timeout_s=60) == [(0, 2, "cpu", 2.0), (1, 2, "cpu", 2.0)]
        with pytest.raises(WorkerFailed, match="rank 1: .*broken rank"):
            run_local(_always_fails, (), 2, cuda=False, timeout_s=60)
