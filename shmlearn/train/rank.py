"""One rank of a run: its device, data, model, strategy, optimizer and schedule, built and checked
on every rank before any collective; its process group around the loop (loop.py).

The config reaching here is settled (entry.py): validated, its workers resolved and its layout
checked once for the run.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from shmlearn.config.limits import rank_threads
from shmlearn.config.train_config import TrainConfig
from shmlearn.data.stream import StreamLoader
from shmlearn.errors import BadInput, count
from shmlearn.launch.placement import backend_for, device_type, set_determinism
from shmlearn.launch.start import DistEnv, init_process_group, leave_default_group
from shmlearn.models import apply_init
from shmlearn.sync import registry
from shmlearn.train import checkpoint as ckpt
from shmlearn.train import noise
from shmlearn.train.guard import check_agreement, check_replicas
from shmlearn.train.inputs import gathered_loader, run_data, run_loader, run_model
from shmlearn.train.loop import Loop
from shmlearn.train.result import RunResult
from shmlearn.user import recipe
from shmlearn.user.optim import build_optimizer, build_schedule
from shmlearn.user.parts import Parts


def run_rank(cfg: TrainConfig, env: DistEnv, spec: registry.Spec, prune_key, t_entry: float,
             parts: Parts) -> RunResult:
    """This rank's run of a settled config (cfg.workers: the computing ranks). prune_key: where a
    sweep posts the bound this run must beat (pruning.py); t_entry: perf_counter() at the rank's
    entry (summary.json's setup_time_s counts from it)."""
    compute = cfg.workers
    device = torch.device(device_type(cfg.device))
    set_determinism(cfg.deterministic, device)
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.set_num_threads(rank_threads(device.type, env.local_world_size, cfg.threads, fixed=cfg.deterministic))

    # Everything that can fail on bad input happens here, before any collective, on every rank.
    compute_loss = recipe.resolve_compute_loss(cfg, parts.compute_loss)
    data = run_data(cfg, parts, compute_loss, device, env.rank, env.world_size)
    budget = cfg.budget_samples(data.n_train)
    steps = budget // (compute * cfg.batch_size * cfg.accumulate)  # --accumulate: micro-batches a step
    if steps == 0:
        micro = f" x {cfg.accumulate} micro-batches" if cfg.accumulate > 1 else ""
        raise BadInput(f"--samples {budget}: smaller than one step of {count(compute, 'worker')} x "
                       f"{cfg.batch_size} samples{micro}")
    if cfg.label_smoothing and data.spec.task != "classification":
        raise BadInput(f"--label-smoothing {cfg.label_smoothing}: only for classification; "
                       f"{cfg.dataset} is a {data.spec.task} task")
    user_loss = recipe.resolve_loss(cfg, parts.loss)
    if cfg.label_smoothing and user_loss is not None:
        raise BadInput(f"--label-smoothing {cfg.label_smoothing}: smooths the built-in cross-entropy, "
                       f"and your own loss= replaces it (smooth inside your loss)")
    if cfg.warmup >= steps:
        raise BadInput(f"--warmup {cfg.warmup}: as long as the whole run ({steps} steps); "
                       f"the learning rate would never reach --lr")
    torch.manual_seed(cfg.seed)
    model, metric_names = run_model(cfg, parts, data, compute_loss, user_loss)
    apply_init(model, cfg.init)
    strategy = spec.build(rank=env.rank, world_size=env.world_size)
    strategy.timeout_s = cfg.timeout
    strategy.shared_memory = cfg.shared_memory
    strategy.run_steps = steps
    strategy.accumulate, strategy.clip_grad_norm = cfg.accumulate, cfg.clip_grad_norm
    # A server builds a loader too (shard 0), so a bad layout fails on every rank, not on workers only.
    shard = spec.shard(env.rank) or 0
    loader, augment = run_loader(cfg, data, shard=shard, num_shards=compute, device=device)

    backend = backend_for(cfg, device.type == "cuda")
    owns_group = not dist.is_initialized()
    if owns_group:
        init_process_group(backend, env, cfg.timeout)
    try:
        if cfg.resume and (done := ckpt.finished(cfg.out, env.rank, env.world_size)) is not None:
            return RunResult(status="completed", run_dir=cfg.out, summary=done, rank=env.rank)
        loader, augment = gathered_loader(cfg, data, parts.data, loader, augment, shard=shard, num_shards=compute,
                                          device=device, world=env.world_size)
        check_agreement(ckpt.agreed_fields(cfg), data, model, env.rank, env.world_size)
        model.to(device)
        optimizer = recipe.build_user_optimizer(cfg, parts.optimizer, model) or build_optimizer(
            cfg.optimizer, model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        start_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        strategy.setup(model, optimizer, channels_last=cfg.channels_last)
        if cfg.noise_scale:  # augmented samples are drawn afresh: no finite population to correct for
            strategy.noise = noise.NoiseMeter(workers=compute, batch_size=cfg.batch_size, steps=steps, device=device,
                                              n_train=None if augment.active else data.n_train,
                                              world_size=env.world_size,
                                              every=cfg.noise_every or noise.default_every(compute))
        check_replicas(strategy.params_flat, env.world_size)
        schedule = recipe.build_user_scheduler(cfg, parts.scheduler, optimizer,
                                               max(1, data.n_train // (compute * cfg.batch_size * cfg.accumulate)))
        if schedule is None:
            schedule = build_schedule(cfg.lr_schedule, optimizer, steps, cfg.warmup_steps(steps))
        loop = Loop(cfg, env, data, model, strategy, optimizer, schedule,
                    loader if strategy.computes else None, steps, budget, device, prune_key=prune_key,
                    t_entry=t_entry, loss=user_loss, spec=spec, compute_loss=compute_loss,
                    metric_names=metric_names, start_lrs=start_lrs)
        return loop.run()
    finally:
        strategy.close()
        if isinstance(loader, StreamLoader):
            loader.close()
        if owns_group:  # NCCL never hangs it; Gloo closes promptly (in a thread its teardown upsets torchrun's restarts)
            leave_default_group(env.rank, nccl=device.type == "cuda")

