"""When a run evaluates by default: often enough to draw its accuracy curve, rarely enough that
evaluation stays under EVAL_SHARE of the run's time (issue 41: a 1-epoch Fashion-MNIST run spent
more than a third of its time in its fixed 10 + 1 full test passes; docs/performance.md, "Behind
the code").

n evaluations of c seconds each stay under a share s of a run of T training seconds while
n * c <= s * (T + n * c), i.e. n <= T * s / ((1 - s) * c). n counts the evaluation at the end
(always made: it is the run's result) and the one before training (if made), and is at most
EVAL_MAX; the others are spread evenly over the projected training time. Rank 0 decides (its
request rides in the loop's control all-reduce), so every rank evaluates at the same steps.

`evaluate` is the evaluation itself (`test_pass`: the full test set, split between the ranks;
`compute_pass`: a split of the general contract's data); `Monitor` follows one of its numbers for
--early-stop and --save-best.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shmlearn.data.stream import test_batches
from shmlearn.data.tree import TreeData, rows
from shmlearn.errors import BadInput
from shmlearn.record.metrics import metric_goal
from shmlearn.train.eval_graph import EvalGraph
from shmlearn.user.tasks import correct, loss_fn, split_result

EVAL_SHARE = 0.1
"""The default schedule keeps evaluation under this share of a run's time."""
EVAL_MAX = 10
"""... with at most this many evaluations (the fixed default before issue 41)."""
FORWARD_SHARE = 1 / 3
"""A forward pass's share of a training step's time per sample, for the estimate of an
evaluation's cost before one has been measured (--eval-at-start off)."""


def estimated_cost(step_s: float, test_per_rank: float, batch_size: int) -> float:
    """Seconds of one evaluation: this rank's test slice at a forward pass's cost per sample."""
    return step_s * FORWARD_SHARE * test_per_rank / batch_size


def count(total_s: float, cost_s: float) -> int:
    """Evaluations a run of total_s training seconds affords at cost_s each (1 to EVAL_MAX)."""
    return min(EVAL_MAX, max(1, int(total_s * EVAL_SHARE / ((1 - EVAL_SHARE) * max(cost_s, 1e-9)))))


def due(*, steps: int, done: int, train_s: float, cost_s: Optional[float], test_per_rank: float,
        batch_size: int, eval_steps: Sequence[int]) -> bool:
    """Whether to evaluate after `done` of `steps` steps, `train_s` seconds of training in (the
    evaluation at the last step is made anyway). cost_s: the last evaluation's measured seconds,
    or None (estimated); eval_steps: the steps evaluated so far (0: before training)."""
    if done >= steps or done <= 0 or train_s <= 0:
        return False
    step_s = train_s / done
    total = step_s * steps
    cost = cost_s if cost_s is not None else estimated_cost(step_s, test_per_rank, batch_size)
    middle = count(total, cost) - 1 - int(0 in eval_steps)
    made = sum(1 for s in eval_steps if 0 < s < steps)
    return made < middle and train_s >= total * (made + 1) / (middle + 1)


@torch.no_grad()
def test_pass(model, data, *, rank: int, world_size: int, device: torch.device, normalize, autocast, loss, task: str,
              timeout_s, batch_size: int = 1024, graph: Optional[EvalGraph] = None) -> torch.Tensor:
    """Full test set, once: rank r evaluates the r-th of W contiguous slices, sums are
    all-reduced, so no sample is skipped or counted twice. Returns (loss sum, correct, samples) on
    the device, float64. loss: the user's mean loss, or None (the task's, summed); autocast: () ->
    the step's autocast context; graph: the run's EvalGraph (CUDA: full batches replayed, the same
    numbers), or None."""

    def add(sums: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> None:
        with autocast():
            out = model(normalize(xb)).float()
        if loss is None:
            sums[0] += loss_fn(task, out, yb, reduction="sum").double()
        else:  # the user's loss is a mean
            sums[0] += loss(out, yb).double() * len(yb)
        c = correct(task, out, yb)
        if c is not None:
            sums[1] += c
        sums[2] += len(yb)

    model.eval()
    sums = graph.start() if graph is not None else torch.zeros(3, dtype=torch.float64, device=device)
    for xb, yb in test_batches(data, rank, world_size, device, size=batch_size, timeout_s=timeout_s):
        if graph is not None:
            graph.add(add, xb, yb)
        else:
            add(sums, xb, yb)
    if world_size > 1:
        dist.all_reduce(sums)
    model.train()
    return sums.clone() if graph is not None else sums  # the graph's sums are the next pass's


@torch.no_grad()
def compute_pass(model, data, split: str, *, compute, names: Sequence[str], rank: int, world_size: int,
                 device: torch.device, normalize, autocast, batch_size: int, timeout_s) -> Dict[str, float]:
    """The general contract's evaluation of one split (test or val), once: rank r takes the r-th of
    W contiguous slices, `compute(model, batch)` gives each batch's mean loss and metrics, and the
    sums weighted by the batch's rows are all-reduced. Returns {"loss": mean, name: mean, ...}
    over the whole split. data: TreeData (a batch is the tree's rows), or built-in/array data (a
    batch is the (normalized inputs, targets) pair)."""
    model.eval()
    sums = torch.zeros(len(names) + 2, dtype=torch.float64, device=device)
    if isinstance(data, TreeData):
        batches = ((b, rows(b)) for b in data.eval_batches(split, rank, world_size, batch_size))
    else:
        batches = (((normalize(xb), yb), len(yb))
                   for xb, yb in test_batches(data, rank, world_size, device, size=batch_size, timeout_s=timeout_s))
    for batch, n in batches:
        with autocast():
            loss, metrics = split_result(compute(model, batch))
        sums[0] += loss.detach().double() * n
        for i, name in enumerate(names, start=1):
            v = metrics.get(name)
            if v is None:
                raise BadInput(f"compute_loss: returned no metric '{name}' for an evaluation batch "
                               f"(it did on the training samples); return the same names every time")
            sums[i] += (v.detach().double() if isinstance(v, torch.Tensor) else float(v)) * n
        sums[-1] += n
    if world_size > 1:
        dist.all_reduce(sums)
    model.train()
    vals = sums.tolist()
    n = max(vals[-1], 1.0)
    return {"loss": vals[0] / n, **{name: vals[i] / n for i, name in enumerate(names, start=1)}}


def evaluate(*, model, module, data, compute, names: Sequence[str], loss, task: str, rank: int, world_size: int,
             device: torch.device, normalize, autocast, batch_size: int, timeout_s,
             graph: Optional[EvalGraph] = None) -> Dict[str, Optional[float]]:
    """One evaluation's numbers, the same on every rank (all-reduced): with compute_loss the mean
    loss and metrics of the validation split (if any) and the test split (val_loss, val_NAME,
    test_loss, test_NAME; test_accuracy is the metric named accuracy, or None); else the test
    set's mean loss and accuracy (None for regression). model: the bare module; module: what the
    step calls forward on (DDP's wrapper); graph: test_pass's."""
    with untimed_convolutions(device):
        return _evaluate(model=model, module=module, data=data, compute=compute, names=names, loss=loss, task=task,
                         rank=rank, world_size=world_size, device=device, normalize=normalize, autocast=autocast,
                         batch_size=batch_size, timeout_s=timeout_s, graph=graph)


@contextlib.contextmanager
def untimed_convolutions(device: torch.device) -> Iterator[None]:
    """cuDNN's algorithms for an evaluation's convolutions from its heuristics, not timed as
    --cudnn-benchmark times the training step's: an evaluation runs a few batches of its own
    shapes (the test set's batch and the last, smaller one), and timing every algorithm for each
    new shape cost more than the evaluation itself (0.3-0.4 s of a process's first evaluation,
    fashion-net and alexnet-small on an H200, py-spy: results/gpu-2026-11-28-s26/); the step's
    own tuning is untouched."""
    from torch.backends import cudnn
    if device.type != "cuda" or not cudnn.benchmark:
        yield
        return
    cudnn.benchmark = False
    try:
        yield
    finally:
        cudnn.benchmark = True


def _evaluate(*, model, module, data, compute, names: Sequence[str], loss, task: str, rank: int, world_size: int,
              device: torch.device, normalize, autocast, batch_size: int, timeout_s,
              graph: Optional[EvalGraph]) -> Dict[str, Optional[float]]:
    if compute is not None:
        row: Dict[str, Optional[float]] = {}
        for split in (("val", "test") if getattr(data, "val", None) is not None else ("test",)):
            means = compute_pass(module, data, split, compute=compute, names=names, rank=rank, world_size=world_size,
                                 device=device, normalize=normalize, autocast=autocast, batch_size=batch_size,
                                 timeout_s=timeout_s)
            row.update({f"{split}_{k}": v for k, v in means.items()})
        row["test_accuracy"] = row.get("test_accuracy")
        return row
    sums = test_pass(model, data, rank=rank, world_size=world_size, device=device, normalize=normalize,
                     autocast=autocast, loss=loss, task=task, timeout_s=timeout_s, batch_size=batch_size, graph=graph)
    loss_sum, n_correct, n = sums.tolist()
    return {"test_loss": loss_sum / n, "test_accuracy": None if task == "regression" else n_correct / n}


class Monitor:
    """--monitor, --early-stop and --save-best: which evaluation is the best so far by one key of
    the rows, and how many evaluations have passed since. Derived from the rows alone (every rank
    holds the same, all-reduced), so every rank stops at the same step, and a resumed run, whose
    rows come back from its checkpoint, continues the count."""

    def __init__(self, key: str, patience: Optional[int]):
        self.key, self.goal, self.patience = key, metric_goal(key), patience

    def update(self, rows: Sequence[dict]) -> Tuple[bool, bool]:
        """(the newest row is the best so far, training should stop now)."""
        if self.key not in rows[-1]:
            known = ", ".join(k for k in rows[-1] if k.startswith(("val_", "test_")))
            raise BadInput(f"--monitor {self.key}: the evaluations report {known}")
        values = [r.get(self.key) for r in rows]
        finite = [(i, v) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
        if not finite:
            return False, False
        pick = max if self.goal == "max" else min
        best = pick(v for _, v in finite)
        first = next(i for i, v in finite if v == best)  # the earliest of equal values: later ones do not improve
        since = len(rows) - 1 - first
        return since == 0, bool(self.patience and since >= self.patience)

    def summary(self, rows: Sequence[dict], stopped_step: Optional[int]) -> Dict[str, Any]:
        finite = [r for r in rows if r.get(self.key) is not None and math.isfinite(r[self.key])]
        best = (max if self.goal == "max" else min)(finite, key=lambda r: r[self.key]) if finite else None
        return {"monitor": self.key, "monitor_goal": self.goal, "best_step": best["step"] if best else None,
                f"best_{self.key}": best[self.key] if best else None, "stopped_early": stopped_step}
