"""The trial runner that the grid sweep (sweep.Sweep) and the Optuna study (study.StudySweep) share.

    driver (which trial next) --start--> the pool (pool.py) --done--> the run directory,
      published by one rename -> record: one row (save), a progress line, the pruning bounds

A driver subclasses TrialRunner and overrides only its public hooks (lock, run_trials,
attempt_dir, prune_key, bounds, post_bounds, save, pruned_why); everything else here is the same
for both: the checks before anything starts, the slots a trial holds, starting a trial on the pool,
what a trial's end means (recorded, retried once, or failed), adopting a trial that finished before
the last sweep was stopped, timing.json, and the winners and report at the end.
"""
from __future__ import annotations

import abc
import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from shmlearn.record import jsonl

from shmlearn.record import readback

from shmlearn.record import safe_write

from shmlearn.sweeps import winners
from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput, Diverged, WorkerFailed, count
from shmlearn.launch.start import detect_env
from shmlearn.config.limits import usable_cores
from shmlearn.launch import lean
from shmlearn.launch.pool import Pool
from shmlearn.sweeps.results import ResultStore, pick_winners, winner_goal, winners_table
from shmlearn.sweeps.results import fmt as _fmt
from shmlearn.record.runs import check_sweep_out, lock_dir, read_jsonl, write_json_atomic
from shmlearn.sweeps.grid import (NOT_SWEPT, SweepConfig, check_verdict, expand_grid, ordered_axes, trial_id,
                                 trials_at_once, with_repeats)
from shmlearn.sync import registry
from shmlearn.train.entry import trial_main
from shmlearn.train.inputs import preload_data
from shmlearn.user import user_main

TRIAL_TIMES = "sweep_times.json"
"""In a trial's run directory: {elapsed_s, group_s}, as the sweep that ran it measured them."""


@dataclass
class Running:
    """One attempt of a trial on the pool."""
    cfg: TrainConfig
    tid: str
    job: Any
    slots: List[int]
    tmp: str
    t0: float
    attempt: int
    t0_unix: float = 0.0
    """When it started, in unix seconds (timing.json's per-trial start, beside the marks)."""


class TrialRunner(abc.ABC):
    """One sweep directory and the trials run in it, by this process, on one pool."""

    def __init__(self, sc: SweepConfig):
        self.sc = sc
        self.dir = sc.out
        self.trials_dir = os.path.join(self.dir, "trials")
        self.tmp_dir = os.path.join(self.trials_dir, ".tmp")
        self.store = ResultStore(os.path.join(self.dir, "results.jsonl"))
        self.failures: List[Tuple[str, str]] = []
        self.done_now = 0
        self.ran_rows: List[Dict[str, Any]] = []
        self.pool = None
        self.report_failed = False
        self.metric_missing: Optional[str] = None
        """winners' metric_missing: no completed trial reports --winner-metric (exit_code says so)."""
        self.total = self.finished = 0
        self._mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.point_of: Dict[str, Tuple[str, int]] = {}  # --repeats: trial id -> (its point's id, repeat k)
        self.marks: Dict[str, float] = {}
        """Unix seconds at which this invocation reached each phase (mark), timing.json's `marks`:
        where a sweep's seconds go besides training (benchmarks/start.py reads them)."""
        self.timing: Optional[Dict[str, Any]] = None  # timing.json as written (write_timing)
        self.report_helper = None
        """A report.helper.ReportHelper that draws the report (the program's sweeps), or None: here."""

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()

    # -- hooks: a driver overrides these -------------------------------------------------------
    @abc.abstractmethod
    def run_trials(self, trials: List[TrainConfig]) -> int:
        """Run the driver's trials (the grid's `trials` bound the study's space); the exit code."""

    def lock(self):
        return lock_dir(self.dir, f"--out {self.dir}: another sweep (or study) is running in this directory")

    def attempt_dir(self, tid: str, attempt: int) -> str:
        """Where attempt `attempt` of trial `tid` runs before it is published under trials/."""
        return os.path.join(self.tmp_dir, f"{tid}-{attempt}")

    def prune_key(self, cfg: TrainConfig, tid: str) -> Optional[str]:
        """Where the trial's rank 0 reads its pruning bound, or None: it is not pruned."""
        return None

    def bounds(self) -> Dict[int, Tuple[float, Optional[float]]]:
        """Per worker count: (least area of a finished survivor, least time to the target)."""
        return {}

    def post_bounds(self) -> None:
        """A trial finished: post the pruning bounds where running trials read them."""

    @abc.abstractmethod
    def save(self, row: Dict[str, Any]) -> None:
        """Keep a finished trial's row (results.jsonl, or the study)."""

    def pruned_why(self, row: Dict[str, Any]) -> str:
        return f"area so far {row['summary']['loss_area']:.4g} > best {row['pruned']['bound_area']:.4g}"

    # -- setup ---------------------------------------------------------------------------------
    def need(self, cfg: TrainConfig) -> int:
        """Slots a trial holds: a GPU per process, or a core per thread of each process."""
        procs = registry.spec(cfg).processes(cfg.workers)
        return procs if self.cuda else procs * (cfg.threads or 1)

    def procs(self, cfg: TrainConfig) -> int:
        return registry.spec(cfg).processes(cfg.workers)

    def run(self) -> int:
        if detect_env() is not None:
            raise BadInput("sweep: started under torchrun/mpirun/srun; run it directly, it starts its own trials")
        if self.sc.parallel is not None and self.sc.parallel < 1:
            raise BadInput(f"--parallel {self.sc.parallel}: expected a whole number > 0")
        if self.sc.slots is not None and self.sc.slots < 1:
            raise BadInput(f"--slots {self.sc.slots}: expected a whole number > 0")
        check_sweep_out(self.dir)  # not a file, not a training run's folder
        # A damaged sweep.json is refused (one line naming it) before this run rewrites it.
        readback.sweep_spec(self.dir)
        check_verdict(self.sc)
        self.cuda, self.nslots = find_slots(self.sc)
        self.parallel = trials_at_once(self.sc.parallel, self.cuda, self.nslots)
        """Trials at once (SweepConfig.parallel, resolved for this machine)."""
        trials = expand_grid(self.sc.fixed, self.sc.axes, cuda=self.cuda)
        trials, self.point_of = with_repeats(trials, self.sc.repeats)  # the verdict merges them (winners.py)
        if self.cuda:
            import torch
            big = max(self.procs(c) for c in trials)
            if big > torch.cuda.device_count():
                raise BadInput(f"--workers: a trial needs {big} processes, one GPU each; "
                               f"{torch.cuda.device_count()} GPUs present")
        try:  # trials/ or trials/.tmp a link out of --out: refused before anything is made through it
            safe_write.makedirs(self.trials_dir, root=self.dir)
            safe_write.check(self.tmp_dir, self.dir)
        except OSError as e:
            raise BadInput(f"--out {self.dir}: cannot write there ({e.strerror})") from None
        self.mark("checked")
        lock = self.lock()
        # A fork of this process (a pool worker forked from it, a report's drawing copy) closes its
        # copy: flock's lock belongs to the open file, which a fork shares, so a worker outliving a
        # killed sweep by a moment kept the next sweep in this folder out.
        os.register_at_fork(after_in_child=lock.close)
        try:
            return self.run_trials(trials)
        except OSError as e:
            if e.errno not in jsonl.FULL:
                raise
            where = f": {e.filename}" if e.filename else ""
            raise BadInput(f"--out {self.dir}: the disk is full ({e.strerror}{where}); the results so far are in "
                           f"results.jsonl: free space and run the same command again") from None
        finally:
            lock.close()

    def write_spec(self, trials: List[TrainConfig], extra: Optional[Dict[str, Any]] = None) -> None:
        write_json_atomic(os.path.join(self.dir, "sweep.json"), {
            "command": sys.argv, "fixed": self.sc.fixed, "axes": self.sc.axes,
            "axis_order": ordered_axes(self.sc.axes), "threshold": self.sc.threshold,
            "target_accuracy": self.sc.target_accuracy, "target_share": self.sc.target_share,
            "time_axis": self.sc.time_axis, "repeats": self.sc.repeats, "winner_metric": self.sc.winner_metric,
            "winner_goal": sweep_goal(self.sc), "parallel": self.parallel, "prune": self.sc.prune,
            "slots": self.nslots, "device": "cuda" if self.cuda else "cpu",
            "trials": [trial_id(c) for c in trials], **(extra or {})})

    # -- the pool --------------------------------------------------------------------------------
    def open_pool(self, configs: List[TrainConfig], widest: int, *, warm_report: bool = False) -> None:
        """One pool of long-lived workers for every trial (pool.py): the processes, their imports,
        the dataset on the device and each rank set's process group outlive a trial, so a trial
        costs its training, not a start-up. Every worker the trials can use starts now: they
        import in parallel with the first trial."""
        _open_pool(self, configs, widest, warm_report)

    def slots_for(self, cfg: TrainConfig, free: List[int], busy: bool) -> Optional[int]:
        """Slots the trial takes now, or None: it waits (in order: none jumps the queue, so none
        starves). A trial larger than the machine waits until nothing else runs."""
        need = min(self.need(cfg), self.nslots)
        if need > len(free) or (self.need(cfg) > self.nslots and busy):
            return None
        return need

    def start(self, cfg: TrainConfig, slots: List[int], attempt: int) -> Running:
        """Rank r runs on the worker of its first slot and, on CPU, is pinned to its T slots'
        cores. A trial larger than the machine runs alone on workers 0..P-1, unpinned."""
        tid = trial_id(cfg)
        tmp = self.attempt_dir(tid, attempt)
        cfg = dataclasses.replace(cfg, out=tmp)
        procs = self.procs(cfg)
        per = 1 if self.cuda else (cfg.threads or 1)
        if self.need(cfg) <= self.nslots:
            workers = [slots[r * per] for r in range(procs)]
            cores = None if self.cuda else [self._cores(slots[r * per:(r + 1) * per]) for r in range(procs)]
        else:
            workers, cores = list(range(procs)), None
        try:
            with safe_write.open_log(tmp + ".log", root=self.dir) as f:
                f.write(f"sweep: trial on {'GPUs' if self.cuda else 'cores'} "
                        f"{slots if self.cuda or cores is None else [c for cs in cores for c in cs]}\n")
        except OSError as e:  # a full disk: a write error carries no path
            raise OSError(e.errno, e.strerror, tmp + ".log") from None
        job = self.pool.start(trial_main, (cfg.to_dict(), self.prune_key(cfg, tid)), slots=workers,
                              backend="nccl" if self.cuda else "gloo", timeout_s=cfg.timeout,
                              cores=cores, log=tmp + ".log")
        return Running(cfg, tid, job, slots, tmp, time.monotonic(), attempt, time.time())

    def _cores(self, slots: List[int]) -> Optional[List[int]]:
        if not hasattr(os, "sched_getaffinity"):
            return None
        mine = sorted(self._mine)
        return [mine[s % len(mine)] for s in slots]

    def done(self, r: Running, job, ended: Optional[float] = None) -> bool:
        """A trial's job ended (at `ended`, time.monotonic(); default now): record it, or say it
        failed. Returns True to retry it once."""
        try:
            job.results()
            status, text = "completed", ""
        except Diverged as e:
            status, text = "diverged", str(e)
        except BadInput as e:
            status, text = "bad_input", str(e)
        except WorkerFailed as e:
            status, text = "failed", str(e)
        if status in ("completed", "diverged") and os.path.exists(os.path.join(r.tmp, "summary.json")):
            final = os.path.join(self.trials_dir, r.tid)
            os.replace(r.tmp + ".log", os.path.join(r.tmp, "log.txt"))
            # What only this process measured goes with the run directory: a sweep that dies
            # between publishing and recording it is adopted by the next with its times.
            elapsed, group_s = (ended or time.monotonic()) - r.t0, job.group_s()
            _seal(r.tmp, final)
            write_json_atomic(os.path.join(r.tmp, TRIAL_TIMES), {"elapsed_s": elapsed, "group_s": group_s})
            try:
                os.rename(r.tmp, final)  # the run directory appears whole, or not at all
            except OSError:
                if not os.path.isfile(os.path.join(final, "summary.json")):
                    raise
                # A study's other process published the same trial first (it took this one as
                # lost, or this one took its): that run directory counts, this one goes.
                shutil.rmtree(r.tmp, ignore_errors=True)
            self.record(r.cfg, r.tid, final, elapsed, group_s=group_s, start_unix=r.t0_unix)
            return False
        text = text or "no summary.json written"
        if status == "failed" and r.attempt < 2:
            print(f"sweep: {r.tid} failed ({text}); retrying once", file=sys.stderr, flush=True)
            return True
        self.failures.append((r.tid, f"{text} (log {r.tmp}.log)"))
        self.finished += 1
        print(f"[{self.finished}/{self.total}] {r.tid}: FAILED: {text}", flush=True)
        return False

    # -- recording -------------------------------------------------------------------------------
    def record(self, cfg: TrainConfig, tid: str, run_dir: str, elapsed: Optional[float], *,
               adopted: bool = False, group_s: Optional[float] = None, start_unix: Optional[float] = None) -> bool:
        """Append the result line of a finished trial; False if `run_dir` holds no finished run."""
        try:  # a folder whose summary is missing or malformed holds no finished run: the trial runs again
            summary = readback.run_summary(run_dir)
        except BadInput:
            return False
        if summary.get("status") not in ("completed", "diverged", "pruned"):
            return False
        if adopted:  # a trial this sweep ran had its config.yaml fixed before it was published (done)
            _fix_out(run_dir)
        try:
            evals = read_jsonl(os.path.join(run_dir, "eval.jsonl"))
        except (OSError, json.JSONDecodeError, BadInput):
            evals = []
        if adopted:  # the times its own sweep measured (none from before they were kept)
            try:
                with open(os.path.join(run_dir, TRIAL_TIMES)) as f:
                    times = json.load(f)
                elapsed, group_s = times.get("elapsed_s"), times.get("group_s")
            except (OSError, ValueError, AttributeError):
                pass
        row = result_row(cfg, tid, summary, os.path.relpath(run_dir, self.dir), evals, elapsed, group_s,
                         min(self.need(cfg), self.nslots), self.point_of.get(tid))
        if summary["status"] == "pruned":
            bound = self.bounds().get(int(cfg.workers))
            row["pruned"] = {"area_so_far": summary.get("loss_area"), "time_s": summary.get("wall_time_s"),
                             "bound_area": bound[0] if bound else None}
        self.save(row)
        if not adopted:
            self.ran_rows.append(dict(row, start_unix=start_unix, end_unix=time.time()))
        self.post_bounds()
        if not adopted:
            self.done_now += 1
            self.finished += 1
            print(f"[{self.finished}/{self.total}] {tid}: {outcome(row, self.pruned_why)}, "
                  f"{summary['wall_time_s']:.2f} s training" + (f", {elapsed:.1f} s in all" if elapsed else ""),
                  flush=True)
        else:
            print(f"sweep: {tid} had finished before the last sweep was stopped; recorded it", flush=True)
        return True

    def write_timing(self, wall_s: float) -> None:
        """DIR/timing.json: where this invocation's seconds went. Efficiency = the slot-seconds
        trials spent training (each trial's training seconds times the GPUs or cores it held) over
        the slot-seconds the sweep had (its wall time times its slots): at most 1, also when trials
        run side by side; a 1-worker trial at a time on 2 GPUs is at most 0.5. Overhead of a
        trial = its elapsed time minus its training, evaluation and checkpoint seconds (start-up,
        setup, writing)."""
        _write_timing(self, wall_s)

    # -- the end -------------------------------------------------------------------------------
    def finish(self, trials: List[TrainConfig]) -> None:
        """winners.json, the winners table and the report, from results.jsonl's rows of `trials`."""
        ids = [trial_id(c) for c in trials]
        by_id = {r["id"]: r for r in self.store.load(repair=False)}
        rows = [by_id[i] for i in ids if i in by_id]
        extra = len(by_id) - len(rows)
        if extra:
            print(f"sweep: {extra} results in results.jsonl are from another grid; left out of the winners")
        w = pick_winners(rows, threshold=self.sc.threshold, target_accuracy=self.sc.target_accuracy,
                         swept=ordered_axes(self.sc.axes), root=self.dir,  # with the winners' curves
                         metric=self.sc.winner_metric, goal=sweep_goal(self.sc), time_axis=self.sc.time_axis,
                         target_share=self.sc.target_share)
        write_json_atomic(os.path.join(self.dir, "winners.json"), w)
        print(winners_table(w), flush=True)
        self.mark("winners")
        self.metric_missing = w.get("metric_missing")
        if self.sc.report:
            self.report_failed = not draw_report(self.dir, self.report_helper)
            self.mark("report")
        if self.timing is not None:  # the marks up to here join this invocation's timing.json
            write_json_atomic(os.path.join(self.dir, "timing.json"), dict(self.timing, marks=self.marks))

    def exit_code(self, failed: str) -> int:
        """0, or 1 when a trial failed (each listed, after `failed`) or the report could not be
        written, or 2 when no completed trial reports --winner-metric (one line, the last, naming
        the keys they do report: the name was bad input that only the trials could tell)."""
        code = 0
        if self.report_failed and not self.failures:
            code = 1
        if self.failures:
            print(f"sweep: {count(len(self.failures), 'trial')} {failed}:", file=sys.stderr)
            for tid, msg in self.failures:
                print(f"  {tid}: {msg}", file=sys.stderr)
            code = 1
        if self.metric_missing:
            print(f"sweep: {self.metric_missing}", file=sys.stderr, flush=True)
            code = 2
        return code


def draw_report(folder: str, helper=None) -> bool:
    """The sweep's report (report.html and its figures) in folder, by `helper` (report/helper.py)
    where it answers, else here; False where it could not be written (a full disk: the results
    are safe in results.jsonl). Without matplotlib: a note, True."""
    answer = helper.draw(folder) if helper is not None else None
    if answer is None:
        try:
            from shmlearn.report import write_report  # lazy: the report imports matplotlib (optional)
        except ImportError as e:
            answer = {"importerror": str(e)}
        else:
            try:
                answer = {"path": write_report([folder])}
            except OSError as e:
                answer = {"oserror": str(e)}
    if "importerror" in answer:
        print(f"sweep: no report ({answer['importerror']}); pip install matplotlib", file=sys.stderr)
        return True
    if "oserror" in answer:
        print(f"sweep: could not write the report ({answer['oserror']}); the results are recorded; "
              f"`shmlearn report {folder}` writes it again", file=sys.stderr, flush=True)
        return False
    print(f"sweep: report {os.path.join(folder, os.path.basename(answer['path']))}", flush=True)
    return True


def result_row(cfg: TrainConfig, tid: str, summary: Dict[str, Any], run_dir: str, evals: List[Dict[str, Any]],
               elapsed: Optional[float], group_s: Optional[float], slots: int,
               point: Optional[Tuple[str, int]]) -> Dict[str, Any]:
    """A finished trial's results.jsonl line (run_dir relative to the sweep directory; point:
    (its grid point's id, repeat k) under --repeats)."""
    row = {"id": tid, "status": summary["status"],
           "config": {k: v for k, v in cfg.to_dict().items() if k not in NOT_SWEPT},
           "summary": summary, "run_dir": run_dir,
           "eval_curve": [[e["time_s"], e.get("test_accuracy")] for e in evals],
           "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
           # The trial's wall time in the sweep (start to recorded); minus the summary's
           # wall_time_s, eval_time_s and checkpoint_time_s, what the sweep spent around it.
           "elapsed_s": elapsed, "group_s": group_s, "slots": slots}
    if point is not None:
        row["point"], row["repeat"] = point
    return row


def outcome(row: Dict[str, Any], pruned_why) -> str:
    """A finished trial's progress line, after its id: its area, or why it has none; COLLAPSED and
    why where the verdict will skip it (winners.collapsed)."""
    s = row["summary"]
    if s["status"] == "completed":
        fell = winners.collapsed(s)
        return (f"area {s['loss_area']:.4g}, min loss {s['min_loss']:.4f}, acc {_fmt(s.get('test_accuracy'), '.4f')}"
                + (f", COLLAPSED ({fell})" if fell else ""))
    if s["status"] == "pruned":
        return f"PRUNED at step {s.get('steps')}/{s.get('planned_steps')} ({pruned_why(row)})"
    return f"DIVERGED at step {s.get('diverged_step')}"


def sweep_goal(sc: SweepConfig) -> Optional[str]:
    """--winner-goal, or its default for --winner-metric (results.winner_goal); None without one."""
    m = sc.winner_metric
    return None if m is None else sc.winner_goal or winner_goal(m)


def find_slots(sc: SweepConfig) -> Tuple[bool, int]:
    """(cuda, slots): the GPUs, or else the CPU cores, this sweep may use (--slots caps them)."""
    dev = sc.fixed.get("device", "auto")
    devs = set(sc.axes.get("device", [dev]))
    if devs - {"cpu"}:
        import torch
        if torch.cuda.is_available():
            return True, sc.slots or torch.cuda.device_count()
        if "cuda" in devs:
            raise BadInput("--device cuda: no CUDA device is available")
    cores = usable_cores()
    return False, sc.slots or cores


def _open_pool(run: TrialRunner, configs: List[TrainConfig], widest: int, warm_report: bool) -> None:
    """TrialRunner.open_pool: its docstring says what it does."""
    run.mark("pool_start")
    width = max(run.nslots, widest)
    datasets = sorted({(c.dataset, c.data_dir, c.seed) for c in configs}, key=repr)[:2]
    # Where no trial compiles, a lean pool: torch._dynamo imported nowhere (launch/lean.py).
    # On CPUs, in the program's own process (a clean one: no other pool's objects for a fork to
    # inherit), where each rank runs one thread (a core each), its workers fork from this
    # process: torch imported once, here (cli.prestart starts no forkserver).
    run.pool = Pool(width, cuda=run.cuda, init=(preload_data, (datasets, run.cuda)),
                    lean=all(lean.compiles_nothing(c) for c in configs),
                    one_thread=not run.cuda and user_main.in_program()
                    and all((c.threads or 1) == 1 for c in configs))
    run.pool.warm(range(min(width, max(run.nslots if run.parallel > 1 else 0, widest))))
    run.mark("workers_forked")  # a fork from the forkserver waits here for its imports
    # Nothing else runs while a trial trains (its areas are wall-clock): the workers start,
    # and matplotlib loads for the report (~0.5 s on a slow core), before the first trial.
    warm = None
    if warm_report:
        warm = threading.Thread(target=_warm_report, name="sweep-warm-report", daemon=True)
        warm.start()
    run.pool.wait_ready()
    run.mark("workers_ready")
    if warm is not None:
        warm.join()
        run.mark("report_warm")


def _write_timing(run: TrialRunner, wall_s: float) -> None:
    """TrialRunner.write_timing: its docstring says what goes in."""
    rows = run.ran_rows
    train_s = sum(r["summary"].get("wall_time_s") or 0.0 for r in rows)
    eval_s = sum((r["summary"].get("eval_time_s") or 0.0) + (r["summary"].get("checkpoint_time_s") or 0.0)
                 for r in rows)
    over = [r["elapsed_s"] - (r["summary"].get("wall_time_s") or 0.0) - (r["summary"].get("eval_time_s") or 0.0)
            - (r["summary"].get("checkpoint_time_s") or 0.0) for r in rows]
    used = sum((r["summary"].get("wall_time_s") or 0.0) * r.get("slots", 1) for r in rows)
    info = {"wall_s": wall_s, "trials_run": len(rows), "training_s": train_s, "eval_s": eval_s,
            "efficiency": used / (wall_s * run.nslots) if wall_s > 0 else None, "slots": run.nslots,
            "parallel": run.parallel,
            "prune": run.sc.prune, "pruned": sum(r["status"] == "pruned" for r in rows),
            "workers_started": run.pool.started_workers if run.pool else None,
            "startup": run.pool.startup if run.pool else None,
            "overhead_s": [{"id": r["id"], "workers": r["config"]["workers"], "s": o,
                            "setup_s": r["summary"].get("setup_time_s"), "group_s": r.get("group_s"),
                            "start_unix": r.get("start_unix"), "end_unix": r.get("end_unix")}
                           for r, o in zip(rows, over)],
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "marks": run.marks}
    write_json_atomic(os.path.join(run.dir, "timing.json"), info)
    run.timing = info
    print(f"sweep: ran {count(len(rows), 'trial')} in {wall_s:.1f} s: {train_s:.1f} s training, {eval_s:.1f} s "
          f"evaluating (efficiency {info['efficiency'] or 0:.2f})"
          + (f"; pruned {info['pruned']}" if run.sc.prune else ""), flush=True)


def _warm_report() -> None:
    try:
        from shmlearn.report import mpl  # lazy: matplotlib (optional), loaded before the first trial
        fig, ax = mpl.figure(2, 2)
        ax.plot([0, 1], [0, 1])
        ax.set(title="warm", xlabel="x", ylabel="y")
        mpl.png(fig)
    except Exception:  # noqa: BLE001 - no matplotlib: the report step says so itself
        pass


def raise_interrupt(signum, frame):
    """SIGTERM (scancel, a preemption) as Ctrl-C: the driver gives back or drops its trials."""
    raise KeyboardInterrupt


def _seal(tmp: str, final: str) -> None:
    """A trial's folder, before the rename that publishes it as `final`: the trial wrote its whole
    files unsynced (record/runs.py published); they are fsynced here, config.yaml naming `final`."""
    safe_write.sync(os.path.join(tmp, "summary.json"))
    _fix_out(tmp, final)


def _fix_out(run_dir: str, out: Optional[str] = None) -> None:
    """config.yaml names the attempt's temporary folder; point it at the published one, `out`
    (default run_dir itself), and fsync it (a trial's own write was not: record/runs.py published)."""
    import yaml
    from shmlearn.record import yaml_io  # lazy: PyYAML, as the `import yaml` above
    out = out or run_dir
    path = os.path.join(run_dir, "config.yaml")
    try:
        with open(path) as f:
            d = yaml_io.load(f)
    except (OSError, yaml.YAMLError):
        return
    if isinstance(d, dict) and d.get("out") != out:
        d["out"] = out
        safe_write.write(path, yaml_io.dump(d), root=run_dir)
    else:
        safe_write.sync(path)
