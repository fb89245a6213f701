"""Command line: each subcommand only builds a config and calls the library.

Exit codes (docs/architecture.md, "The output contract"): 0 completed, 1 a worker failed,
2 bad input, 3 diverged.

The train flags are generated from TrainConfig with argparse (issue 17 asked: tyro, or argparse
from the dataclass): one flag per option (config.options: TrainConfig's fields and each
registered strategy's parameters), its type from the resolved annotations
(typing.get_type_hints), a Literal's values its choices, its help from the docstring under the
field, each strategy's own flags in a group of their own. Why not tyro: it would bring a dependency to
do what ~100 lines do here, and our flags keep their own conventions (negative numbers in sweep
lists, one-line errors with exit 2, flags a strategy owns grouped under it). The help texts come
from attribute docstrings read from the class's source (`flags.field_docs`), which is how tyro finds
them too; moving them into field metadata would let them be read without the source.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import signal
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional

# shmlearn.config.train_config, train and simulate import torch (~2-6 s), and advise numpy: this
# module imports them in the functions that build the parser or run, after
# `precheck` has refused what it can without them. The modules imported here load without both.
from shmlearn.bench import register as register_bench
from shmlearn.data.files import FILE_DATASETS, check_present
from shmlearn.errors import BadInput, Diverged, WorkerFailed, count
from shmlearn.cli import exits
from shmlearn.launch import forkserver
from shmlearn.user import user_main
from shmlearn.config.flags import Option, choice_error, help_group, read_table, write_table
from shmlearn.config.flags import field_docs, scalar_type as _scalar_type  # noqa: F401 - cli's API, read from here
from shmlearn.launch.start import detect_env
from shmlearn.report.cli import register as register_report
from shmlearn.sweeps.cli import register as register_sweep
from shmlearn.experiments.cli import register as register_experiment
from shmlearn.analysis.simulate.parser import register as register_simulate

if TYPE_CHECKING:
    from shmlearn.config.train_config import TrainConfig


class _LiteralHelp(argparse.HelpFormatter):
    """Help texts as written: ours come from docstrings ("the first 20% of steps") and use no
    %(default)s placeholders, so argparse's %-formatting would only break on a bare %."""

    def _expand_help(self, action) -> str:
        return self._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _LiteralHelp)
        # `--worker 1` is a typo, not --workers: a prefix taken silently changes what runs (53).
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # A word starting "-<digit>" or "-.<digit>" is a value, not an option: "--lr -1e-3",
        # "sweep --lr -1,0.1" (argparse takes only "-1" and "-0.5" so, and no flag of ours
        # starts with a digit). Python 3.13's argparse does the same.
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message: str):  # one line, exit 2, no usage dump
        self.exit(2, f"shmlearn: error: {message}{self._did_you_mean(message)} (see `{self.prog} --help`)\n")

    def _did_you_mean(self, message: str) -> str:
        """For an unknown --flag: the closest flag of this parser or a subcommand's (an
        unrecognized argument is reported by the top parser, after the subcommand's parsed)."""
        if not message.startswith("unrecognized arguments: --"):
            return ""
        word = message.split()[2].split("=")[0]
        known, parsers = [], [self]
        while parsers:
            p = parsers.pop()
            known += [o for o in p._option_string_actions if o.startswith("--")]
            parsers += [c for a in p._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]
        close = difflib.get_close_matches(word, known, n=1)
        return f"; did you mean {close[0]}?" if close else ""

    def _check_value(self, action, value):
        # A flag's value outside its choices (a Literal's): the line config.validate gives for
        # it in a --config file or from Python, not argparse's "invalid choice".
        if action.option_strings and action.choices is not None and value not in action.choices:
            self.exit(2, f"shmlearn: error: {choice_error(action.option_strings[0], value, action.choices)}\n")
        super()._check_value(action, value)


def _train_options() -> List[Option]:
    """config.options(), from the flag table where this process has not imported config (the
    table is plain data: no torch, flags.read_table); read live otherwise, and kept as the table
    for the next process. A process that imported config reads it live: what it registered
    since (a strategy a test adds) is in no table."""
    if "shmlearn.config.train_config" not in sys.modules:
        table = read_table()
        if table is not None:
            return table
    with held_signals():  # the first run with no table imports torch here (import_torch_whole)
        from shmlearn.config.train_config import options  # lazy: torch, after the CLI's cheap checks
    live = list(options().values())
    write_table(live)
    return live


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per option of TrainConfig (config.options): the type from its annotation, the
    choices from its Literal, the help from its docstring; in --help the basics first, then the
    other settings, a strategy's own parameters under that strategy, the GPU kernels last
    (config.HELP_GROUPS)."""
    made: Dict[Any, argparse._ArgumentGroup] = {"basics": p.add_argument_group("basics")}
    rest = p.add_argument_group("training, evaluation and the run directory")
    for o in _train_options():
        where = rest if not o.group and not o.strategies else help_group(p, o, made)
        # A --no-X flag's default is X on; "[default: True]" beside --no-X reads backwards.
        shown = o.default is not None and o.default is not True
        help_ = o.help + (f" [default: {o.default}]" if shown else "")
        if o.kind is bool:
            if o.default:
                where.add_argument("--no-" + o.flag[2:], dest=o.name, action="store_const",
                                   const=False, default=argparse.SUPPRESS, help=help_)
            else:
                where.add_argument(o.flag, dest=o.name, action="store_const", const=True,
                                   default=argparse.SUPPRESS, help=help_)
            continue
        where.add_argument(o.flag, dest=o.name, type=o.kind, default=argparse.SUPPRESS, help=help_,
                           choices=o.choices, metavar=None if o.choices else o.name.upper())


def _register_train(sub) -> None:
    t = sub.add_parser("train", help=COMMANDS["train"],
                       description="Train one model on N workers with a synchronization strategy; "
                                   "writes a run directory (config, metrics, eval, summary, trace).")
    t.add_argument("--config", metavar="FILE.yaml", help="YAML file of any of these flags; flags win")
    _add_config_flags(t)
    t.set_defaults(func=cmd_train)


COMMANDS = {"train": "train one model on N workers",
            "bench": "benchmarks (communication, parameter-server simulation, ...)",
            "sweep": "sweep any train flags; pick the best per worker count",
            "report": "one self-contained HTML page for runs or a sweep",
            "experiment": "rerun one of the seed experiments",
            "simulate": "predict step time and scaling to 1024 workers from measured costs",
            "advise": "workers and batch size from the measured gradient noise scale"}
"""The subcommands and their one-line help, in --help's order: `shmlearn --help` lists them
without building their parsers (several import torch or numpy); tests/cli/test_cli_start.py checks
each line against the one its register() gives."""


def _registrar(name: str, rest: Optional[List[str]] = None):
    """Each subcommand registers itself: register(subparsers) adds a parser with
    set_defaults(func=handler), handler(namespace) -> exit code. rest: the words after the
    subcommand's name (bench builds only the benchmark they name)."""
    if name == "train":
        return _register_train
    if name == "bench":
        return lambda sub: register_bench(sub, rest)
    if name == "report":
        return register_report
    if name == "advise":
        from shmlearn.analysis.advise import register  # lazy: numpy, after the CLI's cheap checks
    elif name == "experiment":
        return register_experiment
    elif name == "simulate":
        return register_simulate
    else:  # the sweep's parser takes the train flags from the table, as train's does: no torch
        return lambda sub: register_sweep(sub, _train_options)
    return register


def build_parser(argv: Optional[List[str]] = None) -> argparse.ArgumentParser:
    """The whole parser; with `argv`, only the subcommand argv names is built in full, the others
    listed by name and help line (COMMANDS), so that `--help` and a typo answer at once."""
    p = _Parser(prog="shmlearn", description="Data-parallel training, and the tools to study it.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    chosen = argv[0] if argv else None
    for name, help_ in COMMANDS.items():
        if argv is None or name == chosen:
            _registrar(name, None if argv is None else argv[1:])(sub)
        else:
            sub.add_parser(name, help=help_)
    return p


def config_from_args(ns: argparse.Namespace) -> "TrainConfig":
    from shmlearn.config.train_config import ALTERNATIVES, TrainConfig, load_yaml  # lazy: torch, after the CLI's cheap checks
    values = load_yaml(ns.config) if getattr(ns, "config", None) else {}
    values = {k.replace("-", "_"): v for k, v in values.items()}
    flags = {k: v for k, v in vars(ns).items() if k not in ("command", "config", "func")}
    for pair in ALTERNATIVES:  # flags win, also over the file's other way of saying the same
        if any(k in flags for k in pair):
            for k in pair:
                values.pop(k, None)
    values.update(flags)
    return TrainConfig.from_dict(values, source=f"--config {ns.config}" if ns.config else "config")


def _is_lead() -> bool:
    env = detect_env()
    return env is None or env.rank == 0


def cmd_train(ns: argparse.Namespace) -> int:
    from shmlearn.train.entry import train  # lazy: torch, after the CLI's cheap checks
    result = train(config_from_args(ns))
    if _is_lead():
        s = result.summary
        acc = s.get("test_accuracy")
        loss = s.get("test_loss")
        print(f"test accuracy {acc:.4f} (best {s['best_test_accuracy']:.4f})" if acc is not None
              else f"test loss {loss:.6f}" if loss is not None else "test loss none (not finite)", end="")
        print(f" | final loss {s['final_loss']:.4f} | {s['steps']} steps x {count(s['workers'], 'worker')}, "
              f"{s['samples_seen']} samples in {s['wall_time_s']:.2f} s "
              f"({s['samples_per_s']:.0f} samples/s) | {result.run_dir}")
    return 0


def _flag_values(args: List[str], flags: tuple) -> Dict[str, str]:
    """The last value of each of `flags` in `args`, spelled in full (--data-dir X or
    --data-dir=X), as argparse would take them; abbreviations are left to argparse."""
    found: Dict[str, str] = {}
    for flag in flags:
        given = _flag_values_all(args, flag)
        if given:
            found[flag] = given[-1]
    return found


def _flag_values_all(args: List[str], flag: str) -> List[str]:
    """Every value of `flag` in `args`, in order (--axis X or --axis=X; a repeatable flag's all)."""
    found = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name == flag:
            if eq:
                found.append(value)
            elif i + 1 < len(args):
                found.append(args[i + 1])
    return found


def precheck(argv: List[str]) -> None:
    """What `train` and `sweep` can refuse before torch is imported (~2-6 s): a file dataset's
    --data-dir that does not exist or lacks its files, with the line train() would give
    (data.files.check_present). Anything it cannot judge from the command line alone (a
    --config that may set them, a flag abbreviated) is left to the full checks."""
    if not argv or argv[0] not in ("train", "sweep") or "-h" in argv or "--help" in argv:
        return
    given = _flag_values(argv[1:], ("--dataset", "--data-dir", "--config"))
    if "--dataset" not in given or ("--config" in given and "--data-dir" not in given):
        return  # the default dataset reads no files; a --config may set either

    def values(flag: str) -> List[Optional[str]]:
        raw = given.get(flag)
        if raw is None:
            return [None]
        # sweep: A,B is an axis (sweep.parse_values); none/null is the default
        parts = [p.strip() for p in raw.split(",")] if argv[0] == "sweep" else [raw]
        return [None if p.lower() in ("none", "null") else p for p in parts]
    for name in values("--dataset"):
        if name in FILE_DATASETS:
            for data_dir in values("--data-dir"):
                if data_dir != "":  # "" is left to the config's own check
                    check_present(name, data_dir)


def prestart(argv: List[str]) -> None:
    """Start the forkserver the local workers of `train`, `sweep` and `experiment run` fork from
    (forkserver.py), CPU or GPU, before this process imports torch, so that both import at once.
    Not for a train that runs here (--workers 1, or a host with one GPU visible and no --workers),
    nor under a launcher."""
    if (not argv or argv[0] not in ("train", "sweep", "experiment") or "-h" in argv or "--help" in argv
            or (argv[0] == "experiment" and argv[1:2] != ["run"]) or detect_env() is not None):
        return
    given = _flag_values(argv[1:], ("--workers", "--device"))
    if argv[0] == "train" and (given.get("--workers") == "1" or (
            "--workers" not in given and given.get("--device") != "cpu" and _visible_gpus() == 1)):
        return
    lean = _lean_sweep(argv) or _lean_train(argv)
    if lean == "caller":
        return
    forkserver.start(dynamo=not lean)


def _lean_sweep(argv: List[str]) -> Optional[str]:
    """A sweep or `experiment run` whose flags compile nothing (no --compile but off, no --config
    that might set it; an experiment: no --axis compile=...): its pool is lean (sweeps/trials.py),
    so no worker imports torch._dynamo (~1.2 s of a core before the first could fork on this 2-core
    CPU; on an H200 host whose image keeps no bytecode caches the forkserver's Dynamo import held
    the seed's sweep's first GPU worker 3 s past the others, all four GPUs waiting). "caller": a
    CPU sweep whose ranks also run one thread each (no --threads but 1) and that is no study, so
    its workers fork from the sweep itself, which needs no forkserver; "forkserver": one that
    imports torch alone (GPU pools always: a fork of a process that uses CUDA cannot). None: not
    such a sweep. Where a trial does compile after all, its worker imports Dynamo itself: slower,
    never wrong."""
    if argv[0] == "experiment":
        given = _flag_values(argv[1:], ("--device",))
        if any(a.startswith("compile=") for a in _flag_values_all(argv[1:], "--axis")):
            return None
        return "caller" if _on_cpu(given) else "forkserver"  # an experiment's trials run one thread a rank
    given = _flag_values(argv[1:], ("--compile", "--config", "--device", "--threads", "--storage"))
    if not (argv[0] == "sweep" and _compiling_nothing(given)):
        return None
    # A study (--storage) may run threads of its storage's, which a fork refuses (caller_fork)
    cpu = _on_cpu(given) and given.get("--threads", "1") == "1" and "--storage" not in given
    return "caller" if cpu else "forkserver"


TORCH_COMMANDS = ("train", "sweep", "experiment", "bench")
"""The program's commands that import torch before they do anything else."""


def import_torch_whole(argv: List[str]) -> None:
    """Import torch with Ctrl-C and SIGHUP held, for a command that imports it anyway: a
    KeyboardInterrupt raised inside the import of one of torch's C++ extensions can end in C++'s
    std::terminate, SIGABRT (-6) and a stack dump instead of the one line and 130 (seen in CI:
    Ctrl-C 0.5 s after `shmlearn train` started). A signal that came meanwhile is delivered when the
    import ends, where it raises as anywhere else (exits.py)."""
    if not argv or argv[0] not in TORCH_COMMANDS or "-h" in argv or "--help" in argv or "torch" in sys.modules:
        return
    with held_signals():
        import torch  # noqa: F401


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Ctrl-C and SIGHUP held (delivered when the block ends) around an import of torch."""
    held = {signal.SIGINT, signal.SIGHUP}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _lean_train(argv: List[str]) -> Optional[str]:
    """A `train` of a pool whose flags compile nothing (no --compile but off, no --config that
    might set it): its pool is lean (train/entry.py; the user's code named by a flag makes it a
    full one after all, whose workers then import torch._dynamo themselves). "caller": a CPU run
    whose ranks run one thread each (--threads 1, or no more cores than processes: the pool's
    one_thread), so its workers fork from this process, which needs no forkserver (2 workers on 2
    cores: the README's first command, whose forkserver's torch._dynamo import held the workers'
    fork by 1 s); else "forkserver": one that imports torch alone (a GPU pool's always). None: not
    such a run."""
    given = _flag_values(argv[1:], ("--compile", "--config", "--device", "--threads", "--workers"))
    if not (argv[0] == "train" and _compiling_nothing(given)):
        return None
    if not _on_cpu(given):
        return "forkserver"
    try:
        workers = max(1, int(given.get("--workers", "2")))  # the CPU default (launch/placement.py)
    except ValueError:
        return None  # refused later, with its line
    from shmlearn.config.limits import usable_cores  # lazy: prestart runs before any other import
    threads = given.get("--threads")
    return "caller" if threads == "1" or (threads is None and usable_cores() // workers <= 1) else "forkserver"


def _compiling_nothing(given: Dict[str, str]) -> bool:
    """Flags (_flag_values of --compile and --config) of a run that compiles nothing: no
    --compile but off, no --config that might set it."""
    return given.get("--compile", "off") == "off" and "--config" not in given


def _on_cpu(given: Dict[str, str]) -> bool:
    """Flags (_flag_values of --device) of a run on the CPU: asked for, or no GPU visible."""
    return given.get("--device") == "cpu" or _visible_gpus() == 0


def _visible_gpus() -> int:
    """How many GPUs a process here would see, without importing torch: CUDA_VISIBLE_DEVICES's
    entries where it is set, else the NVIDIA driver's device files (0 without a driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        return sum(name[6:].isdigit() for name in os.listdir("/dev") if name.startswith("nvidia"))
    except OSError:
        return 0


def main(argv: Optional[List[str]] = None, *, early_workers: bool = False) -> int:
    """early_workers: the program's own run (entry), which may start the forkserver (prestart)."""
    try:
        precheck(sys.argv[1:] if argv is None else argv)
        if (sys.argv[1:] if argv is None else argv)[:1] == ["train"]:
            detect_env()  # a launcher's variables, checked before any import or socket (launch/env.py)
    except BadInput as e:
        print(f"shmlearn: error: {e}", file=sys.stderr)
        return e.exit_code
    if early_workers:
        prestart(sys.argv[1:] if argv is None else argv)
    # The flags are parsed from the flag table before torch is imported: a misspelled flag or a
    # value of the wrong type is answered in ~0.1 s, not after torch's 1-5 s import.
    try:
        ns = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
    except BadInput as e:  # a flag's own check (a sweep's list: sweeps/cli.py _checked)
        print(f"shmlearn: error: {e}", file=sys.stderr)
        return e.exit_code
    if getattr(ns, "before_torch", None) is not None:
        ns.before_torch(ns)  # a command's work beside torch's import (a sweep's report helper)
    if early_workers:
        import_torch_whole(sys.argv[1:] if argv is None else argv)
    try:
        return ns.func(ns)
    except BadInput as e:
        print(f"shmlearn: error: {e}", file=sys.stderr)
        return e.exit_code
    except Diverged as e:
        print(f"shmlearn: {e}", file=sys.stderr)
        return e.exit_code
    except WorkerFailed as e:
        print(f"shmlearn: failed: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGHUP under entry (exits.py)
        return exits.interrupted(sys.argv[1:] if argv is None else argv, hangup=isinstance(e, exits.Hangup))


def entry() -> None:
    """The `shmlearn` program (console script and `python -m shmlearn`)."""
    exits.install()  # Ctrl-C, SIGHUP, a closed stdout, an OSError: one line and its exit code
    user_main.program_owns_main()  # its workers import no script: the console script is not the user's
    code = exits.guarded(lambda: main(early_workers=True), sys.argv[1:])
    exits.finishing()
    try:
        launched = detect_env() is not None
    except BadInput:  # refused in main, with its line
        launched = False
    if launched:
        # A rank of torchrun, mpirun or srun leaves at once, as locally spawned workers do
        # (launch._child): its files are written, and the interpreter's exit-time teardown of
        # torch's distributed state can abort a finished rank ("terminate called without an
        # active exception", seen under mpirun in CI), turning a completed run into a failed job.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    leave(code)


def leave(code: int) -> None:
    """End the program without the interpreter's teardown: it frees torch's modules and objects
    one by one (0.3-1 s of a core, measured by benchmarks/start.py as the time from the last line
    to the exit) when everything is written and closed. The exit handlers still run first (the
    pools' close, the forkserver's end, multiprocessing's finalizers: atexit), then the output is
    flushed; a reader that closed the pipe is no error here."""
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the reader (`| head -1`), or already closed
            pass
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    entry()
