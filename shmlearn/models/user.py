"""The user's own model: an nn.Module (its weights are every rank's starting point), or a class or
callable that builds one, called with the DataSpec if it has a required positional parameter.

Whatever it is, the model is checked once on two training samples before any process group
exists, so a model that does not fit the data is one line naming the argument, not a shape error
(or a CUDA device-side assert) from inside a worker.
"""
from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput, one_line, user_frame
from shmlearn.user.tasks import split_result
from shmlearn.user.refs import call_user


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


def check_loss(model: nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor, what: str,
               loss_what: str) -> None:
    """The user's loss(outputs, targets) on two training samples (CPU, training mode, RNG and
    buffers untouched, no backward): it must return a finite scalar tensor that depends on the model's outputs, the
    batch's mean loss, or it is BadInput naming the loss (it used to fail in evaluation, blaming
    no one, or to train on a Python float that carries no gradient)."""
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}  # BatchNorm's running stats stay
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a probe: the refusal below says what its warnings would
            out = loss_fn(model(inputs), targets)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - the user's loss (or model)
        raise BadInput(f"{loss_what}: on 2 training samples it raised {one_line(e)}{user_frame(e)}") from None
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved:
                    b.copy_(saved[n])
    if not isinstance(out, torch.Tensor):
        raise BadInput(f"{loss_what}: returned a {type(out).__name__}; expected a tensor holding the batch's mean "
                       f"loss, one number that the gradient flows back from")
    if out.numel() != 1:
        raise BadInput(f"{loss_what}: returned a tensor of shape {tuple(out.shape)}; expected the batch's mean "
                       f"loss, one number (reduce it: .mean())")
    if not bool(torch.isfinite(out.detach()).all()):
        raise BadInput(f"{loss_what}: the loss on 2 training samples is {out.item()}; expected a finite number")
    if not out.requires_grad:
        raise BadInput(f"{loss_what}: the loss does not depend on {what}'s outputs (no gradient flows back); "
                       f"compute it from the outputs it is given")


def check_compute_loss(model: nn.Module, fn, batch, what: str, fn_what: str) -> tuple:
    """compute_loss on two training samples (CPU, training mode, RNG and buffers untouched, no
    backward): the loss must be a finite scalar that depends on the parameters, the metrics a dict
    of scalars. Returns the metric names (evaluation reports each, in this order)."""
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]):
            out = fn(model, batch)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function or model
        raise BadInput(f"{fn_what}: on 2 training samples ({_shapes(batch)}) it raised {one_line(e)}"
                       f"{user_frame(e)}") from None
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved:
                    b.copy_(saved[n])
    loss, metrics = split_result(out, fn_what)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise BadInput(f"{fn_what}: returned a loss of shape {shape}; expected the batch's mean loss, one number")
    if not bool(torch.isfinite(loss.detach()).all()):
        raise BadInput(f"{fn_what}: the loss on 2 training samples is {loss.item()}; expected a finite number")
    if not loss.requires_grad:
        raise BadInput(f"{fn_what}: the loss does not depend on {what}'s trainable parameters (no gradient "
                       f"flows to them); compute it from the model's outputs")
    for name, v in metrics.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise BadInput(f"{fn_what}: metric name {name!r}; expected names like 'perplexity' (letters, digits, _)")
        if not (isinstance(v, (int, float)) or isinstance(v, torch.Tensor) and v.numel() == 1):
            raise BadInput(f"{fn_what}: metric '{name}' is a {type(v).__name__}; expected one number per batch")
    return tuple(metrics)


def _shapes(batch) -> str:
    """'x: (2, 784) float32, y: (2,) int64' for a message (the first few tensors)."""
    parts = [f"{keystr(path) or 'batch'}: {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
             for path, t in tree_flatten_with_path(batch)[0][:4] if isinstance(t, torch.Tensor)]
    return ", ".join(parts)
