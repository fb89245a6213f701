"""A run's test pass on CUDA with its full batches replayed from one CUDA graph (issue 52: a sweep
trial's evaluations cost as much as its training).

Why: a test pass is ~10 batches of 1024 whose forward, loss and count the GPU runs in a fraction
of the time the host takes to launch them. On one H200, alexnet-small's pass over Fashion-MNIST's
10,000 test images took 12 ms of host time, six passes a sweep trial (--eval-points 5): 71 ms,
more than the 62 ms of its training (benchmarks/trial_profile.py, docs/performance.md "Processes
and start-up"). Replayed, a batch costs a copy and a launch.

How: the pass's first full batch runs eagerly (the forward's lazy work: cuDNN's plans, kernels'
first loads), the second is captured and replayed, and every later full batch of this and later
passes copies its samples into the graph's input and replays it; a smaller last batch runs
eagerly. Every batch adds into the same float64 sums in the same order as the eager pass, with the
same kernels: the numbers are the eager pass's, bit for bit (tests/train/test_eval_graph.py).

Where: only where the run's training step replays CUDA graphs (its forward, the same model's, was
captured already), and only test_pass (the task's contract; compute_loss's general contract may
sample or branch on the data). The graph shares the step's memory pool: the graphs are never
replayed at once, and neither reads what the other leaves (the pool's rule, step/graphs.py), so
evaluation holds no memory of its own beyond its input. A capture that fails is noted in
summary.json's kernel_notes, and the passes run eagerly from then on; the run goes on.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from shmlearn.errors import one_line


def for_step(stepper, device: torch.device) -> Optional["EvalGraph"]:
    """The run's EvalGraph where its step (step/fast.py's Stepper) replays CUDA graphs, else None."""
    if device.type != "cuda" or not stepper.graphs:
        return None
    return EvalGraph(device, stepper.capture.pool, note=stepper.quiet_notes.append)


class EvalGraph:
    """One run's test batch as a CUDA graph (see the module docstring). pool: the training step's
    graph pool; note(line): where a failed capture is told."""

    def __init__(self, device: torch.device, pool, note: Callable[[str], None]):
        self.device, self.pool, self.note = device, pool, note
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        """What every pass adds into (its address is the graph's): loss sum, correct, samples."""
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.shape = None
        """(inputs' shape and dtype, targets' shape and dtype) of a full batch: the first batch's."""
        self.warm = False
        """Whether a full batch ran eagerly (before the capture)."""
        self.failed = False
        self._x = self._y = None

    def start(self) -> torch.Tensor:
        """A pass begins: its sums, zeroed."""
        self.sums.zero_()
        return self.sums

    def add(self, body: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None], xb: torch.Tensor,
            yb: torch.Tensor) -> None:
        """Add batch (xb, yb) into the sums as body(sums, xb, yb) does: by a replay where it is a
        full batch after the first, else eagerly."""
        if not self._replays(body, xb, yb):
            body(self.sums, xb, yb)

    def _replays(self, body, xb: torch.Tensor, yb: torch.Tensor) -> bool:
        if self.failed:
            return False
        shape = (tuple(xb.shape), xb.dtype, tuple(xb.stride()), tuple(yb.shape), yb.dtype)
        if self.shape is None:
            self.shape = shape
        if shape != self.shape:
            return False  # the last, smaller batch
        if not self.warm:
            self.warm = True
            return False
        if self.graph is None and not self._capture(body, xb, yb):
            return False
        self._x.copy_(xb)
        self._y.copy_(yb)
        self.graph.replay()
        return True

    def _capture(self, body, xb: torch.Tensor, yb: torch.Tensor) -> bool:
        self._x, self._y = torch.empty_like(xb), torch.empty_like(yb)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads (NCCL's watchdog, the heartbeat) may make CUDA calls.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                body(self.sums, self._x, self._y)
        except Exception as e:  # noqa: BLE001 - a failed capture evaluates eagerly, and says why
            torch.cuda.synchronize(self.device)
            self.failed, self._x, self._y = True, None, None
            self.note(f"evaluation runs eagerly: its CUDA graph capture failed ({one_line(e)})")
            return False
        self.graph = graph
        return True
