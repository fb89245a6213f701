"""The run directory: the output contract that tests, sweeps and reports read
(docs/architecture.md, "The output contract").

    config.yaml    the resolved TrainConfig
    metrics.jsonl  one line per logged step: step, samples, time_s, loss, phase_s
    eval.jsonl     one line per evaluation: step, time_s, samples, test_loss, test_accuracy
    summary.json   the run's result (see `summarize`)
    trace.json     Chrome trace of every rank's phases (opens in Perfetto)
    tensorboard/   with --tensorboard: the same curves as TensorBoard event files (tblog.py)

Only rank 0 writes, through safe_write: no file is written through a symlink that leads out of
the run directory, and whole files (config.yaml, summary.json, trace.json) are written atomically
(temp file + rename): a reader never sees half of one. JSONL lines are flushed as they are
written, so a killed run keeps its curve. summary.json is written last.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional


from shmlearn.record import readback

from shmlearn.record import safe_write, yaml_io
from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput
from shmlearn.record.metrics import metric_goal
from shmlearn.record.tblog import TensorBoardLog
from shmlearn.step.summary import StepSummary

RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "summary.json", "trace.json")
SWEEP_FILES = ("results.jsonl", "sweep.json", "winners.json", "trials", "experiment.json")
"""What marks a sweep's, study's or experiment's folder: a run is not written into one (nor they into a run's)."""


def default_run_dir(cfg: TrainConfig, workers: int, claim: bool = False) -> str:
    """runs/STAMP-MODEL-DATASET-STRATEGY-wN. claim: create it now, taking the first of NAME,
    NAME-2, NAME-3, ... that no one has (two runs started in the same second each get their
    own); without claim (the ranks of a launcher's job, which must agree) the plain name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join("runs", f"{stamp}-{_dir_word(cfg.model)}-{_dir_word(cfg.dataset)}-{cfg.strategy}-w{workers}")
    if not claim:
        return base
    k = 1
    while True:
        path = base if k == 1 else f"{base}-{k}"
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            k += 1
        except OSError as e:
            raise BadInput(f"--out {path}: cannot write there ({e.strerror})") from None


def _dir_word(name: str) -> str:
    """A model or dataset as part of one folder name: your own (`dir/own.py:Net`, `pkg.mod:load`,
    `python:ndarray arrays`) by its NAME, since the path's slashes would nest folders; other
    characters than letters, digits, '.', '_' and '-' become '-'. Built-in names stay as they are."""
    word = re.sub(r"[^A-Za-z0-9._-]+", "-", name.rpartition(":")[2]).strip("-.")
    return word or "own"


def check_out_dir(path: str) -> None:
    """Refuse to write over an earlier run, or into a sweep's folder: nothing already written is
    lost. lexists: a link in --out counts as there, even one whose target is missing."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"--out {path}: exists and is not a directory")
    check_links(path)
    if os.path.isdir(path) and any(os.path.lexists(os.path.join(path, f)) for f in RUN_FILES):
        raise BadInput(f"--out {path}: already holds a run; choose another directory")
    held = [f for f in SWEEP_FILES if os.path.lexists(os.path.join(path, f))]
    if held:
        raise BadInput(f"--out {path}: holds a sweep, study or experiment ({held[0]}); a run writes into a "
                       f"folder of its own: choose another directory")


def check_links(path: str) -> None:
    """BadInput naming it where a file a run writes in --out is a symlink leading out of --out:
    said before any worker starts, rather than when rank 0 opens the file."""
    for name in RUN_FILES + ("checkpoints", ".lock", "tensorboard"):
        safe_write.check(os.path.join(path, name), path)


def check_sweep_out(path: str) -> None:
    """A sweep's, study's or experiment's --out: refused where it holds one run (train's output),
    as `check_out_dir` refuses a run into a sweep's folder."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"--out {path}: exists and is not a directory")
    held = [f for f in RUN_FILES if os.path.lexists(os.path.join(path, f))]
    if held:
        raise BadInput(f"--out {path}: holds a training run ({held[0]}); a sweep, study or "
                       f"experiment writes into a folder of its own: choose another directory")


def finished(path: str) -> Optional[Dict[str, Any]]:
    """The summary.json of a run in `path` that ended (completed or diverged), or None: a run to
    continue (no summary: killed, or still to start). What --resume reads before anything is
    touched (checkpoint.finished); a damaged summary.json, config.yaml, metrics.jsonl or
    eval.jsonl is BadInput naming it (readback.resume_check), never resumed over."""
    return readback.resume_check(path)


def lock_dir(path: str, busy: str, *, shared: bool = False):
    """Take PATH/.lock with flock, exclusive (or shared), without waiting: the open file holds
    the lock (closing it lets go; it dies with the process, kill -9 included). Held by another
    process: BadInput(busy). PATH cannot be written: BadInput naming it. A run's --out, a
    sweep's and a study's all lock through here."""
    import fcntl
    try:  # never through a link (a .lock planted to point out of --out is refused, exit 2)
        f = safe_write.open_log(os.path.join(path, ".lock"), root=path, read=True)
    except OSError as e:
        raise BadInput(f"--out {path}: cannot write there ({e.strerror})") from None
    try:
        fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise BadInput(busy) from None
    return f


@contextmanager
def lock_out_dir(path: str) -> Iterator[None]:
    """Hold --out for one run: create it (exit 2, one line, if it cannot be) and take an
    exclusive lock on PATH/.lock, so a second run on the same --out is refused instead of
    interleaving its lines with ours."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BadInput(f"--out {path}: cannot write there ({e.strerror})") from None
    check_links(path)
    f = lock_dir(path, f"--out {path}: another run is writing there; choose another directory")
    # A fork of this process (a worker train() forks from its caller) closes its copy: flock's lock
    # belongs to the open file, which a fork shares, so a worker outliving a killed run by a moment
    # kept the next run on this --out out (as a sweep's did: sweeps/trials.py).
    os.register_at_fork(after_in_child=f.close)
    try:
        yield
    finally:
        f.close()


def finite_json(obj: Any) -> Any:
    """obj with every NaN or infinite float as None: JSON has no NaN (Python's bare `NaN` token
    is invalid JSON to every other reader), and these files say 'no value' with null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_json_atomic(path: str, obj: Any, root: Optional[str] = None) -> None:
    """`path` holds `obj` as indented JSON, whole or as it was (safe_write.write_json)."""
    safe_write.write_json(path, obj, root=root)


_published = False
"""Whether this process writes a run directory that another process publishes (`published`)."""


@contextmanager
def published() -> Iterator[None]:
    """Within: the run directory is written where its publisher moves it into place by one rename
    when the run ends (a sweep's trial: .tmp/ID-ATTEMPT -> trials/ID, sweeps/trials.py `done`), so
    its whole files (config.yaml, summary.json) are not fsynced here: the publisher fsyncs them
    before its rename (a folder that never got there is discarded, fsynced or not). Each fsync cost
    the trial 1-8 ms on the 2-core CPU's disk, three a trial (config.yaml, summary.json twice)."""
    global _published
    before, _published = _published, True
    try:
        yield
    finally:
        _published = before


class RunDir:
    def __init__(self, path: str, cfg: TrainConfig, *, keep_until: Optional[int] = None):
        """keep_until: resuming from this step; rows logged after it will be logged again, so
        they are dropped (a crash between log and checkpoint must not leave duplicates)."""
        self.path = path
        self.fsync = not _published
        """Whether whole files are fsynced here (else by the run directory's publisher: `published`)."""
        os.makedirs(path, exist_ok=True)
        # A link planted in --out that leads out is refused (BadInput, exit 2) before anything
        # is written or truncated.
        check_links(path)
        files = {n: os.path.join(path, n) for n in RUN_FILES}
        safe_write.write(files["config.yaml"], yaml_io.dump(cfg.to_dict()), root=path, fsync=self.fsync)
        if keep_until is not None:
            for name in ("metrics.jsonl", "eval.jsonl"):
                _truncate_after(files[name], keep_until, path)
            if os.path.lexists(files["summary.json"]):
                os.remove(files["summary.json"])  # describes the interrupted attempt, not this one
        fresh = keep_until is None
        self._metrics_path, self._eval_path = files["metrics.jsonl"], files["eval.jsonl"]
        self._metrics = safe_write.open_log(self._metrics_path, root=path, truncate=fresh)
        self._eval = safe_write.open_log(self._eval_path, root=path, truncate=fresh)
        self.tensorboard = TensorBoardLog(path, resumed_after=keep_until) if cfg.tensorboard else None

    def log_metrics(self, row: Dict[str, Any], lr: Any = None) -> None:
        """lr: for TensorBoard only (metrics.jsonl has no lr column)."""
        with _naming(self._metrics_path):
            self._metrics.write(json.dumps(row) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.metrics(row, lr)

    def log_eval(self, row: Dict[str, Any]) -> None:
        with _naming(self._eval_path):
            self._eval.write(json.dumps(finite_json(row), allow_nan=False) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.eval(row)

    def write_trace(self, trace: dict) -> None:
        # whole or absent, never torn; not fsynced: a view of the timings, rewritten by a rerun.
        # json.dumps, not json.dump: the same text, by the C encoder (json.dump's goes through the
        # pure-Python one) in about a third of the time (1,100 events, a 256-step trial's trace:
        # 7.2 -> 2.7 ms on a loaded 2-core CPU).
        with safe_write.atomic_file(os.path.join(self.path, "trace.json"), "w", root=self.path, fsync=False) as f:
            f.write(json.dumps(trace))

    def write_summary(self, summary: Dict[str, Any]) -> None:
        safe_write.write_json(os.path.join(self.path, "summary.json"), finite_json(summary), root=self.path,
                              fsync=self.fsync)

    def close(self) -> None:
        self._metrics.close()
        self._eval.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def loss_area(times: List[float], losses: List[float]) -> Optional[float]:
    """Trapezoid area under the training loss over training seconds (the paper's selection
    metric, seed 000): small when the loss falls low and falls fast."""
    if len(times) < 2:
        return None
    return sum((t1 - t0) * (l0 + l1) / 2 for t0, t1, l0, l1 in zip(times, times[1:], losses, losses[1:]))


def chance_accuracy(spec) -> Optional[float]:
    """The test accuracy of guessing (a data.DataSpec's): 1/classes, 0.5 for a binary task, None
    for regression. A run whose accuracy ends there collapsed (winners.collapsed)."""
    if spec.task == "classification" and spec.num_outputs > 1:
        return 1.0 / spec.num_outputs
    return 0.5 if spec.task == "binary" else None


def quantiles(d: List[float]) -> Optional[Dict[str, float]]:
    """{p10, p25, median, p75, n} of the values d (linear interpolation between order statistics,
    numpy's default); None for none."""
    d = sorted(d)
    if not d:
        return None

    def q(p: float) -> float:
        x = p * (len(d) - 1)
        i = int(x)
        return d[i] + (d[min(i + 1, len(d) - 1)] - d[i]) * (x - i)
    return {"p10": q(0.1), "p25": q(0.25), "median": q(0.5), "p75": q(0.75), "n": len(d)}


def step_clock(step_times: List[float], step_losses: List[float], step_cpu_s: Optional[List[float]] = None,
               step_thread_cpu_s: Optional[List[float]] = None) -> Dict[str, Any]:
    """summary.json's step clock (issue 55), what a verdict that does not drift with machine load
    reads: start_loss (the first step's loss, the collapse rule's reference), loss_area_steps
    (trapezoid area of the training loss over the step index: loss x steps; times a step's price
    it is the area on `--time-axis steps`) and the quantiles {p10, p25, median, p75, n} of three
    clocks per step: step_time_s, wall seconds (steps read together on the device share their
    window's time; the interquartile spread is the run's timing noise); step_cpu_s, the process's
    CPU seconds (all threads); step_thread_cpu_s, the training thread's. Another job on the cores
    stretches the first, not the other two: they price the steps axis on a CPU (winners.py)."""
    finite = [x for x in step_losses if math.isfinite(x)]
    return {"start_loss": finite[0] if finite else None,
            "loss_area_steps": loss_area(list(range(len(step_losses) + 1)),
                                         step_losses[:1] + step_losses) if finite else None,
            "step_time_s": quantiles([t1 - t0 for t0, t1 in zip([0.0] + step_times, step_times)]),
            "step_cpu_s": quantiles(step_cpu_s or []), "step_thread_cpu_s": quantiles(step_thread_cpu_s or [])}


@contextmanager
def _naming(path: str) -> Iterator[None]:
    """An OSError while writing (a full disk) names the file: a write error carries no path."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, f"{e.strerror} (writing {path})") from e
        raise


def _truncate_after(path: str, step: int, root: str) -> None:
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                break  # a torn last line from a kill
    safe_write.write(path, "".join(keep), root=root)


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    """A run's JSON-lines file through the one reader (readback.read_jsonl): a line torn by a
    kill is dropped, anything else malformed (or a missing file) is BadInput naming it."""
    return readback.read_jsonl(path)


# -- summary.json: what one run's training loop (train/loop.py) hands over ---------------------------

def phase_timing(step: StepSummary, timer, device_type: str) -> str:
    """summary.json's phase_timing: how phase_s was measured (step: the rank's Stepper.summary();
    timer: the PhaseTimer)."""
    how = "CUDA events" if device_type == "cuda" else "perf_counter"
    if step.step_mode == "cuda-graph":
        return (f"{how} on {timer.timed_steps} eager steps (one in {step.phase_sample_every}); "
                f"the other {timer.steps - timer.timed_steps} were CUDA graph replays")
    return f"{how} on every step"


def summarize(cfg: TrainConfig, *, status: str, diverged, history: Dict[str, Any], workers: int, processes: int,
              launcher: str, streamed: bool, start_lrs, builtin_optimizer: bool, budget: int, samples_per_step: int,
              planned_steps: int, setup_s, auto_eval: bool, start_step: int, phase_s, timing: str,
              step: StepSummary, device: str, torch_version: str, strategy: Dict[str, Any],
              noise: Optional[Dict[str, Any]], monitor: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """summary.json (DESIGN.md's output contract). history: the loop's step_times, step_losses
    (one per step done), evals (eval.jsonl's rows), eval_s and checkpoint_s; diverged: (step,
    rank, loss) or None; step: how a computing rank's step ran (Stepper.summary()); timing:
    `phase_timing`; strategy: the strategy's own fields (registry.Spec.summary); noise: the
    noise-scale tracker's, or None."""
    step_times, step_losses, evals = history["step_times"], history["step_losses"], history["evals"]
    steps_done = len(step_losses)
    wall = step_times[-1] if step_times else 0.0
    finite = [x for x in step_losses if math.isfinite(x)]
    accs = [e["test_accuracy"] for e in evals if e["test_accuracy"] is not None]
    summary = {
        "status": status, "strategy": cfg.strategy, "workers": workers,
        "processes": processes, "launcher": launcher, "model": cfg.model,
        "dataset": cfg.dataset, "data_path": "stream" if streamed else "resident",
        "optimizer": cfg.optimizer, "optimizer_args": cfg.optimizer_args,
        "scheduler": cfg.scheduler, "scheduler_args": cfg.scheduler_args,
        "scheduler_interval": cfg.scheduler_interval if cfg.scheduler else None,
        "lr_schedule": (cfg.lr_schedule if builtin_optimizer else "none") if not cfg.scheduler
        else "scheduler", "loss": cfg.compute_loss or cfg.loss or "task", "start_lrs": start_lrs,
        "batch_size": cfg.batch_size, "accumulate": cfg.accumulate, "clip_grad_norm": cfg.clip_grad_norm,
        "lr": cfg.lr, "seed": cfg.seed, "budget_samples": budget,
        "samples_seen": steps_done * samples_per_step, "steps": steps_done,
        "planned_steps": planned_steps, "wall_time_s": wall, "eval_time_s": history["eval_s"],
        "checkpoint_time_s": history["checkpoint_s"], "setup_time_s": setup_s,
        "evaluations": len(evals), "eval_at_start": cfg.eval_at_start,
        "eval_schedule": "auto" if auto_eval else ("points" if cfg.eval_points else "every"),
        "resumed_from_step": start_step or None,
        "final_loss": (sum(finite[-10:]) / len(finite[-10:])) if finite else None,
        "min_loss": min(finite) if finite else None,
        "loss_area": loss_area([0.0] + step_times, step_losses[:1] + step_losses)
        if status in ("completed", "pruned") else None,
        **step_clock(step_times, step_losses, history.get("step_cpu_s"), history.get("step_thread_cpu_s")),
        "test_loss": evals[-1]["test_loss"] if evals else None,
        "test_accuracy": evals[-1]["test_accuracy"] if evals else None,
        "best_test_accuracy": max(accs) if accs else None,
        "samples_per_s": steps_done * samples_per_step / wall if wall > 0 else None,
        "phase_s": phase_s,
        "phase_timing": timing,
        "precision": cfg.precision, "channels_last": cfg.channels_last, "augment": cfg.augment,
        **step.fields(),
        "device": device,
        "torch_version": torch_version,
        **strategy,  # strategy_params, and the strategy's own fields
    }
    if cfg.compute_loss is not None and evals:
        summary.update(eval_metrics(evals))
    if monitor is not None:  # --monitor / --early-stop / --save-best (evaluation.Monitor)
        summary.update(monitor)
    if noise is not None:
        summary.update(noise)
    if diverged is not None:
        d_step, d_rank, _ = diverged
        summary.update(diverged_step=d_step, diverged_rank=d_rank)
    summary["weights"] = None
    return summary


def eval_metrics(evals) -> Dict[str, Any]:
    """The general contract's evaluation in summary.json: the last evaluation's val_/test_ loss and
    metrics as they are, and the best value of each over the run (best_val_loss, best_test_NAME:
    the least for a loss, the least or most for a metric as `metric_goal` says)."""
    last = {k: v for k, v in evals[-1].items() if k.startswith(("test_", "val_")) and v is not None}
    out = dict(last)
    for k in last:
        values = [e[k] for e in evals if e.get(k) is not None and math.isfinite(e[k])]
        if values:
            out[f"best_{k}"] = (max if metric_goal(k) == "max" else min)(values)
    return out


def write_results(rundir: RunDir, summary: Dict[str, Any], trace: Any, save_weights=None) -> None:
    """Rank 0: the summary first (it is the result), the trace (a view of the timings), then the
    weights, the largest file (save_weights() -> their summary entry; on a full disk the summary
    is already there), then the summary again, naming them; then the run directory is closed."""
    rundir.write_summary(summary)
    rundir.write_trace(trace)
    if save_weights is not None:
        summary["weights"] = save_weights()
        rundir.write_summary(summary)
    rundir.close()
