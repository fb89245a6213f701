"""The gradient average in buckets during the backward (--grad-buckets, step/buckets.py), on two
Gloo processes: the same weights as the average after the backward, bit for bit (two ranks: each
element is a + b either way), whether gradients are adopted (CUDA's default) or accumulated (the
CPU's), with a parameter the backward never reaches; and refused in one line where it cannot run."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shmlearn.data import load_dataset, normalizer
from shmlearn.data.loader import ShardedLoader
from shmlearn.errors import BadInput
from shmlearn.step.fast import StepOptions, Stepper, StepTuning
from shmlearn.launch.start import free_port
from shmlearn.user.optim import build_optimizer, build_schedule
from shmlearn.step.buckets import plan
from shmlearn.sync import build_strategy
from shmlearn.record.timing import PhaseTimer
from procs import processes


def test_plan_cuts_the_buffer_from_its_end_with_a_small_first_bucket():
    # four parameters of 10, 300, 50 and 40 elements, then 2 control slots: 402 elements
    offsets = [(0, 10), (10, 300), (310, 50), (360, 40)]
    assert plan(offsets, 402, cap=100, first_cap=30) == [
        (360, 402, [3]),        # the last parameter and the control slots: >= 30
        (10, 360, [2, 1]),      # 50 + 300 >= 100
        (0, 10, [0]),           # what is left, down to the buffer's start
    ]
    # one cap larger than the buffer: one bucket, the whole buffer
    assert plan(offsets, 402, cap=10 ** 6, first_cap=10 ** 6) == [(0, 402, [3, 2, 1, 0])]


class _Net(torch.nn.Module):
    """An MLP with a parameter the forward never uses (its gradient: none, so zeros)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(64, 48), torch.nn.Linear(48, 32), torch.nn.Linear(32, 10)
        self.unused = torch.nn.Parameter(torch.ones(7))

    def forward(self, x):
        x = x.flatten(1)
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _stepper(rank, world, *, buckets, adopt, strategy="allreduce", steps=12):
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = _Net()
    opt = build_optimizer("momentum", model.parameters(), lr=0.1, weight_decay=1e-3)
    s = build_strategy(strategy, rank=rank, world_size=world)
    s.setup(model, opt)
    loader = ShardedLoader(data.train_x, data.train_y, batch_size=16, shard=rank, num_shards=world, seed=0,
                           normalize=normalizer(data, torch.device("cpu")))
    # 0.004 MB: buckets of 1,048 floats or more. The flat buffer: unused (7), a (3,072 + 48),
    # b (1,536 + 32), c (320 + 10), 2 control slots; from its end: c and b (1,900), a (3,120),
    # unused (7, started when the backward has ended): three buckets
    opts = StepOptions(check_every=4, grad_buckets=buckets)
    return Stepper(model=model, strategy=s, optimizer=opt, schedule=build_schedule("linear", opt, steps, 2),
                   loader=loader, task="classification", device=torch.device("cpu"), opts=opts,
                   tuning=StepTuning(adopt_grads=adopt, bucket_mb=0.004),
                   timer=PhaseTimer(torch.device("cpu")), rank=rank, world_size=world, total_steps=steps)


def _train(st, steps=12):
    for step in range(steps):
        st.run(step)
        if st.due(step + 1) or step + 1 == steps:
            assert st.read(step + 1).bad is None


def _worker(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    for adopt in ("on", "off"):
        for buckets in ("on", "off"):
            st = _stepper(rank, world, buckets=buckets, adopt=adopt)
            res[adopt, buckets, "n"] = st.grad_buckets
            # the strategy waits on the step's own buckets (handed over by average_in_buckets)
            res[adopt, buckets, "held"] = st.strategy.buckets is st.choice.buckets
            res["init"] = st.strategy.params_flat.clone()
            _train(st)
            res[adopt, buckets] = st.strategy.params_flat.clone()
            i = next(k for k, p in enumerate(st.strategy._trainable) if p is st.model.unused)
            res[adopt, buckets, "grad"] = st.model.unused.grad is st.strategy._grad_views[i]
            st.close()
            res[adopt, buckets, "released"] = st.strategy.buckets is None
    for args in (dict(strategy="weight-avg"),):
        try:
            _stepper(rank, world, buckets="on", adopt="on", **args)
            res["refusal"] = "no error"
        except BadInput as e:
            res["refusal"] = str(e)
    torch.save(res, os.path.join(out, f"buckets-rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # as test_fast's workers: no interpreter teardown racing Gloo's threads


def test_bucketed_average_trains_the_same_weights_on_two_processes(tmp_path):
    processes(_worker, (2, free_port(), str(tmp_path)), 2)
    ranks = [torch.load(os.path.join(tmp_path, f"buckets-rank{r}.pt")) for r in range(2)]
    for r, res in enumerate(ranks):
        for adopt in ("on", "off"):
            assert res[adopt, "on", "n"] == 3 and res[adopt, "off", "n"] == 0, (r, adopt)
            assert torch.equal(res[adopt, "on"], res[adopt, "off"]), (r, adopt)
            assert res[adopt, "on", "grad"], (r, adopt)  # .grad points into the flat buffer again
            assert all(res[adopt, b, k] for b in ("on", "off") for k in ("held", "released")), (r, adopt)
        assert "strategy weight-avg does not average gradients after each backward" in res["refusal"]
    # the replicas agree, and training moved them
    assert torch.equal(ranks[0]["on", "on"], ranks[1]["on", "on"])
    assert not torch.allclose(ranks[0]["on", "on"], ranks[0]["init"])


def test_one_worker_has_no_average_to_overlap():
    with pytest.raises(BadInput, match=r"^--grad-buckets on: one worker: there is no average to overlap$"):
        _stepper(0, 1, buckets="on", adopt="on")
    assert _stepper(0, 1, buckets="auto", adopt="on").grad_buckets == 0
