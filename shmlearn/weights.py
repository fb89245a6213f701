"""The trained weights in the run directory, and the model back from them (issue 41).

    model.safetensors   (when the safetensors package is installed), else
    model.pt            torch.save({"state_dict": ..., "data_spec": ...})

Rank 0 writes the final weights (parameters and buffers, on the CPU) after the last step, unless
--no-save-model: for weight-avg the averaged replica (every rank holds it after the last round),
for ps the server's master weights. `load_model(RUN_DIR)` builds the run's model again from its
config.yaml (a built-in name, or FILE.py:NAME / pkg.module:NAME) and the data's shape facts saved
beside the weights (so no dataset is read), loads the weights and returns it in eval mode.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
from typing import Any, Dict, Optional

import torch

from shmlearn import safe_write
from shmlearn.config import TrainConfig, load_yaml
from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput
from shmlearn.models import build_model
from shmlearn.models.user import user_model
from shmlearn.nn import FoldedLinear
from shmlearn.parts import resolve_ref
from shmlearn.refs import is_ref

SAFETENSORS, TORCH = "model.safetensors", "model.pt"


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401 - optional: torch.save otherwise
    except ImportError:
        return False
    return True


def save(run_dir: str, model: torch.nn.Module, spec: DataSpec, stem: str = "model") -> str:
    """Write the model's weights into run_dir as STEM.safetensors or STEM.pt ("best": --save-best);
    returns the file's name."""
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    meta = json.dumps(dataclasses.asdict(spec))
    name = (SAFETENSORS if _has_safetensors() else TORCH).replace("model.", f"{stem}.", 1)
    path = os.path.join(run_dir, name)
    try:  # whole or absent: safe_write removes the temporary file on any error
        with safe_write.atomic_path(path, root=run_dir) as tmp:
            if name.endswith(".safetensors"):
                from safetensors.torch import save_file  # deferred: an optional package
                save_file(state, tmp, metadata={"data_spec": meta})
            else:
                torch.save({"state_dict": state, "data_spec": json.loads(meta)}, tmp)
    except RuntimeError as e:  # a full disk: torch's zip writer raises RuntimeError, naming no file
        raise OSError(errno.EIO, f"{str(e).splitlines()[0]} (writing {path})") from e
    return name


def read(run_dir: str, stem: str = "model"):
    """(state_dict, DataSpec) of a run directory's weights (stem "best": --save-best's); BadInput
    naming the folder if none."""
    names = [n.replace("model.", f"{stem}.", 1) for n in (SAFETENSORS, TORCH)]
    st, pt = (os.path.join(run_dir, n) for n in names)
    if os.path.isfile(st):
        if not _has_safetensors():
            raise BadInput(f"{run_dir}: its weights are {names[0]}; install safetensors to read them")
        from safetensors import safe_open  # deferred: an optional package
        with safe_open(st, framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
            spec = json.loads(f.metadata()["data_spec"])
    elif os.path.isfile(pt):
        blob = torch.load(pt, map_location="cpu", weights_only=True)
        state, spec = blob["state_dict"], blob["data_spec"]
    elif stem != "model":
        raise BadInput(f"{run_dir}: no {names[0]} or {names[1]} (the run had no --save-best)")
    else:
        raise BadInput(f"{run_dir}: no {SAFETENSORS} or {TORCH} (a run before issue 41, one with "
                       f"--no-save-model, or not a run directory)")
    spec["input_shape"] = tuple(spec["input_shape"])
    return state, DataSpec(**spec)


def load_model(run_dir: str, model: Optional[Any] = None, best: bool = False) -> torch.nn.Module:
    """The trained module of the run in run_dir, on the CPU, in eval mode (best: the weights of
    its best evaluation, --save-best).

    model: what to load the weights into instead of the run's --model (a module, or a class or
    callable building one, as train(model=) takes): needed for a model that was passed from
    Python as an instance, which config.yaml cannot build again."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise BadInput(f"{run_dir}: no config.yaml; expected a run directory")
    cfg = TrainConfig.from_dict(load_yaml(path), source=path)
    state, spec = read(run_dir, "best" if best else "model")
    if model is not None:
        net = user_model(model, spec, "model=")
    elif is_ref(cfg.model):
        net = user_model(resolve_ref(cfg.model, "--model"), spec, f"--model {cfg.model}")
    else:
        net = build_model(cfg.model, spec, linear=FoldedLinear if cfg.folded_linear else torch.nn.Linear)
    try:
        net.load_state_dict(state)
    except RuntimeError as e:
        raise BadInput(f"{run_dir}: the weights do not fit the model {cfg.model} "
                       f"({str(e).splitlines()[0][:200]})") from None
    return net.eval()


