"""The optimization's section of the run's config (OptimOptions): the batch, what is minimized
(the loss) and how (optimizer, learning rate and its schedule, warmup, clipping). TrainConfig is
composed of it (config/train_config.py); the recipe reads it (user/recipe.py, user/optim.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional, Union

from shmlearn.config.flags import Section
from shmlearn.user.optim import SCHEDULES
from shmlearn.user.recipe import INTERVALS


@dataclass(kw_only=True)
class OptimOptions(Section):
    """The batch, the loss, the optimizer and the learning rate's schedule."""

    batch_size: int = 32
    """Samples per worker per micro-batch (per step unless --accumulate is above 1)."""
    accumulate: int = 1
    """Gradient accumulation: each worker computes N micro-batches of --batch-size per step, adding
    their gradients (each micro-batch's loss scaled by 1/N), and the workers synchronize once per
    step (one all-reduce), so a step is one process's step on workers x batch size x N samples.
    --samples and --epochs count those samples (steps = samples // (workers x batch size x N)).
    Not with --noise-scale."""
    lr: float = 0.05
    """Learning rate, applied to the gradient averaged over all workers."""
    optimizer: str = "momentum"
    """Built in: sgd, momentum, nesterov, adagrad, rmsprop, adam, adamax, adadelta, nadam, adamw
    (these read --lr, --momentum, --weight-decay and --lr-schedule). Or any torch.optim class by
    name (Adadelta, AdamW, ...) with --optimizer-args, or your own as FILE.py:NAME or
    pkg.module:NAME: an Optimizer class (called with the model's parameters) or a callable called
    with the model (for parameter groups) returning an Optimizer. A class or your own has no
    built-in schedule: its learning rate is its own unless --scheduler is given."""
    optimizer_args: Optional[Union[str, Dict[str, Any]]] = None
    """Keyword arguments of a torch.optim class or your own --optimizer: 'lr=1.0,rho=0.9'
    (values read as YAML: numbers, true/false, [0.9, 0.999])."""
    momentum: Optional[float] = None
    """Momentum for sgd/momentum/nesterov/rmsprop. Default 0.9 for momentum and nesterov, else 0."""
    weight_decay: float = 0.0
    """L2 penalty (the seed's AlexNet uses 0.004)."""
    lr_schedule: Literal[SCHEDULES] = "linear"
    """linear or cosine (decay to zero at the last step), or constant (the paper's experiments).
    For the built-in optimizers; --scheduler replaces it."""
    warmup: int = 0
    """Steps of linear learning-rate warmup before the schedule."""
    warmup_fraction: Optional[float] = None
    """Instead of --warmup: warmup over this fraction of the run's steps, rounded down (0.2: the
    first 20%), so a recipe's warmup follows --samples/--epochs/--batch-size overrides."""
    scheduler: Optional[str] = None
    """A torch.optim.lr_scheduler class by name (StepLR, CosineAnnealingLR, ...) with
    --scheduler-args, or your own as FILE.py:NAME or pkg.module:NAME, called with the optimizer.
    Replaces --lr-schedule."""
    scheduler_args: Optional[Union[str, Dict[str, Any]]] = None
    """Keyword arguments of --scheduler: 'step_size=1,gamma=0.7'."""
    scheduler_interval: Literal[INTERVALS] = "epoch"
    """When --scheduler steps: epoch (after every pass over the training set: training samples //
    (workers x batch size x --accumulate) steps; as pytorch/examples' StepLR) or step (after every step)."""
    clip_grad_norm: Optional[float] = None
    """Clip the gradient's global L2 norm to this value before each update, as
    torch.nn.utils.clip_grad_norm_ does (scale by min(1, X / (norm + 1e-6))), on the device with no
    host sync. The norm is the gradient averaged over the workers (and the --accumulate
    micro-batches): a step equals one process clipping the gradient of the step's whole batch
    (allreduce, ps, ddp; async-ps: the gradient the server applies). weight-avg has no averaged
    gradient: each worker clips its own gradient before its local update."""
    loss: Optional[str] = None
    """Your own training loss as FILE.py:NAME or pkg.module:NAME, f(outputs, targets) -> mean loss
    (also test_loss). Default: the task's (cross-entropy for classification)."""
    compute_loss: Optional[str] = None
    """The general contract, for any model and data: your own f(model, batch) -> loss, or (loss,
    {name: value}) with metrics that evaluation reports, as FILE.py:NAME or pkg.module:NAME. batch
    is one batch of your Dataset's items, collated and on the device (a tensor, tuple or dict; any
    shape and dtype); loss is the batch's mean. Replaces --loss and the task's loss and accuracy."""
    label_smoothing: float = 0.0
    """Classification: train on cross-entropy against targets mixed with the uniform distribution
    by this much (torch's F.cross_entropy(label_smoothing=...); 0.1 in the Fashion-MNIST recipes).
    Training loss only: test_loss stays plain cross-entropy."""

    def warmup_steps(self, steps: int) -> int:
        """Warmup steps of a run of `steps` steps: --warmup, or --warmup-fraction x steps rounded
        down (as benchmarks/fashion_tta.py computes it)."""
        return int(self.warmup_fraction * steps) if self.warmup_fraction is not None else self.warmup
