"""cnn (seed 003 §4-5): the 2-conv CNN (lenet) on Fashion-MNIST (MNIST with SHMLEARN_MNIST_DIR),
batch {32, 64, 128} x lr with Adam; then data parallel on 1, 2, 4, ... GPUs up to those present
(2 CPU workers without a GPU) at global batch sizes up to 8192: training time and accuracy per setting.

The seed reports val_acc 0.9936 on MNIST at batch 128, lr 0.001, 10 epochs (TensorFlow, V100)."""
from __future__ import annotations

import os

import torch

from shmlearn.config.train_config import TrainConfig
from shmlearn.experiments.common import Context, curve, fashion_or, figure, run, save, write_table

BATCHES = (32, 64, 128)
LRS = (0.01, 0.001, 0.0001)
AXES = ("batch_size", "lr", "workers")
"""What `--axis` may replace: the batch x lr table's batches and lrs, and the data-parallel worker
counts (e.g. `--axis batch_size=128 --axis lr=0.001 --axis workers=1,2,4` where device time is short)."""


def _gpus(ctx: Context) -> int:
    if ctx.device == "cpu" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def run_experiment(ctx: Context) -> str:
    # --quick trains on digits: the same code path in seconds (evaluating 10,000 28x28 test
    # images is most of the cost of a short run on 2 cores).
    dataset, data_dir = ("digits", None) if ctx.quick else fashion_or("digits", os.environ.get("SHMLEARN_MNIST_DIR"))
    budget = dict(samples=3200) if ctx.quick else dict(epochs=10 if _gpus(ctx) else 3)
    rows = []
    fig, ax, path = figure(ctx, "cnn_accuracy")
    for b in ctx.axes.get("batch_size", BATCHES):
        for lr in ctx.axes.get("lr", LRS):
            cfg = TrainConfig(model="lenet", dataset=dataset, data_dir=data_dir, workers=1, batch_size=b,
                              lr=lr, optimizer="adam", lr_schedule="constant", eval_points=5, **budget)
            s = run(ctx, f"b{b}-lr{lr}", cfg)
            rows.append({"batch": b, "lr": lr, "test accuracy": s["test_accuracy"],
                         "best test accuracy": s["best_test_accuracy"], "train s": s["wall_time_s"],
                         "samples/s": s["samples_per_s"]})
            _, t, acc = curve(s["_run_dir"], "test_accuracy", "eval")
            ax.plot(t, acc, marker=".", label=f"batch {b}, lr {lr}")
    ax.set(title=f"lenet on {dataset}, Adam", xlabel="training seconds", ylabel="test accuracy")
    ax.legend(fontsize=7, ncol=2)
    save(fig, path)
    main = write_table(ctx, "cnn_batch_lr", rows, ["batch", "lr", "test accuracy", "best test accuracy",
                                                   "train s", "samples/s"],
                       title=f"lenet, batch x lr, on {dataset} (seed 003 §4)")

    # Data parallel: 1, 2, 4, ... workers up to the GPUs present, one a GPU (2 CPU workers without
    # a GPU), the same model, growing global batch.
    gpus = _gpus(ctx)
    counts = sorted({1 << i for i in range(gpus.bit_length()) if (1 << i) <= gpus} | {gpus}) if gpus else [2]
    counts = [int(w) for w in ctx.axes.get("workers", counts)]
    globals_ = (256, 1024) if ctx.quick else (256, 1024, 4096, 8192)
    dp = []
    for workers in counts:
        for g in globals_:
            per = g // workers
            cfg = TrainConfig(model="lenet", dataset=dataset, data_dir=data_dir, workers=workers, batch_size=per,
                              lr=0.001 * (g / 128) ** 0.5, optimizer="adam", lr_schedule="linear", warmup=0,
                              eval_points=3, threads=1 if not gpus else None,
                              **(dict(samples=6 * g) if ctx.quick else dict(epochs=10 if gpus else 3)))
            s = run(ctx, f"dp-w{workers}-g{g}", cfg)
            dp.append({"workers": workers, "device": s.get("device"), "global batch": g, "batch per worker": per,
                       "lr": cfg.lr, "steps": s["steps"], "test accuracy": s["test_accuracy"],
                       "train s": s["wall_time_s"], "samples/s": s["samples_per_s"]})
    write_table(ctx, "cnn_data_parallel", dp, ["workers", "device", "global batch", "batch per worker", "lr",
                                               "steps", "test accuracy", "train s", "samples/s"],
                title="Data parallel with large batches (seed 003 §5); lr scaled by sqrt(batch/128)")
    return main
