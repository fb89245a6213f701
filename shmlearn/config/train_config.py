"""Typed run configuration: one keyword-only dataclass, YAML in and out, validated once up front.

The CLI only fills a TrainConfig; experiments and sweeps build TrainConfigs in Python. Every
field has a docstring because `shmlearn train --help` is generated from them, and a field that
takes one of a few strings is typed `Literal[...]`: its choices are validate's check and the
flag's argparse choices alike (`options`). A strategy's own parameters are declared in its file
under shmlearn/sync/ (registry.param) and composed here: TrainConfig takes them as keywords,
config.yaml writes them beside `strategy`, and --help lists them under their strategy.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Literal, Optional, Union

import yaml

from shmlearn.record import readback

from shmlearn.user import recipe

from shmlearn.record import tblog
from shmlearn.data import DATASETS
from shmlearn.data.augment import Augment
from shmlearn.data.user import LOADERS, TASKS
from shmlearn.errors import BadInput, count
from shmlearn.config.flags import Option, options_of
from shmlearn.config.limits import MAX_STEPS, number as _number, whole as _whole  # noqa: F401 - MAX_STEPS is part of config's API
from shmlearn.models import MODELS
from shmlearn.nn.conv_overlap import MODES as CONV_OVERLAP
from shmlearn.nn.conv_pool import MODES as CONV_POOL
from shmlearn.nn.image_conv import MODES as IMAGE_CONV
from shmlearn.nn.max_pool import MODES as MAX_POOL
from shmlearn.nn.mlp_head import MODES as MLP_HEAD
from shmlearn.user.optim import SCHEDULES
from shmlearn.user.recipe import INTERVALS
from shmlearn.user.refs import is_ref
from shmlearn.step.options import COMBO, COMPILE, CUDA_GRAPH, EARLY_UPDATE, GRAD_BUCKETS, PRECISIONS, WEIGHT_COPY
from shmlearn.sync import registry

DEFAULT_EPOCHS = {"digits": 20, "fashion-mnist": 2, "mnist": 2, "cifar10": 10, "tiny-imagenet": 10,
                  "synthetic": 10, "step": 1, "line": 20, "line-exact": 20}
"""Budget when neither --samples nor --epochs is given: enough for the default model to learn the
dataset well on a laptop (digits: 20 x 1437 samples; Fashion-MNIST: 2 x 60,000)."""
ALTERNATIVES = (("samples", "epochs"), ("warmup", "warmup_fraction"), ("eval_every", "eval_points"))
"""Fields that say one thing two ways (give one of each pair): a flag on the command line
replaces its pair in a --config file, so `--config recipe.yaml --samples 2048` overrides the
recipe's epochs instead of being refused as a second budget."""
HELP_GROUPS = {"basics": ("dataset", "model", "workers", "strategy", "batch_size", "lr", "samples", "epochs", "out"),
               "GPU kernels and the fast step (auto picks well)": (
                   "image_conv", "conv_pool", "mlp_head", "conv_overlap", "combo_kernels", "update_in_backward",
                   "grad_buckets", "weight_copy", "max_pool", "cuda_graph", "cudnn_benchmark")}
"""`train --help`'s groups (cli.py): the basics first, then the fields in no group, each strategy's
parameters, and the GPU kernels' choices last; within a group the fields' own order."""
OnOff = Literal["on", "off"]
# A Literal over a tuple another module owns (Literal[LOADERS]) is that tuple's values: the
# choices are written once, where the code that acts on them lives (the step's, the layers').


@dataclass(kw_only=True)
class TrainFields:
    """TrainConfig's own settings; TrainConfig adds the strategies' parameters (below)."""

    model: str = "mlp"
    """A built-in model by name (shmlearn.models.MODELS), or your own:
    FILE.py:NAME or pkg.module:NAME, NAME an nn.Module class or a callable returning a module."""
    dataset: str = "digits"
    """A built-in dataset by name (shmlearn.data.DATASETS), or your own:
    FILE.py:NAME or pkg.module:NAME, NAME a callable returning (train_x, train_y, test_x, test_y)
    arrays or a pair of torch Datasets."""
    data_dir: Optional[str] = None
    """Folder holding the dataset's files (IDX, CIFAR batches, tiny-imagenet-200)."""
    workers: Optional[int] = None
    """Gradient-computing workers. Local default 2; under torchrun/mpirun/srun the launcher's world
    size (minus one with --ps-dedicated or async-ps: the server)."""
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """cpu, cuda (one process per GPU, NCCL) or auto (cuda when present)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """How the processes talk: auto (NCCL on GPUs, Gloo on the CPU), nccl, or gloo. gloo on GPUs
    lets processes share a GPU (collectives through host memory): e.g. an async-ps server and
    two workers on one GPU."""
    threads: Optional[int] = None
    """Intra-op CPU threads per worker. Default on the CPU: the cores divided among the processes,
    at least 1; on GPUs at most 4 (limits.GPU_RANK_THREADS: a GPU's rank needs few, and more made
    the ranks of one host slow each other's steps)."""
    strategy: str = registry.DEFAULT
    """How the workers synchronize: a strategy registered in shmlearn.sync, by name."""
    strategy_options: Dict[str, Any] = field(default_factory=dict)
    """The strategies' own parameters this config sets, by config key ({"avg_period": 4}; those
    left at their defaults are not kept). Set them as keywords, flags or YAML keys like any other
    field: TrainConfig(avg_period=4), --avg-period 4, `avg_period: 4`."""
    batch_size: int = 32
    """Samples per worker per micro-batch (per step unless --accumulate is above 1)."""
    accumulate: int = 1
    """Gradient accumulation: each worker computes N micro-batches of --batch-size per step, adding
    their gradients (each micro-batch's loss scaled by 1/N), and the workers synchronize once per
    step (one all-reduce), so a step is one process's step on workers x batch size x N samples.
    --samples and --epochs count those samples (steps = samples // (workers x batch size x N)).
    Not with --noise-scale."""
    clip_grad_norm: Optional[float] = None
    """Clip the gradient's global L2 norm to this value before each update, as
    torch.nn.utils.clip_grad_norm_ does (scale by min(1, X / (norm + 1e-6))), on the device with no
    host sync. The norm is the gradient averaged over the workers (and the --accumulate
    micro-batches): a step equals one process clipping the gradient of the step's whole batch
    (allreduce, ps, ddp; async-ps: the gradient the server applies). weight-avg has no averaged
    gradient: each worker clips its own gradient before its local update."""
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
    scheduler: Optional[str] = None
    """A torch.optim.lr_scheduler class by name (StepLR, CosineAnnealingLR, ...) with
    --scheduler-args, or your own as FILE.py:NAME or pkg.module:NAME, called with the optimizer.
    Replaces --lr-schedule."""
    scheduler_args: Optional[Union[str, Dict[str, Any]]] = None
    """Keyword arguments of --scheduler: 'step_size=1,gamma=0.7'."""
    scheduler_interval: Literal[INTERVALS] = "epoch"
    """When --scheduler steps: epoch (after every pass over the training set: training samples //
    (workers x batch size x --accumulate) steps; as pytorch/examples' StepLR) or step (after every step)."""
    loss: Optional[str] = None
    """Your own training loss as FILE.py:NAME or pkg.module:NAME, f(outputs, targets) -> mean loss
    (also test_loss). Default: the task's (cross-entropy for classification)."""
    compute_loss: Optional[str] = None
    """The general contract, for any model and data: your own f(model, batch) -> loss, or (loss,
    {name: value}) with metrics that evaluation reports, as FILE.py:NAME or pkg.module:NAME. batch
    is one batch of your Dataset's items, collated and on the device (a tensor, tuple or dict; any
    shape and dtype); loss is the batch's mean. Replaces --loss and the task's loss and accuracy."""
    eval_batch_size: int = 1024
    """Samples per forward pass when evaluating (test and validation splits)."""
    lr_schedule: Literal[SCHEDULES] = "linear"
    """linear or cosine (decay to zero at the last step), or constant (the paper's experiments).
    For the built-in optimizers; --scheduler replaces it."""
    warmup: int = 0
    """Steps of linear learning-rate warmup before the schedule."""
    warmup_fraction: Optional[float] = None
    """Instead of --warmup: warmup over this fraction of the run's steps, rounded down (0.2: the
    first 20%), so a recipe's warmup follows --samples/--epochs/--batch-size overrides."""
    momentum: Optional[float] = None
    """Momentum for sgd/momentum/nesterov/rmsprop. Default 0.9 for momentum and nesterov, else 0."""
    weight_decay: float = 0.0
    """L2 penalty (the seed's AlexNet uses 0.004)."""
    label_smoothing: float = 0.0
    """Classification: train on cross-entropy against targets mixed with the uniform distribution
    by this much (torch's F.cross_entropy(label_smoothing=...); 0.1 in the Fashion-MNIST recipes).
    Training loss only: test_loss stays plain cross-entropy."""
    folded_linear: bool = False
    """Build every fully connected layer as a bias-folded FoldedLinear (paper §4) instead of nn.Linear."""
    init: str = "default"
    """default (torch's init) or uniform:A (every parameter uniform in [-A, A])."""
    augment: str = "none"
    """Training-image augmentation on the device, chosen by (seed, epoch, position): none, flip,
    translate:N (shift by up to N pixels, zero fill) or both, e.g. 'flip,translate:2'."""
    precision: Literal[PRECISIONS] = "fp32"
    """fp32, or bf16: forward and backward under bf16 autocast (weights, gradients and optimizer
    state stay fp32)."""
    channels_last: bool = False
    """Keep conv weights and image batches in channels_last memory (faster convolutions on GPUs,
    mostly with bf16)."""
    compile: Literal[COMPILE] = "off"
    """torch.compile the model (Inductor): off, default, max-autotune, or auto (compile, time a
    few steps against eager, keep the faster). Its kernels run inside the fast step (on CUDA
    inside the step's one CUDA graph); compile time is reported (summary.json compile_s) and
    Inductor caches it for later runs and a sweep's trials."""
    image_conv: Literal[IMAGE_CONV] = "auto"
    """How each convolution of the input image runs (in_channels x kernel area <= 128, e.g. the
    3-channel first conv; groups 1, dilation 1), which cuDNN runs far from its limits: cudnn
    (torch's own), im2col (one gather plus cuBLAS GEMMs; pays with --compile), triton
    (shmlearn's implicit-GEMM kernels; CUDA with Triton) or auto (im2col in a compiled step on
    CUDA, else cudnn). Same maths, parameters and checkpoints; shmlearn/nn/image_conv.py."""
    conv_pool: Literal[CONV_POOL] = "auto"
    """How a Conv2d (stride 1) followed by ReLU and MaxPool2d(2) in an nn.Sequential runs: off
    (three ops), triton (one fused Triton kernel that never writes the conv's full output; CUDA
    with Triton) or auto (triton where it can run). Same outputs and gradients, parameters and
    checkpoints; shmlearn/nn/conv_pool.py."""
    mlp_head: Literal[MLP_HEAD] = "auto"
    """How a classifier head of 2 or 3 Linear layers with ReLU between them (consecutive in an
    nn.Sequential, widths <= 128) runs in fp16/bf16: off (torch's ops: about 15 kernels) or triton
    (three fused Triton kernels, forward and backward; CUDA with Triton) or auto (triton where it
    can run). Same outputs and gradients to rounding, parameters and checkpoints;
    shmlearn/nn/mlp_head.py."""
    conv_overlap: Literal[CONV_OVERLAP] = "auto"
    """How a convolution's backward runs its two GEMMs (the input's gradient and the weight's):
    off (one after the other, as torch does), small (on two CUDA streams at once, for
    convolutions whose batch x output height x width is at most 8192: the GEMMs that leave a
    large GPU idle), all (every convolution, conv-pool blocks too) or auto (all on CUDA where the
    fast step takes its gradients whole, small where it cannot, else off). Where the fast step
    takes its gradients whole, the weight GEMMs run on until the backward ends, beside the
    layers before them. Same cuDNN calls, so the same gradients, parameters and checkpoints;
    shmlearn/nn/conv_overlap.py."""
    combo_kernels: Literal[COMBO] = "auto"
    """--compile: Inductor's combo kernels (independent small kernels launched as one): on, off,
    or auto (on CUDA for batches of at most 262,144 image pixels, e.g. 256 images of 32x32,
    where the step is bound by its many small kernels; off elsewhere). Same maths;
    shmlearn/step/fast.py COMBO_MAX_PIXELS."""
    update_in_backward: Literal[EARLY_UPDATE] = "auto"
    """The fast step's SGD update of each convolution's weight inside the backward, on the side
    stream, as soon as its gradient exists (instead of every parameter's after the backward): on,
    off, or auto (on wherever it can run: allreduce at 1 worker or weight-avg, the flat SGD
    kernel on CUDA, convolutions that run shmlearn's backward op; on asks for it and says why not
    where it cannot). The same update, bit for bit; shmlearn/step/fast.py."""
    grad_buckets: Literal[GRAD_BUCKETS] = "auto"
    """The fast step's gradient all-reduce in buckets of 25 MB (the first 1 MB), each started as
    soon as the backward has made its gradients, on a stream of its own, so that the average
    overlaps the rest of the backward (as DDP's buckets do): on, off, or auto (on CUDA where the
    gradient fills two buckets or more and the step is not compiled; on asks for it wherever it
    can run, the CPU's Gloo included). The same sums of the same values: at two workers the same
    bits; shmlearn/step/buckets.py."""
    weight_copy: Literal[WEIGHT_COPY] = "auto"
    """The fast step's update also writes the convolutions' weights cast to bf16, and the next
    forward reads them there instead of casting every weight first (autocast's cast, a pass over
    the weights on the forward's critical path): on, off, or auto (on wherever it can run: bf16,
    the flat SGD kernel on CUDA, convolutions that run shmlearn's op; on says why not where it
    cannot). The same weights cast the same way, so the same steps; shmlearn/step/fast.py."""
    max_pool: Literal[MAX_POOL] = "auto"
    """How max-pools run: aten (torch's kernels: int64 argmax indices, a scatter backward),
    global (global max-pools as a max over the map with a pointwise backward, which Inductor
    fuses), reduce (global and kernel == stride pools alike) or auto (global when the step is
    compiled, else aten; every pool as a reduction was slower on fashion-net). Same outputs and
    gradients, ties included; shmlearn/nn/max_pool.py."""
    cuda_graph: Literal[CUDA_GRAPH] = "auto"
    """auto: on CUDA, capture the whole fast step (data, forward, backward, gradient sync, update)
    in one CUDA graph and replay it (falls back to eager, and says why, if capture fails); off."""
    oversubscribe: bool = False
    """Run more local CPU processes than the machine can hold well (more than 16 per core, or
    more than its available memory at ~150 MB each), or more than 4 threads per core; refused
    otherwise, before any process starts."""
    cudnn_benchmark: OnOff = "on"
    """CUDA: on times every cuDNN convolution algorithm at each new input shape and keeps the
    fastest; off takes cuDNN's heuristic choice. Timing costs seconds at each new batch shape and
    pays back even in short sweep trials (measured: docs/performance.md, "Behind the code").
    --deterministic turns it off."""
    task: Optional[Literal[TASKS]] = None
    """Your own data only (data= or --dataset FILE.py:NAME): classification, binary or regression.
    Default: from the labels (integers: classification, floats: regression)."""
    loader: Literal[LOADERS] = "auto"
    """Your own torch Datasets only: resident (read whole onto the device), stream (a DataLoader
    with worker processes reads each batch), or auto (resident when it takes at most half the
    device's free memory)."""
    deterministic: bool = False
    """Bitwise-reproducible numerics on CUDA: deterministic cuDNN convolutions (no autotuning) and
    torch's deterministic algorithms (a warning for an op that has none); usually slower. Two runs
    of a config then give the same losses, so runs compare by their settings, not by chance (CPU
    runs are reproducible already)."""
    check_every: Optional[int] = None
    """Read the losses (NaN check, logging, rank 0's eval/checkpoint requests) every this many
    steps; in between, a step never waits for the device. Default 10 on CPU, 50 on CUDA
    (fast.DEFAULT_CHECK_EVERY). Above 1 needs allreduce, ps or weight-avg with sgd, momentum or
    nesterov (others read every step)."""
    noise_scale: bool = False
    """Measure the gradient noise scale B_simple = tr(Sigma)/|G|^2 (McCandlish et al. 2018) as
    training runs: each rank adds its local gradient's squared norm to the gradient collective
    the step already makes (allreduce, ps; at 1 worker every strategy, each batch computed as two
    halves). metrics.jsonl and summary.json get the estimates; docs/noise-scale.md."""
    noise_every: Optional[int] = None
    """With --noise-scale: measure every this many steps (steps 0, K, 2K, ...); the others run
    as without it. Default 50 at 1 worker, 10 at 2+ (noise.default_every): what keeps the cost
    under 2% of the step time. A measured step costs most at 1 worker (two half batches) and
    little at 2+ (two norms and one float in the collective; docs/performance.md, "Behind the
    code"); 1 gives every step's estimate (and that cost), fewer measurements give a
    noisier estimate (docs/noise-scale.md)."""
    samples: Optional[int] = None
    """Sample budget: training samples seen by all workers together; steps = samples // (workers *
    batch * accumulate)."""
    epochs: Optional[float] = None
    """Instead of --samples: passes over the training set. Default per dataset: digits 20,
    fashion-mnist/mnist 2, cifar10/tiny-imagenet/synthetic 10, step 1, line 20."""
    eval_every: Optional[float] = None
    """Evaluate the full test set every this many seconds of training."""
    eval_points: Optional[int] = None
    """Evaluate the full test set at exactly this many evenly spaced steps (the last at the end),
    plus the pass before training if --eval-at-start is on. Default (neither this nor
    --eval-every): as many as keep evaluation under ~10% of the run's time, at most 10 and at
    least the one at the end, rank 0 judging from the cost of an evaluation (measured, or until
    one is measured estimated from the step time) against the run's projected training time."""
    eval_at_start: OnOff = "on"
    """on: evaluate the full test set before the first step (step 0 of the accuracy curve; its
    cost counts in eval_time_s); off: skip it."""
    log_every: int = 10
    """Write a metrics.jsonl line every this many steps (and at the last). Logging only: every
    step's loss is kept (loss area, min loss) and checked for NaN/inf either way, read from the
    device every --check-every steps."""
    timeout: float = 300.0
    """Seconds a collective may wait, or a lone worker stay inside one step, before the run is
    brought down naming the rank."""
    checkpoint_every: Optional[Union[int, str]] = None
    """Checkpoint every N steps ("200") or every N seconds of training ("30s"); also at the end."""
    resume: bool = False
    """Continue the run in --out from its newest good checkpoint (start fresh if it has none)."""
    seed: int = 0
    """Seed for weights, data order and augmentation; shared by all ranks."""
    out: Optional[str] = None
    """Run directory. Default runs/<date>-<model>-<dataset>-<strategy>-w<workers>."""
    save_model: bool = True
    """The final weights are saved in the run directory, by default: model.safetensors (with the
    safetensors package) or model.pt, which shmlearn.load_model(RUN_DIR) returns as the trained
    module; --no-save-model skips them."""
    monitor: Optional[str] = None
    """What --early-stop and --save-best watch: a key of eval.jsonl's rows (val_loss, test_loss,
    test_accuracy, val_NAME for a metric of --compute-loss). Default val_loss where the data has a
    validation split, else test_loss. Its best is the least, or the most for accuracy-like names
    (accuracy, f1, auc, ...)."""
    early_stop: Optional[int] = None
    """Stop when --monitor has not improved for this many evaluations in a row (every rank stops
    at the same step; summary.json says stopped_early). Evaluations come from --eval-points or
    --eval-every, or the default schedule (up to 10)."""
    save_best: bool = False
    """Also keep the weights of the best evaluation by --monitor as best.safetensors (or best.pt)
    beside the final ones; shmlearn.load_model(RUN_DIR, best=True) returns them."""
    progress: bool = True
    """Rank 0's progress bar on stderr, on by default; --no-progress turns it off."""
    tensorboard: bool = False
    """Also write TensorBoard event files in RUN/tensorboard/ (rank 0): loss, lr, samples/s, phase
    seconds, test loss and accuracy; a sweep's trials are runs of one log dir (tensorboard
    --logdir SWEEP_DIR). Needs pip install 'shmlearn[tensorboard]'."""

    def budget_samples(self, train_size: int) -> int:
        """Total sample budget implied by --samples or --epochs (default: the dataset's epochs).

        Refuses, naming the flag the user gave, a budget of less than one step (of `workers` x
        `batch_size` samples; workers is known once the run has its processes) or of more than
        MAX_SAMPLES samples or MAX_STEPS steps."""
        if self.samples is not None:
            budget, flag, what = self.samples, f"--samples {self.samples}", ""
        else:
            epochs = self.epochs if self.epochs is not None else DEFAULT_EPOCHS.get(self.dataset, 10)
            budget = epochs * train_size
            flag = f"--epochs {epochs}" + ("" if self.epochs is not None else f" (the {self.dataset} default)")
            what = f"{epochs} x {train_size} training samples = {budget:.6g} samples, "
            if budget > MAX_SAMPLES:
                raise BadInput(f"{flag}: {what}expected at most {MAX_SAMPLES:.0e} samples")
            budget = int(budget)
        workers = self.workers or 1
        per_step = workers * self.batch_size * self.accumulate
        one_step = f"{count(workers, 'worker')} x {self.batch_size} samples" + (
            f" x {self.accumulate} micro-batches" if self.accumulate > 1 else "")
        if budget < per_step:
            raise BadInput(f"{flag}: {what}smaller than one step of {one_step}")
        if budget // per_step > MAX_STEPS:
            raise BadInput(f"{flag}: {budget // per_step} steps of {one_step}; expected at most "
                           f"{MAX_STEPS:.0e} steps "
                           f"(raise --batch-size, or train for fewer samples)")
        return budget

    def warmup_steps(self, steps: int) -> int:
        """Warmup steps of a run of `steps` steps: --warmup, or --warmup-fraction x steps rounded
        down (as benchmarks/fashion_tta.py computes it)."""
        return int(self.warmup_fraction * steps) if self.warmup_fraction is not None else self.warmup



_FIELDS = frozenset(f.name for f in fields(TrainFields))


class TrainConfig(TrainFields):
    """A run's configuration: TrainFields' settings and every registered strategy's parameters
    by their config keys (TrainConfig(strategy="weight-avg", avg_period=4)), so a strategy's
    file adds a parameter with no edit here. They are kept in `strategy_options` and read and
    set as attributes like the rest (cfg.avg_period: the value given, else the default);
    `registry.spec` refuses another strategy's. An unknown keyword is a TypeError, as in any
    dataclass."""

    def __init__(self, **values):
        theirs = registry.options()
        given = dict(values.pop("strategy_options", None) or {})
        given.update({k: values.pop(k) for k in [k for k in values if k in theirs and k not in _FIELDS]})
        super().__init__(**values)
        for k, v in given.items():
            if k not in theirs:
                raise TypeError(f"TrainConfig: unknown strategy parameter '{k}'; registered: {', '.join(theirs)}")
            setattr(self, k, v)

    def __getattr__(self, name: str):
        # Only reached when no attribute has the name: a strategy's parameter by its key.
        option = None if name.startswith("_") else registry.options().get(name)
        if option is None:
            raise AttributeError(f"'TrainConfig' object has no attribute '{name}'")
        return self.__dict__.get("strategy_options", {}).get(name, option.default)

    def __setattr__(self, name: str, value) -> None:
        option = None if name in _FIELDS else registry.options().get(name)
        if option is None:
            super().__setattr__(name, value)
        elif type(value) is type(option.default) and value == option.default:
            self.strategy_options.pop(name, None)  # the default: configs that mean the same are equal
        else:
            self.strategy_options[name] = value

    def to_dict(self) -> Dict[str, Any]:
        """Every key, flat, in options()' order (config.yaml): a strategy's parameters as the
        top-level keys they always were, beside `strategy`."""
        mine = dataclasses.asdict(self)
        given = mine.pop("strategy_options")
        out = {k: mine[k] if k in mine else given.pop(k, o.default) for k, o in options().items()}
        out.update(given)  # a key whose strategy left the registry since: kept, not dropped
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any], *, source: str = "config") -> "TrainConfig":
        """d's values checked against their options' declared types, and read as meant
        (flags.Option.coerce): a wrong type is one line naming `source`, the key and the type."""
        known = options()
        for k in d:
            if k.replace("-", "_") not in known:
                raise BadInput(f"{source}: unknown key {readback.shown(k)}; known keys: {', '.join(sorted(known))}")
        return cls(**{k.replace("-", "_"): known[k.replace("-", "_")].coerce(v, source) for k, v in d.items()})


@functools.lru_cache(maxsize=None)
def _own_options() -> Dict[str, Option]:
    return {o.name: o for o in options_of(TrainFields) if o.name != "strategy_options"}


def options() -> Dict[str, Option]:
    """Every key of a TrainConfig, in order: TrainFields' own, with every registered strategy's
    parameters after `strategy` (registry.options). One source for the train and sweep flags,
    config.yaml and validate; --model, --dataset and --strategy's help name what is registered
    now (the registries, not a copy of them in a docstring), and --strategy's choices are the
    registry's names."""
    theirs = registry.options()
    clash = sorted(_FIELDS & theirs.keys())
    if clash:
        raise TypeError(f"strategy parameter {clash[0]} ({' and '.join(theirs[clash[0]].strategies)}) "
                        f"is already a TrainConfig field")
    out: Dict[str, Option] = {}
    for name, o in _own_options().items():
        if name == "model":
            o = dataclasses.replace(o, help=f"{o.help} Built in: {', '.join(MODELS)}.")
        elif name == "dataset":
            o = dataclasses.replace(o, help=f"{o.help} Built in: {', '.join(DATASETS)}.")
        elif name == "strategy":
            named = "; ".join(f"{n}: {e.help}" for n, e in registry.entries().items())
            o = dataclasses.replace(o, help=f"{o.help} {named}.", choices=tuple(registry.entries()))
        group = next((g for g, names in HELP_GROUPS.items() if name in names), "")
        out[name] = dataclasses.replace(o, group=group) if group else o
        if name == "strategy":
            out.update(theirs)
    return out


def load_yaml(path: str) -> Dict[str, Any]:
    """Read a --config file into a dict of TrainConfig fields (not yet validated; YAML 1.1's
    yes/no/on/off kept as readback.Words, which TrainConfig.from_dict reads by each field's type)."""
    return readback.read_yaml(path, what="--config", words=True)


def save_yaml(cfg: TrainConfig, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)


# The ranges validate() holds every numeric field to, and why. Each bound is far beyond any run
# this library is for; past it the value breaks something (a tensor, a timer, a seed) or means
# a typo, and a run that crashes or trains wrongly minutes later is worse than one line now.
F32_MAX = 3.4028234663852886e38
"""lr becomes a float32 tensor (fast.py) and weight_decay multiplies float32 weights: past this, inf."""
MAX_SAMPLES = 10**12
"""--samples, or --epochs x the training set: ~3 years at 10,000 samples/s (ImageNet x 90 epochs is
1.2e8), and float64 sample counts, rates and epoch fractions stay exact (2**53 is 9e15)."""
MAX_THREADS = 4096
"""Intra-op threads per worker: more than any machine's cores; 100,000 segfaults a rank."""
MAX_EVAL_POINTS = 10**6
"""Evaluations per run (each a full test-set pass; the run builds the set of their steps)."""
MAX_SEED = 2**32
"""Seeds 0 <= seed < 2**32 (numpy's classic range). The loader seeds epoch e's permutation with
seed * 1_000_003 + e, which torch's Generator needs below 2**64 (so seed below ~1.8e13)."""
TIMEOUT_RANGE = (1.0, 1e6)
"""--timeout in seconds: below ~1 s Gloo cannot even connect (it fails with C++ frames); 1e6 s
(11.6 days) is past any wait worth having, and datetime.timedelta holds it."""


def validate(cfg: TrainConfig) -> None:
    """Everything that can be checked without the data. Raises BadInput with one line."""
    for name, option in options().items():  # every value of its declared type (from Python too)
        if name in _FIELDS or name in cfg.strategy_options:
            option.coerce(getattr(cfg, name), strict=True)
    if cfg.model not in MODELS and not is_ref(cfg.model):
        raise BadInput(f"--model {cfg.model}: unknown model; choose one of {', '.join(MODELS)}, "
                       f"or your own as FILE.py:NAME or pkg.module:NAME")
    if cfg.dataset not in DATASETS and not is_ref(cfg.dataset):
        raise BadInput(f"--dataset {cfg.dataset}: unknown dataset; choose one of {', '.join(DATASETS)}, "
                       f"or your own as FILE.py:NAME or pkg.module:NAME")
    for name, option in options().items():  # every Literal field (and --strategy): one of its choices
        if name in _FIELDS:
            option.check(getattr(cfg, name))
    if cfg.task is not None and not is_ref(cfg.dataset):
        raise BadInput(f"--task {cfg.task}: only for your own data (data= or --dataset FILE.py:NAME); "
                       f"{cfg.dataset} knows its task")
    registry.spec(cfg)  # the strategy, its parameters' ranges and choices, and no other strategy's flags
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise BadInput("--backend nccl: needs --device cuda (NCCL talks between GPUs); the CPU uses gloo")
    recipe.validate(cfg)
    if cfg.checkpoint_every is not None:
        checkpoint_period(cfg.checkpoint_every)
    if cfg.tensorboard:
        tblog.require()
    if cfg.resume and not cfg.out:
        raise BadInput("--resume: needs --out DIR, the run directory to continue")
    # Whole numbers. workers has no upper bound here: what the machine can run is
    # launch.check_capacity's to say, and a launcher's world size is its own.
    _whole("workers", cfg.workers, 1)
    _whole("threads", cfg.threads, 1, MAX_THREADS)
    _whole("batch-size", cfg.batch_size, 1, MAX_SAMPLES)
    _whole("accumulate", cfg.accumulate, 1, MAX_STEPS)
    _whole("samples", cfg.samples, 1, MAX_SAMPLES)
    _whole("warmup", cfg.warmup, 0, MAX_STEPS)
    _whole("log-every", cfg.log_every, 1, MAX_STEPS)
    _whole("check-every", cfg.check_every, 1, MAX_STEPS)
    _whole("noise-every", cfg.noise_every, 1, MAX_STEPS)
    _whole("eval-points", cfg.eval_points, 1, MAX_EVAL_POINTS)
    _whole("eval-batch-size", cfg.eval_batch_size, 1, MAX_SAMPLES)
    _whole("early-stop", cfg.early_stop, 1, MAX_EVAL_POINTS)
    if cfg.monitor is not None and not (str(cfg.monitor).startswith(("val_", "test_"))
                                        and str(cfg.monitor).isidentifier()):
        raise BadInput(f"--monitor {cfg.monitor}: expected a key of eval.jsonl's rows: val_loss, test_loss, "
                       f"test_accuracy, or val_NAME / test_NAME for a metric your --compute-loss returns")
    _whole("seed", cfg.seed, 0, MAX_SEED - 1)
    # Real numbers: finite, and inside what their use can hold.
    _number("lr", cfg.lr, 0, F32_MAX, lo_open=True, unit=" (float32's largest)")
    _number("weight-decay", cfg.weight_decay, 0, F32_MAX, unit=" (float32's largest)")
    _number("momentum", cfg.momentum, 0, 1, hi_open=True)
    _number("warmup-fraction", cfg.warmup_fraction, 0, 1, hi_open=True)  # 1 would never reach --lr
    _number("label-smoothing", cfg.label_smoothing, 0, 1, hi_open=True)  # 1: every target uniform, nothing to learn
    _number("clip-grad-norm", cfg.clip_grad_norm, 0, F32_MAX, lo_open=True, unit=" (float32's largest)")
    if cfg.noise_scale and cfg.accumulate > 1:
        raise BadInput(f"--accumulate {cfg.accumulate} with --noise-scale: not supported (the meter measures "
                       f"the gradient of one backward, and a step now adds {cfg.accumulate}); drop one of them")
    if cfg.warmup_fraction is not None and cfg.warmup:
        raise BadInput(f"--warmup {cfg.warmup} and --warmup-fraction {cfg.warmup_fraction}: give one warmup, not both")
    _number("epochs", cfg.epochs, 0, MAX_SAMPLES, lo_open=True)  # x the training set: budget_samples
    _number("eval-every", cfg.eval_every, 0, lo_open=True, unit=" seconds")  # past the run: at the end only
    _number("timeout", cfg.timeout, *TIMEOUT_RANGE, unit=" seconds")
    if cfg.samples is not None and cfg.epochs is not None:
        raise BadInput("--samples and --epochs: give one budget, not both")
    if cfg.eval_every is not None and cfg.eval_points is not None:
        raise BadInput("--eval-every and --eval-points: give one evaluation schedule, not both")
    _check_init(cfg.init)
    Augment.parse(cfg.augment)


def checkpoint_period(spec) -> tuple:
    """'200' -> (200, 'steps'); '30s' -> (30.0, 'seconds'). Steps from 1 to MAX_STEPS; seconds
    finite and > 0 ('nans' and 'infs' parse as floats, and are refused)."""
    text = str(spec).strip()
    seconds = text.endswith("s")
    try:
        value = float(text[:-1]) if seconds else int(text)
    except ValueError:
        value = None
    ok = value is not None and (0 < value < math.inf if seconds else 1 <= value <= MAX_STEPS)
    if not ok:  # NaN fails every comparison
        raise BadInput(f"--checkpoint-every {spec}: expected a number of steps (200) from 1 to "
                       f"{MAX_STEPS:.0e}, or a finite number of seconds > 0 (30s)")
    return (value, "seconds") if seconds else (value, "steps")


def _check_init(init: str) -> None:
    kind, _, arg = init.partition(":")
    ok = init == "default"
    if kind == "uniform":
        try:
            ok = 0 < float(arg) <= F32_MAX  # NaN and inf fail; the weights are float32
        except ValueError:
            ok = False
    if not ok:
        raise BadInput(f"--init {init}: expected 'default' or 'uniform:A' with A finite and > 0")
