"""shmlearn: data-parallel deep-learning training, and the tools to study it.

    import shmlearn
    result = shmlearn.train(shmlearn.TrainConfig(workers=2, strategy="ps"))
"""
import importlib
import sys
import types
from typing import TYPE_CHECKING

from shmlearn.errors import BadInput, Diverged, WorkerFailed
from shmlearn.launch.forkserver import autostart as _autostart

_autostart()  # a script's local CPU workers fork from a process that imports torch meanwhile

__version__ = "0.1.0"
__all__ = ["TrainConfig", "RunResult", "train", "load_model", "BadInput", "Diverged", "WorkerFailed"]

# Imported on first use (PEP 562), not here: they import torch (~2-6 s), and the `shmlearn`
# program refuses a bad --data-dir before that (cli.precheck); `shmlearn.train(...)`,
# `from shmlearn import TrainConfig` work as before.
_LAZY = {"TrainConfig": "shmlearn.config.train_config", "RunResult": "shmlearn.train.entry", "train": "shmlearn.train.entry",
         "load_model": "shmlearn.record.weights"}

if TYPE_CHECKING:
    from shmlearn.config.train_config import TrainConfig
    from shmlearn.train.entry import RunResult, train
    from shmlearn.record.weights import load_model


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Importing the submodule shmlearn.train binds the module to the package's `train`; the
    function keeps that name, as it did when this file imported it eagerly."""

    def __setattr__(self, name: str, value) -> None:
        if name == "train" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
