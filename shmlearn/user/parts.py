"""What a run trains: the model, the data and the loss, by registered name, by reference
(`FILE.py:NAME`, `pkg.module:NAME`) or as Python objects given to `shmlearn.train(cfg, model=,
data=, loss=, compute_loss=)`.

Objects cross to spawned workers pickled, once per run: classes and functions travel by reference
(module and name), so they must be defined at the top level of an importable file (the script
itself counts: a spawned worker imports it as `__mp_main__`). Under torchrun, mpirun or srun each
rank runs the script and holds its own objects, so nothing is pickled.
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from shmlearn.user import user_main
from shmlearn.errors import BadInput
from shmlearn.user.refs import is_ref, load_ref


@dataclass
class Parts:
    model: Any = None
    data: Any = None
    loss: Any = None
    optimizer: Any = None
    """params or model -> torch.optim.Optimizer (recipe.py says which it is called with)."""
    scheduler: Any = None
    """optimizer -> LRScheduler."""
    compute_loss: Any = None
    """(model, batch) -> loss or (loss, metrics): the general contract (data/tree.py)."""

    def given(self) -> bool:
        return any(getattr(self, n) is not None for n in _NAMES)

    def labelled(self, cfg):
        """cfg with `model` / `dataset` naming the objects given (config.yaml and summary.json
        say what ran; a class or function at the top level of a file is a reference that runs)."""
        if self.model is not None:
            cfg = replace(cfg, model=label(self.model))
        if self.data is not None:
            cfg = replace(cfg, dataset=label(self.data), data_dir=None)
        for name in ("loss", "optimizer", "scheduler", "compute_loss"):
            if getattr(self, name) is not None:
                cfg = replace(cfg, **{name: label(getattr(self, name))})
        return cfg

    def pickled(self) -> bytes:
        """The parts as bytes for the spawned workers; BadInput naming the part that cannot go."""
        for name in _NAMES:
            obj = getattr(self, name)
            if obj is None:
                continue
            where = _interactive_main(obj)
            if where:
                raise BadInput(f"{name}=: {where} is defined in an interactive session, `python -c` or `python -` (stdin), which "
                               f"spawned workers cannot import; put it in a .py file (top level), or run "
                               f"one worker (workers=1)")
        try:  # once, whole: the data may be tens of MB (the VAE port's Fashion-MNIST: 58 MB, 0.2 s+)
            return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - PicklingError, AttributeError, TypeError: which part?
            whole = e
        for name in _NAMES:
            obj = getattr(self, name)
            try:
                pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001
                raise BadInput(f"{name}=: cannot be sent to the worker processes ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:200] if str(e) else ''}); define its class or "
                               f"function at the top level of a .py file, not inside a function, a lambda or "
                               f"`if __name__ == \"__main__\":`") from None
        raise BadInput(f"model=/data=/loss=/compute_loss=/optimizer=/scheduler=: cannot be sent to the worker "
                       f"processes ({type(whole).__name__}: {str(whole).splitlines()[0][:200] if str(whole) else ''})") from None

    @staticmethod
    def unpickled(blob: Optional[bytes]) -> "Parts":
        if blob is None:
            return Parts()
        try:
            return pickle.loads(blob)
        except Exception as e:  # noqa: BLE001 - typically: class defined under `if __name__ == "__main__":`
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise BadInput(f"model=/data=/loss=/compute_loss=/optimizer=/scheduler=: a worker process cannot rebuild what was passed ({msg}); "
                           f"define classes and functions at the top level of the script, outside "
                           f"`if __name__ == \"__main__\":`") from None


_NAMES = ("model", "data", "loss", "optimizer", "scheduler", "compute_loss")


def label(obj: Any) -> str:
    """'FILE.py:NAME' or 'pkg.module:NAME' for a class or function at the top level of a module, a
    reference that builds the model or data again; 'python:<type>' for anything else. A module
    instance is 'python:<Class> instance': its class alone would rebuild neither its arguments nor
    its weights."""
    if isinstance(obj, torch.nn.Module):
        return f"python:{type(obj).__qualname__} instance"
    target = obj if callable(obj) else type(obj)
    if isinstance(obj, (tuple, list)):
        return f"python:{type(obj[0]).__name__}" + {2: " pair", 3: " splits"}.get(len(obj), " arrays")
    mod, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not mod or not name or "<" in name:
        return f"python:{type(obj).__name__}"
    if mod == "__main__":
        path = user_main.main_file()
        return f"{os.path.abspath(path)}:{name}" if path else f"python:{name}"
    return f"{mod}:{name}"


def _interactive_main(obj: Any) -> Optional[str]:
    """The name of a class or function of obj's that lives in a __main__ with no file, if any."""
    if user_main.main_file():
        return None
    items = obj if isinstance(obj, (tuple, list)) else (obj,)
    for o in items:
        t = o if (callable(o) and not isinstance(o, torch.nn.Module)) else type(o)
        if getattr(t, "__module__", None) == "__main__":
            return getattr(t, "__qualname__", repr(t))
    return None


def resolve_ref(text: str, flag: str) -> Any:
    """load_ref, with a clear word for the labels of objects that were passed from Python."""
    if text.startswith("python:"):
        raise BadInput(f"{flag} {text}: this run's {flag.lstrip('-')} was passed from Python "
                       f"(shmlearn.train(..., {'data' if flag == '--dataset' else flag.lstrip('-')}=...)); pass it again")
    return load_ref(text, flag)


__all__ = ["Parts", "label", "resolve_ref", "is_ref"]
