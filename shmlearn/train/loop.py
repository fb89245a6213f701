"""THE training loop, shared by every strategy, experiment and sweep.

    config -> launch -> (data, model, strategy) -> this loop -> run directory

Per step: data -> compute (forward, backward) -> one small control all-reduce (loss, which ranks
saw a non-finite loss, whether rank 0 wants an evaluation) -> strategy.step (sync + update).
The control all-reduce is what keeps ranks in lockstep: every rank stops on a NaN at the same
step, before the bad gradient is applied, and evaluates at the same steps.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from shmlearn.config.train_config import TrainConfig, validate
from shmlearn.data import Dataset, check_present, normalizer
from shmlearn.step.fast import StepOptions, Stepper
# preload_data: sweep and study import it from here (a pool's init).
from shmlearn.train.inputs import gathered_loader, preload_data, run_data, run_loader, run_model  # noqa: F401
from shmlearn.train import checkpoint as ckpt
from shmlearn.train import noise
from shmlearn.config.train_config import checkpoint_period
from shmlearn.errors import BadInput, Diverged, WorkerFailed, count
from shmlearn.train.guard import Fault, Heartbeat, check_agreement, check_replicas
from shmlearn.launch.start import DistEnv, check_capacity, detect_env, free_port, init_process_group
from shmlearn.launch.start import destroy_group as _destroy_group
from shmlearn.config.limits import rank_threads
from shmlearn.launch.placement import backend_for, default_workers, device_type, set_determinism  # noqa: F401
from shmlearn.models import apply_init
from shmlearn.data.stream import StreamLoader, StreamedData
from shmlearn.user.parts import Parts, resolve_ref
from shmlearn.user.refs import is_ref
from shmlearn.user.optim import build_optimizer, build_schedule
from shmlearn.train import evaluation
from shmlearn.user import recipe
from shmlearn.record import weights
from shmlearn.launch.pool import current as current_pool, describe, run_local, worker_store
from shmlearn.sweeps.pruning import Watch
from shmlearn.record import runs
from shmlearn.launch import user_main
from shmlearn.record.runs import RunDir, check_out_dir, default_run_dir, lock_out_dir, loss_area
from shmlearn.sync import SyncStrategy, registry
from shmlearn.user.tasks import loss_fn
from shmlearn.record.timing import PhaseTimer, chrome_trace


@dataclass
class RunResult:
    status: str
    """completed | diverged | failed"""
    run_dir: Optional[str]
    summary: Dict[str, Any]
    model: Optional[torch.nn.Module] = None
    """The trained model: rank 0's, on the CPU for local runs (the averaged one for weight-avg:
    replicas are equal after the last step); this rank's under torchrun/mpirun/srun."""
    rank: int = 0
    """The rank this result is from: 0 for local runs; under a launcher every rank gets one, so a
    script prints or saves where rank == 0."""


# --- entry point -----------------------------------------------------------------------------

def train(cfg: TrainConfig, model=None, data=None, loss=None, compute_loss=None, optimizer=None,
          scheduler=None) -> RunResult:
    """Train as the config says: spawn local workers, or be one rank under a launcher.

    model: an nn.Module (its weights are every rank's starting point), or a class or callable
    returning one (called with the DataSpec if it has a required positional parameter); default
    the config's `model`. data: (train_x, train_y, test_x, test_y) arrays or tensors, used as
    given, or a pair of map-style torch Datasets (train, test), or a callable returning either;
    default the config's `dataset`. loss: f(outputs, targets) -> mean loss; default the task's.
    compute_loss: the general contract, f(model, batch) -> loss or (loss, {name: value}), for any
    model and data: `data` is then (train, test) or (train, val, test) Datasets whose items have any
    structure (data/tree.py), batch is a batch of them collated on the device, and evaluation
    reports the mean loss and each metric (test_loss, test_NAME; val_loss, val_NAME).
    optimizer: a torch.optim.Optimizer class (called with the model's parameters) or a callable
    called with the model (parameter groups) returning an Optimizer; default the config's.
    scheduler: a callable optimizer -> LRScheduler, stepped per epoch or per step as
    cfg.scheduler_interval says (recipe.py). Local workers receive these pickled: define them at
    the top level of your script (functools.partial of such is fine).

    Raises BadInput (exit 2), Diverged (exit 3) or WorkerFailed (exit 1)."""
    user_main.stop_if_importing()  # a pool worker running the script stops here (user_main.py)
    parts = Parts(model, data, loss, optimizer, scheduler, compute_loss)
    cfg = parts.labelled(cfg)  # before validation: the labels are what config.yaml records
    validate(cfg)
    recipe.check_refs(cfg, parts)  # a wrong --optimizer/--scheduler/--loss fails here, before any process
    env = detect_env()
    if env is not None:
        return run_worker(cfg, env, parts=parts)
    if model is None and is_ref(cfg.model):  # a wrong FILE.py:NAME fails here, before any process
        resolve_ref(cfg.model, "--model")
    if data is None and is_ref(cfg.dataset):
        resolve_ref(cfg.dataset, "--dataset")
    elif data is None:  # a missing --data-dir or file: one line now, not after the workers start
        check_present(cfg.dataset, cfg.data_dir)
    cuda = device_type(cfg.device) == "cuda"
    spec = registry.spec(cfg)
    if cfg.workers is None:
        cfg = replace(cfg, workers=default_workers(cuda, torch.cuda.device_count() if cuda else 0, spec.servers))
    world = spec.processes(cfg.workers)
    noise.check(cfg, spec, cfg.workers)
    backend = backend_for(cfg, cuda)
    if cuda and world > torch.cuda.device_count() and backend == "nccl":
        extra = f" + {count(spec.servers, 'server')}" if spec.servers else ""
        raise BadInput(f"--workers {cfg.workers}: {world} processes ({count(cfg.workers, 'worker')}{extra}) need "
                       f"{world} GPUs, {torch.cuda.device_count()} present (--backend gloo shares GPUs)")
    if not cfg.resume and cfg.out:
        check_out_dir(cfg.out)
    if not cuda:
        check_capacity(world, cfg.threads, cfg.oversubscribe)
    cfg = replace(cfg, out=cfg.out or default_run_dir(cfg, cfg.workers, claim=True))
    with lock_out_dir(cfg.out):  # BadInput if --out cannot be written, or another run writes there
        if cfg.resume and (done := ckpt.finished(cfg.out)) is not None:  # never rewritten
            return RunResult(status="completed", run_dir=cfg.out, summary=done)
        if world == 1 and current_pool() is None:
            caller_threads = torch.get_num_threads()  # the rank sets its own; the caller keeps its
            try:
                result = run_worker(cfg, DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                                                 launcher="local", master_port=free_port()), parts=parts)
            except (BadInput, Diverged, WorkerFailed, KeyboardInterrupt):
                raise
            except (Exception, SystemExit) as e:  # noqa: BLE001 - one line naming the rank, as with 2+ workers
                raise WorkerFailed(f"rank 0: {describe(e)}") from e
            finally: torch.set_num_threads(caller_threads)  # noqa: E701 - train.py is at 600 lines
            # On the CPU, as rank_main sends it: on the GPU its parameters view the strategy's flat buffer.
            model = copy.deepcopy(result.model).cpu() if result.model is not None else None
            return replace(result, model=model)
        sent = parts.pickled() if parts.given() else None
        summary, run_dir, blob = run_local(rank_main, (cfg.to_dict(), None, True, sent), world,
                                           cuda=cuda, timeout_s=cfg.timeout, backend=backend)[0]
    # The whole module (the user's class), so not weights_only: bytes rank 0 of this run sent over
    # its pool's pipe, never read from a file (docs/security.md).
    model = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False) if blob else None
    return RunResult(status=summary["status"], run_dir=run_dir, summary=summary, model=model)


def rank_main(env: DistEnv, cfg_dict: dict, prune_key: Optional[str] = None, want_model: bool = False,
              parts: Optional[bytes] = None):
    """One rank of a local run, in a pool worker: rank 0 returns (summary, run_dir, the trained
    model on the CPU as torch.save bytes, or None). Bytes, not the module: its parameters are
    views into one flat device buffer, and a pipe would try to share them. parts: the user's
    model/data/loss, pickled (parts.py)."""
    result = run_worker(TrainConfig(**cfg_dict), env, prune_key=prune_key, parts=Parts.unpickled(parts))
    if env.rank != 0:
        return None
    blob = None
    if want_model and result.model is not None:
        buf = io.BytesIO()
        torch.save(copy.deepcopy(result.model).cpu(), buf)
        blob = buf.getvalue()
    return result.summary, result.run_dir, blob


# --- one rank --------------------------------------------------------------------------------

def run_worker(cfg: TrainConfig, env: DistEnv, *, prune_key: Optional[str] = None,
               parts: Optional[Parts] = None) -> RunResult:
    """One rank's run. prune_key (sweeps with --prune): where the sweep posts the bound this run
    must beat (pruning.py). parts: the user's own model/data/loss objects, if any."""
    t_entry = time.perf_counter()
    validate(cfg)
    spec = registry.spec(cfg)
    compute = spec.compute_ranks(env.world_size)
    if compute < 1:
        raise BadInput(f"{spec.flags()}: needs at least {spec.processes(1)} processes "
                       f"({count(spec.servers, 'server')} + 1 worker)")
    if cfg.workers is not None and cfg.workers != compute:
        servers = f" + {count(spec.servers, 'server')}" if spec.servers else ""
        raise BadInput(f"--workers {cfg.workers}: the launcher started {env.world_size} processes "
                       f"({count(compute, 'worker')}{servers}); drop --workers or match it")
    cfg = replace(cfg, workers=compute, out=cfg.out or default_run_dir(cfg, compute))
    noise.check(cfg, spec, compute)
    # Elastic restart: torchrun starts the same command again; it must continue, not restart.
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        cfg = replace(cfg, resume=True)
    if env.rank == 0 and env.launcher != "local" and not cfg.resume:
        check_out_dir(cfg.out)
    # Under torchrun/mpirun/srun rank 0 holds --out's lock for the run (locally, train() does).
    out_lock = lock_out_dir(cfg.out) if env.rank == 0 and env.launcher != "local" else contextlib.nullcontext()
    with out_lock:
        return _run_rank(cfg, env, spec, compute, prune_key, t_entry, parts or Parts())


def _run_rank(cfg: TrainConfig, env: DistEnv, spec: registry.Spec, compute: int, prune_key, t_entry,
              parts: Parts) -> RunResult:

    device = torch.device(device_type(cfg.device))
    set_determinism(cfg.deterministic, device)
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.set_num_threads(rank_threads(device.type, env.local_world_size, cfg.threads))

    # Everything that can fail on bad input happens here, before any collective, on every rank.
    compute_loss = recipe.resolve_compute_loss(cfg, parts.compute_loss)
    data = run_data(cfg, parts, compute_loss, device, env.rank, env.world_size)
    budget = cfg.budget_samples(data.n_train)
    steps = budget // (compute * cfg.batch_size * cfg.accumulate)  # --accumulate: micro-batches a step
    if steps == 0:
        raise BadInput(f"--samples {budget}: smaller than one step of {count(compute, 'worker')} x "
                       f"{cfg.batch_size} samples" + (f" x {cfg.accumulate} micro-batches" if cfg.accumulate > 1 else ""))
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
        check_agreement(_agreed_fields(cfg), data, model, env.rank, env.world_size)
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
        loop = _Loop(cfg, env, data, model, strategy, optimizer, schedule,
                     loader if strategy.computes else None, steps, budget, device, prune_key=prune_key,
                     t_entry=t_entry, loss=user_loss, spec=spec, compute_loss=compute_loss,
                     metric_names=metric_names)
        loop.start_lrs = start_lrs
        return loop.run()
    finally:
        if isinstance(loader, StreamLoader):
            loader.close()
        if owns_group:
            if device.type == "cuda":
                _destroy_group(env.rank)
            else:  # Gloo closes promptly; in a thread its teardown upsets torchrun's restarts
                dist.destroy_process_group()


# Fields that may differ between the original run and its resumption, or between ranks.
_FREE_FIELDS = ("out", "resume", "progress", "timeout", "checkpoint_every", "threads", "workers", "oversubscribe",
                "save_model",
                "cudnn_benchmark")


def _agreed_fields(cfg: TrainConfig) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if k not in _FREE_FIELDS}


_HISTORY = ("step_times", "step_losses", "evals", "eval_s", "checkpoint_s", "last_eval_s", "last_ckpt_s")
"""The _Loop fields a checkpoint keeps (its "loop" entry, in this order) and a resumption restores."""


class _Loop:
    """State of one rank's training run; `run()` is the loop itself."""

    def __init__(self, cfg, env, data: Dataset, model, strategy: SyncStrategy, optimizer, schedule,
                 loader, steps, budget, device, prune_key: Optional[str] = None, t_entry: Optional[float] = None,
                 loss=None, spec: Optional[registry.Spec] = None, compute_loss=None, metric_names=()):
        self.cfg, self.env, self.data, self.model, self.strategy = cfg, env, data, model, strategy
        self.spec = spec if spec is not None else registry.spec(cfg)
        self.loss = loss
        """The user's f(outputs, targets) -> mean loss, or None: the task's (tasks.loss_fn)."""
        self.compute, self.metric_names = compute_loss, tuple(metric_names)
        """The general contract: the user's compute_loss(model, batch) and the metrics it returns."""
        self.optimizer, self.schedule = optimizer, schedule
        self.loader, self.steps, self.budget, self.device = loader, steps, budget, device
        self.task = data.spec.task
        self.normalize = normalizer(data, device)
        self.timer = PhaseTimer(device, env.rank)
        self.lead = env.rank == 0
        self.step_times: List[float] = []
        self.step_losses: List[float] = []
        self.evals: List[Dict[str, Any]] = []
        self.eval_s = 0.0
        self.checkpoint_s = 0.0
        self.last_eval_s = 0.0
        self.last_ckpt_s = 0.0
        self.samples_per_step = strategy.compute_ranks * cfg.batch_size * cfg.accumulate
        self.auto_eval = cfg.eval_points is None and cfg.eval_every is None
        """Choose the evaluations so they stay under EVAL_SHARE of the run (`_auto_wants_eval`)."""
        eval_points = cfg.eval_points or (1 if self.auto_eval else None)
        self.eval_at = ({max(1, round(steps * (i + 1) / eval_points)) for i in range(eval_points)}
                        if eval_points else set())
        self.eval_cost_s: Optional[float] = None
        """The last evaluation's seconds on rank 0 (what `_auto_wants_eval` plans with)."""
        self.ckpt_every = checkpoint_period(cfg.checkpoint_every) if cfg.checkpoint_every else None
        self.monitor = (evaluation.Monitor(cfg.monitor or ("val_loss" if getattr(data, "val", None) is not None
                                                           else "test_loss"), cfg.early_stop)
                        if cfg.monitor or cfg.early_stop or cfg.save_best else None)
        self.stopped_early: Optional[int] = None
        """The step at which --early-stop ended the run, or None."""
        self.t_entry = t_entry if t_entry is not None else time.perf_counter()
        self.setup_s = None
        self.area = 0.0
        """Loss area so far, summed as runs.loss_area sums it (so the last value equals it)."""
        m = strategy.noise
        self.noise = noise.NoiseTracker(m.b_small, m.b_big, m.n_train, m.every) if m is not None and self.lead else None
        """Rank 0's noise-scale estimates (--noise-scale): rank 0 holds the averaged gradient."""
        self.start_step = self._resume() if cfg.resume else 0
        # Resumed from step 0 (no checkpoint): the old rows go, the step-0 evaluation included.
        self.rundir = RunDir(cfg.out, cfg, keep_until=self.start_step if self.start_step > 0 else None) \
            if self.lead else None
        self.fault = Fault.from_env(resumed=self.start_step > 0)
        self.heartbeat = Heartbeat(env.rank, env.world_size, tag=env.job,
                                   store=worker_store() if env.job else None, timeout_s=cfg.timeout)
        self.prune = None
        if prune_key and self.lead:
            if worker_store() is not None:
                self.prune = Watch(worker_store(), prune_key)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> RunResult:
        try:
            with self.heartbeat.naming_the_cause():
                return self._run()
        finally:
            stepper = getattr(self, "stepper", None)
            if stepper is not None:
                stepper.close()
            self.heartbeat.stop()

    def _run(self) -> RunResult:
        cfg = self.cfg
        # Only for a --samples the user gave: a budget in epochs (the default's or --epochs) is
        # rounded down to whole steps as any epoch loop drops its last partial batch.
        if self.lead and cfg.samples is not None and self.budget % self.samples_per_step and self.start_step == 0:
            print(f"shmlearn: budget {self.budget} samples is not a multiple of "
                  f"{count(self.strategy.compute_ranks, 'worker')} x {cfg.batch_size}{f' x {cfg.accumulate}' * (cfg.accumulate > 1)}; running {self.steps} steps = "
                  f"{self.steps * self.samples_per_step} samples", flush=True)
        # After _resume (a graph captures the optimizer's tensors), before the clock starts.
        self.stepper = Stepper(model=self.model, strategy=self.strategy, optimizer=self.optimizer,
                               schedule=self.schedule, loader=self.loader, task=self.task, device=self.device,
                               opts=cfg,
                               timer=self.timer, rank=self.env.rank, world_size=self.env.world_size,
                               total_steps=self.steps, fault=self.fault, loss=self._train_loss(),
                               reached=lambda step: setattr(self.heartbeat, "step", step),
                               compute_loss=self.compute)
        if self.lead and self.stepper.note:
            print(f"shmlearn: {self.stepper.note}", flush=True)
        if self.lead:
            for line in self.stepper.kernel_notes:
                print(f"shmlearn: {line}", flush=True)
        bar = _progress(self.steps, self.start_step) if (self.lead and cfg.progress) else None
        if self.start_step == 0 and cfg.eval_at_start == "on":
            e0 = time.perf_counter()
            self._evaluate(step=0, train_s=0.0)
            self.eval_s += time.perf_counter() - e0  # an evaluation's cost, not setup's
        status, diverged = "completed", None
        resumed_s = self.step_times[-1] if self.step_times else 0.0
        t0 = time.perf_counter() - resumed_s - self.eval_s - self.checkpoint_s
        self.train_start_unix = time.time()  # summary.json: time to first step = this - process start + step 1
        if self.setup_s is None:  # data, model, strategy, graph capture: before the clock starts
            self.setup_s = time.perf_counter() - self.t_entry - self.eval_s
        prev_s = resumed_s
        for step in range(self.start_step, self.steps):
            done = step + 1
            ckpt_step = bool(self.ckpt_every and self.ckpt_every[1] == "steps" and done % self.ckpt_every[0] == 0)
            meets = self.stepper.meets_after(step) or done == self.steps or done in self.eval_at or ckpt_step
            if step > self.start_step:  # the first step may compile: not watched
                self.heartbeat.begin()
            self.stepper.run(step, meets)
            self.heartbeat.step = step  # this rank has reached step's sync (its compute is issued)
            if not meets:
                continue
            # A read: the losses of every step since the last one, and rank 0's requests.
            train_s = time.perf_counter() - t0 - self.eval_s - self.checkpoint_s
            want_eval = bool(cfg.eval_every and self.lead and train_s - self.last_eval_s >= cfg.eval_every) \
                or self._auto_wants_eval(done, train_s)
            want_ckpt = bool(self.ckpt_every and self.ckpt_every[1] == "seconds" and self.lead
                             and train_s - self.last_ckpt_s >= self.ckpt_every[0])
            want_stop = bool(self.prune and self.step_losses and self.prune.should_stop(self.area, train_s))
            win = self.stepper.read(done, want_eval, want_ckpt, want_stop)
            if win.bad is None:
                self.stepper.update()  # classic: sync and update only now that the loss is known finite
            train_s = time.perf_counter() - t0 - self.eval_s - self.checkpoint_s
            self._record(win, done, prev_s, train_s, bar)
            prev_s = train_s
            if win.bad is not None:
                status, diverged = "diverged", (win.bad[0], win.bad[1], float("nan"))
                break
            if win.want_stop and done < self.steps:
                status = "pruned"
                break
            if win.want_eval or done in self.eval_at:
                e0 = time.perf_counter()
                self._evaluate(step=done, train_s=train_s)
                self.last_eval_s = train_s
                self.eval_s += time.perf_counter() - e0
            if self.stopped_early is not None:  # --early-stop: every rank saw the same rows
                break
            if done < self.steps and (win.want_ckpt or ckpt_step):
                self._checkpoint(done, train_s)
        if bar is not None:
            bar.close()
        self.strategy.finish()
        if self.ckpt_every and status == "completed":
            self._checkpoint(len(self.step_losses), self.step_times[-1] if self.step_times else 0.0)
        return self._finish(status, diverged)

    def _record(self, win, done: int, prev_s: float, train_s: float, bar) -> None:
        """Keep the window's losses and times (steps between two reads get times interpolated
        between the reads: the device ran them back to back), write the due metrics lines."""
        span = max(done - win.first, 1)
        phases = None
        pairs = self.strategy.noise.read(win.first, len(win.losses)) if self.noise is not None else None
        for i, loss in enumerate(win.losses):
            step_done = win.first + i + 1
            t = prev_s + (train_s - prev_s) * (i + 1) / span
            if self.step_times:
                self.area += (t - self.step_times[-1]) * (self.step_losses[-1] + loss) / 2
            else:
                self.area += t * loss
            self.step_times.append(t)
            self.step_losses.append(loss)
            if pairs and step_done - 1 in pairs:  # a measured step (--noise-every)
                self.noise.add(step_done, *pairs[step_done - 1])
            if self.lead and (step_done % self.cfg.log_every == 0 or step_done == self.steps):
                if phases is None:
                    totals, timed = self.timer.take_window()
                    phases = {k: v / timed for k, v in totals.items() if k != "eval"} if timed else {}
                row = {"step": step_done, "samples": step_done * self.samples_per_step,
                       "time_s": round(t, 6), "loss": loss, "phase_s": phases}
                if self.noise is not None:
                    row["noise_scale"] = self.noise.log_point(step_done)
                lr = self.optimizer.param_groups[0]["lr"] if self.cfg.tensorboard else None
                self.rundir.log_metrics(row, lr=lr)
        if bar is not None and win.losses:
            bar.update(len(win.losses))
            acc = self.evals[-1]["test_accuracy"] if self.evals else None
            n = len(self.step_losses)
            bar.set_postfix(loss=f"{win.losses[-1]:.4f}", samples_s=f"{n * self.samples_per_step / max(train_s, 1e-9):.0f}",
                            acc="-" if acc is None else f"{acc:.4f}", refresh=False)

    # -- checkpoints (checkpoint.py) ------------------------------------------------------------
    def _history(self) -> dict:
        """What the loop has recorded: saved in checkpoints, summarized in summary.json."""
        return {k: getattr(self, k) for k in _HISTORY}

    def _checkpoint(self, step: int, train_s: float) -> None:
        """Every rank writes its file; after a barrier rank 0 marks the checkpoint complete."""
        c0 = time.perf_counter()
        self.last_ckpt_s = train_s
        state = ckpt.run_state(step, self.env.world_size, _agreed_fields(self.cfg), strategy=self.strategy,
                               optimizer=self.optimizer, schedule=self.schedule, device=self.device,
                               loop=self._history(), noise=self.noise)
        ckpt.save(self.cfg.out, step, self.env.rank, self.env.world_size, state, fault=self.fault)
        self.checkpoint_s += time.perf_counter() - c0

    def _resume(self) -> int:
        """Load the newest checkpoint that every rank can read; 0 if the run has none."""
        step, state = ckpt.resume(self.cfg.out, self.env.rank, self.env.world_size, self.device,
                                  _agreed_fields(self.cfg))
        if state is not None:
            loop = ckpt.restore(state, strategy=self.strategy, optimizer=self.optimizer, schedule=self.schedule,
                                device=self.device)
            for k, v in loop.items():
                setattr(self, k, v)
            if self.noise is not None and state.get("noise"):
                self.noise.load_state_dict(state["noise"])
            self.area = (loss_area([0.0] + self.step_times, self.step_losses[:1] + self.step_losses) or 0.0) \
                if self.step_losses else 0.0
        return step

    def _train_loss(self):
        """What the step minimizes: the user's loss, or the task's with --label-smoothing (None:
        the step's default, the task's plain loss). Evaluation keeps the plain loss."""
        if self.loss is not None or not self.cfg.label_smoothing:
            return self.loss
        task, smoothing = self.task, self.cfg.label_smoothing
        return lambda out, y: loss_fn(task, out, y, label_smoothing=smoothing)

    def _auto_wants_eval(self, done: int, train_s: float) -> bool:
        """Rank 0, with the default schedule: whether to evaluate now (evaluation.py)."""
        if not (self.auto_eval and self.lead):
            return False
        return evaluation.due(steps=self.steps, done=done, train_s=train_s, cost_s=self.eval_cost_s,
                              test_per_rank=self.data.n_test / self.env.world_size,
                              batch_size=self.cfg.batch_size * self.cfg.accumulate, eval_steps=[e["step"] for e in self.evals])

    @torch.no_grad()
    def _evaluate(self, *, step: int, train_s: float) -> None:
        """Full test set, once: rank r evaluates the r-th of W contiguous slices, sums are
        all-reduced, so no sample is skipped or counted twice."""
        t0 = time.perf_counter()
        row = {"step": step, "time_s": train_s, "samples": step * self.samples_per_step}
        with self.timer.phase("eval"), self.strategy.eval_weights():
            row.update(evaluation.evaluate(
                model=self.strategy.model, module=self.strategy.module, data=self.data, compute=self.compute,
                names=self.metric_names, loss=self.loss, task=self.task, rank=self.env.rank,
                world_size=self.env.world_size, device=self.device, normalize=self.normalize,
                autocast=self.stepper.autocast, batch_size=self.cfg.eval_batch_size, timeout_s=self.cfg.timeout))
            self.evals.append(row)
            if self.monitor is not None:  # --monitor: the best weights while they are the model's
                best, stop = self.monitor.update(self.evals)
                self.stopped_early = step if stop and step < self.steps else None
                if best and self.cfg.save_best and self.lead:
                    weights.save(self.cfg.out, self.strategy.model, self.data.spec, stem="best")
        self.eval_cost_s = time.perf_counter() - t0
        if hasattr(self.schedule, "evaluated"):  # ReduceLROnPlateau (recipe.OnEvaluation)
            self.schedule.evaluated(row)
        if self.lead:
            self.rundir.log_eval(row)

    def _start_lr(self):
        """The learning rate the run started at, as its optimizer had it (--lr is the built-in
        optimizers' only; a torch class or your own has its own)."""
        lrs = getattr(self, "start_lrs", None)
        return f"{lrs[0]:g}" if lrs else self.cfg.lr

    def _finish(self, status: str, diverged) -> RunResult:
        cfg, env = self.cfg, self.env
        events = self.timer.trace_events()
        step_fields = runs.step_fields(self.stepper)
        mine = (events, step_fields if self.strategy.computes else None)
        gathered = [None] * env.world_size if self.lead else None
        if env.world_size > 1:
            dist.gather_object(mine, gathered, dst=0)
        else:
            gathered = [mine]
        if gathered:
            # How the step ran is a computing rank's: a dedicated parameter server (rank 0) runs
            # no model step, compiles nothing and reads no batches.
            step_fields = next((f for _, f in gathered if f is not None), step_fields)
            gathered = [e for e, _ in gathered]
        summary = runs.summarize(
            cfg, status=status, diverged=diverged, history=self._history(), workers=self.strategy.compute_ranks,
            processes=env.world_size, launcher=env.launcher, streamed=isinstance(self.data, StreamedData),
            start_lrs=getattr(self, "start_lrs", None), builtin_optimizer=recipe.is_builtin_optimizer(cfg),
            budget=self.budget, samples_per_step=self.samples_per_step, planned_steps=self.steps,
            setup_s=self.setup_s, auto_eval=self.auto_eval, start_step=self.start_step,
            phase_s=self.timer.mean_per_step(), timing=runs.phase_timing(self.stepper, self.timer, self.device.type),
            step=step_fields, torch_version=torch.__version__,
            device=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            strategy=self.spec.summary(self.strategy), noise=self.noise.summary() if self.noise is not None else None,
            monitor=self.monitor.summary(self.evals, self.stopped_early) if self.monitor is not None else None)
        summary["train_start_unix"] = getattr(self, "train_start_unix", None)  # the clock's start, Unix seconds
        summary["chance_accuracy"] = runs.chance_accuracy(self.data.spec)  # the collapse rule's "ends at chance"
        if self.lead:
            save = cfg.save_model and status in ("completed", "pruned")
            runs.write_results(self.rundir, summary, chrome_trace(gathered),
                          (lambda: weights.save(cfg.out, self.strategy.model, self.data.spec)) if save else None)
        if diverged is not None:
            step, rank, _ = diverged
            raise Diverged(f"diverged: loss is not finite at step {step} on rank {rank} "
                           f"(lr {self._start_lr()}); run directory {cfg.out}", step=step, rank=rank)
        return RunResult(status=status, run_dir=cfg.out, summary=summary, model=self.model, rank=self.env.rank)


def _progress(total: int, initial: int = 0):
    from tqdm import tqdm
    # tqdm's default write lock holds a multiprocessing RLock: a named semaphore that a spawned
    # worker, which leaves with os._exit (launch._child), never unlinks, so Python's resource
    # tracker warned of a leaked semaphore at the end of every run. One process writes this bar:
    # a thread lock is all it needs.
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, initial=initial, desc="train", unit="step", mininterval=0.5, dynamic_ncols=True)

