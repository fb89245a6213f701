"""`shmlearn bench throughput`: training steps per second of shmlearn's step against what a user
would write instead, in the same run, on the same device (docs/architecture.md, Style 7; seed 004).

For each worker count W (one fresh process group: Gloo on CPU processes, NCCL with one process
per GPU) and each per-worker batch B, every variant trains the same model (same seed) with the
same optimizer (SGD, momentum 0.9) on random uint8 images of the model's input shape:

  plain        the eager loop a user writes: a device-resident float dataset indexed by a
               random permutation, zero_grad(set_to_none), forward, cross-entropy, backward,
               step; same precision and memory format as shmlearn's (--precision,
               --channels-last). With W > 1 every rank runs it alone: no communication.
  plain-fp32   the same loop in fp32, contiguous (what most code does).
  graph        the plain step captured by hand in one CUDA graph, the torch docs' "whole
               network capture" recipe: a static input (the batch's indices into the device
               dataset; the gather is in the graph), warm-up on a side stream, torch.cuda.graph
               around zero_grad, forward, loss, backward and step (SGD fused: one kernel), then
               copy the next indices and replay. CUDA only: on the CPU the row says skipped.
  compile      the plain loop with torch.compile(model, mode="reduce-overhead"): Inductor's
               kernels in its own CUDA graphs (cudagraph trees); the loss and SGD stay eager.
  compile-max  the same with mode="max-autotune". On the CPU both run mode default (the
               modes' CUDA graphs do not apply there) and their rows say so.
  ddp          torch DistributedDataParallel around the plain loop (W > 1).
  ddp-compile  the same DDP model under torch.compile (mode default: Dynamo splits the graph at
               DDP's buckets so each bucket's all-reduce overlaps the backward), fused SGD: what
               a skilled user picks at W > 1 (W > 1).
  local        shmlearn's step with no communication (each rank its own world; W > 1): the
               ceiling for any strategy.
  <strategy>   shmlearn's step (fast.py) exactly as `shmlearn train` runs it: device loader,
               the chosen step mode (CUDA graph on CUDA unless --cuda-graph off), the loss read
               every --check-every steps. Modifiers after a colon, joined by +: `eager` forces
               --cuda-graph off; `noise` measures the gradient noise scale as --noise-scale does
               (noise.py: every noise.default_every(W) steps, the default --noise-every),
               `noise1` at every step (--noise-every 1); `compile` is --compile default and `compile-max` --compile
               max-autotune (Inductor's kernels inside the step's one CUDA graph), e.g.
               `allreduce:compile`, `allreduce:eager+compile`; not both compile and compile-max.
With W > 1 the baselines other than ddp and ddp-compile run on every rank alone (no communication).

Method: each variant is built, warmed up (its CUDA graph captured, cuDNN autotuned), then timed
`repeats` times. A repeat: synchronize the device, barrier, perf_counter, `steps` steps,
synchronize, perf_counter; its time is the slowest rank's. `steps` is chosen from ten steps
timed after the warm-up so a repeat lasts about --seconds (the same on every rank); for
shmlearn's steps replayed from a CUDA graph, a whole number of their `sample_every` periods
(one eager, phase-timed step each) where that stays within 10x --seconds
(`steps_per_repeat`), so every repeat pays the same share of those eager steps. Compiling and capturing happen while a
variant is built (compile and compile-max run 3 steps there: Inductor compiles forward and
backward, its CUDA graphs are recorded), so `setup_s` (build + warm-up, slowest rank) holds
them and no timed repeat does. Reported: median and spread (min, quartiles, max) of steps/s and
samples/s (all workers' samples), ratios to plain, ddp and the same variant at one worker, and
for shmlearn's variants (and local) `ratio_to_best_baseline`: against the best median samples/s
of plain, graph, compile and compile-max at the same W and B (`best_baseline` names it).

`--sync-models resnet34` adds, for W > 1, the gradient sync alone: shmlearn's average of the
flat gradient buffer (what every allreduce step does) against a bare all_reduce of the same
number of bytes, both as nccl-tests bus bandwidth (2(W-1)/W x bytes / time).
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch

from shmlearn.bench.common import RANK_TIMEOUT_S, environment, parse_int_list, rank_device, stats, sync
from shmlearn.errors import BadInput, WorkerFailed
from shmlearn.limits import rank_threads
from shmlearn.pool import run_local
from shmlearn.sync import registry

BASELINES = ("plain", "plain-fp32", "ddp", "ddp-compile", "local", "graph", "compile", "compile-max")
DDP = ("ddp", "ddp-compile")
"""The baselines that average gradients (W > 1 only); `vs_best_ddp` is against the better one."""
BEST_OF = ("plain", "graph", "compile", "compile-max")
"""What a user could write instead: ratio_to_best_baseline is against the best of these."""
COMPILE_MODES = {"compile": "reduce-overhead", "compile-max": "max-autotune"}
"""Baseline -> torch.compile mode on CUDA (on the CPU: default)."""
MODIFIERS = {"eager": {"cuda_graph": "off"}, "noise": {}, "noise1": {}, "compile": {"compile": "default"},
             "compile-max": {"compile": "max-autotune"}, "im2col": {"image_conv": "im2col"},
             "triton-conv": {"image_conv": "triton"}, "aten-pool": {"max_pool": "aten"},
             "global-pool": {"max_pool": "global"},
             "reduce-pool": {"max_pool": "reduce"}, "accumulate": {"adopt_grads": "off"},
             "adopt": {"adopt_grads": "on"},
             "cudnn-conv": {"image_conv": "cudnn"}, "conv-pool": {"conv_pool": "triton"},
             "unfused": {"conv_pool": "off"}, "torch-sgd": {"flat_sgd": False},
             "mlp-head": {"mlp_head": "triton"}, "unfused-head": {"mlp_head": "off"},
             "all-conv": {"conv_overlap": "all"}, "serial-conv": {"conv_overlap": "off"},
             "joined-conv": {"defer_wgrad": False}, "2-streams": {"side_streams": 2},
             "combo": {"combo_kernels": "on"}, "no-combo": {"combo_kernels": "off"},
             "aggressive": {"inductor": (("aggressive_fusion", True),)},
             "no-split": {"inductor": (("split_reductions", False),)},
             "cdt": {"inductor": (("coordinate_descent_tuning", True),)},
             "pdl": {"inductor": (("triton.enable_pdl", True),)},
             "coop": {"inductor": (("triton.cooperative_reductions", True),)},
             "combo16": {"inductor": (("combo_kernel_max_num_nodes", 16),)},
             "no-mix-order": {"inductor": (("triton.mix_order_reduction", False),)},
             "multi-kernel": {"inductor": (("triton.multi_kernel", 1),)},
             "autotune-pw": {"inductor": (("max_autotune_pointwise", True),)},
             "tile-red": {"inductor": (("triton.tile_reductions", True),)},
             "nd-tiling": {"inductor": (("triton.prefer_nd_tiling", True),)},
             "early-update": {"update_in_backward": "on"}, "late-update": {"update_in_backward": "off"},
             "no-weight-copy": {"weight_copy": "off"}, "weight-copy": {"weight_copy": "on"},
             "normal-priority": {"high_priority_capture": False}, "memset-nodes": {"memset_kernels": False},
             "eager-read": {"compile_read": False},
             "cudnn-all": {"cudnn_benchmark_limit": 0}}
"""Strategy suffixes NAME:a+b (fast.py StepOptions fields each sets; noise attaches the meter at
the default --noise-every, noise1 at --noise-every 1)."""


def step_options(c: "ThroughputConfig", mods) -> "StepOptions":
    """The fast step's options of a shmlearn variant with MODIFIERS `mods`: each sets its fields;
    Inductor options add up (combo+aggressive asks for both)."""
    from shmlearn.fast import StepOptions
    opts = dict(precision=c.precision, channels_last=c.channels_last, cuda_graph=c.cuda_graph,
                check_every=c.check_every)
    for m in sorted(mods):
        for k, v in MODIFIERS[m].items():
            opts[k] = opts.get(k, ()) + v if k == "inductor" else v
    return StepOptions(**opts)


def strategy_names() -> List[str]:
    """The shmlearn strategies this bench times: those with a fast step (fast.py) whose every
    process computes (its layout has no server rank)."""
    return registry.names(fast_step=True, servers=0)


@dataclass(kw_only=True)
class ThroughputConfig:
    model: str = "alexnet-small"
    input_shape: List[int] = field(default_factory=lambda: [3, 32, 32])
    """(C, H, W) of the random images."""
    classes: int = 10
    device: str = "cpu"
    batch_sizes: List[int] = field(default_factory=lambda: [128])
    """Per worker."""
    workers: List[int] = field(default_factory=lambda: [1])
    strategies: List[str] = field(default_factory=lambda: [registry.DEFAULT])
    """shmlearn strategies, each optionally NAME:m1+m2 with MODIFIERS (eager: no CUDA graph; noise;
    compile / compile-max: --compile default / max-autotune)."""
    baselines: List[str] = field(default_factory=lambda: ["plain", "ddp", "local"])
    """Subset of BASELINES, timed in the same run (graph: CUDA only; compile*: mode default on CPU)."""
    avg_period: int = 8
    precision: str = "fp32"
    channels_last: bool = False
    cuda_graph: str = "auto"
    check_every: Optional[int] = None
    repeats: int = 5
    seconds: float = 1.0
    """Target length of one timed repeat."""
    warmup_steps: int = 10
    lr: float = 0.01
    threads: Optional[int] = None
    """CPU: intra-op threads per process (default: cores / W)."""
    samples: int = 50000
    """Images in the random dataset (the loaders wrap around it every epoch)."""
    sync_models: List[str] = field(default_factory=list)
    sync_iters: int = 20


# --- building blocks ---------------------------------------------------------------------------

def _spec(c: ThroughputConfig):
    from shmlearn.data.base import DataSpec
    return DataSpec(name="random", task="classification", input_shape=tuple(c.input_shape),
                    num_outputs=c.classes)


def _model(c: ThroughputConfig, device, model_name: Optional[str] = None):
    from shmlearn.models import build_model
    torch.manual_seed(0)
    return build_model(model_name or c.model, _spec(c)).to(device)


_DATA: Dict[tuple, tuple] = {}


def _random_data(c: ThroughputConfig, n: int, device, rank: int):
    """Random uint8 images (never all zeros) and labels on the device, made once per process."""
    key = (n, tuple(c.input_shape), c.classes, str(device), rank)
    if key not in _DATA:
        _DATA.clear()
        g = torch.Generator().manual_seed(1234 + rank)
        x = torch.randint(0, 256, (n, *c.input_shape), dtype=torch.uint8, generator=g)
        y = torch.randint(0, c.classes, (n,), generator=g)
        _DATA[key] = (x.to(device), y.to(device))
    return _DATA[key]


def _sgd(params, lr, **kw):
    return torch.optim.SGD(params, lr=lr, momentum=0.9, **kw)


class _Plain:
    """The loop a user would write, on data already on the device; compile_mode: with its model
    torch.compile'd (the compile baselines)."""

    mode = "eager"

    def __init__(self, c, device, batch, rank, world, *, fp32: bool = False, ddp: bool = False,
                 compile_mode: Optional[str] = None, fused: bool = False):
        import torch.nn.functional as F
        self.F = F
        self.bf16 = c.precision == "bf16" and not fp32
        cl = c.channels_last and not fp32
        model = _model(c, device)
        if cl:
            model = model.to(memory_format=torch.channels_last)
        if ddp:
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                            gradient_as_bucket_view=True)
        self.model, self.opt = model, _sgd(model.parameters(), c.lr, **({"fused": True} if fused else {}))
        n = max(c.samples, 4 * batch * world)
        xu, self.y = _random_data(c, n, device, 0)
        x = (xu.float() - 127.5) / 64.0
        self.x = x.contiguous(memory_format=torch.channels_last) if cl else x
        self.batch, self.n, self.device = batch, n, device
        self.gen = torch.Generator(device=device).manual_seed(rank)
        self.perm, self.i = torch.randperm(n, device=device, generator=self.gen), 0
        self.forward, self.mark_steps, self.note = model, False, None
        if compile_mode:
            self._compile(compile_mode)

    def _compile(self, mode: str) -> None:
        # dynamic=False: one batch shape per variant, as a user's run has (without it Dynamo
        # recompiles the next batch size of this process with dynamic shapes).
        if self.device.type != "cuda":
            self.note = f"CPU: torch.compile mode default ({mode}'s CUDA graphs do not apply)"
            mode = "default"
        self.compile_mode = mode
        self.forward = torch.compile(self.model, mode=None if mode == "default" else mode, dynamic=False)
        # Inductor's CUDA graphs (cudagraph trees): a new step starts here, so the last step's
        # outputs (already dead) may be overwritten by the next replay.
        self.mark_steps = mode != "default"
        self.mode = "compiled"
        for s in range(3):  # compile forward and backward, record the graphs: setup, not timing
            self.step(s)

    def _next_index(self) -> torch.Tensor:
        b = self.batch
        if self.i + b > self.n:
            self.perm, self.i = torch.randperm(self.n, device=self.device, generator=self.gen), 0
        self.i += b
        return self.perm[self.i - b:self.i]

    def step(self, _step: int) -> None:
        idx = self._next_index()
        x, y = self.x[idx], self.y[idx]
        if self.mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = self.forward(x)
        loss = self.F.cross_entropy(out.float(), y)
        loss.backward()
        self.opt.step()

    def close(self) -> None:
        self.model = self.forward = None


class _Graph(_Plain):
    """The plain step captured by hand in one CUDA graph, as the torch docs' whole-network capture
    does it: static inputs, 3 warm-up steps on a side stream (autograd's and cuDNN's per-stream
    state, momentum buffers, cuDNN autotuning), capture, then per step: fill the static input,
    replay. The static input is the batch's indices (one small copy a step); the gather from the
    device dataset, zero_grad(set_to_none), forward, loss, backward and fused SGD are all in the
    graph (grads live in the graph's memory pool, as in the recipe)."""

    mode = "cuda-graph"

    def __init__(self, c, device, batch, rank, world):
        super().__init__(c, device, batch, rank, world, fused=True)  # fused SGD: one kernel, capturable
        self.static_idx = self._next_index().clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self._body()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (the process group's watchdog) make CUDA calls meanwhile.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self._body()

    def _body(self) -> None:
        idx = self.static_idx
        x, y = self.x[idx], self.y[idx]
        self.opt.zero_grad(set_to_none=True)
        # cache_enabled=False: autocast's weight-cast cache would hold tensors across the capture.
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=False):
            out = self.model(x)
        self.F.cross_entropy(out.float(), y).backward()
        self.opt.step()

    def step(self, _step: int) -> None:
        self.static_idx.copy_(self._next_index())
        self.graph.replay()

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.graph = None
        super().close()


class _Shmlearn:
    """shmlearn's step (fast.py), built the way train.py builds it."""

    def __init__(self, c, device, batch, rank, world, *, strategy: str, local: bool, mods=frozenset(),
                 eager: bool = False, noise: bool = False):
        """mods: MODIFIERS names (eager, noise, compile, compile-max); eager and noise add theirs."""
        mods = set(mods) | {m for m, on in (("eager", eager), ("noise", noise)) if on}
        from shmlearn.data.loader import ShardedLoader
        from shmlearn.fast import Stepper
        from shmlearn.optim import build_schedule
        from shmlearn.sync import build_strategy
        from shmlearn.timing import PhaseTimer
        w = 1 if local else world
        r = 0 if local else rank
        model = _model(c, device)
        opt = _sgd(model.parameters(), c.lr)
        self.strategy = build_strategy(strategy, rank=r, world_size=w, avg_period=c.avg_period)
        self.strategy.setup(model, opt, channels_last=c.channels_last)
        n = max(c.samples, 4 * batch * world)
        if mods & {"noise", "noise1"}:  # as train.py attaches it: after setup, before the Stepper (which binds its step counter)
            from shmlearn.noise import NoiseMeter, default_every
            self.strategy.noise = NoiseMeter(workers=w, batch_size=batch, steps=1 << 20, device=device,
                                             n_train=n, world_size=w,
                                             every=1 if "noise1" in mods else default_every(w))
        x, y = _random_data(c, n, device, 0)
        mean = torch.full((1, c.input_shape[0], 1, 1), 127.5, device=device)
        inv = torch.full((1, c.input_shape[0], 1, 1), 1 / 64.0, device=device)
        loader = ShardedLoader(x, y, batch_size=batch, shard=r, num_shards=w, seed=0,
                               normalize=lambda t: (t.float() - mean) * inv, channels_last=c.channels_last)
        schedule = build_schedule("constant", opt, 1 << 30)
        self.timer = PhaseTimer(device, rank)
        opts = step_options(c, mods)
        self.stepper = Stepper(model=model, strategy=self.strategy, optimizer=opt, schedule=schedule,
                               loader=loader, task="classification", device=device, opts=opts,
                               timer=self.timer, rank=r, world_size=w, total_steps=1 << 20)
        self.bad = None

    @property
    def mode(self) -> str:
        return self.stepper.mode

    @property
    def note(self) -> Optional[str]:
        return self.stepper.note

    def step(self, step: int) -> None:
        st = self.stepper
        st.run(step)
        if st.due(step + 1):
            win = st.read(step + 1)
            if win.bad is None:
                st.update()
            elif self.bad is None:
                self.bad = win.bad

    def flush(self, step: int) -> None:
        """Read what is pending (untimed, between repeats)."""
        self.stepper.flush(step)

    def close(self) -> None:
        self.stepper.graphs = None


# --- one rank ----------------------------------------------------------------------------------

def _parse(v: str):
    """'allreduce:eager+noise' -> ('allreduce', {'eager', 'noise'})."""
    name, _, mod = v.partition(":")
    return name, set(mod.split("+")) - {""}


def _variants(c: ThroughputConfig, world: int) -> List[str]:
    out = []
    for b in c.baselines:
        if b not in DDP + ("local",) or world > 1:
            out.append(b)
    for s in c.strategies:
        name = _parse(s)[0]
        if world == 1 and name != registry.DEFAULT:
            continue  # every strategy is the same step at one worker: the reference stands for all
        out.append(s)
    return out


def _skipped(v: str, device) -> Optional[str]:
    """Why variant v does not run on this device (a row that says so, not an error)."""
    if v == "graph" and device.type != "cuda":
        return "CUDA only: a CUDA graph captures GPU work"
    return None


def _build(c, v: str, device, batch, rank, world):
    if v in ("plain", "plain-fp32", "compile", "compile-max") + DDP:
        return _Plain(c, device, batch, rank, world, fp32=v == "plain-fp32", ddp=v in DDP,
                      compile_mode="default" if v == "ddp-compile" else COMPILE_MODES.get(v),
                      fused=v == "ddp-compile" and device.type == "cuda")
    if v == "graph":
        return _Graph(c, device, batch, rank, world)
    if v == "local":
        return _Shmlearn(c, device, batch, rank, world, strategy=registry.DEFAULT, local=True)
    name, mods = _parse(v)
    return _Shmlearn(c, device, batch, rank, world, strategy=name, local=False, mods=mods)


def _worker(env, cfg: dict):
    import warnings
    import torch.distributed as dist
    c = ThroughputConfig(**cfg)
    rank, world = env.rank, env.world_size
    # ps workers and `local` never call optimizer.step() in Python (graph replays, or rank 0 steps)
    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
    device = rank_device(env, "nccl" if c.device == "cuda" else "gloo")
    # Every variant, baselines included, with the threads a rank of `shmlearn train` gets (a GPU
    # rank few: limits.rank_threads), as torchrun gives DDP's ranks one.
    torch.set_num_threads(rank_threads(device.type, env.local_world_size, c.threads))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: every variant gets autotuned convs
    # Every compiled variant and batch is a new model compiled from the same forward code: past
    # Dynamo's default of 8 entries per code object it would silently run eagerly.
    from torch._dynamo import config as dynamo_config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    flag = torch.zeros(1, device=device)

    def barrier():
        dist.all_reduce(flag)
        sync(device)

    def slowest(t: float) -> float:
        v = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.item()

    rows = []
    for batch in c.batch_sizes:
        rows += _measure_batch(c, batch, device, rank, world, barrier, slowest)
    if world > 1:
        for m in c.sync_models:
            rows.append(_sync_bench(c, m, device, rank, world, barrier))
    return rows if rank == 0 else None


def _probe(runner, step: dict, v: str, steps: int, device, slowest) -> float:
    """Seconds per step over `steps` more steps after the warm-up: the warm-up's own time holds
    the first step (a shmlearn runner's first is eager, sampled), which made repeats too short."""
    t0 = time.perf_counter()
    for _ in range(max(steps, 10)):
        runner.step(step[v])
        step[v] += 1
    sync(device)
    return slowest((time.perf_counter() - t0) / max(steps, 10))


def _sample_every(runner) -> Optional[int]:
    """A shmlearn runner's period of eager, phase-timed steps among its graph replays, if any."""
    st = getattr(runner, "stepper", None)
    return st.sample_every if st is not None and st.graphs else None


def steps_per_repeat(seconds: float, per_step: float, sample_every: Optional[int] = None) -> int:
    """Steps in one timed repeat: about `seconds` of them (5 to 5000). A step replayed from a CUDA
    graph runs one step in `sample_every` eagerly, to time its phases; that step is part of its
    cost, so a repeat holds a whole number of periods (each repeat then carries the same share of
    them) wherever that stays within 10x `seconds`. Otherwise the share is left to chance, and
    small: such a step is slow enough that its eager run costs little more than its replay."""
    n = int(min(5000, max(5, math.ceil(seconds / max(per_step, 1e-6)))))
    if sample_every:
        whole = -(-n // sample_every) * sample_every
        if whole * per_step <= 10 * seconds:
            return whole
    return n


def _measure_batch(c, batch, device, rank, world, barrier, slowest) -> List[dict]:
    """Build and warm up every variant, then time them round-robin (repeat 1 of each, repeat 2 of
    each, ...): a machine whose speed drifts (other load, clocks) bends every variant alike."""
    live = []  # (row, runner, steps per repeat, times)
    rows = []
    step = {}
    for v in _variants(c, world):
        row = {"workers": world, "batch": batch, "variant": v}
        rows.append(row)
        if _skipped(v, device):
            row["skipped"] = _skipped(v, device)
            continue
        try:
            t_build = time.perf_counter()
            runner = _build(c, v, device, batch, rank, world)
            row["mode"] = getattr(runner, "mode", "eager")
            if getattr(runner, "note", None):
                row["note"] = runner.note
            if getattr(runner, "compile_mode", None):  # a compile baseline: the torch.compile mode run
                row["compile_mode"] = runner.compile_mode
            st = getattr(runner, "stepper", None)
            if st is not None and st.compiled is not None:  # shmlearn --compile: its choice, its compile seconds
                row.update(compile=st.compiled, compile_s=st.compile_s, combo_kernels=st.combo)
            if st is not None and st.conv_overlaps:  # --conv-overlap: how many, and whether deferred
                row.update(conv_overlaps=st.conv_overlaps, conv_overlap_deferred=st.deferred,
                           update_in_backward=st.early_update, weight_copy=st.weight_copy)
            if st is not None and st.graphs:  # the captured step's memset nodes made kernels; its sampling
                row.update(memsets_replaced=st.memsets_replaced, largest_memset_bytes=st.memset_bytes,
                           sample_every=st.sample_every, eager_over_replay=round(st.eager_over_replay, 2))
            step[v] = 0
            barrier()
            for _ in range(c.warmup_steps):
                runner.step(step[v])
                step[v] += 1
            sync(device)
            row["setup_s"] = slowest(time.perf_counter() - t_build)
            per_step = _probe(runner, step, v, c.warmup_steps, device, slowest)
            n = steps_per_repeat(c.seconds, per_step, _sample_every(runner))
            live.append((row, runner, n, []))
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the rest
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if world > 1:
                raise  # the other ranks would wait in a collective
    for _ in range(c.repeats):
        for row, runner, n, times in live:
            v = row["variant"]
            if hasattr(runner, "flush"):
                runner.flush(step[v])
            barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                runner.step(step[v])
                step[v] += 1
            sync(device)
            times.append(slowest(time.perf_counter() - t0))
    for row, runner, n, times in live:
        if hasattr(runner, "flush"):
            runner.flush(step[row["variant"]])
        row.update(steps_per_repeat=n, repeat_s=stats(times), steps_per_s=stats([n / t for t in times]),
                   samples_per_s=stats([n * batch * world / t for t in times]))
        if getattr(runner, "bad", None):
            row["note"] = f"non-finite loss at step {runner.bad[0]} (random labels, lr {c.lr})"
        runner.close()
    live.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _sync_bench(c, model_name: str, device, rank: int, world: int, barrier) -> Dict[str, Any]:
    """shmlearn's gradient average of the flat buffer vs a bare all_reduce of the same bytes."""
    import torch.distributed as dist
    from shmlearn.sync import build_strategy
    model = _model(c, device, model_name)
    s = build_strategy(registry.DEFAULT, rank=rank, world_size=world)  # the gradient all-reduce
    s.setup(model, _sgd(model.parameters(), c.lr))
    g = torch.Generator().manual_seed(rank)
    s.grads_ext.copy_(torch.randn(s.grads_ext.numel(), generator=g).to(device))
    bare = torch.randn(s.grads_ext.numel(), generator=g).to(device)
    nbytes = s.grads_ext.numel() * s.grads_ext.element_size()

    def timed(fn) -> float:
        barrier()
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    out: Dict[str, Any] = {"sync_model": model_name, "workers": world, "bytes": nbytes,
                           "params": s.grads_flat.numel()}
    factor = 2 * (world - 1) / world
    for name, fn in (("shmlearn", lambda: s._average_(s.grads_ext)),
                     ("bare_all_reduce", lambda: dist.all_reduce(bare))):
        for _ in range(3):
            timed(fn)
        ts = torch.tensor([timed(fn) for _ in range(c.sync_iters)], dtype=torch.float64, device=device)
        dist.all_reduce(ts, op=dist.ReduceOp.MAX)
        st = stats(ts.tolist())
        out[name] = {"time_s": st, "busbw_GBps": nbytes * factor / st["median"] / 1e9}
    out["ratio"] = out["shmlearn"]["busbw_GBps"] / out["bare_all_reduce"]["busbw_GBps"]
    return out


# --- the whole benchmark -----------------------------------------------------------------------

def check(c: ThroughputConfig) -> None:
    from shmlearn.fast import CUDA_GRAPH, PRECISIONS
    from shmlearn.models import MODELS
    if c.device not in ("cpu", "cuda"):
        raise BadInput(f"--device {c.device}: choose cpu or cuda")
    if c.device == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if max(c.workers) > n:
            raise BadInput(f"--workers {max(c.workers)}: needs one GPU per worker, {n} present")
    for m in [c.model] + list(c.sync_models):
        if m not in MODELS:
            raise BadInput(f"--model {m}: unknown model; choose one of {', '.join(MODELS)}")
    for s in c.strategies:
        name, mods = _parse(s)
        if (name not in strategy_names() or not mods <= set(MODIFIERS) or {"compile", "compile-max"} <= mods
                or {"noise", "noise1"} <= mods):
            raise BadInput(f"--strategies {s}: choose from {', '.join(strategy_names())}, optionally with "
                           f"modifiers {', '.join(MODIFIERS)} joined by + (allreduce:eager+noise; "
                           f"compile or compile-max, not both; noise or noise1, not both)")
    for b in c.baselines:
        if b not in BASELINES:
            raise BadInput(f"--baselines {b}: choose from {', '.join(BASELINES)}")
    if c.precision not in PRECISIONS:
        raise BadInput(f"--precision {c.precision}: choose one of {', '.join(PRECISIONS)}")
    if c.cuda_graph not in CUDA_GRAPH:
        raise BadInput(f"--cuda-graph {c.cuda_graph}: choose one of {', '.join(CUDA_GRAPH)}")
    if c.repeats < 5:
        raise BadInput(f"--repeats {c.repeats}: at least 5 (a median and a spread need them)")
    if len(c.input_shape) != 3 or min(c.input_shape) < 1:
        raise BadInput(f"--input {'x'.join(map(str, c.input_shape))}: expected CxHxW, e.g. 3x32x32")


def run(c: ThroughputConfig, *, log=print) -> Dict[str, Any]:
    check(c)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (shared hosts; KINDS.md)
    doc: Dict[str, Any] = {"benchmark": "throughput", "schema": 1,
                           "env": environment("nccl" if c.device == "cuda" else "gloo"),
                           "config": asdict(c), "results": [], "sync": []}
    for w in c.workers:
        t0 = time.perf_counter()
        try:
            rows = run_local(_worker, (asdict(c),), w, cuda=c.device == "cuda", timeout_s=RANK_TIMEOUT_S)[0]
        except WorkerFailed as e:  # keep the other worker counts' results
            rows = [{"workers": w, "batch": 0, "variant": "*", "error": str(e)}]
        doc["results"].extend(r for r in rows if "variant" in r)
        doc["sync"].extend(r for r in rows if "sync_model" in r)
        log(f"bench throughput: W={w}: {len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    _ratios(doc["results"])
    doc["env"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return doc


def _ratios(rows: List[dict]) -> None:
    """vs_plain, vs_ddp (same W and B) and scaling (same variant at W=1, same B) of median
    samples/s; for shmlearn's variants, ratio_to_best_baseline (BEST_OF, same W and B)."""
    def med(w, b, v):
        for r in rows:
            if (r["workers"], r["batch"], r["variant"]) == (w, b, v) and "samples_per_s" in r:
                return r["samples_per_s"]["median"]
        return None
    for r in rows:
        if "samples_per_s" not in r:
            continue
        x = r["samples_per_s"]["median"]
        if r["variant"] == "local" or r["variant"] not in BASELINES:
            best = max(((med(r["workers"], r["batch"], v), v) for v in BEST_OF
                        if med(r["workers"], r["batch"], v)), default=None)
            if best:
                r["ratio_to_best_baseline"], r["best_baseline"] = x / best[0], best[1]
        for key, ref in (("vs_plain", med(r["workers"], r["batch"], "plain")),
                         ("vs_ddp", med(r["workers"], r["batch"], "ddp")),
                         ("vs_local", med(r["workers"], r["batch"], "local")),
                         ("scaling", med(1, r["batch"], r["variant"] if r["variant"] not in DDP + ("local",)
                                         else registry.DEFAULT))):
            if ref and not (key == "scaling" and r["workers"] == 1):
                r[key] = x / ref
        best_ddp = max((m for m in (med(r["workers"], r["batch"], v) for v in DDP) if m), default=None)
        if best_ddp and r["variant"] not in DDP:
            r["vs_best_ddp"] = x / best_ddp


def table(doc: Dict[str, Any]) -> str:
    e = doc["env"]
    vw = max([25] + [len(r["variant"]) + 1 for r in doc["results"]])  # modifiers make long names
    lines = [f"bench throughput: {doc['config']['model']} {'x'.join(map(str, doc['config']['input_shape']))}, "
             f"{e['device']} x{max(doc['config']['workers'])}, torch {e['torch_version']}, "
             f"precision {doc['config']['precision']}{', channels_last' if doc['config']['channels_last'] else ''}, "
             f"{doc['config']['repeats']} repeats, {e['date']}",
             f"{'W':>2} {'B':>5} {'variant':<{vw}}{'mode':<11}{'ms/step':>9}{'steps/s':>10}{'samples/s':>12}"
             f"{'p25-p75 samples/s':>22}{'vs plain':>9}{'vs ddp':>8}{'vs local':>9}{'scaling':>8}"
             f"{'vs best':>8}{'setup s':>9}"]

    def f(r, k):
        return f"{r[k]:.2f}" if k in r else "-"
    for r in doc["results"]:
        if "samples_per_s" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r.get('error', '?')}"
            lines.append(f"{r['workers']:>2} {r['batch']:>5} {r['variant']:<{vw}}{why}")
            continue
        sp, st = r["samples_per_s"], r["steps_per_s"]
        lines.append(f"{r['workers']:>2} {r['batch']:>5} {r['variant']:<{vw}}{r.get('mode', ''):<11}"
                     f"{1e3 / st['median']:>9.3f}{st['median']:>10.1f}{sp['median']:>12.0f}"
                     f"{sp['p25']:>11.0f}-{sp['p75']:<10.0f}{f(r, 'vs_plain'):>9}{f(r, 'vs_ddp'):>8}"
                     f"{f(r, 'vs_local'):>9}{f(r, 'scaling'):>8}{f(r, 'ratio_to_best_baseline'):>8}"
                     f"{r.get('setup_s', 0):>9.1f}")
    notes = [f"{r['workers']} {r['batch']} {r['variant']}: {r['note']}" for r in doc["results"] if r.get("note")]
    if any("ratio_to_best_baseline" in r for r in doc["results"]):
        lines.append(f"vs best: median samples/s over the best of {', '.join(BEST_OF)} at the same W and B; "
                     "setup s: build + warm-up (compiling, capturing), not timed")
    lines += [f"note (W B variant): {n}" for n in notes]
    for s in doc.get("sync", []):
        lines.append(f"gradient sync {s['sync_model']} W={s['workers']} {s['bytes'] / 2**20:.1f} MiB: shmlearn "
                     f"{s['shmlearn']['time_s']['median'] * 1e3:.3f} ms ({s['shmlearn']['busbw_GBps']:.1f} GB/s busbw), "
                     f"bare all_reduce {s['bare_all_reduce']['time_s']['median'] * 1e3:.3f} ms "
                     f"({s['bare_all_reduce']['busbw_GBps']:.1f} GB/s): {100 * s['ratio']:.1f}%")
    return "\n".join(lines)


# --- command line ------------------------------------------------------------------------------

def register(bench_sub) -> None:
    p = bench_sub.add_parser(
        "throughput", help="steps/s of shmlearn's step vs a plain PyTorch loop, its CUDA graph, torch.compile "
                           "and DDP, same run",
        description="Median and spread of steps/s and samples/s over repeats, for shmlearn's strategies and, "
                    "in the same run, a plain PyTorch eager loop, the same step captured in a CUDA graph, "
                    "torch.compile of the model (reduce-overhead, max-autotune), torch DDP and shmlearn with no "
                    "communication, with the same model, batch and optimizer (SGD momentum). JSON out, "
                    "table printed last.")
    p.add_argument("--model", default="alexnet-small", help="model name [alexnet-small]")
    p.add_argument("--input", default="3x32x32", help="image shape CxHxW [3x32x32]")
    p.add_argument("--classes", type=int, default=10, help="classes [10]")
    p.add_argument("--device", default="cpu", help="cpu (Gloo processes) or cuda (one process per GPU, NCCL) [cpu]")
    p.add_argument("--batch-sizes", default="128", help="per-worker batch sizes, e.g. 128,1024 [128]")
    p.add_argument("--workers", default="1", help="worker counts, e.g. 1,2 [1]")
    p.add_argument("--strategies", default=registry.DEFAULT,
                   help=f"shmlearn strategies: {','.join(strategy_names())}; modifiers after a colon, joined by +: "
                        f"eager (no CUDA graph), noise (noise-scale meter at the default --noise-every), "
                        f"noise1 (at every step), compile (--compile default), "
                        f"compile-max (--compile max-autotune), im2col (--image-conv im2col), triton-conv (--image-conv triton), e.g. allreduce:compile "
                        f"[{registry.DEFAULT}]")
    p.add_argument("--baselines", default="plain,ddp,local",
                   help=f"subset of {','.join(BASELINES)}; graph: the plain step in one CUDA graph (CUDA only), "
                        f"compile/compile-max: torch.compile reduce-overhead/max-autotune (default mode on CPU) "
                        f"[plain,ddp,local]")
    p.add_argument("--avg-period", type=int, default=8, help="weight-avg: average every K steps [8]")
    p.add_argument("--precision", default="fp32", help="fp32 or bf16 (shmlearn and plain) [fp32]")
    p.add_argument("--channels-last", action="store_true", help="channels_last weights and batches (shmlearn and plain)")
    p.add_argument("--cuda-graph", default="auto", help="auto or off [auto]")
    p.add_argument("--check-every", type=int, default=None, help="read losses every K steps [10 on CPU, 50 on CUDA]")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per setting, >= 5 [5]")
    p.add_argument("--seconds", type=float, default=1.0, help="target seconds per repeat [1]")
    p.add_argument("--warmup-steps", type=int, default=10, help="untimed steps after building [10]")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per process [cores / W]")
    p.add_argument("--samples", type=int, default=50000, help="images in the random dataset [50000]")
    p.add_argument("--sync-models", default="", help="W > 1: also time the gradient sync of these models, e.g. resnet34")
    p.add_argument("--out", default="throughput.json", help="JSON file [throughput.json]")
    p.set_defaults(func=cmd_throughput)


def config_from_args(ns) -> ThroughputConfig:
    try:
        shape = [int(v) for v in ns.input.lower().split("x")]
    except ValueError:
        raise BadInput(f"--input {ns.input}: expected CxHxW, e.g. 3x32x32") from None
    split = lambda s: [v for v in s.split(",") if v.strip()]  # noqa: E731
    return ThroughputConfig(model=ns.model, input_shape=shape, classes=ns.classes, device=ns.device,
                            batch_sizes=parse_int_list(ns.batch_sizes, flag="--batch-sizes"),
                            workers=parse_int_list(ns.workers, flag="--workers"),
                            strategies=split(ns.strategies), baselines=split(ns.baselines),
                            avg_period=ns.avg_period, precision=ns.precision, channels_last=ns.channels_last,
                            cuda_graph=ns.cuda_graph, check_every=ns.check_every, repeats=ns.repeats,
                            seconds=ns.seconds, warmup_steps=ns.warmup_steps, threads=ns.threads,
                            samples=ns.samples,
                            sync_models=split(ns.sync_models))


def cmd_throughput(ns) -> int:
    c = config_from_args(ns)
    doc = run(c)
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {ns.out}")
    print(table(doc))
    return 0
