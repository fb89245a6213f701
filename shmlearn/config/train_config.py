"""Typed run configuration: TrainConfig, composed of sections owned by their code; YAML in and
out; validated once, up front.

Each part of shmlearn declares the settings it reads as a section beside its code, a keyword-only
dataclass with a docstring under every field (its --help) and Literal[...] types for choices
(config.flags.Section checks them when a section is made): ModelOptions (models/options.py),
DataOptions (data/options.py), RunOptions (config/run.py), the sync section (each strategy's
parameters, declared in its file under shmlearn/sync/ and gathered by registry.section),
OptimOptions (user/options.py), StepOptions (step/options.py) and EvalOptions
(train/eval_options.py). TrainConfig is the dataclass that inherits them all.

Why inheritance and not nested sections (cfg.step.precision): a field stays one flat name
everywhere a user meets it, `TrainConfig(lr=0.1, grad_buckets="on")`, `cfg.lr`, `lr:` in YAML,
`--grad-buckets`, `dataclasses.replace(cfg, seed=1)`, with no mapping layer and no attribute
hooks to keep in step with the sections; each field is still declared once, by its owner, and a
TrainConfig *is* each of its sections, so the step is given the config itself as its StepOptions
(no copy of its fields). Adding a step option is its field in StepOptions and its use in the
step; adding a strategy parameter is its `param` in the strategy's file. Two sections may not
declare one name (a dataclass would silently keep one: `_check_disjoint` refuses it).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, fields
from typing import Any, Dict


from shmlearn.record import readback, yaml_io

from shmlearn.user import recipe

from shmlearn.record import tblog
from shmlearn.data import DATASETS
from shmlearn.data.augment import Augment
from shmlearn.data.options import DataOptions
from shmlearn.errors import BadInput, count
from shmlearn.config.flags import Option, options_of
from shmlearn.config.limits import MAX_STEPS, number as _number, whole as _whole  # noqa: F401 - MAX_STEPS is part of config's API
from shmlearn.config.run import RunOptions
from shmlearn.models import MODELS
from shmlearn.models.options import ModelOptions
from shmlearn.train.eval_options import EvalOptions
from shmlearn.user.options import OptimOptions
from shmlearn.user.refs import is_ref
from shmlearn.step.options import StepOptions
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

SyncOptions = registry.section()
"""The sync section: `strategy` and every registered strategy's parameters (registry.section)."""


def _check_disjoint(sections) -> None:
    """TypeError if two sections declare one field (a strategy's parameter named as a field):
    TrainConfig would keep one of them without a word."""
    owner: Dict[str, str] = {}
    for s in sections:
        for f in fields(s):
            if f.name in owner:
                raise TypeError(f"config field {f.name}: declared by both {owner[f.name]} and {s.__name__}")
            owner[f.name] = s.__name__


@dataclass(kw_only=True)
class TrainConfig(EvalOptions, StepOptions, OptimOptions, SyncOptions, RunOptions, DataOptions, ModelOptions):
    """A run's configuration: every section's fields, flat (TrainConfig(lr=0.1, avg_period=4),
    cfg.lr); an unknown keyword is a TypeError, as in any dataclass. A dataclass lists its last
    base's fields first: config.yaml and --help list the model's, the data's, the run's, the
    sync section's, the optimization's, the step's and the evaluation's, in that order."""

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

    def to_dict(self) -> Dict[str, Any]:
        """Every key, flat, in options()' order (config.yaml): a strategy's parameters as the
        top-level keys they always were, beside `strategy`."""
        mine = dataclasses.asdict(self)
        return {k: mine[k] for k in options()}

    @classmethod
    def from_dict(cls, d: Dict[str, Any], *, source: str = "config") -> "TrainConfig":
        """d's values checked against their options' declared types, and read as meant
        (flags.Option.coerce): a wrong type is one line naming `source`, the key and the type."""
        known = options()
        for k in d:
            if k.replace("-", "_") not in known:
                raise BadInput(f"{source}: unknown key {readback.shown(k)}; known keys: {', '.join(sorted(known))}")
        return cls(**{k.replace("-", "_"): known[k.replace("-", "_")].coerce(v, source) for k, v in d.items()})



_check_disjoint(reversed(TrainConfig.__bases__))
_FIELDS = frozenset(f.name for f in fields(TrainConfig))


@functools.lru_cache(maxsize=None)
def _own_options() -> Dict[str, Option]:
    return {o.name: o for o in options_of(TrainConfig)}


def options() -> Dict[str, Option]:
    """Every key of a TrainConfig, in its fields' order: the strategies' parameters (after
    `strategy`) as the registry describes them, the others as their sections declare them. One
    source for the train and sweep flags, config.yaml and validate; --model, --dataset and
    --strategy's help name what is registered now (the registries, not a copy of them in a
    docstring), and --strategy's choices are the registry's names."""
    theirs = registry.options()
    out: Dict[str, Option] = {}
    for name, o in _own_options().items():
        if name in theirs:
            out[name] = theirs[name]
            continue
        if name == "model":
            o = dataclasses.replace(o, help=f"{o.help} Built in: {', '.join(MODELS)}.")
        elif name == "dataset":
            o = dataclasses.replace(o, help=f"{o.help} Built in: {', '.join(DATASETS)}.")
        elif name == "strategy":
            named = "; ".join(f"{n}: {e.help}" for n, e in registry.entries().items())
            o = dataclasses.replace(o, help=f"{o.help} {named}.", choices=tuple(registry.entries()))
        group = next((g for g, names in HELP_GROUPS.items() if name in names), "")
        out[name] = dataclasses.replace(o, group=group) if group else o
    return out


def load_yaml(path: str) -> Dict[str, Any]:
    """Read a --config file into a dict of TrainConfig fields (not yet validated; YAML 1.1's
    yes/no/on/off kept as readback.Words, which TrainConfig.from_dict reads by each field's type)."""
    return readback.read_yaml(path, what="--config", words=True)


def save_yaml(cfg: TrainConfig, path: str) -> None:
    with open(path, "w") as f:
        yaml_io.dump(cfg.to_dict(), f)


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
        option.coerce(getattr(cfg, name), strict=True)
    if cfg.model not in MODELS and not is_ref(cfg.model):
        raise BadInput(f"--model {cfg.model}: unknown model; choose one of {', '.join(MODELS)}, "
                       f"or your own as FILE.py:NAME or pkg.module:NAME")
    if cfg.dataset not in DATASETS and not is_ref(cfg.dataset):
        raise BadInput(f"--dataset {cfg.dataset}: unknown dataset; choose one of {', '.join(DATASETS)}, "
                       f"or your own as FILE.py:NAME or pkg.module:NAME")
    # Each Literal field is one of its choices: its section checked that when it was made
    # (flags.Section); --strategy and its parameters' choices are registry.spec's, below.
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
