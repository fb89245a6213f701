"""A process that captures the same step again (a pool worker's next sweep trial of one batch size)
warms up with one step and reuses the sampling period it measured (step/graphs.py SEEN): what makes
two captures the same (`step_key`), every rank's agreement over real Gloo groups (`agree_seen`),
and on a GPU the second run's losses bit for bit the first's (--deterministic: cuDNN's timed choices
are not), captured, after one warm-up step."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shmlearn.launch.start import free_port
from shmlearn.step.graphs import agree_seen, step_key
from shmlearn.step.options import StepOptions, StepTuning
from procs import processes


def _parts(*, batch=32, width=16, momentum=0.9, lr=0.1, opts=None, tuning=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    strategy = SimpleNamespace(module=model, optimizer=optimizer, accumulate=1)
    loader = SimpleNamespace(batch_size=batch, global_batch=batch, x=torch.zeros(100, 8))
    return dict(model=model, strategy=strategy, loader=loader, device=torch.device("cpu"),
                opts=opts or StepOptions(), tuning=tuning or StepTuning(), world_size=1, kinds=[(False, False)])


def test_the_step_key_is_the_same_for_a_new_trial_that_differs_only_in_its_learning_rate():
    assert step_key(**_parts()) == step_key(**_parts(lr=0.7))  # new tensors, new optimizer, same step


@pytest.mark.parametrize("change", [dict(batch=64), dict(width=32), dict(momentum=0.0),
                                    dict(opts=StepOptions(cuda_graph="off")),
                                    dict(tuning=StepTuning(flat_sgd=False))], ids=lambda c: next(iter(c)))
def test_the_step_key_changes_with_what_changes_the_kernels_or_shapes(change):
    assert step_key(**_parts()) != step_key(**_parts(**change))


def test_the_step_key_changes_with_the_world_and_the_kinds_of_step():
    base = _parts()
    assert step_key(**base) != step_key(**dict(base, world_size=2))
    assert step_key(**base) != step_key(**dict(base, kinds=[(False, False), (True, False)]))


def test_ddp_always_warms_up_fully():
    parts = _parts()
    ddp = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    parts["strategy"] = SimpleNamespace(module=ddp, optimizer=parts["strategy"].optimizer, accumulate=1)
    assert step_key(**parts) is None


def test_one_rank_agrees_with_itself():
    assert agree_seen(None, 1, torch.device("cpu")) is None
    assert agree_seen(2.5, 1, torch.device("cpu")) == 2.5


def _agree(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cases = {"all seen": [2.0, 3.5], "one not": [2.0, None], "none": [None, None]}
    got = {name: agree_seen(vals[rank], world, torch.device("cpu")) for name, vals in cases.items()}
    with open(os.path.join(out, f"agree-{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown racing Gloo's threads


def test_every_rank_takes_the_short_warm_up_only_if_every_rank_has_seen_the_step(tmp_path):
    processes(_agree, (2, free_port(), str(tmp_path)), 2)
    for rank in range(2):
        got = json.load(open(tmp_path / f"agree-{rank}.json"))
        assert got == {"all seen": 3.5, "one not": None, "none": None}, rank


TWICE = """
import json, sys
import shmlearn
from shmlearn.step import graphs
warmups = []
capture = graphs.Graphs._capture
def recording(self, warmup=graphs.WARMUP):
    warmups.append(warmup)
    return capture(self, warmup)
graphs.Graphs._capture = recording
out, extra = sys.argv[1], json.loads(sys.argv[2])
runs = []
for i in range(2):
    cfg = shmlearn.TrainConfig(model="lenet", dataset="digits", device="cuda", workers=1, samples=6400,
                               batch_size=64, eval_points=1, progress=False, out=f"{out}/r{i}", deterministic=True,
                               **extra)
    res = shmlearn.train(cfg)
    losses = [json.loads(l)["loss"] for l in open(f"{out}/r{i}/metrics.jsonl")]
    runs.append({"losses": losses, "mode": res.summary["step_mode"],
                 "sample_every": res.summary["phase_sample_every"]})
print(json.dumps({"warmups": warmups, "runs": runs}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [{}, {"optimizer": "adam", "lr": 0.003}, {"noise_scale": True},
                                   {"accumulate": 2}, {"precision": "fp32"}], ids=lambda e: "-".join(e) or "default")
def test_a_second_capture_in_the_process_warms_up_once_and_trains_the_same_bits(tmp_path, extra):
    p = subprocess.run([sys.executable, "-c", TWICE, str(tmp_path), json.dumps(extra)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    first, second = got["runs"]
    assert got["warmups"] == [3, 1]
    assert first["mode"] == second["mode"] == "cuda-graph"
    assert first["sample_every"] == second["sample_every"]
    assert second["losses"] == first["losses"] and len(first["losses"]) >= 5


TWICE_ON_A_POOL = """
import json, sys
import torch
import shmlearn
from shmlearn.launch.pool import Pool, using
out = sys.argv[1]
runs = []
if __name__ == "__main__":
    with Pool(2, cuda=True) as p, using(p):
        for i in range(2):
            cfg = shmlearn.TrainConfig(model="lenet", dataset="digits", device="cuda", workers=2, samples=6400,
                                       batch_size=64, eval_points=1, progress=False, out=f"{out}/r{i}",
                                       deterministic=True)
            res = shmlearn.train(cfg)
            losses = [json.loads(l)["loss"] for l in open(f"{out}/r{i}/metrics.jsonl")]
            runs.append({"losses": losses, "mode": res.summary["step_mode"],
                         "sample_every": res.summary["phase_sample_every"]})
    print(json.dumps({"runs": runs}))
"""


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_ranks_capturing_again_on_a_pool_train_the_same_bits(tmp_path):
    """Two ranks over NCCL (one GPU shared over Gloo runs eagerly: nothing to capture): the pool's
    workers capture the same step a second time after agreeing that both have seen it."""
    script = tmp_path / "twice.py"
    script.write_text(TWICE_ON_A_POOL)
    p = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    first, second = json.loads(p.stdout.strip().splitlines()[-1])["runs"]
    assert first["mode"] == second["mode"] == "cuda-graph"
    assert first["sample_every"] == second["sample_every"]
    assert second["losses"] == first["losses"] and len(first["losses"]) >= 5
