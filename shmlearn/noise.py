"""Gradient noise scale measured during training (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", arXiv:1812.06162, appendix A); docs/noise-scale.md has the derivation.

B_simple = tr(Sigma) / |G|^2, Sigma the per-example gradient covariance and G the true gradient.
A gradient averaged over b examples drawn at random without replacement from N has

    E |g_b|^2 = |G|^2 + c (1/b - 1/N),     c = tr(Sigma) N / (N - 1)

so the squared norms of two batch sizes b_s < b_b give unbiased estimates of both unknowns:

    c      = (|g_s|^2 - |g_b|^2) / (1/b_s - 1/b_b)
    |G|^2  = |g_b|^2 - c (1/b_b - 1/N)          (the paper's form when N -> infinity)

Data parallelism has both for free: b_s = B is each rank's local gradient (its squared norm is
averaged over the W ranks: lower variance, same expectation) and b_b = W B the averaged one. Each
rank adds one scalar, |g_local|^2, to the gradient collective its strategy already makes (a
control slot of the flat buffer, sync/base.py); whoever holds the averaged gradient records the
pair. At one worker the batch is computed as two half batches (b_s = B/2, b_b = B): the same
samples and, for models without batch statistics, the same gradient, at two smaller kernels.

Device side (`NoiseMeter`): no host sync; the pair goes into a device history indexed by the
step counter, read with the losses at the loop's reads (fast.py). Host side (`NoiseTracker`,
rank 0): per-step estimates, an exponential moving average of |G|^2 and of tr(Sigma) taken
separately (their ratio is what is reported: the ratio of noisy estimates would be biased and
heavy-tailed), and the run's totals for summary.json.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from shmlearn.errors import BadInput

EMA_DECAY = 0.99
"""Per step: the moving averages of |G|^2 and tr(Sigma) forget with a time constant of ~100
steps (bias-corrected as Adam's moments are, so the first steps are not pulled toward 0)."""
TRAJECTORY_POINTS = 200
"""summary.json keeps at most this many (step, B_simple) points, evenly thinned."""


def estimate(small: float, big: float, b_small: float, b_big: float,
             n: Optional[int] = None) -> Tuple[float, float]:
    """(|G|^2, tr(Sigma)) from the squared norms of gradients over b_small and b_big examples
    (unbiased for sampling without replacement from n examples; n None: from an infinite pool)."""
    c = (small - big) / (1.0 / b_small - 1.0 / b_big)
    inv_n = 1.0 / n if n else 0.0
    g2 = big - c * (1.0 / b_big - inv_n)
    trace = c * (n - 1) / n if n else c
    return g2, trace


def sq_norm(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """|x|^2 as a 0-dim tensor (into `out` if given). A norm, squared, not a dot product: on a
    CPU torch.dot goes to a BLAS that threads even a 10k-element product (measured on the 2-core
    machine under load: 483 us with 2 threads, 4 us with 1), the norm is a plain reduction
    (3 us either way)."""
    n = torch.linalg.vector_norm(x) if out is None else torch.linalg.vector_norm(x, out=out)
    return n.square_()


def check(cfg, spec, workers: int) -> None:
    """Refuse, in one line naming the flag, a layout whose noise scale cannot be measured."""
    if not cfg.noise_scale:
        return
    cls = spec.entry.cls
    if workers == 1:
        if not getattr(cls, "grads_in_flat_buffer", True):
            raise BadInput(f"--noise-scale: {spec.flags()} at 1 worker keeps its gradients outside the flat "
                           f"buffer that the half batches are measured in; use --strategy allreduce (the same "
                           f"maths at 1 worker) or 2+ workers")
        if cfg.batch_size < 2 or cfg.batch_size % 2:
            raise BadInput(f"--noise-scale: at 1 worker each batch is computed as two halves; "
                           f"--batch-size {cfg.batch_size} is not even")
    if (workers > 1 or spec.servers) and not getattr(cls, "measures_noise", False):
        raise BadInput(f"--noise-scale: {spec.flags()} has no averaged gradient to measure at {workers} "
                       f"workers (it averages weights or applies stale gradients); use --strategy allreduce "
                       f"or ps, or 1 worker")


class NoiseMeter:
    """One rank's device side: this rank's |g_local|^2, the recorded (small, big) pairs."""

    def __init__(self, *, workers: int, batch_size: int, steps: int, device: torch.device,
                 n_train: Optional[int], world_size: int):
        self.micro = workers == 1
        """One worker: two half batches give the small gradients."""
        self.b_small = batch_size / 2 if self.micro else float(batch_size)
        self.b_big = float(workers * batch_size)
        self.n_train = n_train
        self.records_locally = world_size == 1
        """Only one process: the half batches' step records here, no strategy involved."""
        self.hist = torch.zeros(steps + 1, 2, dtype=torch.float32, device=device)
        self.t = torch.zeros(1, dtype=torch.int64, device=device)
        self.owns_t = True
        self._local = torch.zeros((), dtype=torch.float32, device=device)
        self._saved: Optional[torch.Tensor] = None
        self._pair = torch.zeros(1, 2, dtype=torch.float32, device=device)
        self._small, self._big = self._pair[0, 0], self._pair[0, 1]  # views made once, not per step
        self._sq1 = torch.zeros((), dtype=torch.float32, device=device)

    # -- device side: no host sync, capturable in a CUDA graph ----------------------------------
    def bind(self, t: torch.Tensor) -> None:
        """Index the history by the fast step's device step counter (fast.py advances it)."""
        self.t, self.owns_t = t, False

    def seek(self, step: int) -> None:
        """Classic loop: the next record is step `step` (a resumed run)."""
        if self.owns_t:
            self.t.fill_(step)

    def put_local(self, slot: torch.Tensor, grads: torch.Tensor) -> None:
        """slot <- |g_local|^2 (a 0-dim view of the collective's buffer): the half batches' mean
        at one worker, else this rank's gradient now (one pass over it)."""
        if self.micro:
            slot.copy_(self._local)
        else:
            sq_norm(grads, out=slot)

    def record_grad(self, small: torch.Tensor, grads: torch.Tensor) -> None:
        """small: mean over the ranks of |g_local|^2 (batch b_small); grads: the averaged gradient."""
        self._small.copy_(small)
        sq_norm(grads, out=self._big)
        self._push()

    def record(self, small: torch.Tensor, big: torch.Tensor) -> None:
        """As record_grad, with |averaged g|^2 already summed (DDP's buckets)."""
        self._small.copy_(small)
        self._big.copy_(big)
        self._push()

    def _push(self) -> None:
        self.hist.index_copy_(0, self.t, self._pair)
        if self.owns_t:
            self.t.add_(1)

    def two_halves(self, fb: Callable[[Any, Any], torch.Tensor], x, y, grads: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the batch as two halves; `fb(x, y)` runs one and returns its
        (detached) mean loss. Leaves the batch's mean gradient in `grads` (sum / 2: equal halves)
        and returns the batch's mean loss. Costs one gradient-sized copy and two passes."""
        h = len(x) // 2
        if self._saved is None:
            self._saved = torch.empty_like(grads)
        l1 = fb(x[:h], y[:h])
        sq_norm(grads, out=self._sq1)
        self._saved.copy_(grads)
        l2 = fb(x[h:], y[h:])  # accumulates: grads = g1 + g2
        self._saved.sub_(grads)  # -g2
        sq_norm(self._saved, out=self._local).add_(self._sq1).mul_(0.5)
        grads.mul_(0.5)
        if self.records_locally:
            self.record_grad(self._local, grads)
        return (l1 + l2) * 0.5

    # -- host side -----------------------------------------------------------------------------
    def read(self, first: int, n: int) -> List[Tuple[float, float]]:
        """The pairs of steps [first, first + n); syncs the device (call it at the loop's reads)."""
        return [tuple(r) for r in self.hist[first:first + n].tolist()]


class NoiseTracker:
    """Rank 0's host side: per-step estimates, their moving averages and the run's totals."""

    def __init__(self, b_small: float, b_big: float, n_train: Optional[int]):
        self.b_small, self.b_big, self.n_train = b_small, b_big, n_train
        self.steps = 0
        self.ema_g2 = self.ema_trace = 0.0
        self.sum_g2 = self.sum_trace = 0.0
        self.trajectory: List[List[float]] = []
        self.last: Optional[Dict[str, float]] = None

    def add(self, step: int, small: float, big: float) -> Dict[str, Optional[float]]:
        """Step `step` (1-based, as metrics.jsonl counts) measured `small` and `big`."""
        g2, trace = estimate(small, big, self.b_small, self.b_big, self.n_train)
        if math.isfinite(g2) and math.isfinite(trace):
            self.steps += 1
            self.sum_g2 += g2
            self.sum_trace += trace
            self.ema_g2 = EMA_DECAY * self.ema_g2 + (1 - EMA_DECAY) * g2
            self.ema_trace = EMA_DECAY * self.ema_trace + (1 - EMA_DECAY) * trace
        debias = 1 - EMA_DECAY ** self.steps if self.steps else 1.0
        eg2, etr = self.ema_g2 / debias, self.ema_trace / debias
        b = etr / eg2 if eg2 > 0 else None
        self.last = {"b_simple": b, "g2": eg2, "trace": etr, "small_sq": small, "big_sq": big}
        return self.last

    def log_point(self, step: int) -> Dict[str, Optional[float]]:
        """The metrics.jsonl entry at a logged step; also kept for the trajectory."""
        self.trajectory.append([step, self.last["b_simple"] if self.last else None])
        return dict(self.last or {})

    def summary(self) -> Dict[str, Any]:
        g2 = self.sum_g2 / self.steps if self.steps else None
        trace = self.sum_trace / self.steps if self.steps else None
        traj = self.trajectory
        if len(traj) > TRAJECTORY_POINTS:
            idx = sorted({round(i * (len(traj) - 1) / (TRAJECTORY_POINTS - 1)) for i in range(TRAJECTORY_POINTS)})
            traj = [traj[i] for i in idx]
        return {
            "gradient_noise_scale": trace / g2 if g2 and g2 > 0 else None,
            "gradient_noise_scale_final": self.last["b_simple"] if self.last else None,
            "gradient_noise_scale_trajectory": traj,
            "noise_scale": {"g2_mean": g2, "trace_mean": trace, "steps": self.steps,
                            "b_small": self.b_small, "b_big": self.b_big, "n_train": self.n_train,
                            "ema_decay": EMA_DECAY,
                            "estimator": "McCandlish et al. 2018 appendix A, finite-population corrected; "
                                         "gradient_noise_scale = mean tr(Sigma) / mean |G|^2 over the run"}}

    def state_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in ("steps", "ema_g2", "ema_trace", "sum_g2", "sum_trace",
                                              "trajectory", "last")}

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        for k, v in d.items():
            setattr(self, k, v)
