"""The training step, shared by the loop (train.py) and the benchmarks (bench/throughput.py).

Two ways to run a step, chosen once per run (`resolve_mode`):

* classic: data -> compute -> the loop reads the loss now (one small all-reduce and a host sync
  per step) -> strategy.step. A NaN is caught before any update. Every strategy and optimizer.

* fast: the whole step is device work with no host sync, and on CUDA it is captured once in a
  CUDA graph and replayed (one launch per step instead of ~100):
      next_batch (device counter) -> forward/backward (bf16 autocast if asked) ->
      loss into a device history -> strategy.gated_step (communication + fused SGD update)
  The loop reads the history every `check_every` steps (and at evaluation, checkpoint and the
  last step): one small all-reduce of every rank's losses, then the host decides as before.
  NaN safety without the per-step sync: the optimizer is torch's fused SGD, which skips its
  update on the device while `found_inf` is 1.0, and each strategy sets that flag before the
  update when a loss it must trust is not finite (allreduce and ps carry the losses in the
  gradient collective they already do). The flag stays set, so the weights stay those before
  the bad step; the read then stops every rank and reports the first bad step and its rank, as
  the classic path does. What changes: up to check_every - 1 more steps are computed (not
  applied); timestamps between reads are interpolated; with weight averaging and K > 1 the
  other workers learn of a bad rank only at the next round, so their own replicas may take up to
  K - 1 more local steps before the run stops (the diverged run writes no checkpoint, and the
  reported step is the first bad one).
  Needs: a strategy with `gated_step` (allreduce, ps, weight-avg) and an SGD-family optimizer
  (sgd, momentum, nesterov); anything else runs classic.

Phase timing in graph mode: a replayed step is one launch and is not split into phases. One step
in every `sample_every` runs eagerly instead (same kernels, same result) with CUDA events around
its phases; phase_s is the mean over those sampled steps, step time comes from the wall clock.
An eager step of a compiled model costs 8-25 replays (ResNet-34 at batch 128 on an H100: 12),
so the period is chosen at capture to keep those steps within 1% of the time
(`sample_period`), unless StepOptions.sample_every fixes it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from shmlearn import flat_sgd, graph_memsets
from shmlearn.errors import BadInput, one_line
from shmlearn.nn import choice, conv_overlap, conv_pool, image_conv, max_pool, mlp_head
from shmlearn.sync.base import check_non_finite
from shmlearn.tasks import loss_fn
from shmlearn.timing import NULL_TIMER

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
Steps on an H100, compiled (benchmarks/results/copy-h100/): resnet34 at batch 128 3.720 -> 3.711 ms,
resnet18 2.169 -> 2.158 (run 5); at 1024, with the earlier kernel of 1024 values a program,
21.30 -> 21.14 and 20.99 -> 20.81 (runs 1 and 2), where at 128 that kernel's stores had made
the copy lose (3.850 -> 3.892)."""
ADOPT_GRADS = ("auto", "on", "off")
"""StepOptions.adopt_grads. On CUDA adopting saves a memset and an add kernel per parameter, in
the graph (resnet18 at batch 128 on an H100: 62 kernels, 135 us). On the CPU the adds run inside
autograd's C++, and adopting costs a Python permute and reshape per parameter and a cat: about
45 us a step. 2-core CPU, fast step, ms per step (benchmarks/results/read-cpu/): the mlp at
batch 32 0.519 -> 0.470 (1 worker) and 2.52 -> 2.46 (2 workers); lenet and alexnet-small at
batch 32 within 1% (15.47 -> 15.62, 21.74 -> 21.85)."""
COMBO = ("auto", "on", "off")
"""--combo-kernels: Inductor's combo kernels in the compiled step (`combo_kernels`)."""
COMBO_MAX_PIXELS = 256 * 32 * 32
"""combo auto: on CUDA for batches of at most this many image pixels (batch x height x width;
batch alone for inputs that are not images). One H100, bf16, the fast step compiled
(benchmarks/results/defer-h100/): at batch 128 of 32x32 images resnet18 2.446 -> 2.344 ms and
resnet34 4.212 -> 4.031 (their ~300 small BatchNorm, cast and stat kernels launch in fewer
groups); at 1024, 11.954 -> 12.095 and 21.760 -> 22.163 (slower: large kernels gain nothing from
sharing a launch). The limit sits between the two measured sizes."""


def combo_kernels(mode: str, device: torch.device, x: Optional[torch.Tensor]) -> bool:
    """Whether the compiled step uses Inductor's combo kernels (COMBO; x: a batch of inputs)."""
    if mode != "auto":
        return mode == "on"
    if device.type != "cuda" or x is None:
        return False
    pixels = x.shape[0] * (x.shape[-2] * x.shape[-1] if x.dim() == 4 else 1)
    return pixels <= COMBO_MAX_PIXELS


DEFAULT_CHECK_EVERY = {"cpu": 10, "cuda": 50}
"""Steps between reads of the loss when --check-every is not given. On a GPU each read drains
the launch queue. On the CPU a read is one more collective per step, and a rank waits in it for
the slowest: the default digits run (2 Gloo workers, mlp) trains in 1.11-1.13 s at 10 against
1.47-1.76 s at 1 (same losses), alexnet-small at batch 32 in 24.4 against 26.0 ms a step.
Strategies and optimizers without a fast step read every step whatever this says."""


@dataclass(frozen=True)
class StepOptions:
    precision: str = "fp32"
    channels_last: bool = False
    cuda_graph: str = "auto"
    check_every: Optional[int] = None
    """None: DEFAULT_CHECK_EVERY by device."""
    sample_every: Optional[int] = None
    """Graph mode: run one step in this many eagerly, with phase timing. None: `sample_period` of
    the eager step's time over the replay's, both measured at capture (256 at least)."""
    cudnn_benchmark: bool = True
    """CUDA: time cuDNN's algorithms per new shape (ignored with deterministic cuDNN)."""
    cudnn_benchmark_limit: Optional[int] = None
    """How many of cuDNN's algorithms that timing tries per shape (torch.backends.cudnn.
    benchmark_limit; 0: all of them); None leaves torch's setting (10) alone. Process-wide, as
    torch's flag is (the bench's `cudnn-all` modifier)."""
    compile: str = "off"
    """COMPILE: off, default, max-autotune or auto."""
    image_conv: str = "auto"
    """How the input image's convolutions run: cudnn, im2col, triton or auto (im2col when compiled
    on CUDA; shmlearn/nn/image_conv.py)."""
    max_pool: str = "auto"
    """How max-pools run: aten, global, reduce, or auto (global when compiled; shmlearn/nn/max_pool.py)."""
    conv_pool: str = "auto"
    """Conv + ReLU + 2x2 max-pool blocks: off, triton (one fused kernel) or auto (triton where it
    can run; shmlearn/nn/conv_pool.py)."""
    adopt_grads: str = "auto"
    """ADOPT_GRADS: on: take each backward's gradient tensors and copy them into the flat buffer
    in one kernel (SyncStrategy.release_grads); off: zero the buffer and let autograd add each
    gradient into its view (the bench's `accumulate` modifier); auto: on on CUDA, off on the CPU."""
    mlp_head: str = "auto"
    """Classifier heads of 2-3 Linear layers with ReLU between: off, triton (three fused kernels)
    or auto (triton where it can run; shmlearn/nn/mlp_head.py)."""
    conv_overlap: str = "auto"
    """A convolution's backward GEMMs: off (one after the other), small (two CUDA streams where
    the GEMMs are small), all (two streams for every convolution, conv-pool blocks too) or auto
    (on CUDA all where the weight GEMMs can be deferred, `defer_wgrad`, else small;
    shmlearn/nn/conv_overlap.py)."""
    defer_wgrad: bool = True
    """With --conv-overlap: leave the weights' GEMMs on the side stream until the backward ends
    (conv_overlap.deferred), where the step adopts its gradients whole; False: each convolution's
    backward joins its two streams before returning (the bench's `joined-conv` modifier)."""
    side_streams: int = 1
    """Deferred weight GEMMs: how many side streams take them in turn (conv_overlap.deferred)."""
    combo_kernels: str = "auto"
    """--compile: Inductor's combo kernels: on, off or auto (`combo_kernels`)."""
    inductor: Tuple[Tuple[str, object], ...] = ()
    """--compile: further Inductor options as (name, value) pairs (the bench's aggressive,
    no-split and cdt modifiers)."""
    flat_sgd: bool = True
    """SGD's update as one kernel over the flat buffers where it can run (flat_sgd.py: a Triton
    kernel on CUDA, torch's fused SGD called on the flat buffers on the CPU); False: the
    optimizer's step() with torch's fused SGD (the bench's `torch-sgd` modifier, to compare)."""
    update_in_backward: str = "auto"
    """EARLY_UPDATE: on, off, or auto (on wherever it can run: `Stepper._early_why_not`)."""
    weight_copy: str = "auto"
    """WEIGHT_COPY: on, off, or auto (on wherever it can run: `Stepper._copy_why_not`)."""
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
    (shmlearn/graph_memsets.py): a memset node between two kernels idles the GPU for several
    microseconds on each side.
    False: keep them (the bench's `memset-nodes` modifier)."""


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


def fast_capable(strategy, optimizer) -> Optional[str]:
    """None if the fast step can run this strategy and optimizer, else why not."""
    if not strategy.gated:
        return f"strategy {strategy.name} has no fast step"
    if type(optimizer) is not torch.optim.SGD:
        return f"optimizer {type(optimizer).__name__}: the fast step needs SGD (fused, with a skip flag)"
    return None


class Stepper:
    """One rank's training step in the chosen mode; see the module docstring."""

    def __init__(self, *, model, strategy, optimizer, schedule, loader, task: str, device: torch.device,
                 opts: StepOptions, timer, rank: int, world_size: int, total_steps: int, fault=None,
                 loss=None, reached=None):
        """loss: f(outputs, targets) -> scalar; default the task's (tasks.loss_fn).
        reached: f(step), called when an eagerly run fast step has computed and is about to
        enter its collective (the loop's heartbeat: a rank that hangs before it is named)."""
        self.reached = reached
        self.model, self.strategy, self.optimizer, self.schedule = model, strategy, optimizer, schedule
        self.loader, self.task, self.device, self.opts, self.timer = loader, task, device, opts, timer
        self.rank, self.world_size, self.fault = rank, world_size, fault
        self.loss = loss or (lambda out, y: loss_fn(task, out, y))
        self.check_every = opts.check_every or DEFAULT_CHECK_EVERY.get(device.type, 1)
        why_not = fast_capable(strategy, optimizer)
        # A free-running strategy (async-ps) always takes the fast path's loop (its ranks read
        # the losses every check_every steps), with fused SGD when the optimizer is SGD.
        self.fast = strategy.free_running or (why_not is None and self.check_every > 1)
        # Say why only when --check-every was asked for; the default just falls back.
        self.note = why_not if (why_not and (opts.check_every or 1) > 1 and not strategy.free_running) else None
        self.graphs = None
        """CUDA graphs of the step, one per kind (`_kinds`, `_key`), replayed by `run`."""
        self._pool = None
        """The memory pool the step's graphs share (`_capture`)."""
        self.hist = torch.zeros(total_steps + 1, dtype=torch.float32, device=device)
        """This rank's loss at every step (fast: written on the device, read every K steps)."""
        self.free_hist = torch.zeros(total_steps + 1, dtype=torch.float64) if strategy.free_running else None
        """Free running: this rank's step_loss() at every step, in float64 (a server's sum of W losses)."""
        self._pending_from: Optional[int] = None  # first step not yet read
        self._expected: Optional[int] = None
        self._batches = 0
        """Free running: batches this rank has trained on (its own count, not the loop's steps)."""
        if device.type == "cuda":
            # Fixed shapes: pick the fastest conv once (by timing, so not with --deterministic).
            torch.backends.cudnn.benchmark = opts.cudnn_benchmark and not torch.backends.cudnn.deterministic
            if opts.cudnn_benchmark_limit is not None:
                torch.backends.cudnn.benchmark_limit = opts.cudnn_benchmark_limit
        if opts.image_conv == "triton" and (why := image_conv.triton_usable(device)):
            raise BadInput(why)
        if opts.conv_pool == "triton" and (why := conv_pool.usable(device)):
            raise BadInput(why)
        if opts.mlp_head == "triton" and (why := mlp_head.usable(device)):
            raise BadInput(why)
        if opts.conv_overlap in ("small", "all") and (why := conv_overlap.usable(device)):
            raise BadInput(why)
        # First: the fused blocks' convs and pools are then left alone by the two passes below.
        # Each layer takes a kernel only where it can run on this device (nn/choice.py).
        self.conv_pool = conv_pool.resolve(opts.conv_pool, device)
        self.mlp_head = mlp_head.resolve(opts.mlp_head, device)
        self.kernels = choice.choose(model, conv_pool_mode=self.conv_pool, mlp_head_mode=self.mlp_head,
                                     dtype=torch.bfloat16 if opts.precision == "bf16" else torch.float32, device=device)
        """Which layers run a custom kernel, and why not where they do not (summary.json `kernels`)."""
        choice.check_forced(self.kernels, {"conv-pool": opts.conv_pool == "triton", "mlp-head": opts.mlp_head == "triton"},
                            torch.cuda.get_device_name(device) if device.type == "cuda" else device.type)
        self.image_conv = image_conv.resolve(opts.image_conv, opts.compile != "off", device.type)
        self.image_convs = image_conv.convert(model, self.image_conv)
        """--image-conv: how many convolutions were switched (before compiling: Inductor sees them)."""
        self._probe_kernels()
        self.conv_pools = sum(c.kernel == "conv-pool" and c.path == "triton" for c in self.kernels)
        """--conv-pool: how many conv + ReLU + max-pool blocks run fused."""
        self.mlp_heads = sum(c.kernel == "mlp-head" and c.path == "triton" for c in self.kernels)
        """--mlp-head: how many classifier heads run fused."""
        # After the two above: the convolutions they switched are theirs (conv_pool's blocks
        # take the overlapped backward through their own flag, with `all` asked for only: slower
        # on an H100 in alexnet-small's step, conv_overlap.py).
        if opts.adopt_grads not in ADOPT_GRADS:
            raise BadInput(f"adopt_grads {opts.adopt_grads!r}: choose one of {', '.join(ADOPT_GRADS)}")
        adopt = opts.adopt_grads == "on" or (opts.adopt_grads == "auto" and device.type == "cuda")
        self._adopts = adopt and strategy.adopts_grads
        """Whether backwards take their gradients whole (`_gradients`; ADOPT_GRADS)."""
        can_defer = self._adopts and opts.defer_wgrad and device.type == "cuda"
        self.conv_overlap = conv_overlap.resolve(opts.conv_overlap, device, deferred=can_defer)
        plain = conv_overlap.convert(model, self.conv_overlap)
        self.conv_overlaps = plain + conv_pool.set_overlap(model, opts.conv_overlap == "all")
        """--conv-overlap: how many convolutions run their backward GEMMs on two streams."""
        self.deferred = bool(plain and can_defer)
        """Whether the convolutions' weight GEMMs run on past their backward's return until the
        backward ends (conv_overlap.deferred; in steps that adopt their gradients)."""
        self.max_pool = max_pool.resolve(opts.max_pool, opts.compile != "off")
        self.max_pools = max_pool.convert(model, self.max_pool)
        """--max-pool: how many pools run as reductions (before compiling, as above)."""
        # Before compiling: each convolution's slot is a constant of the traced graph.
        why_early = self._early_why_not(why_not, fault)
        if opts.update_in_backward == "on" and why_early:
            raise BadInput(f"--update-in-backward on: {why_early}")
        self._slots = ({} if why_early or opts.update_in_backward == "off"
                       else conv_overlap.set_slots(model, strategy._trainable))
        """slot -> (weight's index, bias's index or None, module name) of each convolution
        updated in the backward (conv_overlap.set_slots)."""
        self.early_update = False
        """Whether convolutions take their SGD step inside the backward (`_setup_fast` binds it)."""
        # Before compiling too: the forward Dynamo traces reads the copies.
        why_copy = self._copy_why_not(why_not)
        if opts.weight_copy == "on" and why_copy:
            raise BadInput(f"--weight-copy on: {why_copy}")
        self._copy = None
        """The flat bf16 copy of the weights that the update writes and the convolutions' forward
        reads (flat_sgd.bind's copy), or None."""
        if why_copy is None and opts.weight_copy != "off":
            self._copy = flat_sgd.weight_copy(strategy.params_flat, torch.bfloat16)
            flat = strategy.params_flat
            base, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            held = {id(p) for p in strategy._trainable}
            if not conv_overlap.set_weight_copies(
                    model, lambda p: (flat_sgd.copy_view(self._copy, p, flat)
                                      if id(p) in held and base <= p.data_ptr() < end else None)):
                self._copy = None
        self.weight_copy = False
        """Whether the update writes the convolutions' bf16 weights for the next forward, which
        then casts none (--weight-copy; `_setup_fast` binds it)."""
        self.memsets_replaced = 0
        """Memset nodes of the step's CUDA graphs made kernel nodes (StepOptions.memset_kernels)."""
        self.memset_bytes = 0
        """The largest of them, in bytes."""
        self.sample_every = opts.sample_every or SAMPLE_EVERY
        """Graph mode: one step in this many runs eagerly with phase timing (`_capture` sets it
        by measurement when StepOptions.sample_every is None)."""
        self.eager_over_replay = 0.0
        """Graph mode: the eager (sampled) step's time over a replay's, measured at capture."""
        self._eager_s = 0.0
        self.train_loss = self._train_loss
        """(x, y) -> the batch's mean loss, after the forward: `_train_loss`, or its torch.compile'd
        form (--compile), in which Inductor fuses the loss into the model's last kernels."""
        self.next_batch = loader.next_batch if loader is not None else None
        """() -> the batch at the loader's device counter (fast step): its `next_batch`, or that
        compiled (StepOptions.compile_read); None on a rank that computes nothing (no loader)."""
        self.read_compiled = False
        self.compile_s: Optional[float] = None
        self.compiled: Optional[str] = None
        self.combo = False
        """--combo-kernels: whether the compiled step uses Inductor's combo kernels."""
        self.update_kernel = "optimizer"
        """What applies the update: flat (one kernel over the flat buffers, flat_sgd.py), torch-fused
        (torch's fused SGD, in the fast step) or optimizer (its step(), as configured)."""
        if opts.compile != "off":
            self._compile()
        if self.fast:
            self._setup_fast(fused=why_not is None)
            if device.type == "cuda" and opts.cuda_graph == "auto" and fault is None and not strategy.free_running:
                self._capture_all_ranks()
            elif device.type == "cuda" and fault is not None:
                self.note = "fault injection runs eagerly (no CUDA graph)"

    def _probe_kernels(self) -> None:
        """On CUDA, where a layer runs a custom kernel: one forward and backward on the first
        batch before anything depends on them (choice.probe); a kernel that fails is switched
        off for the run and the note says so. Unforced kernels the device cannot run were left
        out by choice.choose; the note names them too."""
        skipped = [c for c in self.kernels if c.path != "triton" and c.why and "only" not in c.why]
        notes = [f"{choice.FLAGS[c.kernel]}: {c.layer} runs torch's ops ({c.why})" for c in skipped]
        batch = getattr(self.loader, "batch", None)
        if self.device.type == "cuda" and batch is not None and choice.running(self.model):
            failed = choice.probe(self.model, lambda: batch(0), self.loss, self.autocast, self.device)
            if failed:
                on = set(choice.running(self.model))
                for c in self.kernels:
                    if c.path == "triton" and c.kernel not in on:
                        c.path, c.why = "torch", "failed on this device at the first step"
                if "image-conv" not in on and self.image_conv == "triton":
                    self.image_conv, self.image_convs = "cudnn", 0
                notes += failed
        self.kernel_notes = notes
        """One line per kernel left to torch for this device's sake (printed by the run's lead)."""

    def _early_why_not(self, fast_why_not: Optional[str], fault) -> Optional[str]:
        """None if the update in the backward can run (the update of every convolution's weight
        in its op's backward, as soon as its gradient exists: fast.py's module docstring), else
        why not (one line)."""
        s = self.strategy
        if not self.fast or s.free_running:
            return fast_why_not or "the step is not the fast one (--check-every 1)"
        if not s.updates_locally:
            return (f"strategy {s.name} at {self.world_size} workers updates from other ranks' gradients "
                    "(allreduce at 1 worker and weight-avg update from their own)")
        if not self._adopts:
            return ("the gradients are accumulated into .grad, not taken whole (DDP, the CPU's default, "
                    "or the accumulate modifier)")
        if s.noise is not None:
            return "--noise-scale measures steps as two half batches, whose gradients add up"
        if fault is not None:
            return "fault injection changes the loss after the backward"
        if not self.conv_overlaps or self.conv_overlap == "off":
            return "no convolution runs shmlearn's backward op (--conv-overlap off, or none in the model)"
        if self.opts.compile != "off" and self.opts.precision == "fp32":
            # Seen on an H200 (torch 2.11, resnet18 fp32 --compile default, 1 worker): the compiled
            # backward hands the weights' gradients to .grad itself, so _check_placeholders failed
            # the warm-up, the capture and then the eager step.
            return "--compile in fp32: the compiled backward hands the weights' gradients on itself"
        return self._flat_why_not()

    def _flat_why_not(self) -> Optional[str]:
        """None if the update will be the flat SGD kernel (flat_sgd.bind), else why not (one line)."""
        s = self.strategy
        why = "--flat-sgd is off" if not self.opts.flat_sgd else flat_sgd.why_not(self.optimizer, s._trainable,
                                                                                  s.params_flat)
        return f"the update is not the flat SGD kernel ({why})" if why else None

    def _copy_why_not(self, fast_why_not: Optional[str]) -> Optional[str]:
        """None if the weight copy can run (the flat update writes the bf16 weights that the
        convolutions' forward reads, instead of autocast's cast of each at every forward), else
        why not (one line)."""
        s, o = self.strategy, self.opts
        if not self.fast or s.free_running:
            return fast_why_not or "the step is not the fast one (--check-every 1)"
        if o.precision != "bf16":
            return f"--precision {o.precision}: the forward casts no weights"
        if not self.conv_overlaps or self.conv_overlap == "off":
            return "no convolution runs shmlearn's op (--conv-overlap off, or none in the model)"
        return self._flat_why_not()

    # -- modes ----------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        if self.strategy.free_running:
            return "free-running"
        return "cuda-graph" if self.graphs else ("fast-eager" if self.fast else "classic")

    def autocast(self):
        # No weight-cast cache: each weight is cast once per forward anyway, and a cache would
        # hold tensors across the boundary of a captured graph.
        return (torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)
                if self.opts.precision == "bf16" else contextlib.nullcontext())

    def _setup_fast(self, fused: bool = True) -> None:
        """fused=False (a free-running strategy with another optimizer): the flags only; the
        strategy then skips the update itself (async-ps's server sees the losses on the host)."""
        dev = self.device
        self.found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        self._t = torch.zeros(1, dtype=torch.int64, device=dev)
        self._zero = torch.zeros((), dtype=torch.float32, device=dev)
        self._lr = []
        if not fused:
            return
        for g in self.optimizer.param_groups:
            # fused SGD: one kernel for all parameters, a learning rate read from the device (the
            # schedule fills it in place), and found_inf to skip a step without a host sync.
            g["fused"], g["foreach"] = True, False
            if not isinstance(g["lr"], torch.Tensor):
                g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=dev)
            if g["momentum"] != 0:
                for p in g["params"]:
                    # Zero buffers give the first step buf = 0*m + g = g, as torch's first-step
                    # clone does, and keep the tensors fixed for the graph.
                    st = self.optimizer.state[p]
                    if st.get("momentum_buffer") is None:
                        st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self._lr = [g["lr"] for g in self.optimizer.param_groups]
        self.optimizer.found_inf = self.found_inf
        self.update_kernel = "torch-fused"
        if self.opts.flat_sgd and not self.strategy.free_running:
            early = [i for w, b, _ in self._slots.values() for i in (w, b) if i is not None]
            update, _ = flat_sgd.bind(self.optimizer, self.strategy._trainable, self.strategy.params_flat,
                                      self.strategy.grads_flat, self.found_inf, early=early, copy=self._copy)
            if update is not None:
                self.strategy.flat_update, self.update_kernel = update, "flat"
                self.early_update = bool(early)
                self.weight_copy = self._copy is not None
        if self._slots and not self.early_update:
            conv_overlap.clear_slots(self.model)
            self._slots = {}
        if self._copy is not None and not self.weight_copy:  # never: _copy_why_not checked what bind does
            conv_overlap.set_weight_copies(self.model, lambda p: None)
            self._copy = None
        if self.strategy.noise is not None:
            self.strategy.noise.bind(self._t)  # its history is indexed by the step, as the losses are

    # -- the device step (eager, or captured) -----------------------------------------------------
    def _device_step(self, timer, round_: bool, step: Optional[int] = None) -> None:
        s = self.strategy
        if s.computes:
            with timer.phase("data"):
                x, y = self.next_batch()
            with timer.phase("compute"):
                loss = self._gradients(x, y)
            if self.fault is not None and step is not None:
                loss = self.fault.fire(self.rank, step, loss)
            self.hist.index_copy_(0, self._t, loss.reshape(1))
        else:
            loss = self._zero
        if self.reached is not None and step is not None:
            self.reached(step)
        s.gated_step(timer, loss, self.found_inf, round_)
        self._t.add_(1)

    def _gradients(self, x, y) -> torch.Tensor:
        """This rank's gradients of the batch, in the strategy's flat buffer; the mean loss."""
        s = self.strategy
        meter = s.noise
        # Whole gradients are taken, not accumulated, except where the noise meter's two half
        # batches accumulate into the buffer (a measured step at one worker).
        adopt = self._adopts and not (meter is not None and meter.micro and meter.on)
        if adopt:
            s.release_grads()
        else:
            s.zero_grad()
        # Deferred weight GEMMs are joined on leaving (before adopt_grads reads them); never where
        # gradients are added into .grad during the backward.
        early = adopt and self.early_update
        if early:
            self._taken = [0] * len(self._slots)
            self._placed = {}
        with conv_overlap.deferred(self.device, adopt and self.deferred, self.opts.side_streams,
                                   sink=self._take if early else None):
            loss = self._forward_backward(x, y, gate=early)
        if early:
            self._check_taken()
            self._check_placeholders()
        if adopt:
            s.adopt_grads(s.flat_update.early if early else frozenset())
        return loss

    def _take(self, slot: int, dw, db, placeholders) -> None:
        """The sink of conv_overlap.deferred (update in the backward): convolution `slot`'s
        gradients into the flat buffer and their SGD step, on the stream that made them."""
        w, b, _ = self._slots[slot]
        self._taken[slot] += 1
        for i, t in zip((w, b), placeholders):
            if i is not None and t is not None:
                self._placed[i] = t.data_ptr()
        if dw is not None:
            self.strategy.flat_update.take(w, dw)
        if db is not None and b is not None:
            self.strategy.flat_update.take(b, db)

    def _check_placeholders(self) -> None:
        """After such a backward, on the host: each parameter updated in it must hold the op's
        placeholder as its .grad. Another tensor there means autograd added a gradient from
        elsewhere (the weight used outside its module too), which the update did not see: an
        error, in the warm-up of a captured step (whose updates are skipped) or the first step."""
        s = self.strategy
        for w, b, name in self._slots.values():
            for i in (w, b):
                g = s._trainable[i].grad if i is not None else None
                if g is not None and i in self._placed and g.data_ptr() != self._placed[i]:
                    raise RuntimeError(f"--update-in-backward: {name}'s parameters get gradients from outside "
                                       "the module too; run with --update-in-backward off")

    def _check_taken(self) -> None:
        """After a backward that updated its convolutions (on the host: when a step runs eagerly
        or is captured; a replay repeats the capture): one taken twice is an error (the module is
        called twice per step); one the backward never reached takes its step with a zero
        gradient, as the flat update of a parameter without a gradient does."""
        twice = [self._slots[k][2] for k, n in enumerate(self._taken) if n > 1]
        if twice:
            raise RuntimeError(f"--update-in-backward: convolution {twice[0]} ran more than once in a step; "
                               "run with --update-in-backward off")
        s = self.strategy
        for k, n in enumerate(self._taken):
            if n == 0:
                w, b, _ = self._slots[k]
                for i in (w, b):
                    if i is not None:  # the zeros adopt_grads keeps for a parameter without a gradient
                        if i not in s._zeros:
                            s._zeros[i] = torch.zeros_like(s._grad_views[i])
                        s.flat_update.take(i, s._zeros[i])

    def _train_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss: the forward under autocast (--precision), the loss in fp32."""
        with self.autocast():
            out = self.strategy.module(x)
        return self.loss(out.float(), y)

    def _forward_backward(self, x, y, gate: bool = False) -> torch.Tensor:
        """Forward and backward of this rank's batch; its mean loss, detached. With a noise meter
        at one worker, as two half batches (noise.py: their gradients' norms are the measurement).
        gate: a non-finite loss sets the skip flag before the backward (whose updates read it)."""
        def fb(xb, yb):
            with conv_overlap.weight_copies(self._copy is not None):
                loss = self.train_loss(xb, yb)
            if gate:
                check_non_finite(loss.detach().reshape(1), self.found_inf, self.strategy._one)
            loss.backward()
            return loss.detach()
        meter = self.strategy.noise
        if meter is not None and meter.micro and meter.on:  # only a measured step splits (--noise-every)
            return meter.two_halves(fb, x, y, self.strategy.grads_flat)
        return fb(x, y)

    # -- --compile ---------------------------------------------------------------------------------
    def _compile(self) -> None:
        """Compile before the clock starts: a first forward and backward on a real batch (Inductor
        compiles both; its caches keep them for later runs and a sweep's trials), then, with
        auto, time eager against compiled and keep the faster: where the step will be captured,
        as CUDA graph replays (what the step will run: Python and launch overheads gone), else
        as eager calls. Every rank keeps the same choice (the ranks' times are summed). Gradients
        and buffers (BatchNorm) are put back as they were; the optimizer never steps."""
        mode = {"default": None, "auto": None, "max-autotune": "max-autotune-no-cudagraphs"}[self.opts.compile]
        computes = self.strategy.computes
        batch = self.loader.batch(0) if computes else None
        self.combo = combo_kernels(self.opts.combo_kernels, self.device, batch[0] if batch else None)
        options = dict(self.opts.inductor)
        if self.combo:
            options["combo_kernels"] = True
        if self.deferred:  # Inductor must not reuse what a deferred weight GEMM still reads
            options.update(conv_overlap.INDUCTOR_OPTIONS)
        if options:  # torch.compile takes a mode or options, not both
            from torch._inductor import list_mode_options
            options = {**(list_mode_options(mode) if mode else {}), **options}
            mode = None
        else:
            options = None
        # The forward and the loss as one graph: the loss's kernels (log-softmax, NLL and their
        # backward: 6 launches) fuse into the model's (alexnet-small at batch 128 on an H100: see
        # benchmarks/results/flat-step-h100).
        if isinstance(self.strategy.module, torch.nn.parallel.DistributedDataParallel):
            # DDP is compiled as a module (Dynamo splits its graph at the gradient buckets).
            module = torch.compile(self.strategy.module, mode=mode, options=options, dynamic=False)

            def compiled(x, y):
                with self.autocast():
                    out = module(x)
                return self.loss(out.float(), y)
        else:
            compiled = torch.compile(self._train_loss, mode=mode, options=options, dynamic=False)
        times = torch.zeros(2, dtype=torch.float64)  # eager, compiled (auto)
        saved_buffers = [b.clone() for b in self.model.buffers()]
        try:
            if computes:
                x, y = batch

                def fb(fwd) -> None:
                    self.strategy.zero_grad()
                    with conv_overlap.weight_copies(self._copy is not None):  # as the step will trace it
                        loss = fwd(x, y)
                    loss.backward()

                def timed(fwd, n: int) -> float:
                    self._sync()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fb(fwd)
                    self._sync()
                    return (time.perf_counter() - t0) / n

                def replayed(fwd, n: int = 20) -> float:
                    with self._side_stream():
                        for _ in range(3):
                            fb(fwd)
                    g = self._graph_of(lambda: fb(fwd))
                    g.replay()
                    self._sync()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        g.replay()
                    self._sync()
                    return (time.perf_counter() - t0) / n

                self.compile_s = timed(compiled, 1)
                if self.opts.compile == "auto":
                    captured = (self.device.type == "cuda" and self.opts.cuda_graph == "auto" and self.fault is None
                                and not self.strategy.free_running and self.check_every > 1)
                    if captured:
                        times[0], times[1] = replayed(self._train_loss), replayed(compiled)
                    else:
                        timed(self._train_loss, 2)  # warm (cuDNN autotuning) before timing
                        times[0], times[1] = timed(self._train_loss, 5), timed(compiled, 5)
            if self.opts.compile == "auto" and self.world_size > 1:
                t = times.to(self.device)
                dist.all_reduce(t)
                times = t.cpu()
        finally:
            if computes:
                self._sync()
                self.strategy.zero_grad()
            with torch.no_grad():
                for b, v in zip(self.model.buffers(), saved_buffers):
                    b.copy_(v)
        choice = self.opts.compile
        if choice == "auto":
            eager_s, compiled_s = times.tolist()
            choice = "default" if compiled_s < eager_s else "off"
            self.note = (f"--compile auto: compiled {compiled_s * 1e3:.3f} ms against eager {eager_s * 1e3:.3f} ms a "
                         f"forward and backward; {'compiled' if choice == 'default' else 'eager'}")
        if choice != "off":
            self.train_loss = compiled
            if computes and self.opts.compile_read and self.fast and not self.strategy.free_running:
                self._compile_read(mode, options)
        else:  # eager won: what auto chose for a compiled step is slower eagerly
            self.combo = False
            if self.opts.max_pool == "auto" and self.max_pool != "aten":
                self.max_pool, self.max_pools = "aten", max_pool.convert(self.model, "aten")
            if self.opts.image_conv == "auto" and self.image_conv != "cudnn":
                self.image_conv, self.image_convs = "cudnn", image_conv.convert(self.model, "cudnn")
        self.compiled = choice

    def _compile_read(self, mode, options) -> None:
        """The batch read compiled (StepOptions.compile_read), with the model's mode and options,
        and compiled now, its time added to compile_s: one read at the counter of step 0, which
        the next prepare() resets. A read that does not compile stays eager, and the run says why
        (the model is compiled all the same)."""
        read = torch.compile(self.loader.next_batch, mode=mode, options=options, dynamic=False)
        self.loader.prepare(0)
        self._sync()
        t0 = time.perf_counter()
        try:
            read()
            self._sync()
        except Exception as e:  # noqa: BLE001 - the eager read computes the same batches
            self.note = "; ".join(filter(None, [self.note, f"--compile: the batch read runs eagerly ({one_line(e)})"]))
            read = None
        self.compile_s = (self.compile_s or 0.0) + time.perf_counter() - t0
        self.loader.invalidate()
        if read is not None:
            self.next_batch, self.read_compiled = read, True

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _free_step(self, step: int, meets: bool) -> None:
        """A free-running strategy's step (async-ps): as many gradients as it asks for, each from
        the next batch of this rank's own sequence (its gradients, not the loop's steps, count
        the batches), eagerly."""
        s = self.strategy
        s.plan_step(step, meets)
        if not s.computes:
            if self.reached is not None:
                self.reached(step)
            s.gated_step(self.timer, self._zero, self.found_inf, False)
        while s.computes and s.wants_gradient():
            self.loader.prepare(self._batches)
            self._batches += 1
            with self.timer.phase("data"):
                x, y = self.loader.next_batch()
            with self.timer.phase("compute"):
                loss = self._gradients(x, y)
            if self.fault is not None:
                # A free-running worker may compute no gradient in a given loop step (it ran ahead
                # earlier), so a fault counts this rank's gradients, which reach every number.
                loss = self.fault.fire(self.rank, self._batches - 1, loss)
            if self.reached is not None:
                self.reached(step)
            s.gated_step(self.timer, loss, self.found_inf, False)
        self.free_hist[step] = s.step_loss()

    def meets_after(self, step: int) -> bool:
        """Whether the loss is read after step `step` (the loop adds its evaluations and the end)."""
        first = self._pending_from if self._pending_from is not None else step
        return not self.fast or step + 1 - first >= self.check_every

    def _kinds(self) -> List[Tuple[bool, bool]]:
        """The kinds of step a graph is captured for: (round kind, measures the noise scale); the
        measuring variant only with --noise-scale (noise.py: a measured step runs other kernels,
        e.g. two half batches at 1 worker)."""
        measuring = (False, True) if self.strategy.noise is not None else (False,)
        return [(k, m) for m in measuring for k in self.strategy.round_kinds()]

    @staticmethod
    def _key(round_: bool, measuring: bool):
        """self.graphs' key of a kind of step: the plain step's graph keeps the round kind alone
        (what the benchmarks and tests read as graphs[False]), a measuring step's is (round_, True)."""
        return (round_, True) if measuring else round_

    def _begin(self, step: int) -> bool:
        """Whether step `step` measures the noise scale (--noise-every); tells the meter."""
        meter = self.strategy.noise
        return meter.begin(step) if meter is not None else False

    def _as_kind(self, kind: Tuple[bool, bool]) -> None:
        """Capture: run the next device step as `kind` (round kind, measuring)."""
        if self.strategy.noise is not None:
            self.strategy.noise.on = kind[1]

    def _capture_all_ranks(self) -> None:
        """Capture on every rank; if any rank fails, every rank runs eagerly (same maths)."""
        err = None
        try:
            graphs = self._capture()
        except Exception as e:  # noqa: BLE001 - a failed capture falls back to eager, and says why
            graphs, err = None, one_line(e)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        ok = torch.tensor([0.0 if graphs else 1.0], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(ok)
        if ok.item() == 0:
            self.graphs = graphs
            if self.opts.sample_every is None and self.device.type == "cuda":  # every rank replays, then agrees
                ratio = torch.tensor([self._eager_s / self._replay_s()], device=self.device)
                if self.world_size > 1:
                    dist.all_reduce(ratio, op=dist.ReduceOp.MAX)  # every rank samples the same steps
                self.eager_over_replay = float(ratio.item())
                self.sample_every = sample_period(self.eager_over_replay, 1.0)
        else:
            self.note = f"CUDA graph capture failed ({err or 'on another rank'}); running eagerly"

    def _capture(self):
        """Warm up on a side stream (allocator, cuDNN autotuning, NCCL communicators), capture one
        graph per kind of step, and put back everything the warm-up touched. The graphs share one
        memory pool: they are never replayed concurrently, and nothing allocated in one is read by
        another (what outlives a step was allocated in the warm-up), so the measuring variant does
        not double the activation memory."""
        kinds = self._kinds()
        with self._no_update():
            if self.strategy.computes:
                self.loader.prepare(0)
            eager_s = 0.0
            with self._side_stream():
                for i in range(3):
                    for j, k in enumerate(kinds):
                        self._as_kind(k)
                        last = i == 2 and j == 0  # warm by now: what a sampled eager step costs
                        if last:
                            self._sync()
                            t0 = time.perf_counter()
                        self._device_step(NULL_TIMER, k[0])
                        if last:
                            self._sync()
                            eager_s = time.perf_counter() - t0
            self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
            graphs = {}
            for k in kinds:
                self._as_kind(k)
                graphs[self._key(*k)] = self._graph_of(lambda k=k: self._device_step(NULL_TIMER, k[0]))
            self._eager_s = eager_s
            return graphs

    @contextlib.contextmanager
    def _no_update(self):
        """Steps that compute and communicate but never update (the skip flag set), with the
        weights, buffers, loader and step counter put back after, also after an error: capture's
        warm-up, and the replays `_replay_s` times."""
        saved_params = self.strategy.params_flat.clone()
        saved_buffers = [b.clone() for b in self.model.buffers()]
        self.found_inf.fill_(1.0)
        try:
            yield
        finally:  # also after a failed capture: the eager fallback starts from the same state
            if self.device.type == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)
            with torch.no_grad():
                self.strategy.params_flat.copy_(saved_params)
                for b, v in zip(self.model.buffers(), saved_buffers):
                    b.copy_(v)
                if self.strategy.flat_update is not None:
                    self.strategy.flat_update.refresh()  # the weights were written around the update
            self.found_inf.zero_()
            self._expected = None  # the next step re-primes the loader and the step counter
            if self.strategy.computes:
                self.loader.invalidate()

    def _replay_s(self, n: int = 5) -> float:
        """Seconds per replay of the plain step's graph (median of n after one), under
        `_no_update`."""
        kind = self._kinds()[0]
        graph = self.graphs[self._key(*kind)]
        times = []
        with self._no_update():
            self._as_kind(kind)
            self._t.fill_(0)
            for i in range(n + 1):
                if self.strategy.computes:
                    self.loader.prepare(i)
                self._sync()
                t0 = time.perf_counter()
                graph.replay()
                self._sync()
                times.append(time.perf_counter() - t0)
        return sorted(times[1:])[n // 2]

    @contextlib.contextmanager
    def _side_stream(self):
        """Where warm-up runs: a side stream, as torch.cuda.graphs asks (autograd and NCCL set up
        their per-stream state there, not on the stream being captured)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream(self.device).wait_stream(side)

    def _graph_of(self, fn):
        """fn's device work captured in a CUDA graph (fn does not run); replay() runs it. In
        the memory pool self._pool (the step's graphs share one, `_capture`), else its own."""
        edit = self.opts.memset_kernels and graph_memsets.supported()
        g = torch.cuda.CUDAGraph(keep_graph=True) if edit else torch.cuda.CUDAGraph()
        stream = None
        if self.opts.high_priority_capture:  # a large negative number maps to the highest priority
            stream = torch.cuda.Stream(self.device, priority=-100)
        # thread_local: other threads (NCCL's watchdog, the heartbeat) may make CUDA calls.
        with torch.cuda.graph(g, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            fn()
        if edit:
            try:
                sizes = graph_memsets.memsets_to_kernels(g.raw_cuda_graph(), self.device.index)
                self.memsets_replaced += len(sizes)
                self.memset_bytes = max([self.memset_bytes, *sizes])
            except (OSError, RuntimeError, AttributeError) as e:  # each replacement leaves a valid graph
                self.note = f"memset nodes kept in the step's CUDA graph: {e}"
            g.instantiate()
        return g

    # -- what the loop calls ----------------------------------------------------------------------
    def run(self, step: int, meets: bool = False) -> None:
        """Do training step `step`: classic: data and compute only (the loop reads, then calls
        update()); fast: the whole step, on the device, with no host sync. meets: the loop meets
        in a collective after this step (`meets_after`; free-running strategies need to know)."""
        if self._pending_from is None:
            self._pending_from = step
        measuring = self._begin(step)
        if self.fast and self.strategy.free_running:
            self._free_step(step, meets)
            self._step_schedule()
            self._keep_lr_tensors()
            self.timer.step_done()
            return
        if not self.fast:
            s = self.strategy
            loss = None
            if s.computes:
                with self.timer.phase("data"):
                    x, y = self.loader.batch(step)
                with self.timer.phase("compute"):
                    loss = self._gradients(x, y)
            if self.fault is not None:
                loss = self.fault.fire(self.rank, step, loss)
            if loss is not None:
                self.hist[step:step + 1].copy_(loss.reshape(1))
            return
        if step != self._expected:
            self._t.fill_(step)
        self._expected = step + 1
        if self.strategy.computes:
            self.loader.prepare(step)
        round_ = self.strategy.next_round()
        sampled = self.graphs is None or step % self.sample_every == 0
        if sampled:
            self._device_step(self.timer, round_, step)
        else:
            self.graphs[self._key(round_, measuring)].replay()
        self.strategy.host_step(round_)
        self._step_schedule()
        self._keep_lr_tensors()
        self.timer.step_done(timed=sampled)

    def _keep_lr_tensors(self) -> None:
        """Recent torch schedulers fill a tensor learning rate in place; older ones assign a
        float. Either way the value ends up in the tensor the graph and fused SGD read."""
        for g, t in zip(self.optimizer.param_groups, self._lr):
            v = g["lr"]
            if v is not t:
                if isinstance(v, torch.Tensor):
                    t.copy_(v)
                else:
                    t.fill_(float(v))
                g["lr"] = t

    def _step_schedule(self) -> None:
        # This step's update has happened, but not always through this rank's optimizer.step(),
        # whose wrapper is what torch's scheduler checks before its first step: fused SGD runs
        # inside the step (or its graph), and under ps only the server updates. Without the flag
        # torch warns of a wrong call order (a schedule off by one) that did not happen.
        self.optimizer._opt_called = True
        self.schedule.step()

    def update(self) -> None:
        """Classic only: sync and update, after the loop has read a finite loss."""
        if not self.fast:
            self.strategy.step(self.timer)
            self._step_schedule()
            self.timer.step_done()

    def close(self) -> None:
        """Release the captured graphs before the process group goes: a graph holds NCCL work,
        and destroying the communicators under it hangs (seen on 4x H200, torch 2.11)."""
        if self.graphs is not None:
            torch.cuda.synchronize(self.device)
            self.graphs = None
        if self._copy is not None:  # the model goes back to casting its weights (and holds no copy)
            conv_overlap.set_weight_copies(self.model, lambda p: None)

    def flush(self, done: int) -> Optional[Window]:
        """Read whatever is pending (the benchmark does, between timed repeats)."""
        return self.read(done) if self._pending_from is not None else None

    def due(self, done: int) -> bool:
        """Whether the loop must read after `done` steps (classic: always)."""
        return self.meets_after(done - 1)

    def read(self, done: int, want_eval: bool = False, want_ckpt: bool = False, want_stop: bool = False) -> Window:
        """One all-reduce of every rank's losses of steps [first, done) and rank 0's requests;
        this syncs the device."""
        first = self._pending_from if self._pending_from is not None else done
        n, w = done - first, self.world_size
        ctrl = torch.zeros(w * n + 3, dtype=torch.float64, device=self.device)
        if self.free_hist is not None and n:  # a free-running server: the sums of its updates' losses
            ctrl[self.rank * n:(self.rank + 1) * n] = self.free_hist[first:done].to(self.device)
        elif self.strategy.computes and n:
            ctrl[self.rank * n:(self.rank + 1) * n] = self.hist[first:done]
        ctrl[w * n] = float(want_eval)
        ctrl[w * n + 1] = float(want_ckpt)
        ctrl[w * n + 2] = float(want_stop)
        if w > 1:
            dist.all_reduce(ctrl)
        vals = ctrl.tolist()
        self._pending_from = None
        per_rank = [vals[r * n:(r + 1) * n] for r in range(w)]
        losses, bad = [], None
        for i in range(n):
            column = [per_rank[r][i] for r in range(w)]
            odd = [r for r, v in enumerate(column) if v != v or v in (float("inf"), float("-inf"))]
            if odd:
                bad = (first + i, odd[0])
                break
            losses.append(sum(column) / self.strategy.compute_ranks)
        return Window(first, losses, bad, vals[w * n] > 0, vals[w * n + 1] > 0, vals[w * n + 2] > 0)
