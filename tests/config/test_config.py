"""config.validate and TrainConfig.budget_samples: every numeric field has a finite, documented
range; a value outside it is one BadInput line naming the flag, the value and what is expected."""
import math
import sys

import pytest

from shmlearn.config.train_config import MAX_STEPS, TrainConfig, checkpoint_period, validate
from shmlearn.errors import BadInput
from shmlearn.sync import registry

# (field values, the start of the message: the flag and the value as the user wrote it)
BAD = [
    ({"samples": 10**30}, "--samples 1000000000000000000000000000000"),
    ({"samples": 0}, "--samples 0"),
    ({"lr": 1e308}, "--lr 1e+308"),
    ({"lr": math.inf}, "--lr inf"),
    ({"lr": math.nan}, "--lr nan"),
    ({"lr": 10**400}, "--lr 1000"),  # from YAML: an int too large for a float
    ({"weight_decay": math.inf}, "--weight-decay inf"),
    ({"weight_decay": -1e-3}, "--weight-decay -0.001"),
    ({"momentum": 1.0}, "--momentum 1.0"),
    ({"momentum": -math.inf}, "--momentum -inf"),
    ({"timeout": math.inf}, "--timeout inf"),
    ({"timeout": 1e-9}, "--timeout 1e-09"),
    ({"timeout": 1e7}, "--timeout 10000000.0"),
    ({"seed": 18446744073709551616}, "--seed 18446744073709551616"),
    ({"seed": 2**63}, "--seed 9223372036854775808"),
    ({"seed": -1}, "--seed -1"),
    ({"epochs": math.inf}, "--epochs inf"),
    ({"epochs": math.nan}, "--epochs nan"),
    ({"epochs": 1e13}, "--epochs 10000000000000.0"),
    ({"eval_every": math.inf}, "--eval-every inf"),
    ({"eval_points": 10**9}, "--eval-points 1000000000"),
    ({"log_every": 10**10}, "--log-every 10000000000"),
    ({"warmup": 10**10}, "--warmup 10000000000"),
    ({"warmup": -1}, "--warmup -1"),
    ({"check_every": 10**10}, "--check-every 10000000000"),
    ({"strategy": "weight-avg", "avg_period": 0}, "--avg-period 0"),
    ({"strategy": "weight-avg", "avg_period": 10**10}, "--avg-period 10000000000"),
    ({"batch_size": 10**13}, "--batch-size 10000000000000"),
    ({"threads": 100000}, "--threads 100000"),
    ({"threads": 0}, "--threads 0"),
    ({"workers": 0}, "--workers 0"),
    ({"checkpoint_every": "nans"}, "--checkpoint-every nans"),
    ({"checkpoint_every": "infs"}, "--checkpoint-every infs"),
    ({"checkpoint_every": "0s"}, "--checkpoint-every 0s"),
    ({"checkpoint_every": str(10**10)}, "--checkpoint-every 10000000000"),
    ({"init": "uniform:inf"}, "--init uniform:inf"),
    ({"init": "uniform:nan"}, "--init uniform:nan"),
]


@pytest.mark.parametrize("kw,flag", BAD, ids=[b[1] for b in BAD])
def test_an_extreme_value_is_one_line_naming_the_flag(kw, flag):
    with pytest.raises(BadInput) as e:
        validate(TrainConfig(**kw))
    msg = str(e.value)
    assert msg.startswith(flag) and "expected" in msg and "\n" not in msg, msg


GOOD = [
    {"lr": 10.0, "momentum": 0.0, "timeout": 1.0},
    {"lr": 1e-12, "weight_decay": 0.0, "timeout": 1e6, "momentum": 0.999},
    {"seed": 2**32 - 1, "threads": 4096, "workers": 1, "warmup": 0, "eval_points": 1, "log_every": 1},
    {"samples": 10**12, "check_every": 1},
    {"epochs": 1e-3, "eval_every": 1e-3},
    {"strategy": "weight-avg", "avg_period": 1000},
    {"checkpoint_every": "1"}, {"checkpoint_every": "0.5s"}, {"checkpoint_every": 200},
    {"init": "uniform:0.05"},
]


@pytest.mark.parametrize("kw", GOOD, ids=[str(g) for g in GOOD])
def test_sensible_edge_values_pass(kw):
    validate(TrainConfig(**kw))


def test_checkpoint_period_parses_steps_and_seconds():
    assert checkpoint_period("200") == (200, "steps")
    assert checkpoint_period("30s") == (30.0, "seconds")


# budget_samples runs on each rank once the worker count is known (train.py).
@pytest.mark.parametrize("kw,flag", [
    ({"epochs": 1e-9}, "--epochs 1e-09: "),                 # was reported as "--samples 0"
    ({"epochs": 0.01}, "--epochs 0.01: "),                  # 14 samples < one step of 64
    ({"samples": 63}, "--samples 63: "),
    ({"epochs": 1e12}, "--epochs 1000000000000.0: "),       # x 1437 samples: past 1e12 samples
    ({"samples": 10**12, "batch_size": 1}, "--samples 1000000000000: "),  # 5e11 steps
], ids=["epochs-1e-9", "epochs-0.01", "samples-63", "epochs-1e12", "samples-1e12-batch-1"])
def test_a_budget_out_of_range_names_the_flag_given(kw, flag):
    cfg = TrainConfig(workers=2, **kw)
    validate(cfg)
    with pytest.raises(BadInput) as e:
        cfg.budget_samples(1437)
    assert str(e.value).startswith(flag), e.value


def test_budgets_in_range_are_exact():
    assert TrainConfig(workers=2, epochs=2).budget_samples(1437) == 2874
    assert TrainConfig(workers=2, samples=64).budget_samples(1437) == 64
    assert TrainConfig(workers=1, batch_size=1, samples=MAX_STEPS).budget_samples(10) == MAX_STEPS
    assert TrainConfig(workers=2, dataset="digits").budget_samples(1437) == 20 * 1437


def _main(argv, capfd, monkeypatch):
    """(exit code, stderr) of the CLI's main() in this process: a refusal of a fresh interpreter
    was ~3-6 s of two cores here (tests/cli/test_cli.py runs the program itself to its exit 2). capfd:
    a refusal found in the workers main() spawns is on their stderr too, as it was the program's."""
    from shmlearn.cli.main import main
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capfd.readouterr().err


@pytest.mark.parametrize("args,needle", [(["--lr", "inf"], "--lr inf: "),
                                         (["--epochs", "1e-9"], "--epochs 1e-09: ")])
def test_cli_refuses_with_exit_2_and_one_line(tmp_path, capfd, monkeypatch, args, needle):
    code, err = _main(["train", *args, "--workers", "2", "--no-progress", "--out", str(tmp_path / "run")],
                      capfd, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize("content,needle", [
    (open(sys.executable, "rb").read(3000), "not UTF-8 text"),    # a binary: was a traceback, exit 1
    (b"\xff\xfelr: 0.1\n", "not UTF-8 text"),
    (b"1: 2\n", "expected a mapping of flag names to values"),  # a key that is no flag name
], ids=["binary", "utf16-bom", "int-key"])
def test_a_config_file_that_is_not_yaml_text_is_one_line(tmp_path, content, needle):
    from shmlearn.config.train_config import load_yaml
    path = tmp_path / "b.yaml"
    path.write_bytes(content)
    with pytest.raises(BadInput) as e:
        load_yaml(str(path))
    assert str(e.value).startswith(f"--config {path}: ") and needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_cli_refuses_a_binary_config_with_exit_2_and_one_line(tmp_path, capfd, monkeypatch, command):
    path = tmp_path / "b.yaml"
    path.write_bytes(open(sys.executable, "rb").read(3000))
    code, err = _main([command, "--config", str(path), "--out", str(tmp_path / "run")], capfd, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"--config {path}: not UTF-8" in lines[0], err


def test_a_budget_of_one_worker_says_worker_not_workers():
    with pytest.raises(BadInput, match="smaller than one step of 1 worker x 32 samples"):
        TrainConfig(workers=1, samples=16).budget_samples(1437)  # said "1 workers"
    with pytest.raises(BadInput, match="steps of 1 worker x 1 samples; expected at most"):
        TrainConfig(workers=1, batch_size=1, samples=10**12).budget_samples(1437)


def test_backend_is_checked_once_with_the_flag_named():
    from shmlearn.config.train_config import TrainConfig, validate
    from shmlearn.errors import BadInput
    validate(TrainConfig(backend="gloo", device="cpu"))
    with pytest.raises(BadInput, match=r"^--backend mpi: choose one of auto, nccl, gloo$"):
        validate(TrainConfig(backend="mpi"))
    with pytest.raises(BadInput, match=r"^--backend nccl: needs --device cuda"):
        validate(TrainConfig(backend="nccl", device="cpu"))


def test_a_literal_field_gives_validate_and_its_flag_the_same_choices():
    """A field typed Literal[...] names its choices once: its section checks them when a config
    is made (before validate) and the train flag offers them to argparse (whose refusal is the
    same one line)."""
    import typing
    from shmlearn.cli.main import build_parser
    from shmlearn.config.train_config import options
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    actions = {a.dest: a for a in train._actions}
    hints = typing.get_type_hints(TrainConfig)
    chosen = {name: o.choices for name, o in options().items() if o.choices is not None}
    assert {"device", "backend", "precision", "compile", "loader", "lr_schedule", "image_conv", "conv_pool",
            "mlp_head", "conv_overlap", "max_pool", "combo_kernels", "update_in_backward", "weight_copy",
            "cuda_graph", "cudnn_benchmark", "eval_at_start", "scheduler_interval", "task"} <= set(chosen)
    assert chosen["device"] == typing.get_args(hints["device"]) == ("cpu", "cuda", "auto")
    for name, choices in chosen.items():
        assert tuple(actions[name].choices) == choices, name
        with pytest.raises(BadInput, match=f"^--{name.replace('_', '-')} nope: choose "):
            validate(TrainConfig(**{name: "nope"}))  # a section's field refused when made; --strategy by validate
        validate(TrainConfig(**{name: choices[-1]}, **({"dataset": "tmp/own.py:load"} if name == "task" else {})))


def test_cli_refuses_a_value_outside_a_literal_as_validate_does(tmp_path, capfd, monkeypatch):
    code, err = _main(["train", "--device", "gpu", "--out", str(tmp_path / "run")], capfd, monkeypatch)
    assert code == 2 and err.strip() == "shmlearn: error: --device gpu: choose one of cpu, cuda, auto", err


def test_strategy_parameters_read_and_set_as_attributes_and_keep_their_yaml_keys(tmp_path):
    """config.yaml of a run before the strategies owned their parameters still loads: the keys
    are the same, beside `strategy`."""
    from shmlearn.config.train_config import load_yaml, save_yaml
    cfg = TrainConfig(strategy="weight-avg", avg_period=4)
    assert (cfg.avg_period, cfg.staleness, cfg.ps_dedicated) == (4, 0, False)
    cfg.avg_period = 6
    assert registry.spec(cfg).params.period == 6 and cfg == TrainConfig(strategy="weight-avg", avg_period=6)
    save_yaml(cfg, str(tmp_path / "config.yaml"))
    saved = load_yaml(str(tmp_path / "config.yaml"))
    keys = list(saved)
    assert {"avg_period", "ps_dedicated", "staleness"} <= set(keys) and saved["avg_period"] == 6
    assert keys.index("strategy") < keys.index("avg_period") < keys.index("batch_size")
    assert TrainConfig.from_dict(saved) == cfg
    assert TrainConfig(strategy="ps", ps_dedicated=False) == TrainConfig(strategy="ps")  # a default is no setting
    with pytest.raises(TypeError):
        TrainConfig(no_such_field=1)
