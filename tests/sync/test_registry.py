"""The strategy registry (issue 17): every strategy describes itself in its own file, runs record
their parameters in summary.json (`strategy_params`), and a strategy's own flag given to another
strategy is one line, exit 2."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from shmlearn.cli.main import field_docs
from shmlearn.config.train_config import TrainConfig, options, validate
from shmlearn.errors import BadInput
from shmlearn.sync import AllReduce, WeightAveraging, build_strategy, registry

STRATEGY_PARAMS = {  # (config fields, the strategy_params summary.json records)
    "allreduce": ({}, {}),
    "ps": ({}, {"dedicated": False}),
    "weight-avg": ({"avg_period": 4}, {"period": 4}),
    "ddp": ({}, {}),
    "async-ps": ({"staleness": 1}, {"staleness": 1, "staleness_lr": 2.0}),
}


def test_every_strategy_registers_in_its_own_file_with_documented_typed_parameters():
    entries = registry.entries()
    assert list(entries) == ["allreduce", "ps", "weight-avg", "ddp", "async-ps"]
    config_fields = options()  # TrainConfig's keys: its fields and the strategies' parameters
    for name, e in entries.items():
        assert e.cls.name == name
        module = sys.modules[e.cls.__module__]
        assert module.ENTRY is e, f"{name}: registered outside {module.__file__}"
        docs = field_docs(e.params) if dataclasses.fields(e.params) else {}
        for f in dataclasses.fields(e.params):
            assert docs.get(f.name), f"{name}: parameter {f.name} has no docstring"
            c = config_fields[f.metadata["config"]]  # a TrainConfig field (a CLI flag) sets it
            assert c.default == f.default and type(f.default).__name__ in str(c.type)
    assert {n for n, e in entries.items() if e.fast_step} == {"allreduce", "ps", "weight-avg", "async-ps"}
    assert [n for n, e in entries.items() if e.rounds] == ["weight-avg"]


def test_layout_processes_compute_ranks_and_shards():
    plain = registry.spec(TrainConfig(strategy="ps"))
    assert (plain.processes(3), plain.compute_ranks(3), [plain.shard(r) for r in range(3)]) == (3, 3, [0, 1, 2])
    ded = registry.spec(TrainConfig(strategy="ps", ps_dedicated=True))
    assert (ded.processes(3), ded.compute_ranks(4), [ded.shard(r) for r in range(4)]) == (4, 3, [None, 0, 1, 2])
    assert ded.flags() == "--strategy ps --ps-dedicated"
    wa = registry.spec(TrainConfig(strategy="weight-avg", avg_period=3))
    assert (wa.processes(2), wa.period(), wa.flags()) == (2, 3, "--strategy weight-avg --avg-period 3")
    assert registry.spec(TrainConfig()).name == registry.DEFAULT == TrainConfig().strategy


@pytest.mark.parametrize("kw,message", [
    ({"strategy": "allreduce", "avg_period": 2}, "--avg-period 2: only for --strategy weight-avg, not allreduce"),
    ({"strategy": "ddp", "ps_dedicated": True}, "--ps-dedicated: only for --strategy ps, not ddp"),
    ({"strategy": "ps", "avg_period": 3}, "--avg-period 3: only for --strategy weight-avg, not ps"),
    ({"strategy": "weight-avg", "ps_dedicated": True}, "--ps-dedicated: only for --strategy ps, not weight-avg"),
    ({"strategy": "allreduce", "staleness": 2}, "--staleness 2: only for --strategy async-ps, not allreduce"),
    ({"strategy": "gossip"}, "--strategy gossip: choose one of allreduce, ps, weight-avg, ddp, async-ps"),
])
def test_another_strategys_flag_is_refused_naming_the_flag_and_its_strategies(kw, message):
    with pytest.raises(BadInput) as e:
        validate(TrainConfig(**kw))
    assert str(e.value) == message


def test_build_strategy_takes_config_fields_and_ignores_other_strategies():
    s = build_strategy("weight-avg", rank=0, world_size=2, avg_period=3, ps_dedicated=False)
    assert isinstance(s, WeightAveraging) and s.period == 3
    assert isinstance(build_strategy("allreduce", rank=0, world_size=2, avg_period=8), AllReduce)
    assert build_strategy("ps", rank=1, world_size=3, ps_dedicated=True).compute_ranks == 2


def test_round_kinds_are_the_graphs_the_fast_step_captures():
    assert AllReduce(rank=0, world_size=2).round_kinds() == [False]
    assert WeightAveraging(rank=0, world_size=2, period=1).round_kinds() == [True]
    assert WeightAveraging(rank=0, world_size=2, period=3).round_kinds() == [False, True]
    assert WeightAveraging(rank=0, world_size=1, period=3).round_kinds() == [False]


def _shmlearn(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "shmlearn", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("args,flag,takers", [
    (["--strategy", "allreduce", "--avg-period", "2"], "--avg-period 2", "--strategy weight-avg"),
    (["--strategy", "weight-avg", "--ps-dedicated"], "--ps-dedicated", "--strategy ps"),
    (["--strategy", "allreduce", "--staleness", "2"], "--staleness 2", "--strategy async-ps"),
])
def test_cli_another_strategys_flag_exits_2_with_one_line(tmp_path, capfd, monkeypatch, args, flag, takers):
    """The CLI's main() in this process, fd 2 read (a fresh interpreter apiece was ~3 s of two
    cores here for a refusal made before any worker starts)."""
    from shmlearn.cli.main import main
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    try:
        code = main(["train", *args, "--out", str(tmp_path / "run"), "--no-progress"])
    except SystemExit as e:
        code = e.code
    r = subprocess.CompletedProcess([], code, *capfd.readouterr())
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert flag in lines[0] and takers in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.fixture(scope="module")
def pool():
    """The runs below that take two processes (async-ps, a dedicated server) share one pool: a
    fresh train() spawns and imports both for a run of a few steps."""
    from shmlearn.launch.pool import Pool
    with Pool(2) as p:
        yield p


@pytest.mark.parametrize("strategy", list(STRATEGY_PARAMS))
def test_summary_records_strategy_params(tmp_path, pool, strategy):
    import shmlearn
    from shmlearn.launch.pool import using
    config, params = STRATEGY_PARAMS[strategy]
    with using(pool):
        res = shmlearn.train(TrainConfig(strategy=strategy, workers=1, threads=1, samples=256, eval_points=1,
                                         progress=False, out=str(tmp_path / "run"), **config))
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert res.summary["strategy_params"] == on_disk["strategy_params"] == params


def test_summary_records_a_dedicated_server(tmp_path, pool):
    import shmlearn
    from shmlearn.launch.pool import using
    with using(pool):
        res = shmlearn.train(TrainConfig(strategy="ps", ps_dedicated=True, workers=1, threads=1, samples=256,
                                         eval_points=1, progress=False, out=str(tmp_path / "run")))
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["strategy_params"] == {"dedicated": True} and (s["workers"], s["processes"]) == (1, 2)
    assert res.summary["strategy_params"] == {"dedicated": True}
