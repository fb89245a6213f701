"""Loss and accuracy by task. Models output raw logits/values; the task decides what they mean."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from shmlearn.errors import BadInput


def loss_fn(task: str, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean",
            label_smoothing: float = 0.0) -> torch.Tensor:
    """The task's loss. label_smoothing (classification only, --label-smoothing): cross-entropy
    against (1 - s) one-hot + s / classes, as torch computes it."""
    if task == "classification":
        return F.cross_entropy(out, y, reduction=reduction, label_smoothing=label_smoothing)
    if label_smoothing:
        raise ValueError(f"label smoothing is for classification, not {task}")
    if task == "binary":
        # The paper's single sigmoid neuron is trained on the L2 loss of its sigmoid output
        # (seed 000 plots "L2 loss"), not on binary cross-entropy.
        return F.mse_loss(torch.sigmoid(out), y, reduction=reduction)
    return F.mse_loss(out, y, reduction=reduction)


def correct(task: str, out: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
    """Number of correct predictions in the batch, or None where accuracy has no meaning."""
    if task == "classification":
        return (out.argmax(1) == y).sum()
    if task == "binary":
        return ((out >= 0).to(y.dtype) == y).sum()
    return None


def split_result(out, what: str = "compute_loss"):
    """compute_loss's result as (loss, {name: value}): a loss alone, or a (loss, metrics) pair.
    Host checks only (isinstance), so the step may call it inside a captured CUDA graph."""
    if isinstance(out, torch.Tensor):
        return out, {}
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict):
        return out[0], out[1]
    raise BadInput(f"{what}: returned a {type(out).__name__}; expected the loss (a tensor) or (loss, "
                   f"{{name: value}})")

