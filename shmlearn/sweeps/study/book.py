"""A study's trials as one process of it sees them (study.py drives it): which trial to run next
(asked of the study, dropped if it repeats one done, queued or running), this process's heartbeat
for its trials, failing the trials of dead processes and queueing their configs again, and giving
this process's trials back when it is interrupted."""
from __future__ import annotations

import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput
from shmlearn.sweeps.study.search import finished_rows
from shmlearn.sweeps.grid import SweepConfig, trial_id
from shmlearn.sweeps.trials import Running

BEAT_S = 5.0
"""Seconds between a process's heartbeats for its trials (one storage write per trial)."""
LOOK_S = 1.0
"""Seconds between reads of the whole study while this process waits for others."""
CLAIM_WAIT_S = 30.0
"""A trial with a lower number whose params are not written yet is waited for this long."""
HOST = socket.gethostname()


def _proc_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc), so a reused pid is not it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return None if rest[0] == "Z" else rest[19]  # a zombie has died
    except (OSError, IndexError):
        return None


def _alive(owner: Dict[str, Any]) -> bool:
    pid = owner.get("pid")
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    start = _proc_start(int(pid))
    if os.path.isdir("/proc"):
        return start is not None and (owner.get("start") is None or start == owner["start"])
    return True


@dataclass
class Owned:
    """One of this process's study trials."""
    trial: "optuna.trial.Trial"
    cfg: TrainConfig
    tid: str
    run: Optional[Running] = None
    evals_seen: int = 0
    pruned: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)


class StudyBook:
    """The study's trials, read at most every LOOK_S seconds, and this process's own (`owned`)."""

    def __init__(self, sc: SweepConfig, study: "optuna.Study", storage, space: Dict[str, Any],
                 grid_ids: Optional[List[str]], config: Callable[[Dict[str, Any]], TrainConfig],
                 failures: List[Tuple[str, str]]):
        self.sc, self.study, self.storage, self.space, self.grid_ids = sc, study, storage, space, grid_ids
        self.config = config
        """Params -> the trial's TrainConfig (BadInput when it fails validation)."""
        self.failures = failures
        """The runner's list of failed trials: a config that fails validation goes there."""
        self.owned: Dict[str, Owned] = {}
        self.seen_beats: Dict[int, Tuple[Any, float]] = {}
        self.tids: Dict[int, Optional[str]] = {}
        self.cached: Optional[List[FrozenTrial]] = None
        self.cached_at = -math.inf
        self.beat_at = 0.0
        self.beats = 0
        self.owner = {"host": HOST, "pid": os.getpid(), "start": _proc_start(os.getpid())}
        self.points: Optional[int] = None
        """How many distinct points a tpe/random search space holds, where that is finite."""
        start = self.trials(fresh=True)
        # Trials that failed before this command: their configs run again (a grid), as the same
        # sweep command retries a failed trial; failures from now on are not retried here.
        self.failed_before = {t.number for t in start if "shmlearn_failed" in t.user_attrs}

    def trials(self, fresh: bool = False) -> List[FrozenTrial]:
        if fresh or self.cached is None or time.monotonic() - self.cached_at > LOOK_S:
            self.cached = self.study.get_trials(deepcopy=False)
            self.cached_at = time.monotonic()
        return self.cached

    def tid(self, t: FrozenTrial) -> Optional[str]:
        """The shmlearn id of a trial's config: from its params, or its queued params; None while
        they are not written yet; 'invalid' for a config that fails validation."""
        if t.number in self.tids:
            return self.tids[t.number]
        params = t.params if set(t.params) >= set(self.space) else t.system_attrs.get("fixed_params")
        if params is None or not set(params) >= set(self.space):
            return t.user_attrs.get("shmlearn_id")
        try:
            tid = trial_id(self.config({a: params[a] for a in self.space}))
        except BadInput:
            tid = "invalid"
        self.tids[t.number] = tid
        return tid

    # -- asking --------------------------------------------------------------------------------
    def want(self, *, busy: bool) -> str:
        """'ask' (the study wants a trial run), 'wait' (others still run trials) or 'done'; lost
        trials are failed and queued again, and a grid's points that GridSampler counts as
        visited but nobody finished are queued."""
        trials = self.trials(fresh=True)
        if self.reap(trials):
            trials = self.trials(fresh=True)
        done = {r["id"] for r in finished_rows(trials)}
        live, waiting, failed = set(), False, set()
        others_running = False
        for t in trials:
            if t.state == TrialState.WAITING:
                waiting = True
                live.add(self.tid(t))
            elif t.state == TrialState.RUNNING:
                live.add(self.tid(t))
                others_running |= all(o.trial.number != t.number for o in self.owned.values())
            elif t.state == TrialState.FAIL and "shmlearn_failed" in t.user_attrs and t.number not in self.failed_before:
                failed.add(self.tid(t))
        if self.grid_ids is not None:
            todo = [i for i in self.grid_ids if i not in done and i not in live and i not in failed]
            tried = {self.tid(t) for t in trials if "grid_id" in t.system_attrs}
            for i in todo:
                if i in tried:  # GridSampler counts a failed or lost point as visited: queue it
                    self.study.enqueue_trial(self.params_of(i), user_attrs={"shmlearn_id": i})
                    waiting = True
            want = bool(todo)
        else:
            failed_all = sum(1 for t in trials if "shmlearn_failed" in t.user_attrs)
            want = len(done) + len({i for i in live if i}) + failed_all < (self.sc.trials or 0)
            if want and self.points is not None:  # every point asked for once (repeats too): the search is over
                seen = {tuple(sorted(t.params.items())) for t in trials if set(t.params) >= set(self.space)}
                want = len(seen) < self.points
        if want or waiting:
            return "ask"
        return "wait" if (busy or others_running) else "done"

    def params_of(self, tid: str) -> Dict[str, Any]:
        for t in self.trials():
            if self.tid(t) == tid and set(t.params) >= set(self.space):
                return {a: t.params[a] for a in self.space}
        raise RuntimeError(f"no params known for {tid}")

    def claim(self) -> Optional[Owned]:
        """Ask the study for a trial and keep it unless it repeats one done, queued or running
        (the caller adopts it if its run directory was published already)."""
        trial = self.study.ask(self.space)
        try:
            cfg = self.config(trial.params)
        except BadInput as e:
            trial.set_user_attr("shmlearn_failed", str(e))
            self.study.tell(trial, state=TrialState.FAIL)
            self.failures.append((f"trial {trial.number}", str(e)))
            print(f"sweep: trial #{trial.number} {trial.params}: {e}", flush=True)
            return None
        tid = trial_id(cfg)
        self.tids[trial.number] = tid
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            conflict, unknown = None, False
            for t in self.trials(fresh=True):
                if t.number == trial.number:
                    continue
                other = self.tid(t)
                if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and "row" in t.user_attrs and other == tid:
                    conflict = t
                elif t.number < trial.number and t.state in (TrialState.RUNNING, TrialState.WAITING):
                    if other == tid:
                        conflict = t
                    unknown |= other is None and t.state == TrialState.RUNNING
                if conflict is not None:
                    break
            if conflict is not None or not unknown or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if conflict is not None:
            trial.set_user_attr("shmlearn_repeat_of", conflict.number)
            self.study.tell(trial, state=TrialState.FAIL)
            print(f"sweep: trial #{trial.number} repeats {tid} (trial #{conflict.number}, "
                  f"{conflict.state.name.lower()}); dropped", flush=True)
            return None
        trial.set_user_attr("shmlearn_id", tid)
        trial.set_user_attr("shmlearn_owner", self.owner)
        trial.set_user_attr("shmlearn_beat", 0)
        o = Owned(trial, cfg, tid)
        self.owned[tid] = o
        return o

    # -- liveness --------------------------------------------------------------------------------
    def beat(self) -> None:
        if time.monotonic() < self.beat_at:
            return
        self.beat_at = time.monotonic() + BEAT_S
        self.beats += 1
        for o in list(self.owned.values()):
            try:
                o.trial.set_user_attr("shmlearn_beat", self.beats)
            except UpdateFinishedTrialError:  # another process judged it lost: it runs again there
                print(f"sweep: trial #{o.trial.number} ({o.tid}) was taken as lost by another process",
                      file=sys.stderr, flush=True)

    def reap(self, trials: List[FrozenTrial]) -> bool:
        """Fail the running trials of dead processes and queue their configs again."""
        mine = {o.trial.number for o in self.owned.values()}
        reaped = False
        now = time.monotonic()
        for t in trials:
            if t.state != TrialState.RUNNING or t.number in mine:
                continue
            beat, owner = t.user_attrs.get("shmlearn_beat"), t.user_attrs.get("shmlearn_owner")
            last = self.seen_beats.get(t.number)
            if last is None or last[0] != beat:
                self.seen_beats[t.number] = (beat, now)
                last = (beat, now)
            why = None
            if owner and owner.get("host") == HOST and not _alive(owner):
                why = f"its process {owner.get('pid')} on {HOST} is gone"
            elif now - last[1] > self.sc.stale_after:
                why = f"no heartbeat for {now - last[1]:.0f} s"
            if why is None:
                continue
            try:
                t_id = t._trial_id
                self.storage.set_trial_user_attr(t_id, "shmlearn_lost", why)
                won = self.storage.set_trial_state_values(t_id, TrialState.FAIL)
            except (UpdateFinishedTrialError, RuntimeError):
                continue  # finished, or another process failed it first
            if not won:
                continue
            reaped = True
            params = t.params if set(t.params) >= set(self.space) else None
            if params is not None:
                self.study.enqueue_trial({a: params[a] for a in self.space},
                                         user_attrs={"shmlearn_id": self.tid(t), "shmlearn_retry_of": t.number})
            print(f"sweep: trial #{t.number} ({self.tid(t)}) lost: {why}; "
                  + ("queued again" if params is not None else "it had no config yet"), flush=True)
        return reaped

    def release(self, owned: List[Owned]) -> None:
        """Interrupted (Ctrl-C, SIGTERM from a scheduler): give our trials back to the study now."""
        for o in owned:
            try:
                o.trial.set_user_attr("shmlearn_lost", "its process was interrupted")
                self.study.tell(o.trial, state=TrialState.FAIL)
                self.study.enqueue_trial({a: o.trial.params[a] for a in self.space},
                                         user_attrs={"shmlearn_id": o.tid, "shmlearn_retry_of": o.trial.number})
            except Exception:  # noqa: BLE001 - the storage may be what failed; the heartbeat covers it
                pass
        self.owned.clear()

    # -- telling -------------------------------------------------------------------------------
    def tell_failed(self, o: Owned, why: str) -> None:
        self.owned.pop(o.tid, None)
        try:
            o.trial.set_user_attr("shmlearn_failed", why[:2000])
            self.study.tell(o.trial, state=TrialState.FAIL)
        except UpdateFinishedTrialError:
            pass

    def params_by_id(self, trials: List[FrozenTrial], tid: str) -> Dict[str, Any]:
        for t in trials:
            if t.user_attrs.get("row", {}).get("id") == tid:
                return t.params
        raise RuntimeError(f"no trial for {tid}")
