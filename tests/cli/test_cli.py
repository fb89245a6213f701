"""The `shmlearn train` command end to end: defaults, budget arithmetic, bad input, divergence.

Each test runs the real CLI in a subprocess, as a user would, and reads the run directory.
"""
import gzip
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_inproc import run_main

CONTRACT_KEYS = {"status", "strategy", "workers", "batch_size", "lr", "samples_seen", "steps",
                 "wall_time_s", "final_loss", "min_loss", "loss_area", "test_accuracy",
                 "best_test_accuracy", "samples_per_s", "phase_s", "device", "torch_version"}


def in_process(capfd, monkeypatch, *args):
    """(exit code, stderr) of the CLI's main() in this process (tests/cli_inproc.py)."""
    r = run_main(args, monkeypatch, capfd)
    return r.returncode, r.stderr


def shmlearn(*args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "shmlearn", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def test_default_run_learns_digits_within_a_minute(tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = shmlearn("train", "--out", str(out), "--no-progress")
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert CONTRACT_KEYS <= s.keys()
    assert (s["status"], s["strategy"], s["workers"], s["dataset"]) == ("completed", "allreduce", 2, "digits")
    assert s["test_accuracy"] >= 0.95
    assert f"test accuracy {s['test_accuracy']:.4f}" in r.stdout
    assert elapsed < 60, f"default run took {elapsed:.1f} s"
    # metrics, eval and the trace hold what the contract says
    metrics = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert metrics[-1]["step"] == s["steps"] and {"samples", "time_s", "loss", "phase_s"} <= metrics[0].keys()
    evals = [json.loads(l) for l in open(out / "eval.jsonl")]
    assert evals[0]["samples"] == 0 and evals[-1]["test_accuracy"] == s["test_accuracy"]
    assert set(s["phase_s"]) == {"data", "compute", "allreduce", "update"}
    trace = json.load(open(out / "trace.json"))
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert s["loss_area"] > 0 and s["min_loss"] <= s["final_loss"]


def test_a_run_with_its_progress_bar_ends_without_a_leaked_semaphore_warning(tmp_path):
    r = shmlearn("train", "--samples", "4096", "--eval-points", "1", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "train:" in r.stderr  # the bar was drawn
    assert "leaked semaphore" not in r.stderr, r.stderr


def test_sample_budget_gives_exact_steps(tmp_path):
    out = tmp_path / "run"
    # 50 steps of 4 x 128 (was 600 steps, 307200 samples: the arithmetic is the same, 5 s more training)
    r = shmlearn("train", "--samples", "25600", "--batch-size", "128", "--workers", "4",
                 "--eval-points", "1", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert (s["steps"], s["samples_seen"], s["workers"]) == (50, 25600, 4)
    assert "not a multiple" not in r.stdout


def test_budget_that_does_not_divide_rounds_down_and_says_so(tmp_path, capfd, monkeypatch):
    out = tmp_path / "run"
    # main() in this process: at 1 worker its rank 0 is this process, so what it prints is read
    # from fd 1 as from the program (a fresh interpreter was ~3 s of imports on two cores)
    r = run_main(["train", "--samples", "1000", "--batch-size", "32", "--workers", "1",
                  "--out", str(out), "--no-progress"], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert (s["steps"], s["samples_seen"], s["budget_samples"]) == (31, 992, 1000)
    assert "not a multiple" in r.stdout and "31 steps = 992 samples" in r.stdout
    assert "| 31 steps x 1 worker, 992 samples" in r.stdout, r.stdout  # said "1 workers"


def test_nan_loss_diverges_with_exit_3_on_every_rank(tmp_path):
    out = tmp_path / "run"
    r = shmlearn("train", "--lr", "1e6", "--workers", "2", "--out", str(out), "--no-progress")
    assert r.returncode == 3, r.stderr
    s = summary(out)
    assert s["status"] == "diverged" and s["loss_area"] is None
    assert s["diverged_step"] < 10 and s["steps"] == s["diverged_step"]
    assert f"at step {s['diverged_step']} on rank {s['diverged_rank']}" in r.stderr
    assert "Traceback" not in r.stderr


def _idx(path, arr, dtype_code=0x08, gz=False):
    data = struct.pack(">BBBB", 0, 0, dtype_code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) \
        + arr.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


@pytest.fixture
def mnist_dir(tmp_path):
    d = tmp_path / "mnist"
    d.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 64), ("t10k", 16)):
        _idx(d / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _idx(d / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, (n,)))
    return d


BAD_INPUTS = [
    (["--model", "nosuchnet"], "--model nosuchnet"),
    (["--dataset", "nosuchdata"], "--dataset nosuchdata"),
    (["--dataset", "mnist", "--data-dir", "/nonexistent/dir"], "/nonexistent/dir"),
    (["--lr", "0"], "--lr 0"),
    (["--lr", "-0.5"], "--lr -0.5"),
    (["--lr", "-1e-3"], "--lr -0.001: expected"),  # was argparse's "expected one argument"
    (["--lr", "abc"], "--lr"),
    (["--batch-size", "1000", "--workers", "2"], "--batch-size 1000"),
    (["--init", "uniform:x"], "--init uniform:x"),
    (["--samples", "10", "--epochs", "2"], "--samples"),
]


@pytest.mark.parametrize("args,needle", BAD_INPUTS, ids=[a[1] for a in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, needle):
    """The CLI's main() in this process (each case was a fresh interpreter: ~2 s of imports for a
    refusal); argparse's refusals leave by SystemExit. The tests around this one run the
    program itself to its exit 2 and one line."""
    from shmlearn.cli.main import main
    try:
        code = main(["train", *args, "--out", str(tmp_path / "run")])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_truncated_idx_exits_2_on_every_worker(mnist_dir, tmp_path):
    f = mnist_dir / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:1000])
    r = shmlearn("train", "--dataset", "mnist", "--data-dir", str(mnist_dir), "--model", "lenet",
                 "--workers", "2", "--out", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "train-images-idx3-ubyte" in lines[0] and "truncated" in lines[0], r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_malformed_cifar_exits_2(tmp_path, capfd, monkeypatch):
    d = tmp_path / "cifar-10-batches-bin"
    d.mkdir()
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (d / name).write_bytes(b"\x01" * 3000)  # not a multiple of the 3073-byte record
    code, err = in_process(capfd, monkeypatch, "train", "--dataset", "cifar10", "--data-dir", str(d), "--workers",
                           "1", "--out", str(tmp_path / "run"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "data_batch_1.bin" in err


def test_existing_run_is_never_overwritten(tmp_path, capfd, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text('{"status": "completed"}')
    code, err = in_process(capfd, monkeypatch, "train", "--out", str(out))
    assert code == 2 and "already holds a run" in err
    assert (out / "summary.json").read_text() == '{"status": "completed"}'


def test_config_file_gives_flags_and_flags_win(tmp_path, capfd, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("workers: 1\nbatch_size: 16\nsamples: 320\nlr: 0.01\n")
    out = tmp_path / "run"
    # main() in this process: the run's config is the point, not the program's process
    code, err = in_process(capfd, monkeypatch, "train", "--config", str(cfg), "--lr", "0.02", "--out", str(out),
                           "--no-progress")
    assert code == 0, err
    s = summary(out)
    assert (s["workers"], s["batch_size"], s["steps"], s["lr"]) == (1, 16, 20, 0.02)
    bad = tmp_path / "bad.yaml"
    bad.write_text("wrokers: 2\n")
    code, err = in_process(capfd, monkeypatch, "train", "--config", str(bad))
    assert code == 2 and "wrokers" in err


FASHION = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
def test_fashion_mnist_lenet_two_workers_reaches_086_in_half_an_epoch(tmp_path, capfd, monkeypatch):
    # The README's command (fashion-mnist, lenet, 2 workers) for accuracy only: how long it takes
    # is the README's measured figure, not a unit test's (a 120 s limit failed on a loaded 2-core
    # machine at 128 s). Half an epoch, not the default two (the test was the suite's largest
    # cost: ~85 s at two epochs, ~42 s at one): a step costs the same per sample at batch 16 as at
    # 32 on the CPU, and twice the steps at a lower lr make up for the samples. Measured on this
    # 2-core machine: 29,984 samples (937 steps of 2 x 16) at lr 0.03: 0.8782 (lr 0.05: 0.8679;
    # 20,000 samples at lr 0.05: 0.8642; one epoch at lr 0.03: 0.8910; the defaults' 2 epochs:
    # 0.9055); 0.86 leaves ~2 points for another CPU's rounding, far above chance (0.1). No
    # evaluation but the last (--eval-points 1, no --eval-at-start: 10,000 test images each, ~10 s
    # of a loaded 2-core machine, unasserted; evaluating does not change the training). main() in
    # this process (tests/cli_inproc.py): what the command trains is the point, not the program's
    # process; its 2 workers are real Gloo processes either way.
    out = tmp_path / "run"
    r = run_main(["train", "--dataset", "fashion-mnist", "--model", "lenet", "--workers", "2", "--samples", "29984",
                  "--batch-size", "16", "--lr", "0.03", "--eval-at-start", "off", "--eval-points", "1",
                  "--out", str(out), "--no-progress"], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert (s["workers"], s["samples_seen"]) == (2, 29984) and s["test_accuracy"] >= 0.86, s


def _helps(*path):
    """{dest: help} of the subcommand at `path`, e.g. ("train",) or ("bench", "throughput")."""
    from shmlearn.cli.main import build_parser
    p = build_parser()
    for name in path:
        p = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction").choices[name]
    return {a.dest: " ".join((a.help or "").split()) for a in p._actions}, p


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_help_says_what_the_code_does(command):
    from shmlearn.data import DATASETS
    from shmlearn.step.fast import DEFAULT_CHECK_EVERY
    from shmlearn.models import MODELS
    helps, _ = _helps(command)
    # the CPU default was given as 1; it is 10
    assert f"Default {DEFAULT_CHECK_EVERY['cpu']} on CPU, {DEFAULT_CHECK_EVERY['cuda']} on CUDA" in helps["check_every"]
    # the loss was said to be checked every step; it is read every --check-every steps
    assert "checked every step" not in helps["log_every"] and "--check-every" in helps["log_every"]
    # --model and --dataset list their choices, and the user's own
    for dest, names in (("model", MODELS), ("dataset", DATASETS)):
        assert all(name in helps[dest] for name in names) and "FILE.py:NAME" in helps[dest], helps[dest]


def test_no_progress_help_reads_the_right_way_round():
    helps, p = _helps("train")
    flag = next(a for a in p._actions if a.dest == "progress")
    assert flag.option_strings == ["--no-progress"]
    assert "--no-progress turns it off" in helps["progress"] and "[default: True]" not in helps["progress"]
    assert not helps["progress"].startswith("Show"), helps["progress"]


def test_a_strategys_parameters_show_under_that_strategy_in_help():
    """The help is generated from the typed config and the strategy registry: each strategy's own
    flags sit in a group named after it, not among the general flags."""
    from shmlearn.cli.main import build_parser
    from shmlearn.sync import registry
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in train._action_groups}
    for name, entry in registry.entries().items():
        for field_name in entry.config_fields():
            assert any(name in title and field_name in dests for title, dests in groups.items()
                       if title and title.startswith("--strategy")), (name, field_name, groups)
    general = [a.dest for g in train._action_groups if not (g.title or "").startswith("--strategy")
               for a in g._group_actions]
    assert "avg_period" not in general and "ps_dedicated" not in general and "lr" in general


def test_flag_types_come_from_the_annotations():
    """Optional[float] parses as float, Optional[int] as int, bool as a switch: from the typing
    objects, not from how the annotation is spelled."""
    import typing
    from shmlearn.cli.main import _scalar_type
    assert _scalar_type(typing.Optional[float]) is float
    assert _scalar_type(typing.Optional[int]) is int
    assert _scalar_type(bool) is bool and _scalar_type(str) is str
    assert _scalar_type(typing.Optional[str]) is str
    from shmlearn.cli.main import build_parser
    ns = build_parser().parse_args(["train", "--momentum", "0.5", "--workers", "3", "--eval-every", "2"])
    assert (ns.momentum, ns.workers, ns.eval_every) == (0.5, 3, 2.0)
    assert isinstance(ns.eval_every, float) and isinstance(ns.workers, int)


@pytest.mark.parametrize("argv", [["train"], ["sweep"], ["advise"], ["simulate"], ["report"],
                                  ["bench", "throughput"], ["bench", "comm"], ["experiment"]])
def test_every_help_prints_and_keeps_a_percent_sign_as_written(argv, capsys):
    """A docstring with a bare % ('the first 20%') broke argparse's %-formatting of `train --help`."""
    from shmlearn.cli.main import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    if argv == ["train"]:
        assert "(0.2: the first 20%)" in " ".join(out.split())
