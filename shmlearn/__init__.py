"""shmlearn: data-parallel deep-learning training, and the tools to study it.

    import shmlearn
    result = shmlearn.train(shmlearn.TrainConfig(workers=2, strategy="ps"))
"""
from shmlearn.config import TrainConfig
from shmlearn.errors import BadInput, Diverged, WorkerFailed
from shmlearn.train import RunResult, train
from shmlearn.weights import load_model

__version__ = "0.1.0"
__all__ = ["TrainConfig", "RunResult", "train", "load_model", "BadInput", "Diverged", "WorkerFailed"]
