"""cpu-vs-gpu (seed 004): samples/s of alexnet and resnet34 on 28x28x1, 32x32x3 and 64x64x3
inputs, on the CPU, on one GPU and on every GPU present data parallel (batch 128 a GPU), and
samples/s against the number of CPU threads (1, 2, 4, ... up to the cores present). Training runs print per-"epoch" lines in the seed's CNTK shape:

    Finished Epoch[1 of 3]: [Training] loss = 2.301 * 1280, metric = 88.28% * 1280 12.3s ( 104.1 samples/s);

where an epoch is one evaluation interval of the run's sample budget (the full dataset would take
hours on a CPU), and metric is the test error, as CNTK's classification metric is an error rate.
Inputs are the synthetic datasets of those shapes, so the study needs no downloads."""
from __future__ import annotations

import os

import torch

from shmlearn.record import safe_write
from shmlearn.config.train_config import TrainConfig
from shmlearn.experiments.common import Context, curve, figure, run, save, write_table
from shmlearn.config.limits import usable_cores

SHAPES = {"28x28x1": "synthetic-28", "32x32x3": "synthetic-32", "64x64x3": "synthetic-64"}
MODELS = ("alexnet", "resnet34")


def _epoch_lines(run_dir: str, epochs: int) -> list:
    steps, times, acc = curve(run_dir, "test_accuracy", "eval")
    msteps, _, loss = curve(run_dir)
    import json
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    per_step = summary["samples_seen"] / max(1, summary["steps"])
    lines, prev_t, prev_s = [], 0.0, 0
    for i, (s, t, a) in enumerate(zip(steps[1:], times[1:], acc[1:]), start=1):
        window = [l for st, l in zip(msteps, loss) if prev_s < st <= s] or loss[-1:]
        n = int((s - prev_s) * per_step)
        dt = max(t - prev_t, 1e-9)
        lines.append(f"Finished Epoch[{i} of {epochs}]: [Training] loss = {sum(window) / len(window):.6f} * {n}, "
                     f"metric = {100 * (1 - a):.2f}% * {n} {dt:.3f}s ({n / dt:6.1f} samples/s);")
        prev_t, prev_s = t, s
    return lines


def run_experiment(ctx: Context) -> str:
    cuda = ctx.device != "cpu" and torch.cuda.is_available()
    cores = usable_cores()
    gpus = torch.cuda.device_count() if cuda else 0
    # (device, workers): one CPU process, one GPU, and every GPU data parallel (batch 128 a GPU)
    devices = [("cpu", 1)] + ([("cuda", 1)] if cuda else []) + ([("cuda", gpus)] if gpus > 1 else [])
    epochs = 2 if ctx.quick else 3
    cpu_samples = 64 * epochs if ctx.quick else 512 * epochs
    rows, log = [], []
    shapes = {"28x28x1": SHAPES["28x28x1"]} if ctx.quick else SHAPES
    models = MODELS[:1] if ctx.quick else MODELS  # resnet34 on a CPU takes minutes per run
    for model in models:
        for shape, dataset in shapes.items():
            for dev, workers in devices:
                batch = 32 if dev == "cpu" else 128
                samples = cpu_samples if dev == "cpu" else 128 * 200 * workers
                cfg = TrainConfig(model=model, dataset=dataset, workers=workers, device=dev, batch_size=batch,
                                  samples=samples, lr=0.01, optimizer="momentum", eval_points=epochs,
                                  threads=cores if dev == "cpu" else None, log_every=1)
                name = f"{model}-{shape}-{dev}" + (f"-w{workers}" if workers > 1 else "")
                s = run(Context(ctx.out, ctx.quick, dev), name, cfg)
                log += [f"== {model} {shape} {dev} x{workers}"] + _epoch_lines(s["_run_dir"], epochs)
                rows.append({"model": model, "input": shape, "device": s["device"], "workers": workers,
                             "batch": batch, "samples/s": s["samples_per_s"], "final loss": s["final_loss"]})
    for line in log:
        print(line)
    safe_write.write(os.path.join(ctx.out, "epoch_log.txt"), "\n".join(log) + "\n")
    main = write_table(ctx, "cpu_vs_gpu", rows, ["model", "input", "device", "workers", "batch", "samples/s",
                                                     "final loss"],
                       title="Samples/s, CPU vs GPU (seed 004); batch per worker")

    threads = sorted({1 << i for i in range(cores.bit_length()) if (1 << i) <= cores} | {cores})
    trows = []
    fig, ax, path = figure(ctx, "cpu_threads")
    for model in models:
        xs, ys = [], []
        for t in threads:
            cfg = TrainConfig(model=model, dataset="synthetic-32", workers=1, device="cpu", batch_size=32,
                              samples=cpu_samples, lr=0.01, optimizer="momentum", eval_points=1, threads=t)
            s = run(Context(ctx.out, ctx.quick, "cpu"), f"{model}-threads{t}", cfg)
            trows.append({"model": model, "threads": t, "samples/s": s["samples_per_s"]})
            xs.append(t)
            ys.append(s["samples_per_s"])
        ax.plot(xs, ys, marker="o", label=model)
    ax.set(title="Training samples/s against CPU threads (32x32x3, batch 32)", xlabel="intra-op threads",
           ylabel="samples/s")
    ax.set_xscale("log", base=2)
    ax.legend()
    save(fig, path)
    write_table(ctx, "cpu_threads", trows, ["model", "threads", "samples/s"],
                title="Samples/s against CPU threads (seed 004)")
    return main
