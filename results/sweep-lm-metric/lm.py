"""A tiny language model as a user writes it for shmlearn's general contract: items (ids int64,
next ids int64) of a deterministic token sequence, a (train, val, test) split, and compute_loss
returning the mean loss and the token accuracy. docs/sweeps.md sweeps it; tests/test_sweep_metric.py
runs that sweep."""
import torch
import torch.nn.functional as F
from torch import nn

V, T = 13, 8


class Tokens(torch.utils.data.Dataset):
    """(ids int64 [T], next ids int64 [T]): windows of the sequence t -> (5 t + 2) % V."""

    def __init__(self, n, start):
        self.n, self.start = n, start

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.empty(T, dtype=torch.int64)
        t = (self.start + i) % V
        for k in range(T):
            ids[k] = t
            t = (5 * t + 2) % V
        return ids, (ids * 5 + 2) % V


def data():
    return Tokens(256, 0), Tokens(64, 3), Tokens(64, 7)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, 16), nn.Linear(16, V)

    def forward(self, ids):
        if ids.dtype != torch.int64:  # the contract: token ids stay integers
            raise TypeError(f"token ids arrived as {ids.dtype}")
        return self.out(self.emb(ids))


def fn(model, batch):
    ids, nxt = batch
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), nxt.flatten())
    return loss, {"accuracy": (logits.argmax(-1) == nxt).float().mean()}
