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

Only every K-th step measures (--noise-every, `default_every`): step s measures when s % K == 0
(0-based, the same on every rank; `NoiseMeter.begin`). The other steps run exactly as without
--noise-scale: one whole batch, no norms, nothing recorded.

Device side (`NoiseMeter`): no host sync; the pair goes into a device history indexed by the
step counter, read with the losses at the loop's reads (fast.py); only measured steps' rows are
written and read. Host side (`NoiseTracker`, rank 0): per-measurement estimates, an exponential moving average of |G|^2 and of tr(Sigma) taken
separately (their ratio is what is reported: the ratio of noisy estimates would be biased and
heavy-tailed), and the run's totals for summary.json.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from shmlearn.errors import BadInput

EMA_DECAY = 0.99
"""Per step: the moving averages of |G|^2 and tr(Sigma) forget with a time constant of ~100
steps (bias-corrected as Adam's moments are, so the first steps are not pulled toward 0)."""
MIN_DECAY = 0.9
"""Per measurement, at least: measuring every K steps, the averages decay by EMA_DECAY**K per
measurement (still ~100 steps), but never faster than this (10 measurements). At K = 50,
0.99**50 = 0.61 would make each estimate 40% of the average: a single step's |G|^2 is about as
noisy as it is large (docs/noise-scale.md), so a few measurements must not be forgotten at once;
the average then spans ~10 K steps instead (500 at K = 50)."""
EVERY_ONE_WORKER = 50
"""Default --noise-every at 1 worker: a measured step computes its batch as two halves, which
cost up to three quarters of a step more (results/noise-scale/NOTES.md;
docs/performance.md, "Behind the code"); 1/50 of that is <= 1.5%."""
EVERY_WORKERS = 10
"""Default --noise-every at 2+ workers: a measured step adds two squared norms of the gradient
and a scalar in the collective, at most a few percent of a small step (docs/performance.md);
1/10 of that is <= 0.7%, and 10x the measurements of the 1-worker default."""
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
    CPU torch.dot goes to a BLAS that threads even a 10k-element product (on the 2-core machine
    under load, two orders of magnitude slower with 2 threads than with 1; docs/performance.md),
    the norm is a plain reduction (as fast either way)."""
    n = torch.linalg.vector_norm(x) if out is None else torch.linalg.vector_norm(x, out=out)
    return n.square_()


def default_every(workers: int) -> int:
    """--noise-every when not given: steps per measurement, by what a measured step costs."""
    return EVERY_ONE_WORKER if workers == 1 else EVERY_WORKERS


def measured_steps(first: int, stop: int, every: int) -> range:
    """The measured steps (0-based) in [first, stop)."""
    return range(first + (-first) % every, stop, every)


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
                 n_train: Optional[int], world_size: int, every: int = 1):
        self.every = every
        """Steps per measurement: step s measures when s % every == 0."""
        self.on = False
        """Whether the current step measures (`begin`); every hook checks it, so nothing of the
        measurement runs on the other steps (a CUDA graph captures each case apart, fast.py)."""
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
        """No fast step (classic loop): `begin` sets t to the measured step itself."""
        self._local = torch.zeros((), dtype=torch.float32, device=device)
        self._saved: Optional[torch.Tensor] = None
        self._pair = torch.zeros(1, 2, dtype=torch.float32, device=device)
        self._small, self._big = self._pair[0, 0], self._pair[0, 1]  # views made once, not per step
        self._sq1 = torch.zeros((), dtype=torch.float32, device=device)

    # -- device side: no host sync, capturable in a CUDA graph ----------------------------------
    def bind(self, t: torch.Tensor) -> None:
        """Index the history by the fast step's device step counter (fast.py advances it)."""
        self.t, self.owns_t = t, False

    def measures(self, step: int) -> bool:
        return step % self.every == 0

    def begin(self, step: int) -> bool:
        """Step `step` starts (0-based, every rank alike): whether it measures. The classic loop
        has no device step counter: the record of a measured step goes to row `step`."""
        self.on = self.measures(step)
        if self.on and self.owns_t:
            self.t.fill_(step)
        return self.on

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

    def two_halves(self, fb: Callable[[Any, Any], torch.Tensor], x, y, grads: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the batch as two halves; `fb(x, y)` runs one and returns its
        (detached) mean loss. Leaves the batch's mean gradient in `grads` (sum / 2: equal halves)
        and returns the batch's mean loss. Costs one gradient-sized copy and two passes."""
        h = len(tree_flatten(x)[0][0]) // 2  # x: inputs, or the batch's tree (compute_loss; y None)

        def half(b, s: slice):
            return None if b is None else tree_map(lambda t: t[s], b)
        if self._saved is None:
            self._saved = torch.empty_like(grads)
        l1 = fb(half(x, slice(None, h)), half(y, slice(None, h)))
        sq_norm(grads, out=self._sq1)
        self._saved.copy_(grads)
        l2 = fb(half(x, slice(h, None)), half(y, slice(h, None)))  # accumulates: grads = g1 + g2
        self._saved.sub_(grads)  # -g2
        sq_norm(self._saved, out=self._local).add_(self._sq1).mul_(0.5)
        grads.mul_(0.5)
        if self.records_locally:
            self.record_grad(self._local, grads)
        return (l1 + l2) * 0.5

    # -- host side -----------------------------------------------------------------------------
    def read(self, first: int, n: int) -> Dict[int, Tuple[float, float]]:
        """step -> pair, for the measured steps in [first, first + n) only (the other rows hold
        nothing, or a CUDA graph's warm-up); syncs the device (call it at the loop's reads)."""
        steps = measured_steps(first, first + n, self.every)
        if not steps:
            return {}
        rows = self.hist[steps.start:steps.stop:self.every].tolist()
        return {s: tuple(r) for s, r in zip(steps, rows)}


class NoiseTracker:
    """Rank 0's host side: the measured steps' estimates, their moving averages and the run's
    totals. `add` only the measured steps."""

    def __init__(self, b_small: float, b_big: float, n_train: Optional[int], every: int = 1):
        self.b_small, self.b_big, self.n_train, self.every = b_small, b_big, n_train, every
        self.decay = max(EMA_DECAY ** every, MIN_DECAY)
        """Per measurement (MIN_DECAY says why); EMA_DECAY itself at every = 1."""
        self.steps = 0
        """Measurements taken (not training steps)."""
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
            d = self.decay
            self.ema_g2 = d * self.ema_g2 + (1 - d) * g2
            self.ema_trace = d * self.ema_trace + (1 - d) * trace
        debias = 1 - self.decay ** self.steps if self.steps else 1.0
        eg2, etr = self.ema_g2 / debias, self.ema_trace / debias
        b = etr / eg2 if eg2 > 0 else None
        self.last = {"b_simple": b, "g2": eg2, "trace": etr, "small_sq": small, "big_sq": big,
                     "measured_step": step}
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
                            "every": self.every, "ema_decay": self.decay,
                            "estimator": "McCandlish et al. 2018 appendix A, finite-population corrected; "
                                         "gradient_noise_scale = mean tr(Sigma) / mean |G|^2 over the run"}}

    def state_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in ("steps", "ema_g2", "ema_trace", "sum_g2", "sum_trace",
                                              "trajectory", "last")}

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        for k, v in d.items():
            setattr(self, k, v)
