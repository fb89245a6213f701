"""A user's data file (`--data FILE.py:train_stuck` or `:test_stuck`) whose one sample never
returns, as a read from a dead network mount: tests/data/test_stream.py and the fault campaign
(benchmarks/faults/issue38.py) write it and check that the run is stopped and its processes end."""

STUCK_DATA = '''import time
import numpy as np
import torch


class Pairs(torch.utils.data.Dataset):
    classes = ("a", "b", "c", "d")

    def __init__(self, x, y, stuck=None):
        self.x, self.y, self.stuck = x, y, stuck

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.stuck:
            time.sleep(600)  # a read that never returns (a dead network mount)
        return self.x[i], self.y[i]


def _arrays():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(512, 5)).astype(np.float32), rng.integers(0, 4, 512),
            rng.normal(size=(64, 5)).astype(np.float32), rng.integers(0, 4, 64))


def train_stuck():  # sample 115 is in rank 0's first batch (seed 0, batch 16, 2 workers)
    a, b, c, d = _arrays()
    return Pairs(a, b, stuck=115), Pairs(c, d)


def test_stuck():  # rank 0 evaluates test samples 0..31 (at step 0, before training)
    a, b, c, d = _arrays()
    return Pairs(a, b), Pairs(c, d, stuck=3)
'''
