"""`shmlearn experiment list` and `shmlearn experiment run NAME [--quick] [--device] [--out]`."""
from __future__ import annotations

from shmlearn.errors import BadInput
from shmlearn.experiments import EXPERIMENTS, default_out, run_experiment


def register(sub) -> None:
    p = sub.add_parser("experiment", help="rerun one of the seed experiments",
                       description="Rerun a seed experiment through the shared training loop; writes its "
                                   "tables (Markdown, CSV) and figures and prints its main table.")
    esub = p.add_subparsers(dest="experiment_command", required=True)
    esub.add_parser("list", help="list the experiments").set_defaults(func=_list)
    r = esub.add_parser("run", help="run one experiment")
    r.add_argument("name", type=_known, help="experiment name (see `shmlearn experiment list`)")
    r.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores, same code path")
    r.add_argument("--device", default="auto", choices=("cpu", "cuda", "auto"))
    r.add_argument("--out", help="output folder [default: experiments/<date>-<name>]")
    r.add_argument("--axis", action="append", default=[], metavar="FLAG=VALUES",
                   help="sweeping experiments: replace one axis of the grid, e.g. --axis lr=0.1:0.9:0.2 "
                        "or --axis workers=4,2,1 (values as `shmlearn sweep` takes them; repeatable)")
    r.set_defaults(func=_run)


def _known(name: str) -> str:
    """An experiment's name, refused by the parser before torch's import if there is none of that
    name (the line run_experiment gives; BadInput, which argparse lets through)."""
    if name not in EXPERIMENTS:
        raise BadInput(f"experiment {name}: unknown; choose one of {', '.join(EXPERIMENTS)}")
    return name


def _list(ns) -> int:
    width = max(map(len, EXPERIMENTS))
    for name, (_, what) in EXPERIMENTS.items():
        print(f"{name:<{width}}  {what}")
    return 0


def _run(ns) -> int:
    out = ns.out or (default_out(ns.name, ns.quick) if ns.name in EXPERIMENTS else None)
    print(run_experiment(ns.name, quick=ns.quick, device=ns.device, out=out, axes=_axes(ns.axis)))
    print(f"experiment {ns.name}: tables, figures and runs in {out}", flush=True)
    return 0


def _axes(items) -> dict:
    from shmlearn.config.train_config import TrainConfig  # lazy: torch, after the CLI's cheap checks
    from shmlearn.sweeps.grid import parse_values  # lazy: torch, after the CLI's cheap checks
    fields = set(TrainConfig().to_dict())
    axes = {}
    for item in items:
        name, sep, raw = item.partition("=")
        key = name.strip().lstrip("-").replace("-", "_")
        if not sep or not raw.strip():
            raise BadInput(f"--axis {item}: expected FLAG=VALUES, e.g. lr=0.1,0.5")
        if key not in fields:
            raise BadInput(f"--axis {item}: {name.strip()} is not a train flag")
        axes[key] = parse_values(key, raw)
    return axes
