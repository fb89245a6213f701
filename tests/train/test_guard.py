"""train/guard.py's checks at setup between real Gloo ranks (a pool of 2): the one all-reduce that
finds the ranks' values the same or not (check_replicas; check_agreement's usual case), and the
all-gather that then names the rank that differs."""
import math

import pytest
import torch

from shmlearn.errors import BadInput
from shmlearn.launch.pool import Pool
from shmlearn.train import guard


@pytest.fixture(scope="module")
def pool():
    with Pool(2) as p:
        yield p


def _same(env, values_by_rank):
    v = values_by_rank[env.rank]
    return guard._same_everywhere(torch.tensor(v, dtype=torch.float64) if isinstance(v[0], float) else v)


@pytest.mark.parametrize("values,same", [
    (([1.5, -2.0], [1.5, -2.0]), True),
    (([1.5, -2.0], [1.5, -2.5]), False),         # the second value differs
    (([0.0, 3.0], [-0.0, 3.0]), True),           # 0.0 == -0.0, as torch.equal says
    (([math.nan, 1.0], [math.nan, 1.0]), False),  # a NaN is never the same
    (([2**62 + 1, 7], [2**62 + 1, 7]), True),    # int64 digests near the top of the range
    (([2**62 + 1, 7], [2**62, 7]), False),
])
def test_same_everywhere_is_one_all_reduce_that_answers_alike_on_every_rank(pool, values, same):
    assert pool.run(_same, (values,), slots=range(2)) == [same, same]


def _replicas(env, shift):
    flat = torch.arange(10, dtype=torch.float32) + (shift if env.rank == 1 else 0.0)
    try:
        guard.check_replicas(flat, env.world_size)
        return "ok"
    except RuntimeError as e:
        return str(e)


def test_check_replicas_passes_equal_weights_and_refuses_a_changed_one(pool):
    assert pool.run(_replicas, (0.0,), slots=range(2)) == ["ok", "ok"]
    assert pool.run(_replicas, (1e-3,), slots=range(2)) == ["replicas differ after the initial broadcast"] * 2


class _Data:
    def __init__(self, n):
        self.spec, self.train_x, self.test_x = "spec", torch.ones(n, 3), torch.ones(4, 3)
        self.train_y, self.test_y = torch.zeros(n), torch.zeros(4)


def _agree(env, lr1, n1):
    cfg = {"lr": lr1 if env.rank == 1 else 0.1, "model": "mlp"}
    data = _Data(n1 if env.rank == 1 else 8)
    try:
        guard.check_agreement(cfg, data, torch.nn.Linear(3, 2), env.rank, env.world_size)
        return "ok"
    except BadInput as e:
        return str(e)


def test_check_agreement_names_the_rank_and_what_differs_on_every_rank(pool):
    assert pool.run(_agree, (0.1, 8), slots=range(2)) == ["ok", "ok"]
    config = pool.run(_agree, (0.2, 8), slots=range(2))
    assert config[0] == config[1] and config[0].startswith("rank 1 has a different config from rank 0")
    data = pool.run(_agree, (0.1, 9), slots=range(2))
    assert data[0] == data[1] and data[0].startswith("rank 1 has a different dataset from rank 0")
