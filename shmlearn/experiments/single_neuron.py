"""single-neuron (paper 002 §3): one sigmoid neuron learns the step at 0.5 on 2, 4, 8 and 16
workers, 10,000 steps per worker, lr 0.5, plain SGD, with gradient averaging (Eq. 2.1) and weight
averaging (Eq. 2.2, K=1); one loss plot per worker count with both modes.

The paper's finding to compare with: more workers converge more slowly per step but with a less
noisy loss. Each worker takes one sample per step (the paper's neuron is trained online).

With plain SGD and K=1 the two modes are the same update (the paper's Eq. 2.3), so their curves
coincide to float precision; the full run adds weight averaging every 10 steps (local SGD), where
the replicas drift between rounds, to show what the period changes.
"""
from __future__ import annotations

import statistics

from shmlearn.config.train_config import TrainConfig
from shmlearn.experiments.common import Context, curve, figure, run, save, write_table

MODES = {"allreduce": "gradient averaging", "weight-avg": "weight averaging"}


def run_experiment(ctx: Context) -> str:
    workers = (2, 4) if ctx.quick else (2, 4, 8, 16)
    steps = 600 if ctx.quick else 10_000
    rows, averaged = [], []
    for w in workers:
        fig, ax, path = figure(ctx, f"single_neuron_w{w}")
        modes = list(MODES.items()) + ([] if ctx.quick else [("weight-avg-10", "weight averaging, K=10")])
        for strategy, label in modes:
            period = 10 if strategy.endswith("-10") else 1
            strategy = strategy.replace("-10", "")
            cfg = TrainConfig(model="neuron", dataset="step", workers=w, threads=1, strategy=strategy,
                              avg_period=period,
                              batch_size=1, samples=steps * w, lr=0.5, optimizer="sgd",
                              lr_schedule="constant", eval_points=4, log_every=max(1, steps // 200),
                              timeout=600)
            s = run(ctx, f"{strategy}{'-k' + str(period) if period > 1 else ''}-w{w}", cfg)
            st, _, loss = curve(s["_run_dir"])
            ax.plot(st, loss, label=label, lw=0.8)
            if strategy == "allreduce":
                averaged.append((w, st, loss))
            head = sum(loss[: max(1, len(loss) // 10)]) / max(1, len(loss) // 10)
            tail = sum(loss[-max(1, len(loss) // 10):]) / max(1, len(loss) // 10)
            # The paper's "less noisy with more workers": the spread of the logged step losses
            # (each the mean over workers of one sample's loss) over the second half of training.
            half = loss[len(loss) // 2:]
            noise = statistics.pstdev(half) if len(half) > 1 else 0.0
            rows.append({"workers": w, "mode": label, "steps per worker": s["steps"],
                         "first 10% loss": head, "last 10% loss": tail,
                         "loss std, 2nd half": noise, "min loss": s["min_loss"],
                         "test accuracy": s["test_accuracy"], "wall s": s["wall_time_s"]})
        ax.set(title=f"Single sigmoid neuron, {w} workers, lr 0.5", xlabel="step (per worker)",
               ylabel="L2 loss of the sigmoid output (mean over workers)")
        ax.legend()
        save(fig, path)
    # The paper's Fig. 2.1 in one panel: gradient averaging at every worker count, log scale.
    fig, ax, path = figure(ctx, "single_neuron_all")
    for w, st, loss in averaged:
        ax.plot(st, loss, label=f"{w} workers", lw=0.7)
    ax.set(title="Single sigmoid neuron, gradient averaging, lr 0.5", xlabel="step (per worker)",
           ylabel="L2 loss (mean over workers)", yscale="log")
    ax.legend()
    save(fig, path)
    return write_table(ctx, "single_neuron", rows, ["workers", "mode", "steps per worker", "first 10% loss",
                                                    "last 10% loss", "loss std, 2nd half", "min loss", "test accuracy",
                                                    "wall s"],
                       title="Single neuron learning a step at 0.5 (paper §3)")
