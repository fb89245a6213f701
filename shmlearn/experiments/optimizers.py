"""optimizers (seed 003 §3): a single-layer softmax classifier on Fashion-MNIST (MNIST when its
files are given with SHMLEARN_MNIST_DIR); Adam at four learning rates, then the ten optimizers at
lr 0.001; table of train and validation (test set) accuracy; loss and accuracy curves."""
from __future__ import annotations

import os

import torch

from shmlearn.config.train_config import TrainConfig
from shmlearn.data import load_dataset, normalizer
from shmlearn.experiments.common import Context, curve, fashion_or, figure, run, save, write_table
from shmlearn.user.optim import OPTIMIZERS

ADAM_LRS = (0.1, 0.01, 0.001, 0.0001)


@torch.no_grad()
def train_accuracy(model, data) -> float:
    norm = normalizer(data, torch.device("cpu"))
    model.eval()
    correct = sum(int((model(norm(data.train_x[i:i + 4096])).argmax(1) == data.train_y[i:i + 4096]).sum())
                  for i in range(0, len(data.train_x), 4096))
    return correct / len(data.train_x)


def run_experiment(ctx: Context) -> str:
    # --quick trains on digits: the same code path in seconds (evaluating 10,000 28x28 test
    # images is most of the cost of a short run on 2 cores).
    dataset, data_dir = ("digits", None) if ctx.quick else fashion_or("digits", os.environ.get("SHMLEARN_MNIST_DIR"))
    data = load_dataset(dataset, data_dir)
    budget = dict(samples=9600) if ctx.quick else dict(epochs=5)

    def one(name, optimizer, lr):
        cfg = TrainConfig(model="softmax", dataset=dataset, data_dir=data_dir, workers=1, batch_size=32,
                          optimizer=optimizer, lr=lr, lr_schedule="constant", eval_points=5, log_every=20,
                          **budget)
        s = run(ctx, name, cfg, extras=lambda model: {"train_accuracy": train_accuracy(model, data)})
        return s, (s["_extras"] or {}).get("train_accuracy")

    lr_rows = []
    fig, ax, path = figure(ctx, "adam_lr_loss")
    for lr in ADAM_LRS:
        s, tr = one(f"adam-lr{lr}", "adam", lr)
        lr_rows.append({"lr": lr, "train accuracy": tr, "validation accuracy": s["test_accuracy"],
                        "final loss": s["final_loss"], "status": s["status"]})
        st, _, loss = curve(s["_run_dir"])
        ax.plot(st, loss, label=f"lr {lr}", lw=0.8)
    ax.set(title=f"Softmax on {dataset}, Adam", xlabel="step (batch 32)", ylabel="training cross-entropy")
    ax.set_yscale("log")
    ax.legend()
    save(fig, path)
    write_table(ctx, "adam_lr", lr_rows, ["lr", "train accuracy", "validation accuracy", "final loss", "status"],
                title=f"Adam learning rates, softmax on {dataset}")

    rows = []
    fig, (ax1, ax2) = _two_panel()
    for opt in OPTIMIZERS:
        s, tr = one(f"opt-{opt}", opt, 0.001)
        rows.append({"optimizer": opt, "train accuracy": tr, "validation accuracy": s["test_accuracy"],
                     "final loss": s["final_loss"], "wall s": s["wall_time_s"]})
        st, _, loss = curve(s["_run_dir"])
        ax1.plot(st, loss, label=opt, lw=0.8)
        st, _, acc = curve(s["_run_dir"], "test_accuracy", "eval")
        ax2.plot(st, acc, label=opt, marker=".")
    ax1.set(title="training loss", xlabel="step", ylabel="cross-entropy")
    ax2.set(title="validation accuracy", xlabel="step", ylabel="accuracy")
    ax2.legend(fontsize=7, ncol=2)
    save(fig, os.path.join(ctx.out, "optimizers_curves.png"))
    return write_table(ctx, "optimizers", rows, ["optimizer", "train accuracy", "validation accuracy",
                                                 "final loss", "wall s"],
                       title=f"Ten optimizers at lr 0.001, softmax on {dataset} (seed 003 §3)")


def _two_panel():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)
    return fig, axes
