"""Phase timer: where every millisecond of a step goes, per rank, plus a Chrome trace.

On CPU a phase is timed with perf_counter around the Python call (CPU work is synchronous).
On CUDA a phase is a pair of CUDA events on the current stream, so timing adds no host sync;
events are resolved lazily in `flush()`, which the loop calls only when it syncs anyway
(at logging). Either way the numbers say what the device spent between the phase boundaries.

A step replayed from a captured CUDA graph cannot be split into phases (its kernels run as one
launch, and event timing inside a capture is not portable). Such steps are not timed:
`step_done(timed=False)`. The fast step (fast.py) instead runs one step in every N eagerly, with
the same kernels and CUDA events, and per-step means divide by the steps that were timed.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch

PHASES = ("data", "compute", "allreduce", "gather", "average", "update", "broadcast", "push", "pull", "wait",
          "eval")


class PhaseTimer:
    def __init__(self, device: torch.device, rank: int = 0, *, trace_steps: int = 1000):
        self.cuda = device.type == "cuda"
        self.rank = rank
        self.trace_steps = trace_steps
        """Trace events are kept for the first this many steps only (a trace must stay openable)."""
        self.totals: Dict[str, float] = defaultdict(float)
        self.counts: Dict[str, int] = defaultdict(int)
        self.steps = 0
        self.timed_steps = 0
        """Steps whose phases were recorded (all of them unless some were graph replays)."""
        self._events: List[dict] = []
        self._pending: list = []  # CUDA: (name, step, start_event, end_event)
        self._prev_totals: Dict[str, float] = {}
        self._prev_timed = 0
        self._wall0 = time.time()
        self._perf0 = time.perf_counter()
        if self.cuda:
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record()

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, self.steps, start, end))
        else:
            t0 = time.perf_counter()
            yield
            t1 = time.perf_counter()
            self._add(name, self.steps, t0 - self._perf0, t1 - t0)

    def _add(self, name: str, step: int, start_s: float, dur_s: float) -> None:
        self.totals[name] += dur_s
        self.counts[name] += 1
        if step < self.trace_steps:
            self._events.append({"name": name, "ph": "X", "pid": self.rank, "tid": 0,
                                 "ts": (self._wall0 + start_s) * 1e6, "dur": dur_s * 1e6,
                                 "args": {"step": step}})

    def step_done(self, timed: bool = True) -> None:
        self.steps += 1
        self.timed_steps += int(timed)

    def flush(self) -> None:
        """Resolve pending CUDA events. Waits for the last one: call it where the loop syncs anyway."""
        if not self._pending:
            return
        self._pending[-1][3].synchronize()
        for name, step, start, end in self._pending:
            self._add(name, step, self._base.elapsed_time(start) / 1e3, start.elapsed_time(end) / 1e3)
        self._pending.clear()

    def mean_per_step(self, steps: Optional[int] = None) -> Dict[str, float]:
        """Mean seconds per timed training step by phase (a phase that ran every K steps counts
        1/K). eval is excluded: it is not part of a training step."""
        self.flush()
        n = max(steps if steps is not None else self.timed_steps, 1)
        return {k: self.totals[k] / n for k in PHASES if k in self.totals and k != "eval"}

    def take_phase_totals(self) -> Dict[str, float]:
        """Totals since the last call (for per-log-line phase times in metrics.jsonl)."""
        return self.take_window()[0]

    def take_window(self):
        """(phase totals, number of timed steps) since the last call."""
        self.flush()
        cur, prev = dict(self.totals), self._prev_totals
        self._prev_totals = cur
        timed, self._prev_timed = self.timed_steps - self._prev_timed, self.timed_steps
        return {k: v - prev.get(k, 0.0) for k, v in cur.items()}, timed

    def trace_events(self) -> List[dict]:
        self.flush()
        meta = {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}
        return [meta] + self._events


class NullTimer:
    """A timer that records nothing: used while a CUDA graph is captured (an event record there
    would become part of the graph) and for untimed replays."""

    @contextmanager
    def phase(self, name: str):
        yield


NULL_TIMER = NullTimer()


def chrome_trace(per_rank_events: List[List[dict]]) -> dict:
    """Merge ranks' events into one Chrome/Perfetto trace, times relative to the earliest event."""
    events = [e for evs in per_rank_events for e in evs]
    t0 = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - t0, 3)
            e["dur"] = round(e["dur"], 3)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
