"""linreg-gd (seed 003 §2): fit y = Wx + b by full-batch gradient descent at four learning
rates for 1000 epochs; table of W, b and MSE beside the closed-form least-squares fit and R^2."""
from __future__ import annotations

import numpy as np
import torch

from shmlearn.config.train_config import TrainConfig
from shmlearn.data import load_dataset
from shmlearn.experiments.common import Context, curve, figure, run, save, write_table

LRS = (0.1, 0.01, 0.001, 0.0001)
SEED_TABLE = {0.1: (-1.0, 1.0, 2.1672e-13), 0.01: (-0.9938, 0.9819, 5.5029e-05),
              0.001: (-0.9085, 0.7310, 0.0121), 0.0001: (-0.8524, 0.6572, 0.0279)}
"""Seed 003, Table 1 (TensorFlow 2, its own data points): W, b, MSE after 1000 epochs."""


def _fitted(model) -> dict:
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    return {"W": float(layer.weight.detach().reshape(-1)[0]), "b": float(layer.bias.detach().reshape(-1)[0])}


def run_experiment(ctx: Context) -> str:
    data = load_dataset("line-exact")
    n = len(data.train_x)
    rows = []
    fig, ax, path = figure(ctx, "linreg_loss")
    for lr in LRS:
        # One worker, the whole training set as the batch: gradient descent, not SGD.
        cfg = TrainConfig(model="linreg", dataset="line-exact", workers=1, batch_size=n, epochs=1000,
                          lr=lr, optimizer="sgd", lr_schedule="constant", eval_points=1, log_every=10)
        s = run(ctx, f"lr{lr}", cfg, extras=_fitted)
        w, b = s["_extras"]["W"], s["_extras"]["b"]
        seed_w, seed_b, seed_mse = SEED_TABLE[lr]
        rows.append({"lr": lr, "W": w, "b": b, "MSE (test)": s["test_loss"], "final train loss": s["final_loss"],
                     "seed W": seed_w, "seed b": seed_b, "seed MSE": seed_mse})
        steps, _, loss = curve(s["_run_dir"])
        ax.semilogy(steps, loss, label=f"lr {lr}")
    ax.set(title="Linear regression by gradient descent (y = -x + 1)", xlabel="epoch (full batch)",
           ylabel="training MSE (log)")
    ax.legend()
    save(fig, path)

    # The closed-form fit the seed compares with (scikit-learn's LinearRegression and its R^2).
    from sklearn.linear_model import LinearRegression
    x, y = data.train_x.numpy().astype(np.float64), data.train_y.numpy().reshape(-1).astype(np.float64)
    lin = LinearRegression().fit(x, y)
    closed = [{"model": "least squares (closed form)", "W": float(lin.coef_[0]), "b": float(lin.intercept_),
               "R^2": float(lin.score(x, y)), "seed W": -1.0, "seed b": 1.0, "seed R^2": 1.0}]
    write_table(ctx, "closed_form", closed, ["model", "W", "b", "R^2", "seed W", "seed b", "seed R^2"],
                title="Closed-form fit (seed 003, Table 2)")
    return write_table(ctx, "linreg_gd", rows, ["lr", "W", "b", "MSE (test)", "final train loss",
                                                "seed W", "seed b", "seed MSE"],
                       title="Gradient descent, 1000 epochs (seed 003, Table 1)")
