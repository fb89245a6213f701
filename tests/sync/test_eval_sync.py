"""What every rank evaluates, on real Gloo groups of three forked ranks, through shared memory
(the CPU's default) and through Gloo: setup makes every replica rank 0's (weights and every
buffer, integer ones included: one broadcast per dtype); `sync_buffers` averages the
floating-point buffers (one average per dtype) and leaves the others alone; weight averaging
between rounds evaluates the replicas' average and the asynchronous server's weights, each rank
getting its own weights back after, and the collectives going on. References: the values themselves, computed here."""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shmlearn.launch.start import free_port
from shmlearn.sync import build_strategy
from procs import processes

WORLD = 3


class _Net(nn.Module):
    """BatchNorm's three buffers (two float32, one int64) and a float64 buffer of its own."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)
        self.register_buffer("scale", torch.ones(5, dtype=torch.float64))

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) * self.scale[0]


def _value(t: torch.Tensor, rank: int, i: int) -> torch.Tensor:
    """Rank `rank`'s own value for tensor i: random floats, or an integer naming rank and tensor."""
    if not t.is_floating_point():
        return torch.full_like(t, 10 * rank + i)
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)


def _state(model, s):
    return {"params": s.params_flat.clone(), **{k: b.clone() for k, b in model.named_buffers()}}


CASES = [(strategy, extra, shared_memory) for strategy, extra in
         (("allreduce", {}), ("weight-avg", {"avg_period": 3}), ("async-ps", {}))
         for shared_memory in ("auto", "off")]


def _case(rank, world, out, strategy, shared_memory, extra, i):
    torch.manual_seed(rank)  # every rank its own initial model: setup must make them rank 0's
    model = _Net()
    with torch.no_grad():
        for j, b in enumerate(model.buffers()):
            b.copy_(_value(b, rank, j))
    s = build_strategy(strategy, rank=rank, world_size=world, **extra)
    s.timeout_s, s.shared_memory, s.run_steps = 60.0, shared_memory, 10
    s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    got = {"setup": _state(model, s), "path": s.collectives_path}
    with torch.no_grad():
        for j, b in enumerate(model.buffers()):
            b.copy_(_value(b, rank, 10 + j))
        s.params_flat.copy_(_value(s.params_flat, rank, 99))
    if strategy == "weight-avg":
        s.local_steps = 1  # between rounds: the replicas differ
    with s.eval_weights():
        got["inside"] = _state(model, s)
    got["after"] = _state(model, s)
    got["sums"] = []
    for _ in range(3):  # the collectives go on after an evaluation, as the next steps' reads
        t = torch.full((4,), float(rank + 1), dtype=torch.float64)
        s.sum_(t)
        got["sums"].append(t)
    s.close()
    torch.save(got, os.path.join(out, f"case{i}-rank{rank}.pt"))


def _rank(rank, world, port, out):
    """Every case, one after the other, in one group of ranks (a group and its ranks' start are
    most of a case's time)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for i, (strategy, extra, shared_memory) in enumerate(CASES):
        _case(rank, world, out, strategy, shared_memory, extra, i)
    dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-sync")
    processes(_rank, (WORLD, free_port(), str(out)), WORLD)
    return out


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_every_rank_evaluates_the_same_model_and_gets_its_own_weights_back(cases, i):
    strategy, _, shared_memory = CASES[i]
    got = [torch.load(cases / f"case{i}-rank{r}.pt") for r in range(WORLD)]
    names = [k for k in got[0]["setup"] if k != "params"]
    assert len(names) == 4 and "bn.num_batches_tracked" in names
    for r in range(WORLD):
        assert got[r]["path"] == ("shared-memory" if shared_memory == "auto" else "gloo")
        for k, v in got[0]["setup"].items():  # rank 0's model everywhere, bit for bit
            assert torch.equal(got[r]["setup"][k], v), (r, k)
    torch.manual_seed(0)
    rank0 = torch.cat([p.detach().reshape(-1) for p in _Net().parameters()])
    assert torch.equal(got[0]["setup"]["params"], rank0)

    for r in range(WORLD):
        for i, k in enumerate(names):
            b = got[r]["inside"][k]
            if b.is_floating_point():  # averaged, and kept after the evaluation
                mean = sum(_value(b, q, 10 + i).double() for q in range(WORLD)) / WORLD
                torch.testing.assert_close(b.double(), mean, rtol=1e-6, atol=1e-7)
                assert torch.equal(got[r]["after"][k], b)
            else:  # a count: each rank's own
                assert torch.equal(b, _value(b, r, 10 + i)) and torch.equal(got[r]["after"][k], b)
        own = _value(got[r]["inside"]["params"], r, 99)
        inside = got[r]["inside"]["params"]
        if strategy == "allreduce":  # the replicas are the same already: nothing to do
            assert torch.equal(inside, own)
        elif strategy == "weight-avg":
            mean = sum(_value(inside, q, 99).double() for q in range(WORLD)) / WORLD
            torch.testing.assert_close(inside.double(), mean, rtol=1e-6, atol=1e-7)
        else:  # the server's (rank 0's) weights
            assert torch.equal(inside, _value(inside, 0, 99))
        assert torch.equal(got[r]["after"]["params"], own)  # its own weights back
        assert all(torch.equal(t, torch.full((4,), 6.0, dtype=torch.float64)) for t in got[r]["sums"])
