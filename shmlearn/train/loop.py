"""THE training loop, shared by every strategy, experiment and sweep: one rank's run, from the
first step to summary.json.

    config -> launch (entry.py) -> (data, model, strategy: rank.py) -> this loop -> run directory

Per step: data -> compute (forward, backward) -> one small control all-reduce (loss, which ranks
saw a non-finite loss, whether rank 0 wants an evaluation) -> strategy.step (sync + update).
The control all-reduce is what keeps ranks in lockstep: every rank stops on a NaN at the same
step, before the bad gradient is applied, and evaluates at the same steps.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from shmlearn.config.train_config import checkpoint_period
from shmlearn.data import Dataset, normalizer
from shmlearn.errors import Diverged, count
from shmlearn.launch.pool import worker_store
from shmlearn.record import runs, weights
from shmlearn.record.runs import RunDir, loss_area
from shmlearn.record.timing import PhaseTimer, chrome_trace
from shmlearn.step.fast import Stepper
from shmlearn.sweeps.pruning import Watch
from shmlearn.sync import SyncStrategy, registry
from shmlearn.train import checkpoint as ckpt
from shmlearn.train import evaluation, noise
from shmlearn.train.eval_graph import EvalGraph, for_step
from shmlearn.train.inputs import host_fed
from shmlearn.train.guard import Fault, Heartbeat
from shmlearn.train.result import RunResult, gather_ranks
from shmlearn.user import recipe
from shmlearn.user.tasks import loss_fn

_HISTORY = ("step_times", "step_losses", "step_cpu_s", "step_thread_cpu_s", "evals", "eval_s", "checkpoint_s",
            "last_eval_s", "last_ckpt_s")
"""The Loop fields a checkpoint keeps (its "loop" entry, in this order) and a resumption restores."""


def cpu_clocks() -> Tuple[float, float]:
    """(this process's, this thread's) CPU seconds so far: what a step's CPU time is read on."""
    return time.process_time(), time.thread_time()


def start_lr(start_lrs: Optional[List[float]], cfg) -> str:
    """The learning rate a run started at, as its optimizer had it (--lr is the built-in
    optimizers' only; a torch class or your own has its own)."""
    return f"{start_lrs[0]:g}" if start_lrs else str(cfg.lr)


class Loop:
    """State of one rank's training run; `run()` is the loop itself (rank.py builds its parts)."""

    def __init__(self, cfg, env, data: Dataset, model, strategy: SyncStrategy, optimizer, schedule,
                 loader, steps, budget, device, prune_key: Optional[str] = None, t_entry: Optional[float] = None,
                 loss=None, spec: Optional[registry.Spec] = None, compute_loss=None, metric_names=(),
                 start_lrs: Optional[List[float]] = None):
        self.cfg, self.env, self.data, self.model, self.strategy = cfg, env, data, model, strategy
        self.spec = spec if spec is not None else registry.spec(cfg)
        self.loss = loss
        """The user's f(outputs, targets) -> mean loss, or None: the task's (tasks.loss_fn)."""
        self.compute, self.metric_names = compute_loss, tuple(metric_names)
        """The general contract: the user's compute_loss(model, batch) and the metrics it returns."""
        self.optimizer, self.schedule = optimizer, schedule
        self.start_lrs = start_lrs
        """Each parameter group's learning rate before the first step (summary.json's start_lrs)."""
        self.loader, self.steps, self.budget, self.device = loader, steps, budget, device
        self.task = data.spec.task
        self.normalize = normalizer(data, device)
        self.timer = PhaseTimer(device, env.rank)
        self.lead = env.rank == 0
        self.step_times: List[float] = []
        self.step_losses: List[float] = []
        self.step_cpu_s, self.step_thread_cpu_s = [], []
        """CPU seconds of each step (`cpu_clocks`): the process's, all threads, and the training
        thread's alone (its compute, without Gloo's threads). Another job on the cores slows a
        step's wall clock but does not add to these: winners.py prices the steps axis with them.
        A checkpoint from before they were kept resumes with the later steps' only."""
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
        self.train_start_unix: Optional[float] = None
        """When the clock started, Unix seconds (summary.json: time to first step)."""
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
        self.stepper: Optional[Stepper] = None
        """The step (step/fast.py), built by `_run` after a resumption and before the clock starts."""
        self.eval_graph: Optional[EvalGraph] = None  # the test pass's CUDA graph (eval_graph.py), made with the step
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
            if self.stepper is not None:
                self.stepper.close()
            self.heartbeat.stop()

    def _run(self) -> RunResult:
        cfg = self.cfg
        # Only for a --samples the user gave: a budget in epochs (the default's or --epochs) is
        # rounded down to whole steps as any epoch loop drops its last partial batch.
        if self.lead and cfg.samples is not None and self.budget % self.samples_per_step and self.start_step == 0:
            micro = f" x {cfg.accumulate}" if cfg.accumulate > 1 else ""
            print(f"shmlearn: budget {self.budget} samples is not a multiple of "
                  f"{count(self.strategy.compute_ranks, 'worker')} x {cfg.batch_size}{micro}; "
                  f"running {self.steps} steps = {self.steps * self.samples_per_step} samples", flush=True)
        # After _resume (a graph captures the optimizer's tensors), before the clock starts.
        self.stepper = Stepper(model=self.model, strategy=self.strategy, optimizer=self.optimizer,
                               schedule=self.schedule, loader=self.loader, task=self.task, device=self.device,
                               opts=cfg,
                               timer=self.timer, rank=self.env.rank, world_size=self.env.world_size,
                               total_steps=self.steps, fault=self.fault,
                               loss=train_loss(self.loss, self.task, cfg.label_smoothing),
                               reached=lambda step: setattr(self.heartbeat, "step", step),
                               compute_loss=self.compute)
        self.eval_graph = for_step(self.stepper, self.device) if self.compute is None else None
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
        cpu0 = cpu_clocks()
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
            self._record(win, done, prev_s, train_s, bar, cpu0)
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
            cpu0 = cpu_clocks()  # a window's CPU: its steps' only (not logging, evaluation or saving)
        if bar is not None:
            bar.close()
        self.strategy.finish()
        if self.ckpt_every and status == "completed":
            self._checkpoint(len(self.step_losses), self.step_times[-1] if self.step_times else 0.0)
        return self._finish(status, diverged)

    def _record(self, win, done: int, prev_s: float, train_s: float, bar, cpu0: Tuple[float, float]) -> None:
        """Keep the window's losses and times (steps between two reads get times interpolated
        between the reads: the device ran them back to back; its CPU seconds since `cpu0` are
        shared alike), write the due metrics lines."""
        cpu_s = [b - a for a, b in zip(cpu0, cpu_clocks())]
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
            self.step_cpu_s.append(cpu_s[0] / span)
            self.step_thread_cpu_s.append(cpu_s[1] / span)
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
            samples_s = len(self.step_losses) * self.samples_per_step / max(train_s, 1e-9)
            bar.set_postfix(loss=f"{win.losses[-1]:.4f}", samples_s=f"{samples_s:.0f}",
                            acc="-" if acc is None else f"{acc:.4f}", refresh=False)

    # -- checkpoints (checkpoint.py) ------------------------------------------------------------
    def _history(self) -> dict:
        """What the loop has recorded: saved in checkpoints, summarized in summary.json."""
        return {k: getattr(self, k) for k in _HISTORY}

    def _checkpoint(self, step: int, train_s: float) -> None:
        """Every rank writes its file; after a barrier rank 0 marks the checkpoint complete."""
        c0 = time.perf_counter()
        self.last_ckpt_s = train_s
        state = ckpt.run_state(step, self.env.world_size, ckpt.agreed_fields(self.cfg), strategy=self.strategy,
                               optimizer=self.optimizer, schedule=self.schedule, device=self.device,
                               loop=self._history(), noise=self.noise)
        ckpt.save(self.cfg.out, step, self.env.rank, self.env.world_size, state, fault=self.fault)
        self.checkpoint_s += time.perf_counter() - c0

    def _resume(self) -> int:
        """Load the newest checkpoint that every rank can read; 0 if the run has none."""
        step, state = ckpt.resume(self.cfg.out, self.env.rank, self.env.world_size, self.device,
                                  ckpt.agreed_fields(self.cfg))
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

    def _auto_wants_eval(self, done: int, train_s: float) -> bool:
        """Rank 0, with the default schedule: whether to evaluate now (evaluation.py)."""
        if not (self.auto_eval and self.lead):
            return False
        return evaluation.due(steps=self.steps, done=done, train_s=train_s, cost_s=self.eval_cost_s,
                              test_per_rank=self.data.n_test / self.env.world_size,
                              batch_size=self.cfg.batch_size * self.cfg.accumulate,
                              eval_steps=[e["step"] for e in self.evals])

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
                autocast=self.stepper.autocast, batch_size=self.cfg.eval_batch_size, timeout_s=self.cfg.timeout,
                graph=self.eval_graph))
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

    def _finish(self, status: str, diverged) -> RunResult:
        """Every rank: hand rank 0 the trace and how the step ran; rank 0 writes summary.json,
        the trace and the weights. Raises Diverged on every rank of a diverged run."""
        cfg, env = self.cfg, self.env
        own_step = self.stepper.summary()
        traces, step = gather_ranks(self.timer.trace_events(), own_step, computes=self.strategy.computes,
                                    rank=env.rank, world_size=env.world_size)
        summary = runs.summarize(
            cfg, status=status, diverged=diverged, history=self._history(), workers=self.strategy.compute_ranks,
            processes=env.world_size, launcher=env.launcher, streamed=host_fed(self.data),
            start_lrs=self.start_lrs, builtin_optimizer=recipe.is_builtin_optimizer(cfg),
            budget=self.budget, samples_per_step=self.samples_per_step, planned_steps=self.steps,
            setup_s=self.setup_s, auto_eval=self.auto_eval, start_step=self.start_step,
            phase_s=self.timer.mean_per_step(), timing=runs.phase_timing(own_step, self.timer, self.device.type),
            step=step, torch_version=torch.__version__,
            device=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            strategy=self.spec.summary(self.strategy), noise=self.noise.summary() if self.noise is not None else None,
            monitor=self.monitor.summary(self.evals, self.stopped_early) if self.monitor is not None else None)
        summary["train_start_unix"] = self.train_start_unix  # the clock's start, Unix seconds
        summary["chance_accuracy"] = runs.chance_accuracy(self.data.spec)  # the collapse rule's "ends at chance"
        if self.lead:
            save = cfg.save_model and status in ("completed", "pruned")
            runs.write_results(self.rundir, summary, chrome_trace(traces),
                               (lambda: weights.save(cfg.out, self.strategy.model, self.data.spec)) if save else None)
        if diverged is not None:
            step, rank, _ = diverged
            raise Diverged(f"diverged: loss is not finite at step {step} on rank {rank} "
                           f"(lr {start_lr(self.start_lrs, cfg)}); run directory {cfg.out}", step=step, rank=rank)
        return RunResult(status=status, run_dir=cfg.out, summary=summary, model=self.model, rank=self.env.rank)


def train_loss(loss, task: str, label_smoothing: float):
    """What the step minimizes: the user's loss, or the task's with --label-smoothing (None: the
    step's default, the task's plain loss). Evaluation keeps the plain loss."""
    if loss is not None or not label_smoothing:
        return loss
    return lambda out, y: loss_fn(task, out, y, label_smoothing=label_smoothing)


def _progress(total: int, initial: int = 0):
    from tqdm import tqdm
    # tqdm's default write lock holds a multiprocessing RLock: a named semaphore that a spawned
    # worker, which leaves with os._exit (launch._child), never unlinks, so Python's resource
    # tracker warned of a leaked semaphore at the end of every run. One process writes this bar:
    # a thread lock is all it needs.
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, initial=initial, desc="train", unit="step", mininterval=0.5, dynamic_ncols=True)

