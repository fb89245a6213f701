"""alexnet-sweep (seeds 000, 002 §5-6): for each worker count, sweep batch x lr under one fixed
sample budget (307,200) with alexnet-small, and pick the configuration that learns fastest in
wall-clock time: drop runs whose minimum loss is above 1.8, then least loss-curve area. On
CIFAR-10 when SHMLEARN_CIFAR_DIR names its files, Fashion-MNIST otherwise. Winners table (the
paper's Table 5.1, each winner with its runner-up, margin and accuracy) and the Fig. 5-6 plots come
from the sweep; beside the paper's rule, the least time to 90% of the best surviving accuracy
(winners.TARGET_SHARE): the paper's rule rewards short runs, so a worker count's area winner may be
under-trained, and the time-to-accuracy winner says what reaches a good model first."""
from __future__ import annotations

import os

import torch

from shmlearn.record import safe_write
from shmlearn.experiments.common import Context, fashion_or
from shmlearn.config.limits import usable_cores
from shmlearn.sweeps.results import winners_table
from shmlearn.sweeps.sweep import SweepConfig
from shmlearn.sweeps.cli import run_sweep
from shmlearn.sweeps.winners import TARGET_SHARE

SWEEPS = True
"""`--axis` may replace axes of the grid (e.g. a coarser lr grid where device time is short)."""
PAPER_WINNERS = {1: (128, 0.5), 2: (128, 0.5), 4: (128, 0.4), 8: (64, 0.6)}
"""Seed 000: batch and lr chosen per worker count (Caffe, CIFAR-10)."""


def _worker_counts(ctx: Context):
    slots = torch.cuda.device_count() if ctx.device != "cpu" and torch.cuda.is_available() else usable_cores()
    return [w for w in (1, 2, 4, 8) if w <= max(slots, 1)]


def run_experiment(ctx: Context) -> str:
    cifar = os.environ.get("SHMLEARN_CIFAR_DIR")
    dataset, data_dir = ("cifar10", cifar) if cifar else fashion_or("synthetic")
    if ctx.quick:  # digits: the same sweep in a minute or two on 2 cores
        dataset, data_dir = "digits", None
        axes = {"workers": [1, 2], "batch_size": [16, 64], "lr": [0.1, 0.5]}
        budget = 12800
    else:
        axes = {"workers": _worker_counts(ctx), "batch_size": [16, 32, 64, 128, 256, 512],
                "lr": [round(0.1 * i, 1) for i in range(1, 10)]}
        budget = 307_200
    axes.update(ctx.axes)
    # The seed's init (uniform +-0.05) needs the full budget to get going; --quick uses torch's.
    fixed = {"model": "alexnet-small", "dataset": dataset, "data_dir": data_dir, "samples": budget,
             "optimizer": "sgd", "weight_decay": 0.004, "lr_schedule": "constant",
             "init": "default" if ctx.quick else "uniform:0.05",
             "eval_points": 5, "device": ctx.device}
    for k in ctx.axes:  # an axis given for a fixed field (e.g. --axis optimizer=sgd,adam) replaces it
        fixed.pop(k, None)
    # One trial per GPU at a time: trials on different GPUs share only the host (the fast step
    # replays CUDA graphs, so it needs little of it); on a CPU, one at a time gives clean timings.
    gpus = torch.cuda.device_count() if ctx.device != "cpu" and torch.cuda.is_available() else 0
    sc = SweepConfig(fixed=fixed, axes=axes, threshold=1.8, out=ctx.out, target_share=TARGET_SHARE,
                     parallel=2 if ctx.quick else max(1, gpus))
    code = run_sweep(sc)
    if code != 0:
        raise RuntimeError(f"alexnet-sweep: the sweep ended with exit code {code}")
    import json
    with open(os.path.join(ctx.out, "winners.json")) as f:
        w = json.load(f)
    paper = "\n".join(f"| {n} | {b} | {lr} |" for n, (b, lr) in PAPER_WINNERS.items())
    safe_write.write(os.path.join(ctx.out, "paper_winners.md"),
                     "### The seed's winners (CIFAR-10, Caffe)\n\n| workers | batch | lr |\n|---|---|---|\n" + paper + "\n")
    return winners_table(w)
