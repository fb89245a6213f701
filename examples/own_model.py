"""Train your own model on your own data with shmlearn: 2 workers, two strategies.

    python examples/own_model.py                            # shmlearn starts the 2 workers
    torchrun --nproc-per-node 2 examples/own_model.py       # or a launcher does
"""
import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import shmlearn
from shmlearn.config.train_config import TrainConfig


class Net(nn.Module):
    """Any nn.Module. Define it at the top level of the file: the spawned workers import it."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.layers(x)


def digits():
    """(train_x, train_y, test_x, test_y) as numpy arrays, used as given: integer labels make it
    classification with 10 classes."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return x[:1500], y[:1500], x[1500:], y[1500:]


if __name__ == "__main__":
    _, _, test_x, test_y = digits()
    for strategy in ("allreduce", "ps"):
        cfg = TrainConfig(strategy=strategy, workers=2, batch_size=32, lr=0.1, epochs=20, progress=False)
        result = shmlearn.train(cfg, model=Net, data=digits)  # or model=Net(): its weights are the start
        model = result.model.eval()  # the trained model, on the CPU
        with torch.no_grad():
            accuracy = (model(torch.from_numpy(test_x)).argmax(1).numpy() == test_y).mean()
        if result.rank == 0:  # under torchrun, mpirun or srun every rank runs this script
            print(f"{strategy}: test accuracy {accuracy:.3f}, run directory {result.run_dir}")
