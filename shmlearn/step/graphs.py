"""CUDA-graph capture of the fast step: warm-up on a side stream, one graph per kind of step in one
shared memory pool, captured at the highest stream priority with the small memset nodes made
kernels (graph_memsets.py), the state the warm-up touched put back, and the period of eager,
phase-timed steps measured from the eager step's time over a replay's (options.sample_period)."""
from __future__ import annotations

import contextlib
import time
from typing import List, Tuple

import torch
import torch.distributed as dist

from shmlearn.step import graph_memsets
from shmlearn.errors import one_line
from shmlearn.step.options import SAMPLE_EVERY, sample_period
from shmlearn.record.timing import NULL_TIMER


class Graphs:
    """The step's CUDA graphs (`graphs`, one per kind, `key`) and how they are made. dstep: the
    DeviceStep they capture; say(line): the step's note (why something runs otherwise)."""

    def __init__(self, *, model, strategy, loader, device: torch.device, opts, tuning, world_size: int, dstep, say):
        self.model, self.strategy, self.loader, self.device, self.opts = model, strategy, loader, device, opts
        self.tuning = tuning
        self.world_size, self.dstep, self.say = world_size, dstep, say
        self.graphs = None
        """CUDA graphs of the step, one per kind (`kinds`, `key`), replayed by the fast step."""
        self._pool = None
        """The memory pool the step's graphs share (`capture`)."""
        self.memsets_replaced = 0
        """Memset nodes of the step's CUDA graphs made kernel nodes (StepTuning.memset_kernels)."""
        self.memset_bytes = 0
        """The largest of them, in bytes."""
        self.sample_every = tuning.sample_every or SAMPLE_EVERY
        """Graph mode: one step in this many runs eagerly with phase timing (`capture_all_ranks`
        sets it by measurement when StepTuning.sample_every is None)."""
        self.eager_over_replay = 0.0
        """Graph mode: the eager (sampled) step's time over a replay's, measured at capture."""
        self._eager_s = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def kinds(self) -> List[Tuple[bool, bool]]:
        """The kinds of step a graph is captured for: (round kind, measures the noise scale); the
        measuring variant only with --noise-scale (noise.py: a measured step runs other kernels,
        e.g. two half batches at 1 worker)."""
        measuring = (False, True) if self.strategy.noise is not None else (False,)
        return [(k, m) for m in measuring for k in self.strategy.round_kinds()]

    @staticmethod
    def key(round_: bool, measuring: bool):
        """graphs' key of a kind of step: the plain step's graph keeps the round kind alone
        (what the benchmarks and tests read as graphs[False]), a measuring step's is (round_, True)."""
        return (round_, True) if measuring else round_

    def _as_kind(self, kind: Tuple[bool, bool]) -> None:
        """Capture: run the next device step as `kind` (round kind, measuring)."""
        if self.strategy.noise is not None:
            self.strategy.noise.on = kind[1]

    def capture_all_ranks(self) -> None:
        """Capture on every rank; if any rank fails, every rank runs eagerly (same maths)."""
        err = None
        try:
            graphs = self._capture()
        except Exception as e:  # noqa: BLE001 - a failed capture falls back to eager, and says why
            graphs, err = None, one_line(e)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        ok = torch.tensor([0.0 if graphs else 1.0], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(ok)
        if ok.item() == 0:
            self.graphs = graphs
            if self.tuning.sample_every is None and self.device.type == "cuda":  # every rank replays, then agrees
                ratio = torch.tensor([self._eager_s / self._replay_s()], device=self.device)
                if self.world_size > 1:
                    dist.all_reduce(ratio, op=dist.ReduceOp.MAX)  # every rank samples the same steps
                self.eager_over_replay = float(ratio.item())
                self.sample_every = sample_period(self.eager_over_replay, 1.0)
        else:
            self.say(f"CUDA graph capture failed ({err or 'on another rank'}); running eagerly")

    def release(self, why: str) -> None:
        """Stop replaying: every later step runs eagerly (the same maths, reading the optimizer's
        param groups afresh), and the note says why."""
        self.sync()  # a graph holds the memory its last replay still uses
        self.graphs = None
        self.say(why, join=True)

    def _capture(self):
        """Warm up on a side stream (allocator, cuDNN autotuning, NCCL communicators), capture one
        graph per kind of step, and put back everything the warm-up touched. The graphs share one
        memory pool: they are never replayed concurrently, and nothing allocated in one is read by
        another (what outlives a step was allocated in the warm-up), so the measuring variant does
        not double the activation memory."""
        kinds = self.kinds()
        with self._no_update():
            if self.strategy.computes:
                self.loader.prepare(0)
            eager_s = 0.0
            with self.side_stream():
                for i in range(3):
                    for j, k in enumerate(kinds):
                        self._as_kind(k)
                        last = i == 2 and j == 0  # warm by now: what a sampled eager step costs
                        if last:
                            self.sync()
                            t0 = time.perf_counter()
                        self.dstep.run(NULL_TIMER, k[0])
                        if last:
                            self.sync()
                            eager_s = time.perf_counter() - t0
            self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
            graphs = {}
            for k in kinds:
                self._as_kind(k)
                graphs[self.key(*k)] = self.graph_of(lambda k=k: self.dstep.run(NULL_TIMER, k[0]))
            self._eager_s = eager_s
            return graphs

    @contextlib.contextmanager
    def _no_update(self):
        """Steps that compute and communicate but never update (the skip flag set), with the
        weights, buffers, loader and step counter put back after, also after an error: capture's
        warm-up, and the replays `_replay_s` times."""
        saved_params = self.strategy.params_flat.clone()
        saved_buffers = [b.clone() for b in self.model.buffers()]
        self.dstep.found_inf.fill_(1.0)
        try:
            yield
        finally:  # also after a failed capture: the eager fallback starts from the same state
            if self.device.type == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)
            with torch.no_grad():
                self.strategy.params_flat.copy_(saved_params)
                for b, v in zip(self.model.buffers(), saved_buffers):
                    b.copy_(v)
                if self.strategy.flat_update is not None:
                    self.strategy.flat_update.refresh()  # the weights were written around the update
            self.dstep.found_inf.zero_()
            self.dstep.expected = None  # the next step re-primes the loader and the step counter
            if self.strategy.computes:
                self.loader.invalidate()

    def _replay_s(self, n: int = 5) -> float:
        """Seconds per replay of the plain step's graph (median of n after one), under
        `_no_update`."""
        kind = self.kinds()[0]
        graph = self.graphs[self.key(*kind)]
        times = []
        with self._no_update():
            self._as_kind(kind)
            self.dstep.t.fill_(0)
            for i in range(n + 1):
                if self.strategy.computes:
                    self.loader.prepare(i * self.strategy.accumulate)  # training step i's micro-batches
                self.sync()
                t0 = time.perf_counter()
                graph.replay()
                self.sync()
                times.append(time.perf_counter() - t0)
        return sorted(times[1:])[n // 2]

    @contextlib.contextmanager
    def side_stream(self):
        """Where warm-up runs: a side stream, as torch.cuda.graphs asks (autograd and NCCL set up
        their per-stream state there, not on the stream being captured)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream(self.device).wait_stream(side)

    def graph_of(self, fn):
        """fn's device work captured in a CUDA graph (fn does not run); replay() runs it. In
        the memory pool self._pool (the step's graphs share one, `_capture`), else its own."""
        edit = self.tuning.memset_kernels and graph_memsets.supported()
        g = torch.cuda.CUDAGraph(keep_graph=True) if edit else torch.cuda.CUDAGraph()
        stream = None
        if self.tuning.high_priority_capture:  # a large negative number maps to the highest priority
            stream = torch.cuda.Stream(self.device, priority=-100)
        # thread_local: other threads (NCCL's watchdog, the heartbeat) may make CUDA calls.
        with torch.cuda.graph(g, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            fn()
        if edit:
            try:
                sizes = graph_memsets.memsets_to_kernels(g.raw_cuda_graph(), self.device.index)
                self.memsets_replaced += len(sizes)
                self.memset_bytes = max([self.memset_bytes, *sizes])
            except (OSError, RuntimeError, AttributeError) as e:  # each replacement leaves a valid graph
                self.say(f"memset nodes kept in the step's CUDA graph: {e}")
            g.instantiate()
        return g
