"""`bench throughput`'s runners: one object per variant with step(i) and close().

_Plain is the loop a user writes (plain, plain-fp32, the compile baselines, DDP and DDP+compile),
_Graph the same step captured by hand in one CUDA graph, _Shmlearn shmlearn's own step built as
train.py builds it; _build picks one by variant name. All train the same model (same seed) with
SGD momentum 0.9 on the same random device-resident images.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from shmlearn.bench.throughput_variants import COMPILE_MODES, DDP, ThroughputConfig, _parse, step_options
from shmlearn.data.base import DataSpec
from shmlearn.data.loader import ShardedLoader
from shmlearn.step.fast import Stepper
from shmlearn.models import build_model
from shmlearn.train.noise import NoiseMeter, default_every
from shmlearn.user.optim import build_schedule
from shmlearn.sync import build_strategy, registry
from shmlearn.record.timing import PhaseTimer

def _spec(c: ThroughputConfig):
    return DataSpec(name="random", task="classification", input_shape=tuple(c.input_shape),
                    num_outputs=c.classes)


def _model(c: ThroughputConfig, device, model_name: Optional[str] = None):
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
        w = 1 if local else world
        r = 0 if local else rank
        model = _model(c, device)
        opt = _sgd(model.parameters(), c.lr)
        self.strategy = build_strategy(strategy, rank=r, world_size=w, avg_period=c.avg_period)
        self.strategy.setup(model, opt, channels_last=c.channels_last)
        n = max(c.samples, 4 * batch * world)
        if mods & {"noise", "noise1"}:  # as train.py attaches it: after setup, before the Stepper (which binds its step counter)
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
        opts, tuning = step_options(c, mods)
        self.stepper = Stepper(model=model, strategy=self.strategy, optimizer=opt, schedule=schedule,
                               loader=loader, task="classification", device=device, opts=opts, tuning=tuning,
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
