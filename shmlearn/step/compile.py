"""--compile: torch.compile of the step's forward and loss (and through AOTAutograd its backward)
with Inductor, and of the batch read; with auto, eager against compiled timed on every rank and the
faster kept (options.COMPILE)."""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist

from shmlearn.errors import one_line
from shmlearn.nn import conv_overlap
from shmlearn.step.options import combo_kernels
from shmlearn.step.graphs import collectives_why_not


def build_failure(e: BaseException) -> Optional[BaseException]:
    """The compiler's failure to build code in e's chain (Inductor's C++ or CUDA build, as under
    ATEN_CPU_CAPABILITY=default, where its generated C++ finds no at::vec), else None: that
    falls back to the eager step; any other error is the step's own and is raised."""
    from torch._inductor import exc as inductor_exc
    builds = (inductor_exc.CppCompileError, inductor_exc.CUDACompileError)
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, builds):
            return x
        todo += [x.__cause__, x.__context__, getattr(x, "inner_exception", None)]
    return None


def cacheable_functions(model: torch.nn.Module):
    """AOTAutograd's cache for a step whose every module is torch's or shmlearn's: it then keeps
    graphs with shmlearn's own autograd.Functions (conv_overlap's convolution: the default on
    CUDA), which torch leaves out of its cache unless told (torch._functorch.config
    autograd_cache_allow_custom_autograd_functions, off by default: it cannot know that a user's
    Function has no behavior outside what Dynamo traced into the graph; ours have none, their
    backward is a custom op called by name). Without it every run of a compiled step traced and
    partitioned its joint graph again (issue 52: 3.2 of fashion-94's 5.9 s of compile on an
    H200, warm caches); Inductor's own cache hit either way. A user's module anywhere in the
    model leaves torch's default; so does a torch without the setting."""
    from torch._functorch import config
    ours = all(type(m).__module__.split(".")[0] in ("torch", "shmlearn") for m in model.modules())
    if not ours or not hasattr(config, "autograd_cache_allow_custom_autograd_functions"):
        return contextlib.nullcontext()
    return config.patch(autograd_cache_allow_custom_autograd_functions=True)


class Compiler:
    """Compiles one rank's step in place: dstep's train_loss (and next_batch) become the compiled
    ones. choice: the KernelChoice (deferred GEMMs, the weight copy; put back if eager wins);
    graphs: the Graphs whose capture the auto timing uses; say(line, join): the step's note."""

    def __init__(self, *, model, strategy, loader, device: torch.device, opts, tuning, world_size: int, fault,
                 check_every: int, fast: bool, dstep, choice, graphs, say):
        self.model, self.strategy, self.loader, self.device, self.opts = model, strategy, loader, device, opts
        self.tuning = tuning
        self.world_size, self.fault, self.check_every, self.fast = world_size, fault, check_every, fast
        self.dstep, self.choice, self.graphs, self.say = dstep, choice, graphs, say
        self.read_compiled = False
        self.compile_s: Optional[float] = None
        self.compiled: Optional[str] = None
        self.combo = False
        """--combo-kernels: whether the compiled step uses Inductor's combo kernels."""

    def run(self) -> None:
        """Compile before the clock starts: a first forward and backward on a real batch (Inductor
        compiles both; its caches keep them for later runs and a sweep's trials), then, with
        auto, time eager against compiled and keep the faster: where the step will be captured,
        as CUDA graph replays (what the step will run: Python and launch overheads gone), else
        as eager calls. Every rank keeps the same choice (the ranks' times are summed). Gradients
        and buffers (BatchNorm) are put back as they were; the optimizer never steps."""
        mode = {"default": None, "auto": None, "max-autotune": "max-autotune-no-cudagraphs"}[self.opts.compile]
        computes = self.strategy.computes
        dstep, sync = self.dstep, self.graphs.sync
        batch = self.loader.batch(0) if computes else None
        self.combo = combo_kernels(self.opts.combo_kernels, self.device, batch[0] if batch else None)
        options = dict(self.tuning.inductor)
        if self.combo:
            options["combo_kernels"] = True
        if self.choice.deferred:  # Inductor must not reuse what a deferred weight GEMM still reads
            options.update(conv_overlap.INDUCTOR_OPTIONS)
        if options:  # torch.compile takes a mode or options, not both
            from torch._inductor import list_mode_options
            options = {**(list_mode_options(mode) if mode else {}), **options}
            mode = None
        else:
            options = None
        # The forward and the loss as one graph: the loss's kernels (log-softmax, NLL and their
        # backward: 6 launches) fuse into the model's (alexnet-small at batch 128 on an H100: see
        # results/flat-step-h100).
        if isinstance(self.strategy.module, torch.nn.parallel.DistributedDataParallel):
            # DDP is compiled as a module (Dynamo splits its graph at the gradient buckets).
            module = torch.compile(self.strategy.module, mode=mode, options=options, dynamic=False)

            def compiled(x, y):
                return dstep.forward_loss(module, x, y)
        else:
            compiled = torch.compile(dstep.eager_loss, mode=mode, options=options, dynamic=False)
        times = torch.zeros(3, dtype=torch.float64)  # eager, compiled (auto), ranks whose compile did not build
        unbuilt: Optional[BaseException] = None
        saved_buffers = [b.clone() for b in self.model.buffers()]
        try:
            if computes:
                x, y = batch

                def fb(fwd) -> None:
                    self.strategy.zero_grad()
                    with conv_overlap.weight_copies(self.choice.copy is not None):  # as the step will trace it
                        loss = fwd(x, y)
                    loss.backward()

                def timed(fwd, n: int) -> float:
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fb(fwd)
                    sync()
                    return (time.perf_counter() - t0) / n

                def replayed(fwd, n: int = 20) -> float:
                    with self.graphs.side_stream():
                        for _ in range(3):
                            fb(fwd)
                    g = self.graphs.graph_of(lambda: fb(fwd))
                    g.replay()
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        g.replay()
                    sync()
                    return (time.perf_counter() - t0) / n

                try:
                    with cacheable_functions(self.model):
                        self.compile_s = timed(compiled, 1)
                except Exception as e:  # noqa: BLE001 - only a build failure falls back, the rest is raised
                    unbuilt = build_failure(e)
                    if unbuilt is None:
                        raise
                    times[2] = 1
                if unbuilt is None and self.opts.compile == "auto":
                    captured = (self.device.type == "cuda" and self.opts.cuda_graph == "auto" and self.fault is None
                                and not self.strategy.free_running and self.check_every > 1
                                and collectives_why_not(self.strategy) is None)
                    if captured:
                        times[0], times[1] = replayed(dstep.eager_loss), replayed(compiled)
                    else:
                        timed(dstep.eager_loss, 2)  # warm (cuDNN autotuning) before timing
                        times[0], times[1] = timed(dstep.eager_loss, 5), timed(compiled, 5)
            if self.world_size > 1:  # every rank keeps the same choice
                t = times.to(self.device)
                dist.all_reduce(t)
                times = t.cpu()
        finally:
            if computes:
                sync()
                self.strategy.zero_grad()
            with torch.no_grad():
                for b, v in zip(self.model.buffers(), saved_buffers):
                    b.copy_(v)
        choice = self.opts.compile
        if times[2] > 0:  # Inductor could not build the step's code (on some rank): eager, as with off
            choice = "off"
            self.compile_s = None
            why = one_line(unbuilt) if unbuilt is not None else f"on {int(times[2])} other rank(s)"
            self.say(f"--compile {self.opts.compile}: Inductor could not build the step's code on this machine "
                     f"({why}); the step runs eagerly", join=True)
        elif choice == "auto":
            eager_s, compiled_s, _ = times.tolist()
            choice = "default" if compiled_s < eager_s else "off"
            self.say(f"--compile auto: compiled {compiled_s * 1e3:.3f} ms against eager {eager_s * 1e3:.3f} ms a "
                     f"forward and backward; {'compiled' if choice == 'default' else 'eager'}")
        if choice != "off":
            dstep.train_loss = compiled
            if computes and self.tuning.compile_read and self.fast and not self.strategy.free_running:
                with cacheable_functions(self.model):
                    self._compile_read(mode, options)
        else:  # eager won: what auto chose for a compiled step is slower eagerly
            self.combo = False
            self.choice.eager_won()
        self.compiled = choice

    def _compile_read(self, mode, options) -> None:
        """The batch read compiled (StepTuning.compile_read), with the model's mode and options,
        and compiled now, its time added to compile_s: one read at the counter of step 0, which
        the next prepare() resets. A read that does not compile stays eager, and the run says why
        (the model is compiled all the same)."""
        read = torch.compile(self.loader.next_batch, mode=mode, options=options, dynamic=False)
        self.loader.prepare(0)
        self.graphs.sync()
        t0 = time.perf_counter()
        try:
            read()
            self.graphs.sync()
        except Exception as e:  # noqa: BLE001 - the eager read computes the same batches
            self.say(f"--compile: the batch read runs eagerly ({one_line(e)})", join=True)
            read = None
        self.compile_s = (self.compile_s or 0.0) + time.perf_counter() - t0
        self.loader.invalidate()
        if read is not None:
            self.dstep.next_batch, self.read_compiled = read, True
