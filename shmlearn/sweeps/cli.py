"""The `shmlearn sweep` command, above the two ways it runs: a grid in this process's pool
(sweep.Sweep) or, with --storage, an Optuna study (study.run_study); both run their trials
with trials.TrialRunner.

The parser (`register`) imports nothing of torch's: the train flags come from the caller's
options (the CLI's flag table, config/flags.py), the sweep's own from SweepConfig
(sweep_config.py), so `shmlearn sweep --help` and a misspelled flag answer at once; the modules
that run a sweep (config, grid, sweep: torch) are imported by the functions that run one."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from typing import Callable, Iterable, Optional

from shmlearn.errors import BadInput
from shmlearn.config.flags import Option, field_docs, help_group
from shmlearn.record.readback import Word
from shmlearn.sweeps.values import parse_values
from shmlearn.sweeps.sweep_config import GOALS, NOT_SWEPT, PRUNERS, SEARCHES, SweepConfig


def run_sweep(sc: SweepConfig, parsed: Optional[float] = None, report_helper=None) -> int:
    """Run (or continue) a sweep; returns the CLI's exit code (0, or 1 if trials failed; 2 if no
    completed trial reports --winner-metric). parsed: when the flags were read (unix seconds),
    before torch's import: the first of the sweep's marks (timing.json). report_helper: a
    report.helper.ReportHelper that draws the grid sweep's report (the caller closes it)."""
    parsed = parsed or time.time()
    from shmlearn.sweeps.grid import check_search, check_winner  # lazy: torch, after the CLI's cheap checks
    from shmlearn.sweeps.sweep import Sweep  # lazy: torch, after the CLI's cheap checks
    imported = time.time()
    check_search(sc)
    check_winner(sc)
    if sc.storage is not None:
        try:
            from shmlearn.sweeps.study.sweep import run_study  # lazy: study.py imports optuna (optional)
        except ImportError as e:
            if (e.name or "").split(".")[0] not in ("optuna", "sqlalchemy"):
                raise
            raise BadInput(f"--storage: optuna is not installed ({e.name}); "
                           f"pip install 'shmlearn[optuna]'") from None
        return run_study(sc)
    sweep = Sweep(sc)
    sweep.marks.update(parsed=parsed, imported=imported)
    sweep.report_helper = report_helper
    return sweep.run()


def _live_options() -> Iterable[Option]:
    from shmlearn.config.train_config import options  # lazy: torch (a caller without the flag table)
    return options().values()


def _checked(name: str, kind: type, text: str) -> str:
    """A train flag's text as given, once its list and ranges parse as values of its option's
    kind (values.parse_values): a malformed one is refused by the parser, before torch's
    import, with the line the grid would give (BadInput, which argparse lets through)."""
    parse_values(name, text, kind)
    return text


def register(sub, train_options: Optional[Callable[[], Iterable[Option]]] = None) -> None:
    """The `sweep` parser. train_options: TrainConfig's options (config.options), as the CLI reads
    them from its flag table without torch; None reads them live."""
    p = sub.add_parser("sweep", help="sweep any train flags; pick the best per worker count",
                       description="Run every combination of the given flag values as a training run "
                                   "(each flag takes A,B,C or START:STOP:STEP), P at a time without "
                                   "oversubscribing; pick winners by the paper's rule; write a report. "
                                   "The same command again continues where the last one stopped.")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML of any of these flags; a list is an axis; flags win")
    made: dict = {}
    for o in (train_options or _live_options)():  # TrainConfig's options, each strategy's under it
        if o.name in NOT_SWEPT:
            continue
        where = help_group(p, o, made)
        if o.kind is bool:
            where.add_argument(o.flag, dest=o.name, nargs="?", const="true", default=argparse.SUPPRESS,
                               metavar="true,false", help=o.help, type=functools.partial(_checked, o.name, bool))
        else:
            # A list of values is not one choice: each trial's config is validated (sweep_grid).
            shown = "{" + ",".join(map(str, o.choices)) + "}[,...]" if o.choices else "V[,V...]|A:B:S"
            where.add_argument(o.flag, dest=o.name, default=argparse.SUPPRESS, metavar=shown, help=o.help,
                               type=functools.partial(_checked, o.name, o.kind))
    g = p.add_argument_group("sweep")
    for name in ("threshold", "target_accuracy", "target_share", "time_axis", "repeats", "parallel", "slots", "out"):
        fd = next(f for f in dataclasses.fields(SweepConfig) if f.name == name)
        typ = float if name in ("threshold", "target_accuracy", "target_share") else \
            int if name in ("parallel", "slots", "repeats") else str
        g.add_argument("--" + name.replace("_", "-"), dest=f"sweep_{name}", type=typ,
                       default=fd.default if fd.default != "" else None,
                       help=field_docs(SweepConfig).get(name, "") +
                       (" Default: runs/sweep-<model>-<dataset>." if name == "out" else ""))
    g.add_argument("--winner-metric", dest="sweep_winner_metric", metavar="NAME",
                   help=field_docs(SweepConfig).get("winner_metric", ""))
    g.add_argument("--winner-goal", dest="sweep_winner_goal", metavar="|".join(GOALS),
                   help=field_docs(SweepConfig).get("winner_goal", ""))
    g.add_argument("--no-report", dest="sweep_report", action="store_false", help="skip figures and report.html")
    g.add_argument("--no-progress", dest="sweep_no_progress", action="store_true",
                   help="accepted for symmetry with train; trials never draw a progress bar")
    g.add_argument("--prune", dest="sweep_prune", action="store_true",
                   help=field_docs(SweepConfig).get("prune", ""))
    o = p.add_argument_group("study (Optuna; pip install 'shmlearn[optuna]')")
    sd = field_docs(SweepConfig)
    o.add_argument("--storage", dest="sweep_storage", metavar="URL", help=sd.get("storage", ""))
    o.add_argument("--study", dest="sweep_study", metavar="NAME", help=sd.get("study", ""))
    o.add_argument("--search", dest="sweep_search", default="grid", metavar="|".join(SEARCHES),
                   help=sd.get("search", ""))
    o.add_argument("--trials", dest="sweep_trials", type=int, metavar="N", help=sd.get("trials", ""))
    o.add_argument("--pruner", dest="sweep_pruner", metavar="|".join(PRUNERS), help=sd.get("pruner", ""))
    o.add_argument("--search-seed", dest="sweep_search_seed", type=int, metavar="N", help=sd.get("search_seed", ""))
    o.add_argument("--stale-after", dest="sweep_stale_after", type=float, default=60.0, metavar="S",
                   help=sd.get("stale_after", ""))
    p.set_defaults(func=cmd_sweep, before_torch=before_torch)


def sweep_config_from_args(ns: argparse.Namespace) -> SweepConfig:
    from shmlearn.config.train_config import load_yaml  # lazy: torch, after the CLI's cheap checks
    from shmlearn.sweeps.grid import split_axes  # lazy: torch, after the CLI's cheap checks
    values = load_yaml(ns.config) if getattr(ns, "config", None) else {}
    values = _typed({k.replace("-", "_"): v for k, v in values.items()}, f"--config {ns.config}")
    for k in NOT_SWEPT:
        if k in values:
            raise BadInput(f"--config {ns.config}: '{k}' is set by the sweep (--out names the sweep directory)")
    values.update({k: v for k, v in vars(ns).items()
                   if k not in ("command", "config", "func", "before_torch", "parsed_at", "report_helper") and not k.startswith("sweep_")})
    fixed, axes = split_axes(values)
    for flag, v in (("--parallel", ns.sweep_parallel), ("--slots", ns.sweep_slots)):
        if v is not None and v < 1:
            raise BadInput(f"{flag} {v}: expected a whole number >= 1")
    if ns.sweep_target_accuracy is not None and not 0 < ns.sweep_target_accuracy <= 1:
        raise BadInput(f"--target-accuracy {ns.sweep_target_accuracy}: expected a fraction in (0, 1]")
    def name(k, default):
        return str(fixed.get(k, default)) if k not in axes else "+".join(map(str, axes[k]))
    out = ns.sweep_out or os.path.join("runs", f"sweep-{name('model', 'mlp')}-{name('dataset', 'digits')}")
    return SweepConfig(fixed=fixed, axes=axes, threshold=ns.sweep_threshold,
                       target_accuracy=ns.sweep_target_accuracy, winner_metric=ns.sweep_winner_metric,
                       time_axis=ns.sweep_time_axis, repeats=ns.sweep_repeats, target_share=ns.sweep_target_share,
                       winner_goal=ns.sweep_winner_goal, parallel=ns.sweep_parallel,
                       slots=ns.sweep_slots, out=out, report=ns.sweep_report,
                       prune=getattr(ns, "sweep_prune", False), storage=ns.sweep_storage, study=ns.sweep_study,
                       search=ns.sweep_search, trials=ns.sweep_trials, pruner=ns.sweep_pruner,
                       search_seed=ns.sweep_search_seed, stale_after=ns.sweep_stale_after)


def _typed(values: dict, source: str) -> dict:
    """A sweep's --config values checked against their options' types as train's are
    (flags.Option.coerce), each item of a list (an axis) alone; text is left to parse_values
    ('16,32', '16:64:16' are lists and ranges in a sweep), and so is a list or mapping nested in
    a value (its line says a value may not nest)."""
    from shmlearn.config.train_config import options  # lazy: torch, after the CLI's cheap checks
    known = options()
    out = {}
    for k, v in values.items():
        o = known.get(k)
        items = v if isinstance(v, list) else [v]
        if o is not None:
            items = [x if (isinstance(x, str) and not isinstance(x, Word)) or isinstance(x, (list, dict))
                     else o.coerce(x, source) for x in items]
        out[k] = items if isinstance(v, list) else items[0]
    return out


def before_torch(ns: argparse.Namespace) -> None:
    """What a sweep starts before torch's import (cli.main calls it between the parse and the
    import): the time its flags were read (the sweep's first mark) and, for a grid sweep that
    draws a report, the report's helper, which loads matplotlib on the core that torch's import
    leaves idle (report/helper.py). Started after the import, the helper's ~0.35 s of a core
    fell in the first trials: on 2 cores the first 2-worker trial's steps took twice as long."""
    if getattr(ns, "parsed_at", None) is None:
        ns.parsed_at = time.time()
    if not hasattr(ns, "report_helper"):  # once: None where it could not start
        ns.report_helper = None
        if ns.sweep_report and ns.sweep_storage is None:
            from shmlearn.report.helper import start  # lazy: the program's grid sweeps only
            ns.report_helper = start()


def cmd_sweep(ns: argparse.Namespace) -> int:
    before_torch(ns)  # a caller that did not (main(argv) in a process that has torch already)
    helper, ns.report_helper = ns.report_helper, None
    try:
        return run_sweep(sweep_config_from_args(ns), ns.parsed_at, helper)
    finally:
        if helper is not None:
            helper.close()
