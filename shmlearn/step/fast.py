"""The training step, shared by the loop (train/loop.py) and the benchmarks (bench/throughput.py).

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
  Needs: a strategy with `gated_step` (allreduce, ps, weight-avg) and an optimizer the step can
  skip on the device, stepped with the user's hyperparameters (options.optimizer_why_not, by
  capability): torch's fused implementation where it reads the skip flag (SGD, Adam, AdamW;
  Adagrad on the CPU), else its foreach one (capturable on CUDA) behind step/gate.py, which puts
  the weights and the state back on a skipped step (RMSprop, NAdam, RAdam, Adamax, Adadelta, ASGD,
  Rprop). A step() that needs a closure (LBFGS), a subclass that overrides step() and a class with
  neither implementation run classic with a note (options.optimizer_note). Step hooks run: the
  fast step then calls the optimizer's step() every step, eagerly.

Phase timing in graph mode: a replayed step is one launch and is not split into phases. One step
in every `sample_every` runs eagerly instead (same kernels, same result) with CUDA events around
its phases; phase_s is the mean over those sampled steps, step time comes from the wall clock.
An eager step of a compiled model costs 8-25 replays (ResNet-34 at batch 128 on an H100: 12),
so the period is chosen at capture to keep those steps within 1% of the time
(`sample_period`), unless StepTuning.sample_every fixes it.
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch

from shmlearn.step.compile import Compiler
from shmlearn.step.device import DeviceStep
from shmlearn.step.graphs import Graphs, collectives_why_not
from shmlearn.step.kernels import KernelChoice
from shmlearn.step.modes import ClassicStep, FastStep, FreeRunningStep, arm_fast
# The options and constants live with the step's parts; callers import them from here too.
from shmlearn.step.options import (ADOPT_GRADS, COMBO, COMBO_MAX_PIXELS, COMPILE, CUDA_GRAPH,  # noqa: F401
                                   DEFAULT_CHECK_EVERY, EARLY_UPDATE, GRAD_BUCKETS, PRECISIONS, SAMPLE_COST, SAMPLE_EVERY,
                                   WEIGHT_COPY, StepOptions, StepTuning, Window, combo_kernels, fast_capable, optimizer_note,
                                   sample_period, step_hooks)
from shmlearn.step.summary import StepSummary
from shmlearn.user.tasks import loss_fn


def _part(part: str, name: str) -> property:
    """A Stepper attribute kept by one of its parts (read-only; summary.json and the bench read them)."""
    return property(lambda self: getattr(getattr(self, part), name), doc=f"{part}.{name}")


class Stepper:
    """One rank's training step in the chosen mode (see the module docstring), composed of its
    parts: the layers' kernels (`choice`, step/kernels.py), the device work (`dstep`,
    step/device.py), CUDA-graph capture (`capture`, step/graphs.py), --compile (`compiler`,
    step/compile.py) and the step mode (`stepping`, step/modes.py). It keeps the loss history
    and the read."""

    def __init__(self, *, model, strategy, optimizer, schedule, loader, task: str, device: torch.device,
                 opts: StepOptions, timer, rank: int, world_size: int, total_steps: int, fault=None,
                 loss=None, reached=None, compute_loss=None, tuning: StepTuning = StepTuning()):
        """opts: the step's settings (a TrainConfig is one); tuning: the bench's switches. loss: f(outputs, targets) -> scalar; default the task's (tasks.loss_fn). compute_loss:
        the user's f(model, batch) -> loss or (loss, metrics), which replaces the forward and loss.
        reached: f(step), called when an eagerly run fast step has computed and is about to
        enter its collective (the loop's heartbeat: a rank that hangs before it is named)."""
        self.reached = reached
        self.model, self.strategy, self.optimizer, self.schedule = model, strategy, optimizer, schedule
        self.loader, self.task, self.device, self.opts, self.timer = loader, task, device, opts, timer
        self.tuning = tuning
        self.rank, self.world_size, self.fault = rank, world_size, fault
        self.loss = loss or (lambda out, y: loss_fn(task, out, y))
        self.check_every = opts.check_every or DEFAULT_CHECK_EVERY.get(device.type, 1)
        why_not = fast_capable(strategy, optimizer, device)
        # A free-running strategy (async-ps) always takes the fast path's loop (its ranks read
        # the losses every check_every steps), with torch's fused update where the optimizer has one.
        self.fast = strategy.free_running or (why_not is None and self.check_every > 1)
        self.own_step = self.fast and step_hooks(optimizer) > 0
        """The update is the optimizer's step() at every step, eagerly: its step hooks run
        (options.step_hooks; no flat kernel, no CUDA graph, which would run them once, at capture)."""
        # The user's optimizer is always accounted for (honoured or refused, options.optimizer_note);
        # a strategy without a fast step is named only when --check-every asked for one.
        self._opt_note = None if strategy.free_running or self.check_every <= 1 or not strategy.gated else \
            optimizer_note(optimizer, why_not, self.fast, device)
        self.note = self._opt_note or (why_not if (why_not and (opts.check_every or 1) > 1
                                                   and not strategy.free_running) else None)
        self.hist = torch.zeros(total_steps + 1, dtype=torch.float32, device=device)
        """This rank's loss at every step (fast: written on the device, read every K steps)."""
        self.free_hist = torch.zeros(total_steps + 1, dtype=torch.float64) if strategy.free_running else None
        """Free running: this rank's step_loss() at every step, in float64 (a server's sum of W losses)."""
        self._pending_from: Optional[int] = None  # first step not yet read
        self._gate = None  # step/gate.py's FlagGate of the user's optimizer (the fast step arms it)
        self.choice = KernelChoice(model=model, strategy=strategy, optimizer=optimizer, loader=loader, loss=self.loss,
                                   device=device, opts=opts, tuning=tuning, fast=self.fast, fast_why_not=why_not, fault=fault,
                                   world_size=world_size, total_steps=total_steps)
        self.dstep = DeviceStep(strategy=strategy, loader=loader, loss=self.loss, device=device, opts=opts, tuning=tuning,
                                choice=self.choice, fault=fault, rank=rank, reached=reached, hist=self.hist,
                                compute=compute_loss)
        self.capture = Graphs(model=model, strategy=strategy, loader=loader, device=device, opts=opts, tuning=tuning,
                              world_size=world_size, dstep=self.dstep, say=self._say)
        self.compiler = Compiler(model=model, strategy=strategy, loader=loader, device=device, opts=opts, tuning=tuning,
                                 world_size=world_size, fault=fault, check_every=self.check_every, fast=self.fast,
                                 dstep=self.dstep, choice=self.choice, graphs=self.capture, say=self._say)
        if opts.compile != "off":
            self.compiler.run()
        self.stepping = ClassicStep(strategy=strategy, optimizer=optimizer, schedule=schedule, loader=loader,
                                    timer=timer, dstep=self.dstep, fault=fault, rank=rank, hist=self.hist)
        """The step mode (step/modes.py): classic here; `_setup_fast` makes it fast or free-running."""
        if self.fast:
            self._setup_fast(fused=why_not is None)
            if (device.type == "cuda" and opts.cuda_graph == "auto" and fault is None and not strategy.free_running
                    and not self.own_step):
                why = collectives_why_not(strategy)
                if why is None:
                    self._capture_all_ranks()
                else:
                    self._say(why, join=True)
            elif device.type == "cuda" and fault is not None:
                self._say("fault injection runs eagerly (no CUDA graph)")
        if "torch._dynamo" not in sys.modules and (strategy.flat_update is None or strategy.free_running):
            # torch.optim's step() imports torch._dynamo at its first call (its _use_grad
            # wrapper), which a run without Dynamo (launch/lean.py) would pay inside its first
            # timed step (1-4 s on this 2-core CPU: a 64-step Adam run timed 5.3 s, 0.96 s with
            # Dynamo imported first): imported now, before the clock starts.
            importlib.import_module("torch._dynamo")  # not `import torch._dynamo`: torch is a global here

    def _setup_fast(self, fused: bool = True) -> None:
        """The fast step's mode (modes.arm_fast; fused=False: a free-running strategy with an
        optimizer other than SGD)."""
        lr = arm_fast(optimizer=self.optimizer, strategy=self.strategy, choice=self.choice, dstep=self.dstep,
                      fused=fused)
        self._gate = lr.gate
        common = dict(strategy=self.strategy, optimizer=self.optimizer, schedule=self.schedule, loader=self.loader,
                      timer=self.timer, dstep=self.dstep, lr=lr)
        if self.strategy.free_running:
            self.stepping = FreeRunningStep(**common, fault=self.fault, rank=self.rank, reached=self.reached,
                                            free_hist=self.free_hist)
        else:
            self.stepping = FastStep(**common, graphs=self.capture)

    def _capture_all_ranks(self) -> None:
        """Capture the step's CUDA graphs on every rank, or run eagerly on all (Graphs.capture_all_ranks)."""
        self.capture.capture_all_ranks()

    def _say(self, line: str, join: bool = False) -> None:
        """The parts' note: replaces the one before, or with join is added to it (the optimizer's
        note stays first either way)."""
        self.note = "; ".join(filter(None, [self.note if join else self._opt_note, line]))

    # What `summary`, the bench and the tests read, kept by the parts.
    kernels, kernel_notes = _part("choice", "kernels"), _part("choice", "kernel_notes")
    quiet_notes = _part("choice", "quiet_notes")
    image_conv, image_convs = _part("choice", "image_conv"), _part("choice", "image_convs")
    max_pool, max_pools = _part("choice", "max_pool"), _part("choice", "max_pools")
    conv_pool, conv_pools = _part("choice", "conv_pool"), _part("choice", "conv_pools")
    mlp_head, mlp_heads = _part("choice", "mlp_head"), _part("choice", "mlp_heads")
    conv_overlap, conv_overlaps = _part("choice", "conv_overlap"), _part("choice", "conv_overlaps")
    deferred, update_kernel = _part("choice", "deferred"), _part("choice", "update_kernel")
    early_update, weight_copy = _part("choice", "early_update"), _part("choice", "weight_copy")
    grad_buckets = _part("choice", "grad_buckets")
    _adopts, _slots = _part("choice", "adopts"), _part("choice", "slots")
    compiled, compile_s = _part("compiler", "compiled"), _part("compiler", "compile_s")
    read_compiled, combo = _part("compiler", "read_compiled"), _part("compiler", "combo")
    memsets_replaced, memset_bytes = _part("capture", "memsets_replaced"), _part("capture", "memset_bytes")
    sample_every, eager_over_replay = _part("capture", "sample_every"), _part("capture", "eager_over_replay")
    found_inf, train_loss, next_batch = _part("dstep", "found_inf"), _part("dstep", "train_loss"), _part("dstep", "next_batch")

    @property
    def graphs(self):
        """CUDA graphs of the step, one per kind (Graphs.kinds, Graphs.key), replayed by the fast step."""
        return self.capture.graphs

    @graphs.setter
    def graphs(self, value) -> None:
        self.capture.graphs = value

    @property
    def mode(self) -> str:
        if self.strategy.free_running:
            return "free-running"
        return "cuda-graph" if self.graphs else ("fast-eager" if self.fast else "classic")

    def autocast(self):
        return self.dstep.autocast()

    def summary(self) -> StepSummary:
        """How this rank's step ran (mode, compiler, kernels): what the run directory records."""
        return StepSummary(
            step_mode=self.mode, check_every=1 if not self.fast else self.check_every, step_note=self.note,
            compile=self.compiled or "off", compile_s=self.compile_s, compile_read=self.read_compiled,
            image_conv=self.image_conv, image_convs=self.image_convs,
            max_pool=self.max_pool, max_pools=self.max_pools,
            conv_pool=self.conv_pool, conv_pools=self.conv_pools,
            mlp_head=self.mlp_head, mlp_heads=self.mlp_heads,
            kernels=[c.as_dict() for c in self.kernels], kernel_notes=[*self.kernel_notes, *self.quiet_notes],
            conv_overlap=self.conv_overlap, conv_overlaps=self.conv_overlaps,
            conv_overlap_deferred=self.deferred, combo_kernels=self.combo,
            update_kernel=self.update_kernel, update_in_backward=self.early_update,
            weight_copy=self.weight_copy, grad_buckets=self.grad_buckets,
            collectives=self.strategy.collectives_path, collectives_note=self.strategy.comm_note,
            graph_memsets_replaced=self.memsets_replaced,
            phase_sample_every=self.sample_every if self.graphs else None)

    # -- what the loop calls ----------------------------------------------------------------------
    def meets_after(self, step: int) -> bool:
        """Whether the loss is read after step `step` (the loop adds its evaluations and the end)."""
        first = self._pending_from if self._pending_from is not None else step
        return not self.fast or step + 1 - first >= self.check_every

    def run(self, step: int, meets: bool = False) -> None:
        """Do training step `step`: classic: data and compute only (the loop reads, then calls
        update()); fast: the whole step, on the device, with no host sync. meets: the loop meets
        in a collective after this step (`meets_after`; free-running strategies need to know)."""
        if self._pending_from is None:
            self._pending_from = step
        meter = self.strategy.noise  # whether this step measures the noise scale (--noise-every); tells the meter
        measuring = meter.begin(step) if meter is not None else False
        self.stepping.run(step, meets, measuring)

    def update(self) -> None:
        """Classic only: sync and update, after the loop has read a finite loss."""
        self.stepping.update()

    def close(self) -> None:
        """Release the captured graphs before the process group goes: a graph holds NCCL work,
        and destroying the communicators under it hangs (seen on 4x H200, torch 2.11)."""
        if self.graphs is not None:
            torch.cuda.synchronize(self.device)
            self.graphs = None
        self.choice.release()  # the model goes back to casting its weights (and holds no copy)
        if self._gate is not None:  # the user's optimizer steps as written after the run
            self._gate.remove()
            self._gate = None

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
            self.strategy.sum_(ctrl)  # through shared memory where the strategy's average runs there
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
