"""The fast step's options and constants: StepOptions (the step's section of the run's config:
TrainConfig is composed of it), StepTuning (the bench's switches), the flag choices, the read's
Window, and the small rules the step's parts share (shmlearn/step/fast.py says how a step runs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Tuple

import torch

from shmlearn.config.flags import Section
from shmlearn.errors import BadInput
from shmlearn.nn.conv_overlap import MODES as CONV_OVERLAP
from shmlearn.nn.conv_pool import MODES as CONV_POOL
from shmlearn.nn.image_conv import MODES as IMAGE_CONV
from shmlearn.nn.max_pool import MODES as MAX_POOL
from shmlearn.nn.mlp_head import MODES as MLP_HEAD

PRECISIONS = ("fp32", "bf16")
CUDA_GRAPH = ("auto", "off")
COMPILE = ("off", "default", "max-autotune", "auto")
"""--compile: torch.compile the model's forward (and through AOTAutograd its backward) with
Inductor; its kernels run inside the fast step, and on CUDA inside the step's one CUDA graph.
max-autotune is Inductor's max-autotune-no-cudagraphs (the step makes its own graph); auto
compiles with default, times a few steps of each and keeps the faster."""
EARLY_UPDATE = ("auto", "on", "off")
"""--update-in-backward: each convolution's SGD step as soon as the backward has made its weight's
gradient (`Stepper.early_update`)."""
WEIGHT_COPY = ("auto", "on", "off")
"""--weight-copy: the update writes the convolutions' bf16 weights for the next forward, which then
casts none (`Stepper.weight_copy`). The forward loses its casts (ResNet-34 at batch 128 on an
H100: 1425 -> 1366 us), and the update's kernel writes 2 more bytes a parameter, which cost it
20 us over ResNet-34's 21M parameters (144.6 -> 164.8 us; torch's cast after it costs 45).
Steps on an H100, compiled (results/copy-h100/): resnet34 at batch 128 3.720 -> 3.711 ms,
resnet18 2.169 -> 2.158 (run 5); at 1024, with the earlier kernel of 1024 values a program,
21.30 -> 21.14 and 20.99 -> 20.81 (runs 1 and 2), where at 128 that kernel's stores had made
the copy lose (3.850 -> 3.892)."""
GRAD_BUCKETS = ("auto", "on", "off")
"""--grad-buckets (StepOptions.grad_buckets; step/buckets.py)."""
ADOPT_GRADS = ("auto", "on", "off")
"""StepTuning.adopt_grads. On CUDA adopting saves a memset and an add kernel per parameter, in
the graph (resnet18 at batch 128 on an H100: 62 kernels, 135 us). On the CPU the adds run inside
autograd's C++, and adopting costs a Python permute and reshape per parameter and a cat: about
45 us a step. 2-core CPU, fast step, ms per step (results/read-cpu/): the mlp at
batch 32 0.519 -> 0.470 (1 worker) and 2.52 -> 2.46 (2 workers); lenet and alexnet-small at
batch 32 within 1% (15.47 -> 15.62, 21.74 -> 21.85)."""
COMBO = ("auto", "on", "off")
"""--combo-kernels: Inductor's combo kernels in the compiled step (`combo_kernels`)."""
COMBO_MAX_PIXELS = 256 * 32 * 32
"""combo auto: on CUDA for batches of at most this many image pixels (batch x height x width;
batch alone for inputs that are not images). One H100, bf16, the fast step compiled
(results/defer-h100/): at batch 128 of 32x32 images resnet18 2.446 -> 2.344 ms and
resnet34 4.212 -> 4.031 (their ~300 small BatchNorm, cast and stat kernels launch in fewer
groups); at 1024, 11.954 -> 12.095 and 21.760 -> 22.163 (slower: large kernels gain nothing from
sharing a launch). The limit sits between the two measured sizes."""


def combo_kernels(mode: str, device: torch.device, x: Optional[torch.Tensor]) -> bool:
    """Whether the compiled step uses Inductor's combo kernels (COMBO; x: a batch of inputs)."""
    if mode != "auto":
        return mode == "on"
    if device.type != "cuda" or not isinstance(x, torch.Tensor):  # a tree batch (compute_loss): no rule
        return False
    pixels = x.shape[0] * (x.shape[-2] * x.shape[-1] if x.dim() == 4 else 1)
    return pixels <= COMBO_MAX_PIXELS


DEFAULT_CHECK_EVERY = {"cpu": 10, "cuda": 50}
"""Steps between reads of the loss when --check-every is not given. On a GPU each read drains
the launch queue. On the CPU a read is one more collective per step, and a rank waits in it for
the slowest: the default digits run (2 Gloo workers, mlp) trains in 1.11-1.13 s at 10 against
1.47-1.76 s at 1 (same losses), alexnet-small at batch 32 in 24.4 against 26.0 ms a step.
Strategies and optimizers without a fast step read every step whatever this says."""


@dataclass(kw_only=True)
class StepOptions(Section):
    """The step's section of the run's config: the settings a user gives the fast step and the
    layers' kernels (flags, YAML keys and TrainConfig keywords: TrainConfig is composed of this
    class, config/train_config.py, so a TrainConfig is the StepOptions the Stepper takes). A new
    step option is a field here, with its docstring (its --help), and its use in the step.
    Choices are checked once, when the options are made (flags.Section)."""

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
    with Triton) or auto (triton where it can run and is already built on this machine for these
    shapes, or the run has 10,000+ steps and is not a sweep's trial: a first build takes about a
    minute; step/built.py).
    Evaluation runs torch's ops. Same outputs and gradients, parameters and checkpoints;
    shmlearn/nn/conv_pool.py."""
    mlp_head: Literal[MLP_HEAD] = "auto"
    """How a classifier head of 2 or 3 Linear layers with ReLU between them (consecutive in an
    nn.Sequential, widths <= 128) runs in fp16/bf16: off (torch's ops: about 15 kernels) or triton
    (three fused Triton kernels, forward and backward; CUDA with Triton) or auto (triton where it
    can run and is built, as --conv-pool auto). Evaluation runs torch's ops. Same outputs and
    gradients to rounding, parameters and checkpoints; shmlearn/nn/mlp_head.py."""
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
    cudnn_benchmark: Literal["on", "off"] = "on"
    """CUDA: on times every cuDNN convolution algorithm at each new input shape and keeps the
    fastest; off takes cuDNN's heuristic choice. Timing costs seconds at each new batch shape and
    pays back even in short sweep trials (measured: docs/performance.md, "Behind the code").
    --deterministic turns it off."""
    check_every: Optional[int] = None
    """Read the losses (NaN check, logging, rank 0's eval/checkpoint requests) every this many
    steps; in between, a step never waits for the device. Default 10 on CPU, 50 on CUDA
    (fast.DEFAULT_CHECK_EVERY). Above 1 needs allreduce, ps or weight-avg and an optimizer with a
    fused or foreach implementation (torch.optim's but LBFGS and SparseAdam; docs/recipe.md);
    others read every step."""


@dataclass(frozen=True, kw_only=True)
class StepTuning:
    """The bench's switches of the fast step (bench/throughput_variants.py MODIFIERS): ways to run
    the same step that `bench throughput` times against each other. Not settings of a run (no
    flag, no YAML key): a training run takes the defaults."""

    sample_every: Optional[int] = None
    """Graph mode: run one step in this many eagerly, with phase timing. None: `sample_period` of
    the eager step's time over the replay's, both measured at capture (256 at least)."""
    cudnn_benchmark_limit: Optional[int] = None
    """How many of cuDNN's algorithms the timing of --cudnn-benchmark tries per shape
    (torch.backends.cudnn.benchmark_limit; 0: all of them); None leaves torch's setting (10)
    alone. Process-wide, as torch's flag is (the bench's `cudnn-all` modifier)."""
    adopt_grads: str = "auto"
    """ADOPT_GRADS: on: take each backward's gradient tensors and copy them into the flat buffer
    in one kernel (SyncStrategy.release_grads); off: zero the buffer and let autograd add each
    gradient into its view (the bench's `accumulate` modifier); auto: on on CUDA, off on the CPU."""
    defer_wgrad: bool = True
    """With --conv-overlap: leave the weights' GEMMs on the side stream until the backward ends
    (conv_overlap.deferred), where the step adopts its gradients whole; False: each convolution's
    backward joins its two streams before returning (the bench's `joined-conv` modifier)."""
    side_streams: int = 1
    """Deferred weight GEMMs: how many side streams take them in turn (conv_overlap.deferred)."""
    inductor: Tuple[Tuple[str, object], ...] = ()
    """--compile: further Inductor options as (name, value) pairs (the bench's aggressive,
    no-split and cdt modifiers)."""
    flat_sgd: bool = True
    """SGD's update as one kernel over the flat buffers where it can run (flat_sgd.py: a Triton
    kernel on CUDA, torch's fused SGD called on the flat buffers on the CPU); False: the
    optimizer's step() with torch's fused SGD (the bench's `torch-sgd` modifier, to compare)."""
    bucket_mb: float = 25.0
    """--grad-buckets: the size of a bucket in MB (the first is 1 MB; step/buckets.py)."""
    high_priority_capture: bool = True
    """CUDA graphs: capture the step on a stream of the highest priority, so that its kernels run
    before the side streams' (conv_overlap's weight GEMMs and updates, captured at the lowest
    priority) when both have blocks waiting: torch instantiates graphs with per-node priorities.
    False: the default priority for both (the bench's `normal-priority` modifier)."""
    compile_read: bool = True
    """--compile: compile the batch read too (the loader's `next_batch`: the index arithmetic, the
    gather, augmentation and normalization), whose eager ops are 8 kernels without augmentation
    and about 20 with it, so that Inductor fuses them into two or three. False: the read runs
    eagerly (the bench's `eager-read` modifier, to compare)."""
    memset_kernels: bool = True
    """CUDA graphs: replace the captured graph's small memset nodes (cuDNN zeroing a few bytes of
    workspace) with kernel nodes that write the same bytes, before instantiating it
    (shmlearn/step/graph_memsets.py): a memset node between two kernels idles the GPU for several
    microseconds on each side.
    False: keep them (the bench's `memset-nodes` modifier)."""

    def __post_init__(self) -> None:
        if self.adopt_grads not in ADOPT_GRADS:
            raise BadInput(f"adopt_grads {self.adopt_grads!r}: choose one of {', '.join(ADOPT_GRADS)}")


SAMPLE_EVERY = 256
"""The shortest period of eager, phase-timed steps among replays (and the one without a graph)."""
SAMPLE_COST = 0.01
"""What the eager steps may add to a period of replays, as a share of the replays' time."""


def sample_period(eager_s: float, replay_s: float) -> int:
    """The smallest power of two from SAMPLE_EVERY up (at most 65536) at which one eager step in
    the period adds at most SAMPLE_COST to the period's replays: n >= (eager/replay - 1) / cost."""
    if not (eager_s > 0 and replay_s > 0):
        return SAMPLE_EVERY
    need = (eager_s / replay_s - 1.0) / SAMPLE_COST
    n = SAMPLE_EVERY
    while n < need and n < 65536:
        n *= 2
    return n


@dataclass
class Window:
    """What one read learned, for steps [first, first + len(losses))."""
    first: int
    losses: List[float]
    """Mean over computing ranks of the finite losses, one per step (up to the bad step)."""
    bad: Optional[Tuple[int, int]]
    """(step, rank) of the first non-finite loss, lowest rank first; None if all finite."""
    want_eval: bool
    want_ckpt: bool
    want_stop: bool = False
    """Rank 0 asks every rank to stop here (a pruned sweep trial, pruning.py)."""


IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")
"""The keywords of a torch.optim class that choose how its step() runs, not what it computes."""


def accepts(cls: type, keyword: str) -> bool:
    """Whether optimizer class `cls` takes `keyword` (fused, foreach, capturable) when built."""
    import inspect
    try:
        return keyword in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def needs_closure(cls: type) -> bool:
    """Whether `cls.step` must be given a closure (LBFGS: it evaluates the loss itself, several
    times a step), which no step of shmlearn passes."""
    import inspect
    try:
        p = inspect.signature(inspect.unwrap(cls.step)).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return p is not None and p.default is inspect.Parameter.empty


def torch_class(optimizer) -> type:
    """The torch.optim class that `optimizer` is, or the nearest one it derives from."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim"):
            return cls
    return torch.optim.Optimizer


def step_hooks(optimizer) -> int:
    """How many step hooks run around `optimizer.step()`: its own pre and post hooks
    (register_step_pre_hook, register_step_post_hook) and torch's global ones
    (torch.optim.optimizer.register_optimizer_step_pre_hook / _post_hook)."""
    from torch.optim import optimizer as torch_optimizer
    own = (len(getattr(optimizer, "_optimizer_step_pre_hooks", ()))
           + len(getattr(optimizer, "_optimizer_step_post_hooks", ())))
    return own + len(torch_optimizer._global_optimizer_pre_hooks) + len(torch_optimizer._global_optimizer_post_hooks)


def overrides_step(optimizer) -> bool:
    """Whether a subclass of a torch.optim class defines its own step(). torch wraps step() (its
    hooks, the profiler) on the class of the first instance, also where a subclass only inherits
    it, so the functions under the wrappers are compared."""
    import inspect
    mine = inspect.unwrap(type(optimizer).step)
    return mine is not inspect.unwrap(torch_class(optimizer).step)


_PROBED: Dict[Tuple[type, str], Optional[str]] = {}


def fused_why_not(cls: type, device: torch.device) -> Optional[str]:
    """None if torch's fused `cls` runs on `device` and skips its update while found_inf is 1,
    else why not (one line). Asked of the installed torch once per class and device type: a step
    of a 4-value parameter with the flag set (it must not move), then cleared (it must). The step
    is the class's own, unwrapped, under no_grad (what its wrapper sets up): the wrapper imports
    torch._dynamo, which a run that compiles nothing need not load (launch/lean.py)."""
    import inspect
    key = (cls, device.type)
    if key not in _PROBED:
        try:
            p = torch.nn.Parameter(torch.ones(4, device=device))
            p.grad = torch.ones(4, device=device)
            opt = cls([p], lr=0.5, fused=True)
            opt.found_inf = torch.ones((), dtype=torch.float32, device=device)
            step = inspect.unwrap(cls.step)
            with torch.no_grad():
                step(opt)
            skipped = bool(torch.equal(p.detach(), torch.ones_like(p)))
            opt.found_inf.zero_()
            with torch.no_grad():
                step(opt)
            moved = not torch.equal(p.detach(), torch.ones_like(p))
            _PROBED[key] = None if skipped and moved else \
                f"torch {torch.__version__}'s fused {cls.__name__} does not skip its update on found_inf"
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _PROBED[key] = f"torch {torch.__version__} has no fused {cls.__name__} on {device.type} ({first[:120]})"
    return _PROBED[key]


def optimizer_why_not(optimizer, device: torch.device) -> Optional[str]:
    """None if the fast step can update with `optimizer` with the user's hyperparameters, else why
    not (one line). By capability, not by name (`implementation` says which it takes): torch's
    fused implementation of its class where the installed torch has one on `device` that skips
    its update on the flag (`fused_why_not`), else its foreach implementation, capturable in a
    CUDA graph on CUDA, gated by step/gate.py. Refused: a step() that needs a closure, a subclass
    that overrides step(), differentiable=True, and a class with neither."""
    name = type(optimizer).__name__
    cls = torch_class(optimizer)
    if needs_closure(cls):
        return f"optimizer {name}: its step() needs a closure (it evaluates the loss itself), which the fast step has not"
    if overrides_step(optimizer):
        return f"optimizer {name} overrides step(): the classic step calls it as written"
    groups = optimizer.param_groups
    if any(g.get("differentiable") for g in groups):
        return f"optimizer {name}: differentiable=True has no fused implementation"
    params = [p for g in groups for p in g["params"]]
    if any(not p.is_floating_point() or p.is_sparse or p.device.type != device.type for p in params):
        return f"optimizer {name}: parameters that are not dense floating point on {device}"
    fused = fused_why_not(cls, device) if accepts(cls, "fused") else f"torch has no fused {cls.__name__}"
    if fused is None:
        return None
    if not (accepts(cls, "foreach") and hasattr(cls, "_init_group")):
        return f"optimizer {name}: {fused}, and no foreach implementation to step on the device"
    if device.type == "cuda" and not accepts(cls, "capturable"):
        return (f"optimizer {name}: {fused}, and its foreach step (no capturable=True) keeps its step count on "
                f"the host")
    return None


def implementation(optimizer, device: torch.device) -> str:
    """Which of torch's implementations the fast step runs for an optimizer `optimizer_why_not`
    admits: "fused" (it reads the skip flag itself) or "foreach" (step/gate.py puts its weights
    and state back on a skipped step)."""
    cls = torch_class(optimizer)
    return "fused" if accepts(cls, "fused") and fused_why_not(cls, device) is None else "foreach"


def fast_capable(strategy, optimizer, device: Optional[torch.device] = None) -> Optional[str]:
    """None if the fast step can run this strategy and optimizer, else why not (one line)."""
    if not strategy.gated:
        return f"strategy {strategy.name} has no fast step"
    if device is None:
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    return optimizer_why_not(optimizer, device)


def optimizer_note(optimizer, why_not: Optional[str], fast: bool, device: torch.device) -> Optional[str]:
    """The one line summary.json's step_note and the console give about the user's optimizer in
    this run, or None where there is nothing to say (SGD in the fast step, as always).
    why_not: optimizer_why_not's answer."""
    name = type(optimizer).__name__
    if why_not is not None:
        return f"{why_not}; it runs the classic step"
    if not fast:
        return None
    hooks = step_hooks(optimizer)
    if hooks:
        return (f"optimizer {name} has {hooks} step hook{'s' * (hooks > 1)}: the fast step calls its step() every "
                f"step, eagerly (no flat kernel, no CUDA graph), so they run")
    if torch_class(optimizer) is torch.optim.SGD:
        return None
    kind = implementation(optimizer, device)
    cuda = device.type == "cuda" and accepts(torch_class(optimizer), "capturable")
    how = f"{kind}=True" + (", capturable=True" if cuda else "")
    back = "; a skipped step puts its weights and state back" if kind == "foreach" else ""
    return f"optimizer {name} runs torch's {kind} implementation in the fast step ({how}), with its hyperparameters{back}"
