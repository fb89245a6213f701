"""The user's own optimizer, learning-rate scheduler and loss (issue 41: bring your whole recipe).

Each comes from Python (`shmlearn.train(cfg, optimizer=, scheduler=, loss=)`) or from the config
(`--optimizer`, `--scheduler`, `--loss`), where it is

* a torch class by name: `--optimizer Adadelta --optimizer-args lr=1.0` (any torch.optim
  optimizer), `--scheduler StepLR --scheduler-args step_size=1,gamma=0.7` (a class of
  torch.optim.lr_scheduler; ReduceLROnPlateau steps after each evaluation on the validation
  loss, or the test loss without a validation split: `OnEvaluation`);
* your own, as FILE.py:NAME or pkg.module:NAME (refs.py), called with `--X-args` as keywords;
* a built-in optimizer name (sgd, momentum, ..., optim.py), which reads --lr, --momentum,
  --weight-decay and the built-in --lr-schedule, as before.

What each is called with:

* optimizer: a torch.optim.Optimizer class (or functools.partial of one) is called with
  `model.parameters()`; anything else is called with the model itself (the nn.Module, before any
  wrapping: DDP, compile), so it can build parameter groups from `model.named_parameters()` or
  its submodules. It returns a torch.optim.Optimizer (torch's or any third party's).
* scheduler: called with the optimizer; returns an LRScheduler. It steps once per epoch by
  default (`--scheduler-interval epoch`, as pytorch/examples' StepLR does and Lightning's
  default): an epoch is `steps_per_epoch` = training samples // (workers x batch size x --accumulate) steps.
  `--scheduler-interval step` steps it after every step, as the built-in schedule does.
* loss: f(outputs, targets) -> mean loss, for training and evaluation's test_loss.

A user optimizer gets no built-in schedule (its learning rate is its own unless --scheduler
says otherwise): --lr, --momentum, --weight-decay, --lr-schedule and --warmup belong to the
built-in optimizers and are refused beside it rather than ignored.

config.yaml records each as its reference or name; an object passed from Python that is not a
top-level class or function is recorded as `python:<type>`, and a rerun from that config is
refused in one line (parts.resolve_ref).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Optional

import torch
import yaml

from shmlearn.errors import BadInput, one_line
from shmlearn.user.optim import OPTIMIZERS
from shmlearn.user.parts import resolve_ref
from shmlearn.user.refs import call_user, is_ref

INTERVALS = ("epoch", "step")


def parse_args(text: Optional[str], flag: str) -> Dict[str, Any]:
    """'lr=1.0,betas=[0.9, 0.99],nesterov=true' -> keywords, each value read as YAML (numbers,
    booleans, lists; anything else a string). Commas inside brackets belong to the value."""
    if text is None or str(text).strip() == "":
        return {}
    out: Dict[str, Any] = dict(text) if isinstance(text, dict) else _pairs(str(text), flag)  # a config.yaml may hold a mapping
    for key, v in out.items():  # nan or inf is never a learning rate, a decay or a step
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, float) and not math.isfinite(x):
                raise BadInput(f"{flag} {text}: {key}={x}; expected finite numbers")
    return out


PERIODS = ("step_size", "T_max")
"""Scheduler arguments that are a period in steps or epochs, which torch takes at any sign:
StepLR(step_size=-1) decays at every step, CosineAnnealingLR(T_max=-5) runs its cosine backwards
(0 divides by zero, found only when stepped)."""


def check_periods(args: Dict[str, Any], text: Any) -> None:
    """Each of PERIODS in a scheduler's keywords a whole number >= 1; else BadInput naming it."""
    for key in PERIODS:
        v = args.get(key)
        if key in args and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise BadInput(f"--scheduler-args {text}: {key}={v}; expected a whole number >= 1 "
                           f"(a period in steps or epochs)")


def _pairs(text: str, flag: str) -> Dict[str, Any]:
    items, depth, cur = [], 0, ""
    for ch in str(text):
        depth += (ch in "[(") - (ch in "])")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    out: Dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise BadInput(f"{flag} {text}: expected NAME=VALUE pairs separated by commas "
                           f"(lr=1.0,weight_decay=0.01), got {item.strip()!r}")
        try:
            v = yaml.safe_load(value.strip()) if value.strip() else ""
        except yaml.YAMLError:
            v = value.strip()
        if isinstance(v, str):  # YAML 1.1 reads 1e-3 (no dot) as text; Python writes 1e-05 so
            try:
                v = float(v)
            except ValueError:
                pass
        out[key] = tuple(v) if isinstance(v, list) else v
    return out


def torch_class(name: str, kind: str):
    """The torch.optim (kind 'optimizer') or torch.optim.lr_scheduler (kind 'scheduler') class
    called `name`, or None."""
    where = torch.optim if kind == "optimizer" else torch.optim.lr_scheduler
    base = torch.optim.Optimizer if kind == "optimizer" else torch.optim.lr_scheduler.LRScheduler
    obj = getattr(where, name, None) if name.isidentifier() else None
    return obj if isinstance(obj, type) and issubclass(obj, base) and obj is not base else None


def _torch_names(kind: str) -> str:
    where = torch.optim if kind == "optimizer" else torch.optim.lr_scheduler
    return ", ".join(n for n in dir(where) if torch_class(n, kind) is not None and not n.startswith("_")
                     and n not in ("ReduceLROnPlateau", "ChainedScheduler", "SequentialLR", "LRScheduler"))


def is_builtin_optimizer(cfg) -> bool:
    return cfg.optimizer in OPTIMIZERS


def validate(cfg) -> None:
    """What can be checked without the data or the model (config.validate calls this)."""
    if cfg.optimizer not in OPTIMIZERS and not is_ref(cfg.optimizer) and torch_class(cfg.optimizer, "optimizer") is None:
        raise BadInput(f"--optimizer {cfg.optimizer}: choose one of {', '.join(OPTIMIZERS)}, a torch.optim "
                       f"class ({_torch_names('optimizer')}), or your own as FILE.py:NAME or pkg.module:NAME")
    opt_args = parse_args(cfg.optimizer_args, "--optimizer-args")
    if is_builtin_optimizer(cfg):
        if opt_args:
            raise BadInput(f"--optimizer-args {cfg.optimizer_args}: for a torch.optim class or your own "
                           f"optimizer; the built-in {cfg.optimizer} takes --lr, --momentum, --weight-decay")
    else:
        for flag, given, instead in (
                ("momentum", cfg.momentum is not None, "give it in --optimizer-args"),
                ("weight-decay", cfg.weight_decay != 0.0, "give it in --optimizer-args"),
                ("lr-schedule", cfg.lr_schedule != "linear", "give a --scheduler"),
                ("warmup", bool(cfg.warmup) or cfg.warmup_fraction is not None, "give a --scheduler")):
            if given:
                raise BadInput(f"--{flag}: belongs to the built-in optimizers; with --optimizer {cfg.optimizer} "
                               f"{instead}")
    if cfg.scheduler is None:
        if cfg.scheduler_args:
            raise BadInput(f"--scheduler-args {cfg.scheduler_args}: needs --scheduler")
    else:
        if not is_ref(cfg.scheduler):
            cls = torch_class(cfg.scheduler, "scheduler")
            if cls is None or cls.__name__ in ("ChainedScheduler", "SequentialLR"):
                raise BadInput(f"--scheduler {cfg.scheduler}: choose a torch.optim.lr_scheduler class "
                               f"({_torch_names('scheduler')}), or your own as FILE.py:NAME")
        args = parse_args(cfg.scheduler_args, "--scheduler-args")
        if not is_ref(cfg.scheduler):  # torch's classes; a user's own names its arguments as it likes
            check_periods(args, cfg.scheduler_args)
        if is_builtin_optimizer(cfg) and (cfg.warmup or cfg.warmup_fraction is not None):
            raise BadInput(f"--warmup: belongs to the built-in --lr-schedule; --scheduler {cfg.scheduler} "
                           f"replaces it")
    if cfg.scheduler_interval not in INTERVALS:
        raise BadInput(f"--scheduler-interval {cfg.scheduler_interval}: choose one of {', '.join(INTERVALS)}")
    if cfg.loss is not None and not is_ref(cfg.loss):
        raise BadInput(f"--loss {cfg.loss}: expected your own loss as FILE.py:NAME or pkg.module:NAME "
                       f"(f(outputs, targets) -> mean loss); leave it out for the task's")
    if cfg.compute_loss is not None and not is_ref(cfg.compute_loss):
        raise BadInput(f"--compute-loss {cfg.compute_loss}: expected your own function as FILE.py:NAME or "
                       f"pkg.module:NAME (f(model, batch) -> loss or (loss, metrics))")
    if cfg.compute_loss is not None and cfg.loss is not None:
        raise BadInput(f"--compute-loss {cfg.compute_loss} and --loss {cfg.loss}: give one (compute_loss computes "
                       f"the loss itself)")
    if cfg.compute_loss is not None and cfg.label_smoothing:
        raise BadInput(f"--label-smoothing {cfg.label_smoothing}: smooths the built-in cross-entropy, which "
                       f"--compute-loss replaces (smooth inside your function)")


def check_refs(cfg, parts) -> None:
    """Before any process starts: every reference this run will import can be imported, a
    `python:` label has its object passed again, and a torch class accepts its arguments."""
    for field, flag, given in (("optimizer", "--optimizer", parts.optimizer), ("scheduler", "--scheduler",
                                                                               parts.scheduler),
                               ("loss", "--loss", parts.loss),
                               ("compute_loss", "--compute-loss", parts.compute_loss)):
        text = getattr(cfg, field)
        if given is None and text is not None and is_ref(text):
            resolve_ref(text, flag)
    probe = [torch.nn.Parameter(torch.zeros(2))]
    opt = None
    if parts.optimizer is None and torch_class(cfg.optimizer, "optimizer") is not None:
        check_closure(torch_class(cfg.optimizer, "optimizer"), f"--optimizer {cfg.optimizer}")
        opt = _construct(torch_class(cfg.optimizer, "optimizer"), probe, cfg.optimizer_args, "--optimizer")
    if parts.scheduler is None and cfg.scheduler is not None and not is_ref(cfg.scheduler):
        opt = opt or torch.optim.SGD(probe, lr=0.1)
        sched = _construct(torch_class(cfg.scheduler, "scheduler"), opt, cfg.scheduler_args, "--scheduler")
        probe_scheduler(sched, opt, f"--scheduler {cfg.scheduler}" + (
            f" --scheduler-args {cfg.scheduler_args}" if cfg.scheduler_args else ""))


PROBE_STEPS = 3
"""Steps a torch scheduler is stepped on a dummy optimizer before any process starts: StepLR's
step_size=0 divides by zero at its first step, not when it is built."""


def probe_scheduler(sched, opt, what: str) -> None:
    """Step `sched` PROBE_STEPS times (ReduceLROnPlateau with a loss): an exception, or a learning
    rate that is not a finite number >= 0, is BadInput naming the scheduler and its arguments."""
    plateau = isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
    try:
        for _ in range(PROBE_STEPS):
            opt.step()
            sched.step(1.0) if plateau else sched.step()
    except Exception as e:  # noqa: BLE001 - torch's own arithmetic on the user's arguments
        raise BadInput(f"{what}: stepping it raised {one_line(e)}") from None
    lrs = [g["lr"] for g in opt.param_groups]
    bad = next((lr for lr in lrs if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0)), None)
    if bad is not None:
        raise BadInput(f"{what}: after {PROBE_STEPS} steps the learning rate is {bad}; expected a finite number >= 0")


def _construct(cls, first, args: Optional[str], flag: str):
    kwargs = parse_args(args, f"{flag}-args")
    try:
        return cls(first, **kwargs)
    except Exception as e:  # noqa: BLE001 - torch's own check of its arguments
        shown = f" {flag}-args {args}" if args else ""
        raise BadInput(f"{flag} {cls.__name__}{shown}: {one_line(e)}") from None


def _takes_params(obj) -> bool:
    """A torch Optimizer class (or a partial of one) takes the parameters; anything else the model."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    return isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)


def _factory(cfg, given, field: str, kind: str) -> Optional[Callable]:
    """The optimizer or scheduler factory: the object given, a torch class with its args, or a
    reference with its args; None for the built-in optimizer (optim.py) or no scheduler."""
    text = getattr(cfg, field)
    args = parse_args(getattr(cfg, f"{field}_args"), f"--{field}-args")
    if given is not None:
        return functools.partial(given, **args) if args else given
    if text is None or (kind == "optimizer" and text in OPTIMIZERS):
        return None
    obj = torch_class(text, kind) if not is_ref(text) else resolve_ref(text, f"--{field}")
    return functools.partial(obj, **args) if args else obj


def build_user_optimizer(cfg, given, model: torch.nn.Module) -> Optional[torch.optim.Optimizer]:
    """The user's optimizer over `model`, or None when the config names a built-in one."""
    make = _factory(cfg, given, "optimizer", "optimizer")
    if make is None:
        return None
    what = "optimizer=" if given is not None else f"--optimizer {cfg.optimizer}"
    arg = model.parameters() if _takes_params(make) else model
    opt = call_user(make, (arg,), what)
    if not isinstance(opt, torch.optim.Optimizer):
        raise BadInput(f"{what}: returned {type(opt).__name__}, expected a torch.optim.Optimizer "
                       f"(it is called with {'model.parameters()' if _takes_params(make) else 'the model'})")
    mine = {id(p) for p in model.parameters()}
    held = [p for g in opt.param_groups for p in g["params"]]
    if any(id(p) not in mine for p in held):
        raise BadInput(f"{what}: the optimizer holds tensors that are not this model's parameters "
                       f"(build it from the model it is given)")
    if not held:
        raise BadInput(f"{what}: the optimizer holds no parameters")
    check_closure(type(opt), what)
    return opt


def check_closure(cls, what: str) -> None:
    """An optimizer whose step() needs a closure (LBFGS: it re-evaluates the loss several times a
    step) is refused in one line: every strategy calls step() once, after the gradient's average."""
    import inspect
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise BadInput(f"{what}: {cls.__name__}.step() needs a closure that re-evaluates the loss; shmlearn's "
                       f"step calls step() once per step, after the gradient's average (choose another optimizer)")


class EveryN:
    """A scheduler stepped once every `every` loop steps (an epoch's steps for --scheduler-interval
    epoch, 1 for step): the loop steps whatever it holds after each step (fast.py)."""

    def __init__(self, inner, every: int):
        self.inner, self.every, self.count = inner, max(1, int(every)), 0

    def step(self) -> None:
        self.count += 1
        if self.count % self.every == 0:
            self.inner.step()

    def get_last_lr(self):
        return self.inner.get_last_lr()

    def state_dict(self) -> dict:
        return {"count": self.count, "inner": self.inner.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.count = d["count"]
        self.inner.load_state_dict(d["inner"])


class OnEvaluation:
    """A scheduler driven by a metric (torch's ReduceLROnPlateau): never stepped per step; after
    each evaluation it steps with the validation loss, or the test loss where there is no
    validation split (the loop calls `evaluated`). Every rank sees the same all-reduced value, so
    every rank changes its learning rate at the same evaluation. Its patience counts evaluations
    (--eval-points sets how many)."""

    def __init__(self, inner):
        self.inner = inner

    def step(self) -> None:
        pass

    def evaluated(self, row: dict) -> None:
        value = row.get("val_loss") if row.get("val_loss") is not None else row.get("test_loss")
        if value is not None:
            self.inner.step(value)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.inner.load_state_dict(d["inner"])


class Constant:
    """No schedule: a user optimizer's learning rate is its own."""

    def step(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


def build_user_scheduler(cfg, given, optimizer, steps_per_epoch: int):
    """The user's scheduler wrapped to step per epoch or per step; Constant for a user optimizer
    with none; None when the built-in --lr-schedule applies."""
    make = _factory(cfg, given, "scheduler", "scheduler")
    if make is None:
        return None if is_builtin_optimizer(cfg) else Constant()
    what = "scheduler=" if given is not None else f"--scheduler {cfg.scheduler}"
    sched = call_user(make, (optimizer,), what)
    if not callable(getattr(sched, "step", None)) or not callable(getattr(sched, "state_dict", None)):
        raise BadInput(f"{what}: returned {type(sched).__name__}, expected an LRScheduler "
                       f"(with step() and state_dict())")
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return OnEvaluation(sched)
    return EveryN(sched, steps_per_epoch if cfg.scheduler_interval == "epoch" else 1)


def resolve_compute_loss(cfg, given):
    """The user's compute_loss(model, batch): the object given, or the --compute-loss reference; None
    for the (outputs, targets) contract."""
    if given is not None:
        return given
    if cfg.compute_loss is None:
        return None
    return resolve_ref(cfg.compute_loss, "--compute-loss")


def resolve_loss(cfg, given):
    """The user's loss: the object given, or the --loss reference; None for the task's."""
    if given is not None:
        return given
    if cfg.loss is None:
        return None
    return resolve_ref(cfg.loss, "--loss")


__all__ = ["parse_args", "torch_class", "validate", "check_refs", "build_user_optimizer",
           "build_user_scheduler", "resolve_loss", "resolve_compute_loss", "EveryN", "Constant", "INTERVALS"]
