"""The parser of `shmlearn simulate`, built without torch or numpy: its --help and a misspelled
flag answer at once (issue 53: building it imported the predictor, and torch with it, 2-6 s on a
loaded 2-core machine). The strategies' names come from bench.strategies (kept, or read live
once); the command itself is analysis/simulate/main.py's cmd_simulate."""
from __future__ import annotations

from shmlearn.bench import strategies


def _cmd_simulate(ns) -> int:
    from shmlearn.analysis.simulate.main import cmd_simulate  # lazy: torch and numpy, when it runs
    return cmd_simulate(ns)


def register(sub) -> None:
    fast, every = ",".join(strategies.listed("fast_compute")), ",".join(strategies.listed("simulate"))
    p = sub.add_parser("simulate", help="predict step time and scaling to 1024 workers from measured costs",
                       description="Fit alpha-beta models to bench comm JSON, take compute time from a one-worker "
                                   "run or a throughput JSON, predict step time, samples/s and scaling "
                                   "efficiency per strategy, and compare with measured runs.")
    p.add_argument("--comm", help="bench comm JSON to fit (the network)")
    p.add_argument("--net-bw", type=float, help="instead of --comm: assumed link bandwidth, GB/s")
    p.add_argument("--net-latency-us", type=float, default=0.0, help="with --net-bw: latency per message step, us")
    p.add_argument("--net-name", help="with --net-bw: the network's name in the table and plot")
    p.add_argument("--comm-after-compute", default=None,
                   help="bench comm JSON of the same machine measured with --compute-ms T: the extra cost of a "
                        "step's first collective after its compute (needed on CPUs whose cores the ranks share)")
    p.add_argument("--shared-memory", choices=("auto", "off"), default=None,
                   help="the path CPU runs' collectives take, as train's flag: without --comm or --net-bw, a CPU "
                        "compute source is predicted with the repository's measurement of it (auto: shared "
                        "memory, off: Gloo); with --comm, the file must have measured it [auto]")
    p.add_argument("--compute", required=True,
                   help="one-worker shmlearn run directory (or its summary.json), or a throughput JSON")
    p.add_argument("--batch", type=int, default=None,
                   help="with a bench throughput JSON as --compute: the per-worker batch to take [smallest]")
    p.add_argument("--ps-sim", help="bench ps-sim JSON: the server's averaging cost (default: from the update phase)")
    p.add_argument("--strategies", default=fast,
                   help=f"comma list of {every} [{fast}]")
    p.add_argument("--avg-period", type=int, default=4, help="weight-avg: average every K steps [4]")
    p.add_argument("--allreduce-algo", default="ring",
                   help="ring (as measured) or tree (2 log2 W latency steps: NCCL at scale, a what-if) [ring]")
    p.add_argument("--check-every", type=int, default=None,
                   help="steps per control all-reduce, as train's --check-every: 1 for the classic loop "
                        "[train's default on the compute's device: 10 on CPU, 50 on CUDA for allreduce, "
                        "ps and weight-avg; 1 for ddp]; a measured run is predicted with the value it ran with")
    p.add_argument("--workers", default=None, help="worker counts [1,2,4,...,1024]")
    p.add_argument("--slots", type=float, default=None,
                   help="compute units the workers share, e.g. 2 for 2 CPU cores [one per worker]")
    p.add_argument("--measured", nargs="*", default=[],
                   help="measured runs to compare: run directories, summary.json, or bundles {runs: [...]}")
    p.add_argument("--out", default="simulate", help="directory for simulate.json and simulate.png [simulate]")
    p.set_defaults(func=_cmd_simulate)
