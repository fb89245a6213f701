"""A pool's jobs and their watchdog: which rank of a job died, failed or stopped, how long its peers
get to report, and the job's error naming the rank that caused it.

    Job: a function on `world` ranks; outcomes fill in as ranks report ("ok", "bad_input",
         "diverged", "failed"; "died" and "hung" from here)
    Watchdog.check, on every Pool.poll: a rank whose process is stopped (state T), or whose
         heartbeat (train/guard.py) is older than the job's timeout, is "hung"; once one rank is
         bad, the others get a grace period to report before the pool replaces their processes

pool.py keeps the workers and the dispatch; what a job's outcome means lives here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from shmlearn.errors import BadInput, Diverged, WorkerFailed


def _proc_state(pid: int) -> Optional[str]:
    """A process's state letter from /proc (T: stopped), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclass
class Job:
    """A function running on `world` ranks; `outcomes` fill in as ranks report."""
    id: int
    slots: Tuple[int, ...]
    timeout_s: float
    group: int
    tag: Any = None
    """The caller's (a sweep keeps its trial here)."""
    started: float = field(default_factory=time.monotonic)
    outcomes: Dict[int, tuple] = field(default_factory=dict)
    deadline: Optional[float] = None
    done: bool = False

    @property
    def world(self) -> int:
        return len(self.slots)

    def ok(self) -> bool:
        return len(self.outcomes) == self.world and all(o[0] == "ok" for o in self.outcomes.values())

    def group_s(self) -> Optional[float]:
        """Seconds the slowest rank spent joining (or reusing) the job's process group."""
        t = [o[3].get("group_s") for o in self.outcomes.values() if len(o) > 3 and o[3].get("group_s") is not None]
        return max(t) if t else None

    def results(self) -> List[Any]:
        """Every rank's return value, in rank order; or raise the job's error, naming the rank."""
        # Causes before consequences: a dead or stopped rank, then a rank's own bad input (a
        # stuck Dataset read, a bad label: its peers only see their collective time out), then
        # failures (often the peers' timeouts), then a divergence (every rank sees it).
        order = {"died": 0, "hung": 0, "bad_input": 1, "failed": 2, "diverged": 3}
        bad = sorted((o for o in self.outcomes.values() if o[0] != "ok"), key=lambda o: (order[o[0]], o[1]))
        if bad:
            kind, rank, payload = bad[0]
            if kind == "bad_input":
                raise BadInput(payload[0])
            if kind == "diverged":
                raise Diverged(payload[0], step=payload[1][0], rank=payload[1][1])
            raise WorkerFailed(f"rank {rank}: {payload}")
        missing = [r for r in range(self.world) if r not in self.outcomes]
        if missing:
            raise WorkerFailed(f"rank {missing[0]}: ended without reporting a result")
        return [self.outcomes[r][2] for r in range(self.world)]


class Watchdog:
    """Watches a pool's running jobs (Pool.poll calls `check`). store: the pool's TCP store, where
    each pooled rank posts its heartbeat; quick_grace_s: what a job's other ranks get to report
    after a rank died, failed or hung (its peers fail at once); grace_s: after a divergence or a
    bad input (every rank stops on its own, at the same step)."""

    def __init__(self, store, quick_grace_s: float = 1.0, grace_s: float = 10.0):
        self.store = store
        self.grace = (quick_grace_s, grace_s)

    def check(self, jobs: Iterable[Job], workers: Dict[int, Any]) -> None:
        """Name the ranks of each running job that died, failed or stopped; set the job's deadline
        for its other ranks to report; mark it done when all reported or the deadline passed."""
        now = time.monotonic()
        for job in list(jobs):
            if job.done:
                continue
            bad = [o for o in job.outcomes.values() if o[0] != "ok"]
            if bad and job.deadline is None:
                # A peer's collective or rendezvous timed out: a rank whose process is stopped
                # (SIGSTOP, a debugger) is the cause, whether or not it ever beat (rank 0
                # stopped during the rendezvous: its peer's DistStoreError named rank 1).
                for r in self._stopped_procs(job, workers):
                    job.outcomes[r] = ("hung", r, f"stopped responding: its process is stopped (SIGSTOP or a "
                                                  f"debugger; --timeout {job.timeout_s:g} s)")
                bad = [o for o in job.outcomes.values() if o[0] != "ok"]
            if job.deadline is None:
                if bad:
                    # A dead or failed rank leaves its peers blocked in a collective: give them a
                    # moment to report (a dead peer's neighbours fail at once). A divergence or bad
                    # input stops every rank on its own, at the same step.
                    quick = any(o[0] in ("died", "failed", "hung") for o in bad)
                    job.deadline = now + self.grace[0 if quick else 1]
                elif len(job.outcomes) == job.world:
                    job.deadline = now
                else:
                    stopped = self._stopped_rank(job, now)
                    if stopped is not None:
                        r, why = stopped
                        job.outcomes[r] = ("hung", r, f"{why} (--timeout {job.timeout_s:g} s)")
                        job.deadline = now + self.grace[0]
            if len(job.outcomes) == job.world or (job.deadline is not None and now > job.deadline):
                job.done = True

    @staticmethod
    def _stopped_procs(job: Job, workers: Dict[int, Any]) -> List[int]:
        """The job's ranks, without an outcome, whose worker process is stopped (state T)."""
        return [r for r, s in enumerate(job.slots) if r not in job.outcomes and (w := workers.get(s)) is not None
                and w.proc.pid is not None and _proc_state(w.proc.pid) in ("T", "t")]

    def _stopped_rank(self, job: Job, now: float) -> Optional[Tuple[int, str]]:
        """A rank whose heartbeat thread has been silent longer than the job's timeout (its
        process is stopped or wedged: guard.Heartbeat posts once a second from a thread, even
        while the rank computes), or a lone rank that has been inside one step that long (a hang
        in its own code). Its peers would notice only at their collective's timeout, and no one
        waits on a lone rank."""
        if now - job.started < job.timeout_s:
            return None
        wall = time.time()
        for r, s in enumerate(job.slots):
            if r in job.outcomes:
                continue
            key = f"shmlearn/hb/j{job.id}/{r}"  # guard.Heartbeat's key in this store
            try:
                if not self.store.check([key]):
                    continue  # not training yet (data, model): the collectives' timeouts cover it
                step, t, inside = (self.store.get(key).decode().split() + ["-1"])[:3]
            except Exception:  # noqa: BLE001
                continue
            if wall - float(t) > job.timeout_s:
                return r, f"stopped responding: no heartbeat for {wall - float(t):.0f} s"
            if job.world == 1 and float(inside) > job.timeout_s:  # with peers, their collective names it
                return r, f"no progress for {float(inside):.0f} s inside step {int(step) + 1}: a hang in its own code"
        return None
