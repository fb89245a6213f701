"""`shmlearn bench ps-sim`: the seed's dummy-gradient parameter-shard benchmark (seed 001, report 7).

Dummy weights shaped like the model's (AlexNet-small by default) live on the parameter shard,
rank 0, which initializes them and broadcasts them to the worker shards. Each step every worker
makes a "gradient" of random values with the weights' shapes (the placeholder for training), the
shard gathers them (gradient fetch), averages them, subtracts lr x the average from its weights
(weight update) and broadcasts the weights back (weight distribution). Each step prints the
seed's lines, in the seed's order:

    ---->Start time = ...            (the step starts, before the dummy gradients)
    Gradient Fetch Time = ...        (gather to the shard)
    #Worker_Gradients = N
    Gradient Avg time = ...
    Global Step k, Learning Rate = ...
    Weight Update time = ...
    Local Step k, Loss = ...         (placeholder: mean over workers of 0.5 * mean(w^2))
    ---->End time = ...
    Time spent = ...                 (start to end; the distribution is timed after it)
    Weight distribution time = ...   (broadcast from the shard)

Timings are the shard's, in seconds, each phase between device syncs; a barrier before the
gather and before the broadcast keeps the dummy work and the other phases out of them. By default
the shard is dedicated (the seed's scheme, W workers + 1 shard process); --shared makes rank 0
a worker too (shmlearn's `--strategy ps` default). These are the quantities of the paper's
Fig. 6.4 (average), 6.5 (fetch) and 6.6 (distribution) against the number of workers.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch

from shmlearn.bench.common import (RANK_TIMEOUT_S, check_backend, environment, parse_int_list, rank_device,
                                   stats, sync, try_pyplot)
from shmlearn.data.base import DataSpec
from shmlearn.record import safe_write
from shmlearn.errors import BadInput, count
from shmlearn.models import MODELS, build_model
from shmlearn.launch.pool import run_local

PHASES = ("fetch_s", "avg_s", "update_s", "time_spent_s", "dist_s")


@dataclass(kw_only=True)
class PsSimConfig:
    backend: str = "gloo"
    workers: List[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """Numbers of worker shards to run, one fresh process group each."""
    model: str = "alexnet-small"
    """Model whose parameter shapes the dummy weights take (built for CIFAR-shaped input)."""
    shared: bool = False
    """Rank 0 is also a worker (W processes) instead of a dedicated shard (W + 1 processes)."""
    per_tensor: bool = False
    """One gather and one broadcast per weight tensor (as a per-matrix MPI code would), instead
    of one each over a flat buffer (as shmlearn's ps strategy does)."""
    steps: int = 10
    warmup: int = 2
    """Steps printed but left out of the medians (connection setup, first-touch allocation)."""
    lr: float = 0.4
    """The learning rate the seed's sample output prints."""
    quiet: bool = False
    """Print only the per-W medians, not the seed's lines for every step."""


def shapes_of(model: str) -> List[tuple]:
    spec = DataSpec(name="cifar-shaped", task="classification", input_shape=(3, 32, 32), num_outputs=10)
    return [tuple(p.shape) for p in build_model(model, spec).parameters() if p.requires_grad]


def _worker(env, cfg: dict, workers: int) -> Optional[dict]:
    import torch.distributed as dist
    c = PsSimConfig(**cfg)
    rank, world = env.rank, env.world_size
    device = rank_device(env, c.backend)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    shard = rank == 0
    computes = not shard or c.shared
    first = 0 if c.shared else 1  # the dedicated shard's own row carries no gradient
    sizes = [int(torch.Size(s).numel()) for s in shapes_of(c.model)]
    n = sum(sizes)
    bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
    weights = torch.empty(n, device=device)
    if shard:
        weights.uniform_(-0.05, 0.05)  # seed 001's init range
    grad = torch.zeros(n + 1, device=device)  # the last element carries the placeholder loss
    gathered = torch.empty(world, n + 1, device=device) if shard else None
    avg = torch.empty(n, device=device)
    flag = torch.zeros(1, device=device)

    def barrier() -> None:
        dist.all_reduce(flag)
        sync(device)

    def gather() -> None:
        if c.per_tensor:
            for a, b in bounds:
                dist.gather(grad[a:b], [gathered[r, a:b] for r in range(world)] if shard else None, dst=0)
            dist.gather(grad[n:], [gathered[r, n:] for r in range(world)] if shard else None, dst=0)
        else:
            dist.gather(grad, list(gathered.unbind(0)) if shard else None, dst=0)

    def broadcast() -> None:
        if c.per_tensor:
            for a, b in bounds:
                dist.broadcast(weights[a:b], src=0)
        else:
            dist.broadcast(weights, src=0)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    rows = []
    broadcast()  # the shard distributes its initial weights
    for step in range(c.warmup + c.steps):
        start = time.time()
        if computes:  # the dummy gradient computation of the seed
            grad[:n].normal_()
            grad[n] = 0.5 * weights.square().mean()
        barrier()
        fetch = timed(gather)
        if shard:
            avg_s = timed(lambda: torch.mean(gathered[first:, :n], dim=0, out=avg))
            update_s = timed(lambda: weights.add_(avg, alpha=-c.lr))
            loss = gathered[first:, n].mean().item()
            end = time.time()
            if not c.quiet:
                print(f"---->Start time = {start:.6f}\n"
                      f"Gradient Fetch Time = {fetch:.6f}\n"
                      f"#Worker_Gradients = {workers}\n"
                      f"Gradient Avg time = {avg_s:.6f}\n"
                      f"Global Step {step}, Learning Rate = {c.lr:.6f}\n"
                      f"Weight Update time = {update_s:.6f}\n"
                      f"Local Step {step}, Loss = {loss:.6f}\n"
                      f"---->End time = {end:.6f}\n"
                      f"Time spent = {end - start:.6f}", flush=True)
        barrier()
        dist_s = timed(broadcast)
        if shard:
            if not c.quiet:
                print(f"Weight distribution time = {dist_s:.6f}", flush=True)
            rows.append({"step": step, "warmup": step < c.warmup, "fetch_s": fetch,
                         "n_gradients": workers, "avg_s": avg_s, "update_s": update_s,
                         "time_spent_s": end - start, "dist_s": dist_s, "loss": loss})
    return rows if shard else None


def run(cfg: PsSimConfig, *, log=print) -> Dict[str, Any]:
    processes = [w if cfg.shared else w + 1 for w in cfg.workers]
    if min(processes) < 2:
        raise BadInput("--workers 1 --shared: a shared parameter shard needs at least 2 workers "
                       "(with 1 there is nothing to communicate)")
    if cfg.backend == "nccl" and not cfg.shared and torch.cuda.is_available() \
            and max(processes) > torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise BadInput(f"--workers {max(cfg.workers)}: ps-sim runs W workers + 1 parameter-shard process, one GPU "
                       f"each: at most {count(n - 1, 'worker')} on {n} GPUs (or --shared)")
    check_backend(cfg.backend, processes)
    shapes = shapes_of(cfg.model)
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    doc: Dict[str, Any] = {"benchmark": "ps-sim", "schema": 1, "env": environment(cfg.backend),
                           "config": asdict(cfg), "tensors": [list(s) for s in shapes],
                           "parameters": n, "gradient_bytes": 4 * n, "results": []}
    for w, procs in zip(cfg.workers, processes):
        if not cfg.quiet:
            print(f"== {w} worker{'s' if w > 1 else ''} + {'shared' if cfg.shared else 'dedicated'} "
                  f"parameter shard ({procs} processes, {cfg.backend}) ==", flush=True)
        rows = run_local(_worker, (asdict(cfg), w), procs, cuda=cfg.backend == "nccl", timeout_s=RANK_TIMEOUT_S)[0]
        timed = [r for r in rows if not r["warmup"]]
        med = {k: stats([r[k] for r in timed]) for k in PHASES}
        doc["results"].append({"workers": w, "processes": procs, "steps": rows, "stats": med})
        log(f"ps-sim W={w}: fetch {med['fetch_s']['median'] * 1e3:.3f} ms, avg {med['avg_s']['median'] * 1e3:.3f} ms, "
            f"update {med['update_s']['median'] * 1e3:.3f} ms, distribution {med['dist_s']['median'] * 1e3:.3f} ms "
            f"(median of {len(timed)} steps)")
    doc["env"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return doc


def plot(doc: Dict[str, Any], path: str) -> Optional[str]:
    """The paper's Fig. 6.4 (average), 6.5 (fetch), 6.6 (distribution) against workers."""
    plt = try_pyplot()
    if plt is None:
        return None
    res = doc["results"]
    ws = [r["workers"] for r in res]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, title in zip(axes, ("avg_s", "fetch_s", "dist_s"),
                              ("gradient average (Fig. 6.4)", "gradient fetch (Fig. 6.5)",
                               "weight distribution (Fig. 6.6)")):
        med = [r["stats"][key]["median"] * 1e3 for r in res]
        lo = [m - r["stats"][key]["p25"] * 1e3 for m, r in zip(med, res)]
        hi = [r["stats"][key]["p75"] * 1e3 - m for m, r in zip(med, res)]
        ax.errorbar(ws, med, yerr=[lo, hi], marker="o", capsize=3)
        ax.set(title=title, xlabel="workers", ylabel="ms (median, bars = quartiles)", xticks=ws)
        ax.grid(True, alpha=0.3)
    e = doc["env"]
    fig.suptitle(f"ps-sim: {doc['config']['model']} ({doc['gradient_bytes'] / 1e6:.2f} MB), {e['backend']} "
                 f"on {e['device']}, {'shared' if doc['config']['shared'] else 'dedicated'} shard", fontsize=10)
    return safe_write.finish_figure(fig, path, dpi=110)  # whole or as it was


# --- command line ------------------------------------------------------------------------------



def cmd_ps_sim(ns) -> int:
    if ns.steps < 1 or ns.warmup < 0:
        raise BadInput(f"--steps {ns.steps} --warmup {ns.warmup}: need steps >= 1 and warmup >= 0")
    if ns.model not in MODELS:
        raise BadInput(f"--model {ns.model}: unknown model; choose one of {', '.join(MODELS)}")
    cfg = PsSimConfig(backend=ns.backend, workers=parse_int_list(ns.workers, flag="--workers"), model=ns.model,
                      shared=ns.shared, per_tensor=ns.per_tensor, steps=ns.steps, warmup=ns.warmup,
                      lr=ns.lr, quiet=ns.quiet)
    doc = run(cfg)
    with safe_write.cli_output("bench ps-sim"):  # a full disk, a read-only folder: one line, the measurement named
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        safe_write.write_json(ns.out, doc, indent=1)
    print(f"wrote {ns.out}")
    if not ns.no_plot:
        with safe_write.cli_output("bench ps-sim"):
            png = plot(doc, ns.plot or os.path.splitext(ns.out)[0] + ".png")
        print(f"wrote {png}" if png else "no plot: matplotlib is not installed")
    return 0
