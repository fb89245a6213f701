"""The user's own model: an nn.Module (its weights are every rank's starting point), or a class or
callable that builds one, called with the DataSpec if it has a required positional parameter.

Whatever it is, the model is checked once on two training samples before any process group
exists, so a model that does not fit the data is one line naming the argument, not a shape error
(or a CUDA device-side assert) from inside a worker.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput
from shmlearn.refs import call_user


def takes_spec(fn) -> bool:
    """Whether fn has a required positional parameter (it is then called with the DataSpec)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in sig.parameters.values())


def user_model(obj: Any, spec: DataSpec, what: str) -> nn.Module:
    """A fresh module from `obj`: a deep copy of a module (the caller's stays untouched), or what
    a class or callable returns."""
    if isinstance(obj, nn.Module):
        model = copy.deepcopy(obj)
    elif callable(obj):
        model = call_user(obj, (spec,) if takes_spec(obj) else (), what)
        name = getattr(obj, "__qualname__", type(obj).__name__)
        if not isinstance(model, nn.Module):
            raise BadInput(f"{what}: {name}() returned a {type(model).__name__}; expected a torch.nn.Module")
    else:
        raise BadInput(f"{what}: expected a torch.nn.Module, or a class or callable returning one; "
                       f"got a {type(obj).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise BadInput(f"{what}: the {type(model).__name__} has no trainable parameters")
    return model


def check_outputs(model: nn.Module, sample: torch.Tensor, spec: DataSpec, what: str) -> None:
    """One forward pass on two training samples (CPU, eval mode, RNG untouched): the output must be
    (2, spec.num_outputs), what the task's loss takes."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(sample)
    except Exception as e:  # noqa: BLE001 - the user's forward
        first = str(e).strip().splitlines()
        raise BadInput(f"{what}: a forward pass on 2 training samples of shape {tuple(sample.shape[1:])} raised "
                       f"{type(e).__name__}{': ' + first[0][:200] if first else ''}") from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor):
        raise BadInput(f"{what}: the forward pass returned a {type(out).__name__}; expected one tensor of scores")
    want = (len(sample), spec.num_outputs)
    if tuple(out.shape) != want:
        kind = (f"{spec.num_outputs} classes" if spec.task == "classification"
                else f"{spec.num_outputs} target value(s) per sample")
        raise BadInput(f"{what}: outputs have shape {tuple(out.shape)} for 2 samples, but the data has {kind}: "
                       f"expected {want}")
