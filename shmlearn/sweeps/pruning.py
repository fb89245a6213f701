"""Exact pruning of sweep trials (`sweep --prune`): stop a trial only when it can no longer win.

The paper's winner of a worker count is the least loss area among the finished survivors (minimum
loss <= the threshold, not collapsed: winners.py states the rule; its best_bounds gives the bound,
prune_bound and cannot_win apply it). A training loss is >= 0, so a run's area (loss integrated over training
seconds) only grows with time: once a running trial's area so far exceeds the area of the best
finished survivor of its worker count, its final area will too, and it cannot win. With
--target-accuracy the sweep also ranks by training time to that accuracy; a trial can lose that
ranking for sure only once its training time passes the best time-to-target found so far (the
"adaptive capping" argument of SMAC, Hutter et al. 2011). A trial is pruned only when it cannot
win any ranking the sweep reports, so the winners equal those of the full grid.

The sweep posts each worker count's bound in the pool's store; rank 0 of a trial reads it a few
times a second and asks every rank to stop at the same step, through the loop's control
all-reduce (fast.Stepper.read).
"""
from __future__ import annotations

import time
from typing import Optional, Tuple

from shmlearn.sweeps.winners import cannot_win, prune_bound


def bound_key(sweep_key: str, workers: int) -> str:
    return f"shmlearn/prune/{sweep_key}/w{workers}"


def post_bound(store, key: str, area: float, *, target: bool, time_to_target: Optional[float]) -> None:
    """The sweep's side: the best finished survivor's area, and the best time-to-target (inf
    while no run reached it; -inf when the sweep has no target, so time never saves a run)."""
    a, t = prune_bound(area, time_to_target, target)
    store.set(key, f"{a!r} {t!r}")


class Watch:
    """Rank 0's view of its bound, read from the store at most every `every_s` seconds (a read is
    one round trip to the sweep's process; docs/performance.md, "Behind the code")."""

    def __init__(self, store, key: str, *, every_s: float = 0.2):
        self.store, self.key, self.every_s = store, key, every_s
        self._next = 0.0
        self._bound: Optional[Tuple[float, float]] = None

    def should_stop(self, area_so_far: Optional[float], train_s: float) -> bool:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every_s
            try:
                if self.store.check([self.key]):
                    a, t = self.store.get(self.key).decode().split()
                    self._bound = (float(a), float(t))
            except Exception:  # noqa: BLE001 - no bound readable: never prune on a guess
                pass
        if self._bound is None or area_so_far is None:
            return False
        return cannot_win(area_so_far, train_s, self._bound)
