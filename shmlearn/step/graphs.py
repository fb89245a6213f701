"""CUDA-graph capture of the fast step: warm-up on a side stream, one graph per kind of step in one
shared memory pool, captured at the highest stream priority with the small memset nodes made
kernels (graph_memsets.py), the state the warm-up touched put back, and the period of eager,
phase-timed steps measured from the eager step's time over a replay's (options.sample_period).

A process that has captured the same step before (a pool worker's next sweep trial of this batch
size: `step_key`, `SEEN`) warms up with one step instead of WARMUP and takes the period measured
then: the kernels, cuDNN's choices and the allocator's blocks are warm already, and what a new
trial has that is new (its model's tensors, its optimizer's state) is made by the first warm-up
step. That saved 17-18 ms of a warm trial's ~50 ms of setup (alexnet-small, batch 128, one H200:
benchmarks/trial_profile.py, docs/performance.md "Processes and start-up")."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from shmlearn.step import graph_memsets
from shmlearn.errors import one_line
from shmlearn.step.options import SAMPLE_EVERY, StepOptions, sample_period
from shmlearn.record.timing import NULL_TIMER

WARMUP = 3
"""Eager steps on a side stream before a step is first captured in this process (torch's advice:
a few; lazy initializations, cuDNN's timing, the allocator's blocks and the optimizer's state)."""
SEEN: Dict[tuple, float] = {}
"""This process's captured steps (step_key) and the eager step's time over a replay's measured at
their first capture."""


def collectives_why_not(strategy) -> Optional[str]:
    """Why the step's collectives cannot run inside a CUDA graph, or None: Gloo's, between the
    ranks of a run on GPUs (--backend gloo: ranks sharing a GPU), run on the host. Capturing them
    failed and fell back to eager with a line that read like an error."""
    if strategy.world_size > 1 and dist.get_backend(strategy.group) == "gloo":
        return ("the ranks talk over Gloo, whose collectives run on the host, outside a CUDA graph: "
                "the step runs eagerly")
    return None


def step_key(*, model, strategy, loader, device: torch.device, opts, tuning, world_size: int, kinds) -> Optional[tuple]:
    """What makes two captures of the step run the same kernels on the same shapes: the model's
    modules and tensors, the strategy, the optimizer and its settings but the learning rate, the
    loader's batch and samples, the step's options and switches. None where a capture must always
    warm up fully: torch's DDP rebuilds its buckets after its first iterations."""
    if isinstance(strategy.module, torch.nn.parallel.DistributedDataParallel):
        return None
    x = getattr(loader, "x", None)
    optimizer = getattr(strategy, "optimizer", None)
    groups = tuple(tuple(sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "lr", "initial_lr")))
                   for g in getattr(optimizer, "param_groups", ()))
    return (str(device), world_size, type(strategy).__qualname__, getattr(strategy, "accumulate", 1), tuple(kinds),
            type(optimizer).__qualname__, groups, type(loader).__qualname__, getattr(loader, "batch_size", None),
            getattr(loader, "global_batch", None),
            None if x is None else (tuple(x.shape[1:]), x.dtype), type(getattr(loader, "augment", None)).__qualname__,
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in model.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in model.named_buffers()),
            tuple(type(m).__qualname__ for m in model.modules()),
            tuple((f.name, repr(getattr(opts, f.name, None))) for f in dataclasses.fields(StepOptions)), repr(tuning))


def agree_seen(ratio: Optional[float], world_size: int, device: torch.device) -> Optional[float]:
    """Every rank's answer the same: the ratio (the largest of the ranks') where every rank has
    captured this step before, else None (all warm up fully: the warm-up steps communicate)."""
    if world_size == 1:
        return ratio
    t = torch.tensor([0.0 if ratio is not None else 1.0, ratio or 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    missing, largest = t.tolist()
    return None if missing else largest


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

    @property
    def pool(self):
        """The memory pool the step's graphs share (None before the capture); the test pass's
        graph shares it too (train/eval_graph.py)."""
        return self._pool

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
        key = step_key(model=self.model, strategy=self.strategy, loader=self.loader, device=self.device,
                       opts=self.opts, tuning=self.tuning, world_size=self.world_size, kinds=self.kinds())
        seen = agree_seen(SEEN.get(key) if key is not None else None, self.world_size, self.device)
        err = None
        try:
            graphs = self._capture(warmup=1 if seen is not None else WARMUP)
        except Exception as e:  # noqa: BLE001 - a failed capture falls back to eager, and says why
            graphs, err = None, one_line(e)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        ok = torch.tensor([0.0 if graphs else 1.0], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(ok)
        if ok.item() == 0:
            self.graphs = graphs
            if self.tuning.sample_every is None and self.device.type == "cuda":
                if seen is None:  # every rank replays, then agrees
                    ratio = torch.tensor([self._eager_s / self._replay_s()], device=self.device)
                    if self.world_size > 1:
                        dist.all_reduce(ratio, op=dist.ReduceOp.MAX)  # every rank samples the same steps
                    seen = float(ratio.item())
                self.eager_over_replay = seen
                self.sample_every = sample_period(self.eager_over_replay, 1.0)
            if key is not None:
                SEEN[key] = self.eager_over_replay
        else:
            self.say(f"CUDA graph capture failed ({err or 'on another rank'}); running eagerly")

    def release(self, why: str) -> None:
        """Stop replaying: every later step runs eagerly (the same maths, reading the optimizer's
        param groups afresh), and the note says why."""
        self.sync()  # a graph holds the memory its last replay still uses
        self.graphs = None
        self.say(why, join=True)

    def _capture(self, warmup: int = WARMUP):
        """Warm up on a side stream (allocator, cuDNN autotuning, NCCL communicators; `warmup`
        steps of each kind), capture one graph per kind of step, and put back everything the
        warm-up touched. The graphs share one memory pool: they are never replayed concurrently,
        and nothing allocated in one is read by another (what outlives a step was allocated in the
        warm-up), so the measuring variant does not double the activation memory."""
        kinds = self.kinds()
        with self._no_update():
            if self.strategy.computes:
                self.loader.prepare(0)
            eager_s = 0.0
            with self.side_stream():
                for i in range(warmup):
                    for j, k in enumerate(kinds):
                        self._as_kind(k)
                        # warm by now: what a sampled eager step costs (not timed after one step)
                        last = warmup > 1 and i == warmup - 1 and j == 0
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
