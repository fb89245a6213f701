"""Which kernel each layer of the model runs in the step, chosen once before anything is compiled
or captured: cuDNN's autotuning, the fused conv-pool blocks and classifier heads, the image's
convolutions, max-pools, the convolutions' overlapped backward, the update in the backward and the
weight copy, and which kernel applies the update (`bind_update`). Each layer takes a kernel only
where it can run on this device (nn/choice.py); a kernel forced on where it cannot is one line of
BadInput."""
from __future__ import annotations

from typing import Optional

import torch

from shmlearn.step import flat_sgd
from shmlearn.errors import BadInput
from shmlearn.nn import choice, conv_overlap, conv_pool, image_conv, max_pool, mlp_head
from shmlearn.step import buckets, built
from shmlearn.step.device import autocast
from shmlearn.step.options import step_hooks


def build_key(kernels, loader, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """The step/built.py record's key of the layers in `kernels` that run a Triton kernel, for the
    loader's batch shape: None where none does or the loader has no batch to look at."""
    on = [c for c in kernels if c.path == "triton"]
    batch = getattr(loader, "batch", None)
    if not on or batch is None:
        return None
    x = batch(0)[0]
    return built.key([f"{c.kernel} {c.layer}" for c in on], tuple(x.shape) if isinstance(x, torch.Tensor) else (),
                     dtype, device)


def choose(model, conv_pool_mode: str, mlp_head_mode: str, opts, dtype: torch.dtype, device: torch.device, loader,
           total_steps: int):
    """choice.choose, without compiling to check the kernels' fit where auto will leave them to
    torch anyway: a CUDA run shorter than built.BUILD_MIN_STEPS whose kernels are not built here
    (KernelChoice._defer_unbuilt). The check compiled six conv-pool kernels, ~20 s of a 31 s first
    run of alexnet-small that then ran none of them (one H200, 2026-11-28,
    results/gpu-2026-11-28-b56/). Where the record says built, the layers are chosen again with
    the check (from Triton's cache, quick)."""
    modes = {"conv-pool": conv_pool_mode, "mlp-head": mlp_head_mode}
    short = device.type == "cuda" and not built.may_build(total_steps)
    unchecked = {k for k, flag in (("conv-pool", opts.conv_pool), ("mlp-head", opts.mlp_head))
                 if short and flag == "auto" and modes[k] == "triton"}

    def pick(off=(), **kw):
        return choice.choose(model, conv_pool_mode="off" if "conv-pool" in off else conv_pool_mode,
                             mlp_head_mode="off" if "mlp-head" in off else mlp_head_mode, dtype=dtype, device=device,
                             **kw)
    if not unchecked:
        return pick()
    # What auto would pick, unchecked and unconverted: the record's key (its layers and shapes).
    candidates = pick(unchecked=unchecked, convert=False)
    if built.is_built(build_key(candidates, loader, dtype, device)):
        return pick()  # built here: chosen again with the check, and converted
    # Not built: the other kernels as always, and these as candidates that _defer_unbuilt leaves to torch.
    return pick(off=unchecked) + [c for c in candidates if c.kernel in unchecked]


def may_defer(adopts: bool, defer_wgrad: bool, device: torch.device, compile_mode: str, precision: str) -> bool:
    """Whether the convolutions' weight GEMMs may run on past their backward (conv_overlap.deferred):
    on CUDA, where the step adopts its gradients whole, except in a compiled fp32 step. Its compiled
    backward hands the weights' gradients on itself (early_why_not), reading them on the main
    stream before a deferred GEMM is done: resnet18 fp32 allreduce compiled at 1 worker ended its
    100 steps 0.07-0.12 above the eager reference in nine runs, and 0.01 above it without the
    deferral (one H200, 2026-11-28, results/gpu-2026-11-28-s25/)."""
    return (adopts and defer_wgrad and device.type == "cuda"
            and not (compile_mode != "off" and precision == "fp32"))


class KernelChoice:
    """The layers' kernels for one rank's step (summary.json's `kernels` and the counts beside it).
    fast: the step is the fast one; fast_why_not: fast.fast_capable's answer (None: it can run)."""

    def __init__(self, *, model, strategy, optimizer, loader, loss, device: torch.device, opts, tuning, fast: bool,
                 fast_why_not: Optional[str], fault, world_size: int, total_steps: int):
        self.model, self.strategy, self.optimizer, self.device, self.opts = model, strategy, optimizer, device, opts
        self.tuning = tuning
        self.fast, self.world_size, self.total_steps = fast, world_size, total_steps
        if device.type == "cuda":
            # Fixed shapes: pick the fastest conv once (by timing, so not with --deterministic).
            torch.backends.cudnn.benchmark = opts.cudnn_benchmark == "on" and not torch.backends.cudnn.deterministic
            if tuning.cudnn_benchmark_limit is not None:
                torch.backends.cudnn.benchmark_limit = tuning.cudnn_benchmark_limit
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
        dtype = torch.bfloat16 if opts.precision == "bf16" else torch.float32
        self.kernels = choose(model, self.conv_pool, self.mlp_head, opts, dtype, device, loader, total_steps)
        """Which layers run a custom kernel, and why not where they do not (summary.json `kernels`)."""
        choice.check_forced(self.kernels, {"conv-pool": opts.conv_pool == "triton", "mlp-head": opts.mlp_head == "triton"},
                            torch.cuda.get_device_name(device) if device.type == "cuda" else device.type)
        self._update_key: Optional[str] = None
        self._update = None
        """The flat SGD update's record key in step/built.py (marked once it ran), and the update."""
        self.quiet_notes: list = []
        """Notes summary.json records (`kernel_notes`) but the run does not print: what auto chose
        that changes no result a user reads, only how the step gets there."""
        self.build_key, self._deferred = self._defer_unbuilt(loader, dtype, total_steps)
        """The record of this run's kernels in step/built.py (None: none run, or no key), and the
        kernels that auto left to torch because they are not built here yet."""
        self.image_conv = image_conv.resolve(opts.image_conv, opts.compile != "off", device.type)
        self.image_convs = image_conv.convert(model, self.image_conv)
        """--image-conv: how many convolutions were switched (before compiling: Inductor sees them)."""
        self._probe(loader, loss)
        self.conv_pools = sum(c.kernel == "conv-pool" and c.path == "triton" for c in self.kernels)
        """--conv-pool: how many conv + ReLU + max-pool blocks run fused."""
        self.mlp_heads = sum(c.kernel == "mlp-head" and c.path == "triton" for c in self.kernels)
        """--mlp-head: how many classifier heads run fused."""
        # After the two above: the convolutions they switched are theirs (conv_pool's blocks
        # take the overlapped backward through their own flag, with `all` asked for only: slower
        # on an H100 in alexnet-small's step, conv_overlap.py).
        adopt = tuning.adopt_grads == "on" or (tuning.adopt_grads == "auto" and device.type == "cuda")
        self.adopts = adopt and strategy.adopts_grads
        """Whether backwards take their gradients whole (DeviceStep.gradients; ADOPT_GRADS)."""
        can_defer = may_defer(self.adopts, tuning.defer_wgrad, device, opts.compile, opts.precision)
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
        why_early = self.early_why_not(fast_why_not, fault)
        if opts.update_in_backward == "on" and why_early:
            raise BadInput(f"--update-in-backward on: {why_early}")
        self.slots = ({} if why_early or opts.update_in_backward == "off"
                      else conv_overlap.set_slots(model, strategy._trainable))
        """slot -> (weight's index, bias's index or None, module name) of each convolution
        updated in the backward (conv_overlap.set_slots)."""
        self.early_update = False
        """Whether convolutions take their SGD step inside the backward (`bind_update` binds it)."""
        # Before compiling too: the forward Dynamo traces reads the copies.
        why_copy = self.copy_why_not(fast_why_not)
        if opts.weight_copy == "on" and why_copy:
            raise BadInput(f"--weight-copy on: {why_copy}")
        self.copy = None
        """The flat bf16 copy of the weights that the update writes and the convolutions' forward
        reads (flat_sgd.bind's copy), or None."""
        if why_copy is None and opts.weight_copy != "off":
            self.copy = flat_sgd.weight_copy(strategy.params_flat, torch.bfloat16)
            flat = strategy.params_flat
            base, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            held = {id(p) for p in strategy._trainable}
            if not conv_overlap.set_weight_copies(
                    model, lambda p: (flat_sgd.copy_view(self.copy, p, flat)
                                      if id(p) in held and base <= p.data_ptr() < end else None)):
                self.copy = None
        self.weight_copy = False
        """Whether the update writes the convolutions' bf16 weights for the next forward, which
        then casts none (--weight-copy; `bind_update` binds it)."""
        self.update_kernel = "optimizer"
        """What applies the update: flat (one kernel over the flat buffers, flat_sgd.py), torch-fused
        (torch's fused SGD, in the fast step) or optimizer (its step(), as configured)."""
        self.buckets = self._buckets(fast_why_not, fault)
        """The gradient average in buckets overlapped with the backward (step/buckets.py), or None."""
        strategy.average_in_buckets(self.buckets)

    def _buckets(self, fast_why_not: Optional[str], fault) -> Optional[buckets.GradBuckets]:
        """--grad-buckets: on where `buckets_why_not` allows (BadInput if asked for where it cannot
        run); auto where it also pays: on CUDA, uncompiled, two buckets or more."""
        mode = self.opts.grad_buckets  # one of its choices: StepOptions checked it when it was made
        why = self.buckets_why_not(fast_why_not, fault)
        if mode == "on" and why:
            raise BadInput(f"--grad-buckets on: {why}")
        if mode == "off" or why or (mode == "auto" and (self.device.type != "cuda" or self.opts.compile != "off")):
            return None
        b = buckets.GradBuckets(self.strategy, cap_mb=self.tuning.bucket_mb)
        if mode == "auto" and len(b) < 2:
            b.remove()  # one bucket: it could start only when the backward ends, as without buckets
            return None
        return b

    def buckets_why_not(self, fast_why_not: Optional[str], fault) -> Optional[str]:
        """None if the gradient average can run in buckets during the backward, else why not (one line)."""
        s = self.strategy
        if not self.fast or s.free_running:
            return fast_why_not or "the step is not the fast one (--check-every 1)"
        if not s.averages_in_buckets:
            return f"strategy {s.name} does not average gradients after each backward"
        if self.world_size == 1:
            return "one worker: there is no average to overlap"
        if fault is not None:
            return "fault injection changes the loss after the backward"
        return None

    @property
    def grad_buckets(self) -> int:
        """How many buckets the gradient average runs in during the backward (0: after it)."""
        return len(self.buckets) if self.buckets is not None else 0

    def _defer_unbuilt(self, loader, dtype: torch.dtype, total_steps: int):
        """Under auto, the Triton kernels chosen stay only where they are built on this machine for
        these shapes, or where the run is long enough to build them (step/built.py): a short run on a
        fresh machine would spend a minute compiling and autotuning them to save milliseconds.
        Returns (the record's key, the kernels left to torch)."""
        on = [c for c in self.kernels if c.path == "triton"]
        k = build_key(self.kernels, loader, dtype, self.device)
        if k is None:
            return None, []
        if built.is_built(k) or built.may_build(total_steps):
            return k, []
        auto = {"conv-pool": self.opts.conv_pool == "auto", "mlp-head": self.opts.mlp_head == "auto"}
        deferred = sorted({c.kernel for c in on if auto[c.kernel]})
        for kernel in deferred:
            choice.switch_off(self.model, kernel)
        for c in on:
            if c.kernel in deferred:
                c.path, c.why = "torch", (f"auto: not built on this device for these shapes yet; "
                                          f"{built.why_unbuilt(total_steps)}")
        return (k if len(deferred) < len({c.kernel for c in on}) else None), deferred

    def _probe(self, loader, loss) -> None:
        """On CUDA, where a layer runs a custom kernel: one forward and backward on the first
        batch before anything depends on them (choice.probe); a kernel that fails is switched
        off for the run and the note says so. Unforced kernels the device cannot run were left
        out by choice.choose; the note names them too."""
        skipped = [c for c in self.kernels if c.path != "triton" and c.why and "only" not in c.why
                   and c.kernel not in self._deferred]
        notes = [f"{choice.FLAGS[c.kernel]}: {c.layer} runs torch's ops ({c.why})" for c in skipped]
        notes += [f"{choice.FLAGS[k]} auto: torch's ops, as the fused kernels are not built on this device for "
                  f"these shapes yet (a run of {built.BUILD_MIN_STEPS}+ steps or {choice.FLAGS[k]} triton builds "
                  f"them once; later runs use them)" for k in self._deferred]
        batch = getattr(loader, "batch", None)
        if self.device.type == "cuda" and batch is not None and choice.running(self.model):
            failed = choice.probe(self.model, lambda: batch(0), loss,
                                  lambda: autocast(self.device, self.opts.precision), self.device)
            if failed:
                on = set(choice.running(self.model))
                for c in self.kernels:
                    if c.path == "triton" and c.kernel not in on:
                        c.path, c.why = "torch", "failed on this device at the first step"
                if "image-conv" not in on and self.image_conv == "triton":
                    self.image_conv, self.image_convs = "cudnn", 0
                notes += failed
            if self.build_key and {"conv-pool", "mlp-head"} & set(choice.running(self.model)):
                built.mark_built(self.build_key, {"device": torch.cuda.get_device_name(self.device),
                                                  "kernels": [c.as_dict() for c in self.kernels if c.path == "triton"]})
        self.kernel_notes = notes
        """One line per kernel left to torch for this device's sake (printed by the run's lead)."""

    def early_why_not(self, fast_why_not: Optional[str], fault) -> Optional[str]:
        """None if the update in the backward can run (the update of every convolution's weight
        in its op's backward, as soon as its gradient exists: fast.py's module docstring), else
        why not (one line)."""
        s = self.strategy
        if not self.fast or s.free_running:
            return fast_why_not or "the step is not the fast one (--check-every 1)"
        if not s.updates_locally:
            return (f"strategy {s.name} at {self.world_size} workers updates from other ranks' gradients "
                    "(allreduce at 1 worker and weight-avg update from their own)")
        if not self.adopts:
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
            # backward hands the weights' gradients to .grad itself, so the placeholder check failed
            # the warm-up, the capture and then the eager step.
            return "--compile in fp32: the compiled backward hands the weights' gradients on itself"
        return self.flat_why_not()

    def flat_why_not(self) -> Optional[str]:
        """None if the update will be the flat SGD kernel (flat_sgd.bind), else why not (one line)."""
        s = self.strategy
        if not self.tuning.flat_sgd:
            why = "--flat-sgd is off"
        elif step_hooks(self.optimizer):  # the kernel would update without calling step(), whose hooks run
            why = "the optimizer has step hooks, which run in its step()"
        else:
            why = flat_sgd.why_not(self.optimizer, s._trainable, s.params_flat)
        return f"the update is not the flat SGD kernel ({why})" if why else None

    def copy_why_not(self, fast_why_not: Optional[str]) -> Optional[str]:
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
        return self.flat_why_not()

    def bind_update(self, found_inf: torch.Tensor, kind: str = "fused") -> None:
        """The fast step's update, once the optimizer runs torch's `kind` implementation (fused, or
        foreach behind step/gate.py): for SGD the flat SGD kernel where it can run (with the
        convolutions' updates in the backward and the weight copy where chosen), and what it could
        not bind put back; otherwise, and with step hooks, the optimizer's own step() (sync/base.py
        update_params)."""
        self.update_kernel = f"torch-{kind}"
        s = self.strategy
        if self.flat_why_not() is None and not s.free_running:
            early = [i for w, b, _ in self.slots.values() for i in (w, b) if i is not None]
            g = self.optimizer.param_groups[0]
            variant = (f"momentum={bool(g['momentum'])} nesterov={bool(g['nesterov'])} wd={bool(g['weight_decay'])} "
                       f"copy={self.copy is not None} early={early}")
            backend, self._update_key, note = built.update_backend(
                flat_sgd.backends(s.params_flat.device), variant, s.params_flat.numel(), s.params_flat.dtype,
                self.device, self.total_steps)
            update, _ = flat_sgd.bind(self.optimizer, s._trainable, s.params_flat, s.grads_flat, found_inf,
                                      early=early, copy=self.copy, backend=backend)
            if update is not None:
                self._update = update
                if note:
                    self.quiet_notes.append(note)
                s.update_with(update)
                self.update_kernel = "flat"
                self.early_update = bool(early)
                self.weight_copy = self.copy is not None
        if self.slots and not self.early_update:
            conv_overlap.clear_slots(self.model)
            self.slots = {}
        if self.copy is not None and not self.weight_copy:  # never: copy_why_not checked what bind does
            conv_overlap.set_weight_copies(self.model, lambda p: None)
            self.copy = None

    def eager_won(self) -> None:
        """--compile auto kept the eager step: what auto chose for a compiled step is slower eagerly."""
        if self.opts.max_pool == "auto" and self.max_pool != "aten":
            self.max_pool, self.max_pools = "aten", max_pool.convert(self.model, "aten")
        if self.opts.image_conv == "auto" and self.image_conv != "cudnn":
            self.image_conv, self.image_convs = "cudnn", image_conv.convert(self.model, "cudnn")

    def release(self) -> None:
        """The model goes back to casting its weights (and holds no copy); no bucket hooks are left.
        A flat SGD kernel that ran is recorded as built (step/built.py)."""
        if self._update_key is not None and self._update is not None and self._update.ran:
            built.mark_built(self._update_key, {"device": torch.cuda.get_device_name(self.device), "kernel": "flat-sgd"})
            self._update_key = None
        if self.buckets is not None:
            self.buckets.remove()
            self.buckets = None
            self.strategy.average_in_buckets(None)
        if self.copy is not None:
            conv_overlap.set_weight_copies(self.model, lambda p: None)
