"""The user's own data: arrays or tensors, or a pair of map-style torch Datasets.

    data=(train_x, train_y, test_x, test_y)      numpy arrays or tensors, used as given
    data=(train_set, test_set)                   torch.utils.data.Dataset items (x, y)
    data=callable                                called once per process, returns either

Values are used as given: no rescaling, no normalization (the built-in readers normalize; your
arrays are yours). The task comes from the labels unless the config states it: integer labels are
classification (classes 0..K-1, K = the largest label + 1), floating labels regression; binary
(one logit, 0/1 targets) only when stated. A pair of Datasets is read whole onto the device when it
fits (the same device-resident path as the built-in data), and streamed through a DataLoader
otherwise (data/stream.py); `loader` in the config forces either.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import numpy as np
import torch

from shmlearn.data.base import Dataset, DataSpec, check_usable, dataset_len
from shmlearn.data.stream import StreamedData, label_scan, materialize
from shmlearn.errors import BadInput
from shmlearn.user.refs import call_user

TASKS = ("classification", "binary", "regression")
LOADERS = ("auto", "resident", "stream")
RESIDENT_FRACTION = 0.5
"""Read a Dataset whole only if it takes at most this share of the device's free memory (the
model, its activations and the optimizer need the rest)."""


def user_data(obj: Any, what: str, *, task: Optional[str] = None, loader: str = "auto",
              device: torch.device = torch.device("cpu"), name: str = "user"):
    """A Dataset (resident) or StreamedData from what the user gave; BadInput naming `what`."""
    if callable(obj) and not isinstance(obj, (tuple, list, torch.utils.data.Dataset)):
        obj = call_user(obj, (), what)
    if isinstance(obj, (tuple, list)) and len(obj) == 4:
        if loader == "stream":
            raise BadInput(f"{what}: --loader stream needs a pair of torch Datasets, not arrays "
                           f"(arrays are in memory already)")
        return _from_arrays(obj, what, task, name)
    if (isinstance(obj, (tuple, list)) and len(obj) == 2
            and all(isinstance(d, torch.utils.data.Dataset) for d in obj)):
        return _from_datasets(obj[0], obj[1], what, task, loader, device, name)
    got = f"a {type(obj).__name__} of {len(obj)}" if isinstance(obj, (tuple, list)) else f"a {type(obj).__name__}"
    raise BadInput(f"{what}: expected (train_x, train_y, test_x, test_y) arrays or tensors, a pair of "
                   f"torch Datasets (train, test), or a callable returning one; got {got}")


# --- arrays ----------------------------------------------------------------------------------

def _tensor(a, label: str, what: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(np.asarray(a) if not isinstance(a, torch.Tensor) else a)
    except (TypeError, ValueError, RuntimeError) as e:
        raise BadInput(f"{what}: {label} is not a numeric array ({str(e).splitlines()[0][:120]})") from None
    if t.dtype.is_complex or t.dtype == torch.bool and label.endswith("_x"):
        raise BadInput(f"{what}: {label} has dtype {t.dtype}; expected real numbers")
    return t.detach().cpu()


def _from_arrays(parts, what: str, task: Optional[str], name: str) -> Dataset:
    labels = ("train_x", "train_y", "test_x", "test_y")
    trx, tr_y, tex, te_y = (_tensor(a, n, what) for a, n in zip(parts, labels))
    for x, y, split in ((trx, tr_y, "train"), (tex, te_y, "test")):
        if x.dim() < 2:
            raise BadInput(f"{what}: {split}_x has shape {tuple(x.shape)}; expected (samples, features...) "
                           f"with at least 2 dimensions (reshape a single feature to (N, 1))")
        if len(x) != len(y):
            raise BadInput(f"{what}: {split}_x has {len(x)} samples but {split}_y has {len(y)}")
    if trx.shape[1:] != tex.shape[1:]:
        raise BadInput(f"{what}: train_x samples have shape {tuple(trx.shape[1:])} but test_x samples "
                       f"{tuple(tex.shape[1:])}")
    if trx.dtype != tex.dtype:
        raise BadInput(f"{what}: train_x is {_dt(trx)} but test_x is {_dt(tex)}; give both the same dtype")
    for x, label in ((trx, "train_x"), (tex, "test_x")):
        _check_finite(x, label, what)
    if tr_y.dtype.is_floating_point != te_y.dtype.is_floating_point:
        raise BadInput(f"{what}: train_y is {_dt(tr_y)} but test_y is {_dt(te_y)}; give labels of one kind "
                       f"(integers: classes, floats: targets)")
    task = task or ("regression" if tr_y.dtype.is_floating_point else "classification")
    tr_y, te_y, outputs = labels_for(task, tr_y, te_y, what)
    spec = DataSpec(name=name, task=task, input_shape=tuple(trx.shape[1:]), num_outputs=outputs)
    ds = Dataset(spec, _inputs(trx), tr_y, _inputs(tex), te_y)
    check_usable(ds, what)
    return ds


MAX_CLASSES = 1 << 20
"""The most classes (largest label + 1) a classification head is built for: a stray huge label
would size the model's output layer (10^9 labels asked for 512 GB), so it is named instead."""


def _where(t: torch.Tensor, bad: torch.Tensor) -> Tuple[str, str]:
    """(value, 'row R' or 'row R, column C') of the first True in `bad` (C an index tuple past 2-D)."""
    idx = [int(i) for i in bad.nonzero()[0]]
    v = t[tuple(idx)].item()
    value = str(int(v)) if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 63 else str(v)
    col = "" if len(idx) == 1 else f", column {idx[1] if len(idx) == 2 else tuple(idx[1:])}"
    return value, f"row {idx[0]}{col}"


def _check_finite(x: torch.Tensor, label: str, what: str) -> None:
    """Inputs that are NaN or infinite, named once before training (they surfaced as a divergence
    'at step 12 on rank 1', or as a NaN test loss in summary.json)."""
    if not x.dtype.is_floating_point:
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        n = int(bad.sum())
        value, at = _where(x, bad)
        raise BadInput(f"{what}: {label} holds {value} at {at}" + (f" ({n} such values)" if n > 1 else "")
                       + "; every input must be a finite number (drop or fill those samples)")


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _inputs(x: torch.Tensor) -> torch.Tensor:
    """uint8 stays uint8 (the loader converts a batch at a time, as for the built-in images);
    everything else becomes float32, the models' dtype."""
    return x if x.dtype == torch.uint8 else x.float()


def labels_for(task: str, train_y: torch.Tensor, test_y: torch.Tensor, what: str):
    """(train_y, test_y, num_outputs) in the dtype and shape the task's loss takes."""
    if task not in TASKS:
        raise BadInput(f"--task {task}: choose one of {', '.join(TASKS)}")
    if task == "classification":
        ys = []
        for y, split in ((train_y, "train_y"), (test_y, "test_y")):
            if y.dim() == 2 and y.shape[1] == 1:
                y = y.reshape(-1)
            if y.dim() != 1:
                raise BadInput(f"{what}: {split} has shape {tuple(y.shape)}; class labels are one "
                               f"integer per sample")
            if y.dtype.is_floating_point and (y.isnan().any() or (y != y.round()).any()):
                value, at = _where(y, (y != y.round()) | y.isnan())
                raise BadInput(f"{what}: {split} holds non-integer labels ({value} at {at}); classification "
                               f"needs classes 0..K-1 (or state the task: regression)")
            if len(y) and (float(y.max()) >= MAX_CLASSES or float(y.min()) < 0):
                value, at = _where(y, (y >= MAX_CLASSES) | (y < 0))
                raise BadInput(f"{what}: {split} holds label {value} at {at}; class labels must be 0..K-1"
                               + (f" with K at most {MAX_CLASSES} (the model has one output per class)"
                                  if float(value) >= 0 else ""))
            y = y.long()
            ys.append(y)
        outputs = int(max(ys[0].max(), ys[1].max())) + 1 if len(ys[0]) and len(ys[1]) else 1
        if outputs < 2:
            raise BadInput(f"{what}: every label is 0; classification needs at least 2 classes")
        return ys[0], ys[1], outputs
    ys = []
    for y, split in ((train_y, "train_y"), (test_y, "test_y")):
        y = y.float()
        if y.dim() == 1:
            y = y.reshape(-1, 1)
        if y.dim() != 2:
            raise BadInput(f"{what}: {split} has shape {tuple(y.shape)}; expected (N,) or (N, outputs)")
        if not torch.isfinite(y).all():
            value, at = _where(y, ~torch.isfinite(y))
            raise BadInput(f"{what}: {split} holds NaN or infinite targets ({value} at {at})")
        if task == "binary" and not ((y == 0) | (y == 1)).all():
            raise BadInput(f"{what}: {split} holds values other than 0 and 1; binary targets are 0 or 1")
        ys.append(y)
    if ys[0].shape[1] != ys[1].shape[1]:
        raise BadInput(f"{what}: train_y has {ys[0].shape[1]} outputs per sample but test_y {ys[1].shape[1]}")
    if task == "binary" and ys[0].shape[1] != 1:
        raise BadInput(f"{what}: binary targets are one 0/1 value per sample, not {ys[0].shape[1]}")
    return ys[0], ys[1], ys[0].shape[1]


# --- torch Datasets --------------------------------------------------------------------------

def _from_datasets(train, test, what: str, task: Optional[str], loader: str, device: torch.device, name: str):
    for ds, split in ((train, "train"), (test, "test")):
        dataset_len(ds, what, split)
    x0, y0 = first_item(train, what, "train")
    first_item(test, what, "test")
    y_float = y0.dtype.is_floating_point
    task = task or ("regression" if y_float else "classification")
    if task not in TASKS:
        raise BadInput(f"--task {task}: choose one of {', '.join(TASKS)}")
    per_sample = x0.numel() * x0.element_size() + 8 * max(1, y0.numel())
    need = per_sample * (len(train) + len(test))
    resident = loader == "resident" or (loader == "auto" and need <= RESIDENT_FRACTION * _free_bytes(device))
    if resident:
        trx, tr_y = materialize(train, what, "train")
        tex, te_y = materialize(test, what, "test")
        tr_y, te_y, outputs = labels_for(task, tr_y, te_y, what)
        spec = DataSpec(name=name, task=task, input_shape=tuple(trx.shape[1:]), num_outputs=outputs)
        ds = Dataset(spec, _inputs(trx), tr_y, _inputs(tex), te_y)
        check_usable(ds, what)
        return ds
    outputs = _num_outputs(train, test, task, y0, what)
    spec = DataSpec(name=name, task=task, input_shape=tuple(x0.shape), num_outputs=outputs)
    return StreamedData(spec=spec, train=train, test=test, what=what, bytes_needed=need, label_dtype=y0.dtype)


def first_item(ds, what: str, split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    item = call_user(ds.__getitem__, (0,), f"{what} ({split} Dataset[0])")
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise BadInput(f"{what}: the {split} Dataset's items must be (x, y) pairs; item 0 is a "
                       f"{type(item).__name__}")
    x, y = (torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for v in item)
    return x, y


def _num_outputs(train, test, task: str, y0: torch.Tensor, what: str) -> int:
    """Classes of a streamed classification Dataset without reading its images: `classes` or
    `targets` as torchvision's datasets have them; else every label is read once."""
    if task != "classification":
        return max(1, y0.numel())
    if hasattr(train, "classes"):
        return len(train.classes)
    labels = [torch.as_tensor(getattr(d, "targets")) if hasattr(d, "targets") else label_scan(d, what)
              for d in (train, test)]
    _, _, outputs = labels_for(task, labels[0], labels[1], what)
    return outputs


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
