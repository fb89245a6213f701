"""Every strategy against single-process training (docs/architecture.md, Style 8).

W real Gloo processes train 20 steps of B samples each; one process trains 20 steps of W*B
samples (the loader makes the W batches of a step exactly the single process's batch). The final
weights must agree to float tolerance: gradient averaging is mathematically the big-batch step.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shmlearn.config.train_config import TrainConfig
from shmlearn.launch.start import DistEnv, free_port
from shmlearn.train.entry import run_worker
from procs import processes

B, STEPS = 8, 20
CASES = [  # (strategy, optimizer, extra config)
    ("allreduce", "momentum", {}),
    ("ps", "momentum", {}),
    ("ddp", "momentum", {}),
    ("weight-avg", "sgd", {"avg_period": 1}),
    ("weight-avg", "momentum", {"avg_period": 1}),  # momentum is linear in g: still exact at K=1
    # the fast step (fast.py: fused SGD, losses read every 6 steps, NaN flags in the collective)
    ("allreduce", "momentum", {"check_every": 6}),
    ("ps", "momentum", {"check_every": 6}),
    ("weight-avg", "momentum", {"avg_period": 1, "check_every": 6}),
    # the average through Gloo, not shared memory (the CPU's default: sync/shm.py)
    ("allreduce", "momentum", {"shared_memory": "off"}),
]


def _cfg(out, workers, batch, strategy="allreduce", optimizer="sgd", **kw):
    return TrainConfig(model="mlp", dataset="digits", device="cpu", strategy=strategy, optimizer=optimizer,
                       lr=0.1, batch_size=batch, samples=STEPS * workers * batch, workers=workers,
                       eval_points=1, progress=False, out=str(out), **kw)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker(rank, world, port, tmp, cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                  launcher="local", master_port=port)
    for i, (strategy, optimizer, extra) in enumerate(cases):
        res = run_worker(_cfg(os.path.join(tmp, f"run{i}"), world, B, strategy, optimizer, **extra), env)
        torch.save(_flat(res.model), os.path.join(tmp, f"case{i}-rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # leave as shmlearn's workers do (launch._child): interpreter-exit teardown
    # aborted a finished worker ('terminate called without an active exception', 3 of 27 runs here)


def _reference(tmp, world, optimizer):
    # threads=1, as each worker: in this process a 1-worker run would take both cores, and a second
    # intra-op thread on these batches only waits on the first on a shared 2-core machine
    cfg = _cfg(os.path.join(tmp, f"ref-{optimizer}"), 1, world * B, optimizer=optimizer, threads=1)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="local",
                  master_port=free_port())
    return _flat(run_worker(cfg, env).model)


@pytest.mark.parametrize("world", [2, 4])
def test_strategies_match_single_process(tmp_path, world):
    processes(_worker, (world, free_port(), str(tmp_path), CASES), world)
    refs = {opt: _reference(str(tmp_path), world, opt) for opt in ("sgd", "momentum")}
    start = _flat(_reference_init())
    for i, (strategy, optimizer, _) in enumerate(CASES):
        ranks = [torch.load(os.path.join(tmp_path, f"case{i}-rank{r}.pt")) for r in range(world)]
        for r in range(1, world):  # replicas identical
            torch.testing.assert_close(ranks[r], ranks[0], rtol=0, atol=1e-6, msg=f"{strategy}: rank {r} differs")
        torch.testing.assert_close(ranks[0], refs[optimizer], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{strategy}/{optimizer} vs single process: {m}")
        assert (ranks[0] - start).abs().max() > 1e-2, "training did not move the weights: the test proves nothing"


def _reference_init():
    from shmlearn.data import load_dataset
    from shmlearn.models import build_model
    torch.manual_seed(0)
    return build_model("mlp", load_dataset("digits").spec)


def test_dedicated_parameter_server_matches_single_process(tmp_path):
    """3 processes: rank 0 only serves, ranks 1-2 compute; equals one process at batch 2*B."""
    world, case = 3, [("ps", "momentum", {"ps_dedicated": True})]

    processes(_dedicated_worker, (world, free_port(), str(tmp_path), case), world)
    ref = _reference(str(tmp_path), 2, "momentum")
    for r in range(world):
        torch.testing.assert_close(torch.load(os.path.join(tmp_path, f"case0-rank{r}.pt")), ref,
                                   rtol=1e-4, atol=1e-5)


def _dedicated_worker(rank, world, port, tmp, cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                  launcher="local", master_port=port)
    strategy, optimizer, extra = cases[0]
    cfg = _cfg(os.path.join(tmp, "run"), world - 1, B, strategy, optimizer, **extra)
    res = run_worker(cfg, env)
    torch.save(_flat(res.model), os.path.join(tmp, f"case0-rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # leave as shmlearn's workers do (launch._child): interpreter-exit teardown
    # aborted a finished worker ('terminate called without an active exception', 3 of 27 runs here)


def test_folded_linear_trains_like_nn_linear(tmp_path):
    """--folded-linear changes the memory layout of the FC layers, not the maths (issue 8)."""
    def run(folded):
        cfg = _cfg(os.path.join(tmp_path, f"f{folded}"), 1, 16, optimizer="momentum", folded_linear=folded, threads=1)
        env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="local",
                      master_port=free_port())
        return run_worker(cfg, env)
    plain, folded = run(False), run(True)
    assert any(type(m).__name__ == "FoldedLinear" for m in folded.model.modules())
    pairs = [(a, b) for a, b in zip(plain.model.modules(), folded.model.modules())
             if isinstance(a, torch.nn.Linear)]
    assert pairs and all(type(b).__name__ == "FoldedLinear" for _, b in pairs)
    for a, b in pairs:  # FoldedLinear's .weight and .bias are views of its one [b | W] parameter
        torch.testing.assert_close(b.weight, a.weight, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.bias, a.bias, rtol=1e-4, atol=1e-5)
    assert folded.summary["final_loss"] == pytest.approx(plain.summary["final_loss"], rel=1e-4)
