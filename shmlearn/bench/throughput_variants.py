"""`bench throughput`'s variants: what it can time and with which settings.

The baselines (what a user would write instead), the MODIFIERS a shmlearn strategy takes after a
colon (`allreduce:eager+noise`), the config of one run, which variants run at a worker count, and
the check of a config before any process starts. The docstring of shmlearn/bench/throughput.py
says what each variant is.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import List, Optional, Tuple

import torch

from shmlearn.bench.parsers import BASELINES
from shmlearn.errors import BadInput
from shmlearn.step.fast import CUDA_GRAPH, PRECISIONS, StepOptions, StepTuning
from shmlearn.models import MODELS
from shmlearn.sync import registry

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
             "buckets": {"grad_buckets": "on"}, "no-buckets": {"grad_buckets": "off"},
             "no-weight-copy": {"weight_copy": "off"}, "weight-copy": {"weight_copy": "on"},
             "normal-priority": {"high_priority_capture": False}, "memset-nodes": {"memset_kernels": False},
             "eager-read": {"compile_read": False},
             "cudnn-all": {"cudnn_benchmark_limit": 0}}
"""Strategy suffixes NAME:a+b (the StepOptions or StepTuning fields each sets, step/options.py; noise attaches the meter at
the default --noise-every, noise1 at --noise-every 1)."""


def step_options(c: "ThroughputConfig", mods) -> Tuple[StepOptions, StepTuning]:
    """The fast step's settings and switches of a shmlearn variant with MODIFIERS `mods`: each sets
    its fields; Inductor options add up (combo+aggressive asks for both)."""
    opts = dict(precision=c.precision, channels_last=c.channels_last, cuda_graph=c.cuda_graph,
                check_every=c.check_every)
    for m in sorted(mods):
        for k, v in MODIFIERS[m].items():
            opts[k] = opts.get(k, ()) + v if k == "inductor" else v
    settings = {f.name for f in fields(StepOptions)}
    return (StepOptions(**{k: v for k, v in opts.items() if k in settings}),
            StepTuning(**{k: v for k, v in opts.items() if k not in settings}))


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


def check(c: ThroughputConfig) -> None:
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
