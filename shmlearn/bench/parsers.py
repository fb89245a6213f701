"""The parsers of `shmlearn bench comm`, `ps-sim` and `throughput`, built without torch: their
--help and a misspelled flag answer at once (issue 53: building them imported torch, 2-6 s on a
loaded 2-core machine). Each handler imports its benchmark's module when it runs; the names the
parsers list (collectives, dtypes, baselines) live here, and the benchmarks read them from here.
The strategies' names come from bench.strategies (kept, or read live once)."""
from __future__ import annotations

import importlib
from typing import Callable

from shmlearn.bench import strategies

OPS = ("all_reduce", "reduce", "gather", "broadcast", "all_gather", "reduce_scatter")
"""bench comm's collectives."""
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")
"""bench comm's element types, by torch's names (bench.comm maps them to torch dtypes)."""
BASELINES = ("plain", "plain-fp32", "ddp", "ddp-compile", "local", "graph", "compile", "compile-max")
"""bench throughput's baselines: what a user would write instead, timed in the same run."""


def _handler(module: str, name: str) -> Callable[..., int]:
    """The handler `name` of shmlearn.bench.<module>, imported when the command runs (torch)."""
    def run(ns) -> int:
        return getattr(importlib.import_module(f"shmlearn.bench.{module}"), name)(ns)
    return run


def comm(bench_sub) -> None:
    p = bench_sub.add_parser(
        "comm", help="latency and bus bandwidth of the collectives vs size and workers",
        description="Time all_reduce, reduce, gather, broadcast, all_gather and reduce_scatter on real "
                    "process groups (nccl-tests conventions for size and busbw). Writes JSON and a plot.")
    p.add_argument("--backend", default="gloo", help="gloo (CPU processes) or nccl (one process per GPU) [gloo]")
    p.add_argument("--workers", default=None,
                   help="world sizes, e.g. 2,3,4 or 1-2 [gloo: 2,3,4; nccl: 1 to the GPU count]")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--sizes", default=None, help="explicit sizes, e.g. 4K,64K,1M (overrides the range)")
    p.add_argument("--min-size", default="4K", help="smallest size of the range [4K]")
    p.add_argument("--max-size", default="256M", help="largest size of the range [256M]")
    p.add_argument("--size-factor", type=int, default=4, help="ratio between sizes of the range: 2 or 4 [4]")
    p.add_argument("--dtype", default="float32", help=f"{', '.join(DTYPE_NAMES)} [float32]")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per point [3]")
    p.add_argument("--iters", type=int, default=20, help="timed calls per point, at most [20]")
    p.add_argument("--min-iters", type=int, default=5, help="timed calls per point, at least [5]")
    p.add_argument("--budget-s", type=float, default=2.0, help="seconds of timed calls per point [2]")
    p.add_argument("--repeats", type=int, default=1,
                   help="sweeps of every W; a point keeps the sweep with its median median (loaded machines) [1]")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="ms of computation on every rank before each call, as in a training step "
                        "(0: calls back to back) [0]")
    p.add_argument("--shared-memory", choices=("auto", "off"), default="auto",
                   help="gloo: auto times the shared-memory collectives a CPU run of one host uses (train's "
                        "--shared-memory: all_reduce, gather, broadcast) where they can run, else Gloo; off: Gloo [auto]")
    p.add_argument("--out", default="comm.json", help="JSON file to write [comm.json]")
    p.add_argument("--plot", default=None, help="PNG to write [the --out path with .png]")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.set_defaults(func=_handler("comm", "cmd_comm"))


def ps_sim(bench_sub) -> None:
    p = bench_sub.add_parser(
        "ps-sim", help="the seed's dummy-gradient parameter-shard benchmark",
        description="Seed 001's benchmark: dummy gradients shaped like a model's weights gathered to a "
                    "parameter shard, averaged, applied and broadcast; prints the seed's lines per step.")
    p.add_argument("--backend", default="gloo", help="gloo (CPU processes) or nccl (one process per GPU) [gloo]")
    p.add_argument("--workers", default="1-4", help="numbers of workers, e.g. 1-4 or 1,2,4 [1-4]")
    p.add_argument("--model", default="alexnet-small", help="model whose weight shapes to use [alexnet-small]")
    p.add_argument("--shared", action="store_true", help="rank 0 is also a worker (default: dedicated shard)")
    p.add_argument("--per-tensor", action="store_true", help="one gather/broadcast per weight tensor")
    p.add_argument("--steps", type=int, default=10, help="timed steps per worker count [10]")
    p.add_argument("--warmup", type=int, default=2, help="steps before them, printed, not in the medians [2]")
    p.add_argument("--lr", type=float, default=0.4, help="learning rate of the dummy update [0.4]")
    p.add_argument("--quiet", action="store_true", help="print only the medians per worker count")
    p.add_argument("--out", default="ps-sim.json", help="JSON file to write [ps-sim.json]")
    p.add_argument("--plot", default=None, help="PNG to write [the --out path with .png]")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.set_defaults(func=_handler("ps_sim", "cmd_ps_sim"))


def throughput(bench_sub) -> None:
    default, timed = strategies.listed("default")[0], ",".join(strategies.listed("fast_compute"))
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
    p.add_argument("--strategies", default=default,
                   help=f"shmlearn strategies: {timed}; modifiers after a colon, joined by +: "
                        f"eager (no CUDA graph), noise (noise-scale meter at the default --noise-every), "
                        f"noise1 (at every step), compile (--compile default), "
                        f"compile-max (--compile max-autotune), im2col (--image-conv im2col), triton-conv (--image-conv triton), e.g. allreduce:compile "
                        f"[{default}]")
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
    p.set_defaults(func=_handler("throughput", "cmd_throughput"))
