"""The seed experiments, one file each, each a function of a Context that builds configs and
runs them through the shared training loop (and the sweep where it sweeps).

This package's own import is light (the names, the command's parser: `shmlearn experiment
--help` answers without torch); what runs an experiment is imported by the functions that do."""
from __future__ import annotations

import importlib
import json
import os
import time
from typing import Dict, Tuple

from shmlearn.errors import BadInput
from shmlearn.config.limits import usable_cores

# name -> (module, one line on what it reproduces)
EXPERIMENTS: Dict[str, Tuple[str, str]] = {
    "single-neuron": ("single_neuron", "002 §3: a sigmoid neuron learns a step, 2-16 workers, both averaging modes"),
    "linreg-gd": ("linreg_gd", "003 §2: y = Wx + b by gradient descent at 4 learning rates vs the closed form"),
    "optimizers": ("optimizers", "003 §3: softmax classifier; Adam lr sweep; ten optimizers' accuracies"),
    "cnn": ("cnn", "003 §4-5: the 2-conv CNN, batch x lr; data parallel with batch up to 8192"),
    "alexnet-sweep": ("alexnet_sweep", "000, 002 §5-6: batch x lr x workers sweep, 307,200 samples, winners"),
    "cpu-vs-gpu": ("cpu_vs_gpu", "004: samples/s of alexnet and resnet34, CPU vs GPU, and vs CPU threads"),
}


def default_out(name: str, quick: bool) -> str:
    """experiments/STAMP-NAME[-quick]: where an experiment writes without --out."""
    return os.path.join("experiments", f"{time.strftime('%Y%m%d-%H%M%S')}-{name}{'-quick' if quick else ''}")


def run_experiment(name: str, *, quick: bool = False, device: str = "auto", out: str = None,
                   axes: Dict[str, list] = None) -> str:
    if name not in EXPERIMENTS:
        raise BadInput(f"experiment {name}: unknown; choose one of {', '.join(EXPERIMENTS)}")
    from shmlearn.experiments.common import Context  # lazy: torch (the training loop)
    from shmlearn.launch.pool import Pool, using  # lazy: torch
    out = out or default_out(name, quick)
    module = importlib.import_module(f"shmlearn.experiments.{EXPERIMENTS[name][0]}")
    allowed = getattr(module, "AXES", ())  # the axes a fixed-list experiment lets --axis replace
    if axes and not getattr(module, "SWEEPS", False):
        if not allowed:
            raise BadInput(f"--axis: experiment {name} runs a fixed list of configurations, not a grid")
        for k in axes:
            if k not in allowed:
                raise BadInput(f"--axis {k}: experiment {name} takes only {', '.join(allowed)}")
    _claim(out, {"experiment": name, "quick": quick, "device": device,
                 "axes": {k: list(v) for k, v in sorted((axes or {}).items())}})
    ctx = Context(out=out, quick=quick, device=device, axes=dict(axes or {}))
    if getattr(module, "SWEEPS", False):
        return module.run_experiment(ctx)  # the sweep keeps a pool of its own
    # Every run of the experiment on one pool of workers (pool.py): a run costs its training,
    # not a start-up of processes.
    cuda = device != "cpu" and _cuda()
    with Pool(_slots(cuda), cuda=cuda) as pool, using(pool):
        return module.run_experiment(ctx)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _slots(cuda: bool) -> int:
    if cuda:
        import torch
        return torch.cuda.device_count()
    return usable_cores()


def _claim(out: str, what: dict) -> None:
    """The folder belongs to one experiment invocation (experiment.json). The same invocation
    again resumes it (finished runs are read back); anything else is refused, so no result in
    the folder is overwritten."""
    from shmlearn.record.runs import check_sweep_out, write_json_atomic  # lazy: torch (the config)
    check_sweep_out(out)  # not a file, not a training run's folder
    marker = os.path.join(out, "experiment.json")
    if os.path.exists(marker):
        try:
            with open(marker) as f:
                held = json.load(f)
        except (OSError, ValueError):
            held = None
        if held != what:
            said = "an unreadable experiment.json" if held is None else \
                ", ".join(f"{k} {held.get(k)!r}" for k in what if held.get(k) != what[k])
            raise BadInput(f"--out {out}: holds another experiment run ({said}); choose another directory")
        return
    if os.path.exists(os.path.join(out, "runs")):
        raise BadInput(f"--out {out}: already holds runs of an unknown experiment; choose another directory")
    os.makedirs(out, exist_ok=True)
    write_json_atomic(marker, what)
