"""`shmlearn experiment list` and `shmlearn experiment run NAME [--quick] [--device] [--out]`."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("experiment", help="rerun one of the seed experiments",
                       description="Rerun a seed experiment through the shared training loop; writes its "
                                   "tables (Markdown, CSV) and figures and prints its main table.")
    esub = p.add_subparsers(dest="experiment_command", required=True)
    esub.add_parser("list", help="list the experiments").set_defaults(func=_list)
    r = esub.add_parser("run", help="run one experiment")
    r.add_argument("name", help="experiment name (see `shmlearn experiment list`)")
    r.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores, same code path")
    r.add_argument("--device", default="auto", choices=("cpu", "cuda", "auto"))
    r.add_argument("--out", help="output folder [default: experiments/<date>-<name>]")
    r.set_defaults(func=_run)


def _list(ns) -> int:
    from shmlearn.experiments import EXPERIMENTS
    width = max(map(len, EXPERIMENTS))
    for name, (_, what) in EXPERIMENTS.items():
        print(f"{name:<{width}}  {what}")
    return 0


def _run(ns) -> int:
    from shmlearn.experiments import run_experiment
    print(run_experiment(ns.name, quick=ns.quick, device=ns.device, out=ns.out))
    return 0
