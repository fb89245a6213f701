"""train/entry.py: the run's workers are resolved once and each check runs once (issue 54). train()
validates and settles the config (`settle`), and the ranks it starts are told so (settled=True)
and check nothing again; a rank given an unsettled config (a sweep's trial, a direct call)
validates and settles it itself, and refuses a layout its processes cannot hold in one line."""
import pytest
import torch

from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput
from shmlearn.launch.start import DistEnv, free_port
from shmlearn.sync import registry
from shmlearn.train import early, entry, noise

TINY = dict(model="mlp", dataset="digits", device="cpu", samples=64 * 4, batch_size=64, eval_points=1,
            progress=False)


def _local(world: int = 1, rank: int = 0, launcher: str = "local") -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, launcher=launcher,
                   master_port=free_port())


@pytest.fixture
def calls(monkeypatch):
    """How often each check ran: config.validate (as entry calls it) and noise.check."""
    seen = {"validate": 0, "noise": 0}
    validate, check = entry.validate, noise.check

    def counted_validate(cfg):
        seen["validate"] += 1
        return validate(cfg)

    def counted_check(cfg, spec, workers):
        seen["noise"] += 1
        return check(cfg, spec, workers)
    monkeypatch.setattr(entry, "validate", counted_validate)
    monkeypatch.setattr(noise, "check", counted_check)
    return seen


def test_settle_resolves_the_workers_locally_and_from_the_processes_started():
    spec = registry.spec(TrainConfig(strategy="ps", ps_dedicated=True))
    assert entry.settle(TrainConfig(workers=3), registry.spec(TrainConfig())).workers == 3
    assert entry.settle(TrainConfig(device="cpu"), registry.spec(TrainConfig())).workers == 2  # the CPU default
    # a dedicated server takes one of the processes a launcher started
    assert entry.settle(TrainConfig(strategy="ps", ps_dedicated=True), spec, processes=4).workers == 3
    with pytest.raises(BadInput, match=r"^--workers 4: the launcher started 4 processes \(3 workers \+ 1 server\); "
                                       r"drop --workers or match it$"):
        entry.settle(TrainConfig(strategy="ps", ps_dedicated=True, workers=4), spec, processes=4)
    with pytest.raises(BadInput, match=r"needs at least 2 processes \(1 server \+ 1 worker\)$"):
        entry.settle(TrainConfig(strategy="ps", ps_dedicated=True), spec, processes=1)


def test_settle_checks_the_noise_scale_of_the_layout_it_resolved():
    cfg = TrainConfig(strategy="weight-avg", noise_scale=True)
    spec = registry.spec(cfg)
    with pytest.raises(BadInput, match=r"^--noise-scale: --strategy weight-avg has no averaged gradient to "
                                       r"measure at 2 workers"):
        entry.settle(cfg, spec, processes=2)
    assert entry.settle(cfg, spec, processes=1).workers == 1  # one worker: its half batches are measured


def test_a_one_worker_run_checks_its_config_once(tmp_path, calls):
    res = entry.train(TrainConfig(**TINY, workers=1, out=str(tmp_path / "run")))
    assert res.status == "completed" and res.summary["workers"] == 1
    assert calls == {"validate": 1, "noise": 1}  # before issue 54: 2 and 2 (train(), then the rank)


def test_a_pool_run_settles_once_and_tells_its_ranks(tmp_path, calls, monkeypatch):
    sent = {}

    def fake_local(fn, args, world, *, cuda, timeout_s, backend=None, **kw):
        sent.update(fn=fn, args=args, world=world, kw=kw)
        return [({"status": "completed"}, args[0]["out"], None)]
    monkeypatch.setattr(entry, "run_local", fake_local)
    entry.train(TrainConfig(**TINY, out=str(tmp_path / "run")))
    assert calls == {"validate": 1, "noise": 1}
    cfg_dict, prune_key, want_model, parts, settled = sent["args"]
    assert sent["fn"] is entry.rank_main and sent["world"] == 2 and cfg_dict["workers"] == 2 and settled is True
    # the ranks set their threads as limits.rank_threads does: the pool may fork them from here
    # and each rank starts its data read (and the compiler's imports) beside its group's join; it
    # compiles nothing and runs none of the user's code: a lean pool (its workers skip Dynamo)
    assert sent["kw"] == {"threads": TINY.get("threads"), "rank_threads": True,
                          "early": (early.start, (cfg_dict,)), "lean": True}
    # the user's own model (or any part, or compiling) makes a pool whose workers import Dynamo
    entry.train(TrainConfig(**TINY, out=str(tmp_path / "own")), model=torch.nn.Linear(64, 10))
    assert sent["kw"]["lean"] is False and sent["kw"]["early"] is None
    entry.train(TrainConfig(**TINY, compile="default", out=str(tmp_path / "compiled")))
    assert sent["kw"]["lean"] is False


def test_under_a_launcher_train_checks_once_and_its_rank_not_again(tmp_path, calls, monkeypatch):
    got = {}

    def fake_worker(cfg, env, *, parts=None, settled=False):
        got.update(workers=cfg.workers, settled=settled)
        return entry.RunResult(status="completed", run_dir=None, summary={})
    monkeypatch.setattr(entry, "detect_env", lambda: _local(world=3, launcher="torchrun"))
    monkeypatch.setattr(entry, "run_worker", fake_worker)
    entry.train(TrainConfig(**TINY, out=str(tmp_path / "run")))
    assert got == {"workers": 3, "settled": True} and calls == {"validate": 1, "noise": 1}


def test_a_settled_rank_checks_nothing_and_an_unsettled_one_once(tmp_path, calls):
    settled = entry.settle(TrainConfig(**TINY, out=str(tmp_path / "a")), registry.spec(TrainConfig()), processes=1)
    calls.update(validate=0, noise=0)
    res = entry.rank_main(_local(), settled.to_dict(), None, True, None, True)
    assert res[0]["status"] == "completed" and calls == {"validate": 0, "noise": 0}
    res = entry.rank_main(_local(), TrainConfig(**TINY, out=str(tmp_path / "b")).to_dict())  # a sweep's trial
    assert res[0]["status"] == "completed" and res[0]["workers"] == 1 and calls == {"validate": 1, "noise": 1}


def test_an_unsettled_rank_refuses_a_layout_its_processes_cannot_hold(tmp_path):
    with pytest.raises(BadInput, match=r"^--workers 2: the launcher started 1 processes \(1 worker\); "
                                       r"drop --workers or match it$"):
        entry.run_worker(TrainConfig(**TINY, workers=2, out=str(tmp_path / "run")), _local())
    assert not (tmp_path / "run").exists()  # refused before the rank built or wrote anything
    assert torch.distributed.is_initialized() is False
