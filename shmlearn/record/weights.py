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
import io
import json
import os
import pickle
from typing import Any, Optional

import torch

from shmlearn.record import readback

from shmlearn.record import safe_write
from shmlearn.config.train_config import TrainConfig
from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput, one_line
from shmlearn.models import build_model
from shmlearn.models.user import user_model
from shmlearn.nn import FoldedLinear
from shmlearn.user.parts import resolve_ref
from shmlearn.user.refs import is_ref

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
    """(state_dict, DataSpec, the file read) of a run directory's weights (stem "best":
    --save-best's); BadInput naming the folder if none."""
    names = [n.replace("model.", f"{stem}.", 1) for n in (SAFETENSORS, TORCH)]
    st, pt = (os.path.join(run_dir, n) for n in names)
    if os.path.lexists(st):
        if not _has_safetensors():
            raise BadInput(f"{run_dir}: its weights are {names[0]}; install safetensors to read them")
        from safetensors.torch import load  # deferred: an optional package
        raw = readback.read_bytes(st)  # not a file (a FIFO, a folder): one line, never a blocked open
        try:
            state = load(raw)
            n = int.from_bytes(raw[:8], "little")  # the format: 8 bytes of header length, a JSON header
            meta = json.loads(raw[8:8 + n]).get("__metadata__") or {}
            spec = json.loads(meta["data_spec"])
        except Exception as e:  # noqa: BLE001 - safetensors' own errors name no file
            raise BadInput(f"{st}: not shmlearn's weights ({one_line(e)})") from None
        path = st
    elif os.path.lexists(pt):
        raw = readback.read_bytes(pt)
        try:
            blob = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # torch's refusal: the file would run code when loaded
            raise BadInput(f"{pt}: refused: {readback.unpickle_refusal(e)}, and loading it could run code "
                           f"(a weights file holds only tensors and plain values)") from None
        except Exception as e:  # noqa: BLE001 - not a torch.save file at all
            raise BadInput(f"{pt}: not shmlearn's weights ({one_line(e)})") from None
        readback.need(blob, {"state_dict": dict, "data_spec": dict}, pt)
        state, spec, path = blob["state_dict"], blob["data_spec"], pt
    elif stem != "model":
        raise BadInput(f"{run_dir}: no {names[0]} or {names[1]} (the run had no --save-best)")
    else:
        raise BadInput(f"{run_dir}: no {SAFETENSORS} or {TORCH} (a run before issue 41, one with "
                       f"--no-save-model, or not a run directory)")
    bad = next((k for k, v in state.items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise BadInput(f"{path}: weight {readback.shown(bad)} is not a tensor")
    fields = {f.name for f in dataclasses.fields(DataSpec)}
    try:
        readback.need(spec, {"input_shape": list}, f"{path}: data_spec")
        return state, DataSpec(**{**spec, "input_shape": tuple(spec["input_shape"])}), path
    except TypeError:
        raise BadInput(f"{path}: data_spec has keys {sorted(spec)}; expected {sorted(fields)}") from None


def load_model(run_dir: str, model: Optional[Any] = None, best: bool = False) -> torch.nn.Module:
    """The trained module of the run in run_dir, on the CPU, in eval mode (best: the weights of
    its best evaluation, --save-best).

    model: what to load the weights into instead of the run's --model (a module, or a class or
    callable building one, as train(model=) takes): needed for a model that was passed from
    Python as an instance, which config.yaml cannot build again."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.lexists(path):
        raise BadInput(f"{run_dir}: no config.yaml; expected a run directory")
    cfg = TrainConfig.from_dict(readback.run_config(run_dir), source=path)  # each value of its field's type
    state, spec, path = read(run_dir, "best" if best else "model")
    if model is not None:
        net = user_model(model, spec, "model=")
    elif is_ref(cfg.model):
        net = user_model(resolve_ref(cfg.model, "--model"), spec, f"--model {cfg.model}")
    else:
        net = build_model(cfg.model, spec, linear=FoldedLinear if cfg.folded_linear else torch.nn.Linear)
    try:
        net.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise BadInput(f"{path}: the weights do not fit the model {cfg.model} "
                       f"({str(e).splitlines()[0][:200]})") from None
    return net.eval()


