"""--compile block by block where the average runs in buckets (shmlearn/step/regions.py).

References: which blocks are found (a transformer's layers, not a ResNet's stages); the blocks are
compiled in place (state_dict keys unchanged) and run eagerly inside `eager()`; and two real Gloo
workers training a tower of blocks with `--compile default --grad-buckets on` end with the weights
of the same run uncompiled (to a tolerance: Inductor's kernels are not torch's), saying that the
blocks were compiled one by one.

The model is at the top level: spawned pool workers unpickle it by reference.
"""
import pytest
import torch
from torch import nn

import shmlearn
from shmlearn.config import TrainConfig
from shmlearn.pool import Pool, using
from shmlearn.step.regions import Regions, repeated_blocks


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Tower(nn.Module):
    def __init__(self, blocks=4, d=16, classes=10):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(64, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x.flatten(1))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_the_blocks_found_are_a_run_of_one_class_holding_most_weights():
    tower = Tower()
    assert repeated_blocks(tower) == list(tower.blocks)
    assert repeated_blocks(Tower(blocks=3)) == []  # a ResNet stage's 2-3 blocks stay whole
    wide_head = Tower(classes=2000)  # the blocks hold under half of the weights
    assert repeated_blocks(wide_head) == []
    mixed = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    assert repeated_blocks(mixed) == []


def test_blocks_compiled_in_place_keep_their_keys_and_run_eagerly_on_request():
    tower = Tower()
    keys = list(tower.state_dict())
    regions = Regions(list(tower.blocks), mode=None, options=None)
    assert list(tower.state_dict()) == keys and len(regions) == 4
    assert all(b._compiled_call_impl is not None for b in tower.blocks)
    with regions.eager():
        assert all(b._compiled_call_impl is None for b in tower.blocks)
    assert all(b._compiled_call_impl is not None for b in tower.blocks)
    regions.off()
    assert all(b._compiled_call_impl is None for b in tower.blocks)


@pytest.fixture(scope="module")
def pool():
    with Pool(2) as p:
        yield p


def test_two_workers_compiled_block_by_block_train_the_eager_runs_weights(tmp_path, pool):
    def run(compile):
        cfg = TrainConfig(device="cpu", workers=2, dataset="digits", batch_size=32, optimizer="sgd", lr=0.05,
                          samples=64 * 12, eval_points=1, progress=False, threads=1, seed=1, compile=compile,
                          grad_buckets="on", out=str(tmp_path / compile))
        with using(pool):
            return shmlearn.train(cfg, model=Tower())
    eager, compiled = run("off"), run("default")
    assert compiled.summary["status"] == "completed" and compiled.summary["compile"] == "default"
    assert "4 Block blocks compiled one by one" in (compiled.summary["step_note"] or "")
    assert compiled.summary["grad_buckets"] >= 1
    for (name, got), want in zip(compiled.model.state_dict().items(), eager.model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
