"""The CLI's first answer (issue 53): --help, a subcommand's --help and a misspelled flag are
answered before torch is imported; prefixes are not flags; train --help is grouped, basics first;
the help of a --no-X flag says what the flag does."""
import argparse
import json
import os
import subprocess
import sys

import pytest
from cli_inproc import run_main

# Runs the CLI's parser as the program does (cli.main builds it from argv) and reports what the
# process imported, the exit code and the parsed values; a fresh interpreter, so sys.modules is
# the parser's own doing.
PROBE = r"""
import json, sys
argv = json.loads(sys.argv[1])
from shmlearn.cli.main import build_parser
try:
    ns = build_parser(argv).parse_args(argv)
    code, values = None, {k: v for k, v in vars(ns).items() if k != "func"}
except SystemExit as e:
    code, values = e.code, None
sys.stdout.flush()
sys.stderr.write("\nPROBE " + json.dumps({"torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules,
                                          "code": code, "values": values}) + "\n")
"""


def probe(argv, cache):
    env = dict(os.environ, SHMLEARN_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True,
                       env=env, timeout=300)
    head, _, tail = r.stderr.rpartition("\nPROBE ")
    assert tail, r.stderr
    return r.stdout, head, json.loads(tail)


def test_top_level_help_and_an_unknown_command_import_no_torch(tmp_path):
    out, _, seen = probe(["--help"], tmp_path / "cache")
    assert seen["code"] == 0 and not seen["torch"] and not seen["numpy"], seen
    from shmlearn.cli.main import COMMANDS
    assert all(name in out and help_ in " ".join(out.split()) for name, help_ in COMMANDS.items()), out
    _, err, seen = probe(["trian"], tmp_path / "cache")
    assert seen["code"] == 2 and not seen["torch"], seen
    assert err.strip().count("\n") == 0 and "invalid choice: 'trian'" in err, err


def test_train_help_and_a_typo_answer_from_the_table_without_torch(tmp_path):
    cache = tmp_path / "cache"
    live_help, _, first = probe(["train", "--help"], cache)  # no table yet: read live, kept
    assert first["code"] == 0 and first["torch"]
    assert [p.name for p in cache.iterdir()] and all(p.name.startswith("flags-") for p in cache.iterdir())
    table_help, _, second = probe(["train", "--help"], cache)
    assert second["code"] == 0 and not second["torch"], second
    assert table_help == live_help and "--batch-size" in table_help
    _, err, typo = probe(["train", "--worker", "1"], cache)
    assert typo["code"] == 2 and not typo["torch"], typo
    assert err.strip() == ("shmlearn: error: unrecognized arguments: --worker 1; did you mean --workers? "
                           "(see `shmlearn --help`)"), err


def test_sweep_help_answers_from_the_table_without_torch_as_it_did_live(tmp_path):
    """`sweep --help` imported torch (its parser read TrainConfig's options live); it reads the
    flag table as train's does, and says the same."""
    cache = tmp_path / "cache"
    live_help, _, first = probe(["sweep", "--help"], cache)  # no table yet: read live, kept
    assert first["code"] == 0 and first["torch"]
    table_help, _, second = probe(["sweep", "--help"], cache)
    assert second["code"] == 0 and not second["torch"], second
    assert table_help == live_help and "--threshold" in table_help and "--batch-size" in table_help
    _, err, typo = probe(["sweep", "--worker", "1"], cache)
    assert typo["code"] == 2 and not typo["torch"] and "did you mean --workers?" in err, (typo, err)


@pytest.mark.parametrize("argv", [["experiment", "--help"], ["experiment", "run", "--help"], ["report", "--help"],
                                  ["advise", "--help"], ["bench", "--help"]])
def test_a_subcommands_help_imports_no_torch(tmp_path, argv):
    out, _, seen = probe(argv, tmp_path / "cache")
    assert seen["code"] == 0 and not seen["torch"], seen
    assert out.startswith(f"usage: shmlearn {' '.join(argv[:-1])}"), out


def test_the_table_parses_every_kind_of_flag_as_the_live_options_do(tmp_path):
    """What a table-built parser gives the config is what the live one gives: types (int, float,
    Optional), choices, --no-X switches, a strategy's parameter."""
    cache = tmp_path / "cache"
    argv = ["train", "--workers", "3", "--lr", "0.25", "--eval-every", "2", "--device", "cpu", "--no-save-model",
            "--deterministic", "--strategy", "weight-avg", "--avg-period", "4", "--compile", "default"]
    _, _, live = probe(argv, cache)
    _, _, table = probe(argv, cache)
    assert live["torch"] and not table["torch"]
    assert table["values"] == live["values"] and live["values"]["eval_every"] == 2.0, table
    assert live["values"]["save_model"] is False and live["values"]["avg_period"] == 4
    _, err, bad = probe(["train", "--device", "tpu"], cache)
    assert bad["code"] == 2 and not bad["torch"] and "--device tpu: choose one of cpu, cuda, auto" in err, err


def test_a_table_that_cannot_be_read_is_rebuilt(tmp_path):
    from shmlearn.config.flags import KEEP_TABLES, TABLE_PREFIX, source_digest
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"{TABLE_PREFIX}{source_digest()}.json").write_text('[{"name": "lr"')  # cut short
    others = [cache / f"{TABLE_PREFIX}{i:04d}.json" for i in range(KEEP_TABLES + 2)]  # other trees'
    for i, other in enumerate(others):
        other.write_text("[]")
        os.utime(other, (1e9 + i, 1e9 + i))  # older first
    out, _, seen = probe(["train", "--help"], cache)
    assert seen["code"] == 0 and seen["torch"] and "--batch-size" in out
    _, _, again = probe(["train", "--help"], cache)
    assert again["code"] == 0 and not again["torch"]
    kept = sorted(p.name for p in cache.iterdir())
    assert kept == sorted([f"{TABLE_PREFIX}{source_digest()}.json"] + [o.name for o in others[-(KEEP_TABLES - 1):]])


def _parsers(p):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for c in a.choices.values():
                yield from _parsers(c)


def test_no_parser_takes_a_prefix_for_a_flag(capsys):
    from shmlearn.cli.main import build_parser
    parser = build_parser()
    assert all(not p.allow_abbrev for p in _parsers(parser))
    for argv in (["train", "--worker", "1"], ["train", "--batch", "8"], ["sweep", "--thresh", "1"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2, argv
        assert "unrecognized arguments" in capsys.readouterr().err
    assert build_parser().parse_args(["train", "--workers", "1"]).workers == 1


def test_the_command_list_is_each_commands_own_help():
    from shmlearn.cli.main import COMMANDS, build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {a.dest: a.help for a in sub._choices_actions} == COMMANDS


def test_the_benchmark_list_is_each_benchmarks_own_help():
    """`bench --help` lists the benchmarks from bench.SUBCOMMANDS without importing them."""
    from shmlearn.bench import SUBCOMMANDS
    from shmlearn.cli.main import build_parser
    bench = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    assert {a.dest: a.help for a in sub._choices_actions} == {k: v[1] for k, v in SUBCOMMANDS.items()}


def _train_parser():
    from shmlearn.cli.main import build_parser
    return build_parser(["train"])._subparsers._group_actions[0].choices["train"]


def test_train_help_lists_the_basics_first_and_the_gpu_kernels_last():
    from shmlearn.config.train_config import HELP_GROUPS, options
    groups = [(g.title, [a.dest for a in g._group_actions]) for g in _train_parser()._action_groups
              if g._group_actions and g.title not in ("positional arguments", "options")]
    titles = [t for t, _ in groups]
    gpu = next(t for t in HELP_GROUPS if t != "basics")
    assert titles[0] == "basics" and titles[-1] == gpu, titles
    assert all(t.startswith("--strategy") for t in titles[2:-1]), titles
    basics = dict(groups)["basics"]
    assert basics == [n for n in options() if n in HELP_GROUPS["basics"]]
    assert {"dataset", "model", "workers", "strategy", "batch_size", "lr", "samples", "epochs", "out"} == set(basics)
    assert set(dict(groups)[gpu]) == set(HELP_GROUPS[gpu]) and "cuda_graph" in dict(groups)[gpu]
    # every field of a group exists: a renamed field would drop out of its group silently
    assert set(sum(HELP_GROUPS.values(), ())) <= set(options())
    # the general settings sit between them, not in the argparse "options" group before the basics
    assert "seed" in dict(groups)[titles[1]]


def test_a_no_flag_says_what_it_does():
    """--no-save-model's help read "Save the final weights": what the flag turns off."""
    switches = [a for a in _train_parser()._actions if a.option_strings and a.option_strings[0].startswith("--no-")]
    assert {"--no-save-model", "--no-progress"} <= {a.option_strings[0] for a in switches}
    for a in switches:
        assert a.option_strings[0] in a.help, (a.option_strings, a.help)
        assert not a.help.startswith("Save"), a.help


def test_a_default_budget_in_epochs_prints_no_note(tmp_path, capfd, monkeypatch):
    """digits' default 20 epochs (28,740 samples) is no multiple of 32: rounded down to whole
    steps in silence; a --samples that does not divide still gets its note (test_cli)."""
    out = tmp_path / "run"
    # --threads 1: a 1-worker run with the default threads crawls on a loaded 2-core machine
    r = run_main(["train", "--workers", "1", "--threads", "1", "--eval-points", "1", "--out", str(out),
                  "--no-progress"], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    with open(out / "summary.json") as f:
        s = json.load(f)
    assert (s["budget_samples"], s["steps"]) == (28740, 898)
    assert "shmlearn: budget" not in r.stdout and "not a multiple" not in r.stdout, r.stdout


def test_the_program_leaves_without_teardown_but_runs_its_exit_handlers():
    """cli.leave: the exit handlers (pools, the forkserver, multiprocessing's finalizers) run,
    unflushed output is written, the exit code is kept; a reader that closed the pipe is no error."""
    code = ("import atexit, sys; from shmlearn.cli.main import leave; "
            "atexit.register(lambda: print('handler ran', end='')); print('last line ', end=''); "
            "sys.stderr.write('err '); leave(3)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (3, "last line handler ran", "err ")
    # the output waits in its buffer (a pipe) until the reader has gone, then leave() flushes it
    p = subprocess.Popen([sys.executable, "-c", "import sys; from shmlearn.cli.main import leave; "
                          "sys.stdin.readline(); print('unread'); leave(0)"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    p.stdout.close()  # `| head -0`
    p.stdin.write(b"go\n")
    p.stdin.close()
    assert p.wait(timeout=120) == 0
    assert p.stderr.read() == b""


@pytest.mark.parametrize("argv", [["simulate", "--help"], ["bench", "comm", "--help"], ["bench", "ps-sim", "--help"],
                                  ["bench", "throughput", "--help"], ["bench", "timeline", "--help"]])
def test_simulate_and_a_benchmarks_help_answer_without_torch(tmp_path, argv):
    """`simulate --help` and `bench NAME --help` imported torch (their parsers lived in the modules
    that run them; simulate's and throughput's list the registry's strategies). The parsers are
    light; the strategies' names are read live once and kept, as the train flag table is."""
    cache = tmp_path / "cache"
    live, _, first = probe(argv, cache)
    kept, _, second = probe(argv, cache)
    assert first["code"] == 0 and second["code"] == 0, (first, second)
    assert not second["torch"] and not second["numpy"], second
    assert kept == live and kept.startswith(f"usage: shmlearn {' '.join(argv[:-1])}"), kept
    _, err, typo = probe(argv[:-1] + ["--bogus"], cache)  # or a required argument missing: first
    assert typo["code"] == 2 and not typo["torch"] and err.strip().startswith("shmlearn: error:"), (typo, err)
    assert err.strip().count("\n") == 0, err


def test_the_strategies_listed_without_torch_are_the_registrys():
    """What simulate's and bench throughput's help list, from the kept names, is what the registry
    says: every simulate variant, and the fast-step strategies whose every process computes."""
    from shmlearn.analysis.simulate.predict import default_strategies, strategies
    from shmlearn.bench.throughput_variants import strategy_names
    from shmlearn.cli.main import build_parser
    from shmlearn.sync import registry

    def help_of(argv):
        sub = build_parser(argv)._subparsers._group_actions[0].choices[argv[0]]
        if argv[0] == "bench":
            sub = sub._subparsers._group_actions[0].choices[argv[1]]
        return next(a for a in sub._actions if a.dest == "strategies")
    sim = help_of(["simulate"])
    assert sim.default == ",".join(default_strategies())
    assert sim.help == f"comma list of {','.join(strategies())} [{','.join(default_strategies())}]"
    tp = help_of(["bench", "throughput"])
    assert tp.default == registry.DEFAULT and tp.help.startswith(f"shmlearn strategies: {','.join(strategy_names())};")


def test_kept_strategy_names_that_cannot_be_read_are_read_live_again(tmp_path):
    from shmlearn.bench import strategies
    from shmlearn.config import flags
    cache = tmp_path / "cache"
    cache.mkdir()
    kept = cache / f"{strategies.PREFIX}{flags.source_digest()}.json"
    kept.write_text('{"names": [')  # cut short
    out, _, seen = probe(["simulate", "--help"], cache)
    assert seen["code"] == 0 and seen["torch"] and "--strategies" in out, seen  # read live
    assert set(json.loads(kept.read_text())) == set(strategies.KEYS)  # and kept whole
    again, _, second = probe(["simulate", "--help"], cache)
    assert second["code"] == 0 and not second["torch"] and again == out


@pytest.mark.parametrize("argv, line", [
    (["train", "--workers", "x"], "argument --workers: invalid int value: 'x'"),
    (["train", "--workers", "2", "--batch-size", "y"], "argument --batch-size: invalid int value: 'y'"),
    (["sweep", "--workers", "1,2", "--samples", "many"], "--samples many: expected a number"),
    (["sweep", "--batch-size", "32:8:8"], "--batch-size 32:8:8: the step must be nonzero and go from 32 toward 8"),
    (["sweep", "--lr", "0.1,,0.3"], "--lr 0.1,,0.3: empty value in the list"),
    (["experiment", "run", "nosuch"], "experiment nosuch: unknown; choose one of single-neuron")])
def test_the_program_refuses_a_malformed_value_before_it_imports_torch(tmp_path, argv, line):
    """The program (entry: forkserver prestarted, torch imported whole) parses its flags first: a
    value of the wrong type, a sweep's malformed list or an unknown experiment costs the parse,
    not torch's 1-5 s import; one line (the one the full checks give), exit code 2."""
    cache = tmp_path / "cache"
    probe(["train", "--help"], cache)  # the flag table, as any run after the first has it
    code = ("import atexit, runpy, sys; sys.argv = ['shmlearn'] + sys.argv[1:]; "
            "atexit.register(lambda: sys.stderr.write('\\nTORCH %s' % ('torch' in sys.modules))); "
            "runpy.run_module('shmlearn', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, SHMLEARN_CACHE_DIR=str(cache)), cwd=tmp_path)
    err, _, torch_seen = r.stderr.rpartition("\nTORCH ")
    assert r.returncode == 2 and torch_seen == "False", r.stderr
    assert err.strip().count("\n") == 0 and err.startswith("shmlearn: error: ") and line in err, err


# The program's sweep as main runs it, with the report's helper and the sweep itself replaced by
# recorders: what was imported when the helper started, and that the sweep got its parse time.
SWEEP_PROBE = r"""
import json, sys
import shmlearn.report.helper as helper
import shmlearn.sweeps.cli as sweep_cli
seen = {}
class Helper:
    def close(self):
        seen["closed"] = True
def start():
    seen.setdefault("starts", []).append("torch" in sys.modules)
    return Helper()
def run_sweep(sc, parsed, report_helper):
    seen.update(parsed=parsed, torch_at_run="torch" in sys.modules, helper=report_helper is not None)
    return 0
helper.start, sweep_cli.run_sweep = start, run_sweep
from shmlearn.cli.main import main
code = main(json.loads(sys.argv[1]), early_workers=True)
sys.stderr.write("\nPROBE " + json.dumps(dict(seen, code=code)) + "\n")
"""


def test_a_sweep_starts_its_report_helper_before_torchs_import(tmp_path):
    """The helper loads matplotlib on the core torch's import leaves idle (sweeps/cli.py
    before_torch); started after it, its import fell in the first trials."""
    argv = ["sweep", "--dataset", "digits", "--lr", "0.1,0.2", "--device", "cpu", "--out", str(tmp_path / "s")]
    env = dict(os.environ, SHMLEARN_CACHE_DIR=str(tmp_path / "cache"))
    probe(argv[:1] + ["--help"], tmp_path / "cache")  # the flag table, as a first --help leaves it
    r = subprocess.run([sys.executable, "-c", SWEEP_PROBE, json.dumps(argv)], capture_output=True, text=True,
                       env=env, timeout=300)
    seen = json.loads(r.stderr.rpartition("\nPROBE ")[2] or "null")
    assert seen and seen["code"] == 0, r.stderr
    assert seen["starts"] == [False] and seen["torch_at_run"] is True, seen  # one helper, before torch
    assert seen["helper"] and seen["closed"] and isinstance(seen["parsed"], float), seen
    r = subprocess.run([sys.executable, "-c", SWEEP_PROBE, json.dumps(argv + ["--no-report"])], capture_output=True,
                       text=True, env=env, timeout=300)
    seen = json.loads(r.stderr.rpartition("\nPROBE ")[2] or "null")
    assert seen and seen["code"] == 0 and "starts" not in seen and not seen["helper"], r.stderr
