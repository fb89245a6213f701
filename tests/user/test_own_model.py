"""shmlearn.train(cfg, model=, data=, loss=) and --model/--dataset FILE.py:NAME, end to end (issue 16).

References, not shapes: a module passed in trains to the same weights, bit for bit on the CPU, as the
same architecture registered by name, for every strategy on 2 real Gloo workers; RunResult.model
scores the run's own test accuracy and loss; every bad input is one line naming the argument
(BadInput from Python, exit 2 from the CLI, no traceback from inside a worker).

What is passed in crosses to spawned pool workers pickled, by reference: the classes and builders
below live at the top level of this module, which the workers import by name (`test_own_model`,
from the tests folder pytest puts on sys.path; spawned workers inherit sys.path).
"""
import contextlib
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shmlearn
from shmlearn.config.train_config import TrainConfig
from shmlearn.data import load_dataset
from shmlearn.errors import BadInput
from shmlearn.models import build_model
from shmlearn.launch.pool import Pool, current, using
from shmlearn.record.runs import default_run_dir
from shmlearn.launch.placement import default_workers

train_mod = importlib.import_module("shmlearn.train.entry")  # the module: `shmlearn.train` is also the function

SPEC = load_dataset("digits").spec


# --- what a user passes in (top level: pool workers unpickle these by reference) -------------------

def mlp_builder(spec):
    """The registry's mlp, built by the user's own callable."""
    return build_model("mlp", spec)


def raising_builder(spec):
    raise RuntimeError("out of ideas")


def wide_builder(spec):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, spec.num_outputs + 1))


class HoldsLambda(nn.Module):
    """Fine in one process; a lambda cannot be pickled to a worker."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.act = lambda x: x.flatten(1)

    def forward(self, x):
        return self.fc(self.act(x))


def mean_cross_entropy(out, y):
    """A loss of the user's own (here the task's default, so the run must still score as evaluated)."""
    return F.cross_entropy(out, y)


def mean_mse(out, y):
    return F.mse_loss(out, y)


def _cfg(out, **kw) -> TrainConfig:
    # threads=1: a 1-worker run (in this process) defaults to every core, and a second intra-op
    # thread on batches of 32 only waits on the first (30 steps took ~45 s on the loaded 2-core box)
    base = dict(model="mlp", dataset="digits", device="cpu", samples=2048, batch_size=32, lr=0.05,
                eval_points=1, progress=False, threads=1, out=str(out))
    base.update(kw)
    return TrainConfig(**base)


def _one_line(e) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def pool():
    """One pool of Gloo workers for the module's 2-worker runs (it grows to 3 for ps_dedicated),
    used where a test says `with using(pool)`: saves a spawn and torch import per run on a small
    shared machine. Other tests run as a script would: train() spawns its own, or none."""
    with Pool(2) as p:
        yield p


# --- 1. a module passed in == the same architecture by name, every strategy -----------------------

STRATEGIES = [  # on CPU every one but ddp takes the fast step (check_every 10); ddp the classic one
    ("allreduce", {}),
    ("ps", {}),
    ("ps", {"ps_dedicated": True}),
    ("weight-avg", {"avg_period": 3}),
    ("ddp", {}),
]


@pytest.mark.parametrize("strategy,extra", STRATEGIES, ids=["allreduce", "ps", "ps-dedicated", "weight-avg", "ddp"])
def test_a_module_or_builder_passed_in_trains_as_the_registered_model(tmp_path, pool, strategy, extra):
    cfg = _cfg(tmp_path / "name", workers=2, strategy=strategy, **extra)
    torch.manual_seed(cfg.seed)
    module = build_model("mlp", SPEC)  # exactly what the registry builds for this seed
    start = {k: v.clone() for k, v in module.state_dict().items()}
    with using(pool):
        by_name = shmlearn.train(cfg)
        passed = shmlearn.train(dataclasses.replace(cfg, out=str(tmp_path / "module")), model=module)
        built = shmlearn.train(dataclasses.replace(cfg, out=str(tmp_path / "builder")), model=mlp_builder)
    ref = by_name.model.state_dict()
    assert by_name.status == passed.status == built.status == "completed"
    for k in ref:
        assert not torch.equal(ref[k], start[k]), f"{k}: training did not move it; the test would prove nothing"
        assert torch.equal(passed.model.state_dict()[k], ref[k]), f"{strategy}: module passed in: {k} differs"
        assert torch.equal(built.model.state_dict()[k], ref[k]), f"{strategy}: builder: {k} differs"
        assert torch.equal(module.state_dict()[k], start[k]), "the caller's module was trained in place"
    assert passed.summary["final_loss"] == by_name.summary["final_loss"]
    assert passed.summary["model"] == "python:Sequential instance"
    assert built.summary["model"] == "test_own_model:mlp_builder"
    assert passed.summary["processes"] == 2 + int(extra.get("ps_dedicated", False))
    mode = "classic" if strategy == "ddp" else "fast-eager"
    assert passed.summary["step_mode"] == by_name.summary["step_mode"] == mode


# --- 2. RunResult.model is the model the run evaluated ---------------------------------------------

def _digits_arrays():
    """digits as the user's own float arrays, standardized by the user (values are used as given)."""
    d = load_dataset("digits")
    mean, std = d.train_x.float().mean(), d.train_x.float().std()
    return ((d.train_x.float() - mean) / std).numpy(), d.train_y.numpy(), \
        ((d.test_x.float() - mean) / std).numpy(), d.test_y.numpy()


def _scores(model, test_x, test_y):
    model.eval()
    with torch.no_grad():
        out = model(torch.as_tensor(test_x))
    y = torch.as_tensor(test_y)
    return int((out.argmax(1) == y).sum()), F.cross_entropy(out, y).item()


@pytest.mark.parametrize("workers,extra,loss,shared", [
    (1, {}, None, False),
    (2, {}, mean_cross_entropy, False),                              # the user's loss crosses to the workers too
    (2, {"strategy": "allreduce", "check_every": 1}, None, True),  # the classic step (the CPU default is the fast one)
    (2, {"strategy": "weight-avg", "avg_period": 4}, None, True),  # 30 steps: ends between rounds, finish() averages
    (2, {"strategy": "ps", "ps_dedicated": True}, None, True),     # rank 0 only serves: its weights are the result
], ids=["1-worker-in-process", "2-workers", "2-workers-classic-step", "weight-avg", "ps-dedicated"])
def test_the_returned_model_scores_the_runs_own_test_accuracy(tmp_path, request, workers, extra, loss, shared):
    """1 worker: in this process; "2-workers": on a pool that train() spawns, as a script's run;
    the other strategies on the module's pool (a pool of their own each was a spawn and a torch
    import per run, and the model comes back over the pool's pipe either way)."""
    assert current() is None
    data = _digits_arrays()
    cfg = _cfg(tmp_path / "run", workers=workers, samples=30 * 2 * 32, **extra)
    with using(request.getfixturevalue("pool")) if shared else contextlib.nullcontext():
        r = shmlearn.train(cfg, model=mlp_builder, data=data, loss=loss)
    assert r.status == "completed" and r.summary["steps"] == 30 * 2 // workers
    assert r.summary["dataset"] == "python:ndarray arrays"
    assert not any(t.is_cuda for t in r.model.state_dict().values())
    n_correct, test_loss = _scores(r.model, data[2], data[3])
    n = len(data[3])
    # the run evaluated in slices of its own; a near-tie may fall the other way in the last bit
    assert abs(n_correct - r.summary["test_accuracy"] * n) < 1.5, (n_correct, r.summary["test_accuracy"] * n)
    assert test_loss == pytest.approx(r.summary["test_loss"], rel=1e-5, abs=1e-6)
    assert r.summary["test_accuracy"] > 0.8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_one_worker_returns_the_model_on_the_cpu(tmp_path):
    """One worker runs in this process: the model comes back on the CPU, as it does from a pool
    worker (it was the run's module on the GPU)."""
    data = _digits_arrays()
    r = shmlearn.train(_cfg(tmp_path / "run", device="cuda", workers=1, samples=30 * 64), model=mlp_builder, data=data)
    assert all(t.device.type == "cpu" for t in r.model.state_dict().values())
    n_correct, loss = _scores(r.model, data[2], data[3])
    assert abs(n_correct - r.summary["test_accuracy"] * len(data[3])) < 1.5
    assert loss == pytest.approx(r.summary["test_loss"], rel=1e-3)


def test_arrays_are_used_as_given_end_to_end(tmp_path):
    """Regression on raw features far from 0 (mean ~5, std ~3): the returned model, fed the raw
    test arrays, gives the run's test loss, so the run fed it the same raw values."""
    rng = np.random.default_rng(0)
    x = rng.normal(5.0, 3.0, size=(1200, 4)).astype(np.float32)
    y = (x @ np.array([0.5, -1.0, 0.25, 2.0], np.float32) + 3.0).astype(np.float32)
    data = (x[:1000], y[:1000], x[1000:], y[1000:])
    r = shmlearn.train(_cfg(tmp_path / "run", model="linreg", workers=1, lr=0.002, lr_schedule="constant",
                            samples=4000, optimizer="sgd"), data=data, loss=mean_mse)
    assert r.summary["test_accuracy"] is None  # float labels: regression
    with torch.no_grad():
        pred = r.model(torch.as_tensor(data[2]))
    assert pred.shape == (200, 1)
    want = F.mse_loss(pred, torch.as_tensor(data[3]).reshape(-1, 1)).item()
    assert want == pytest.approx(r.summary["test_loss"], rel=1e-5)
    assert want < 0.1 * float(np.var(data[3]))  # it learned: a standardized run would not map raw inputs


# --- 5. bad input: one line naming the argument ----------------------------------------------------

def test_an_unpicklable_module_is_one_line_before_any_worker_starts(tmp_path):
    with pytest.raises(BadInput) as e:
        shmlearn.train(_cfg(tmp_path / "a", workers=2), model=HoldsLambda())
    msg = _one_line(e)
    assert msg.startswith("model=: cannot be sent to the worker processes") and "top level" in msg

    class Local(nn.Module):  # defined inside a function: workers cannot import it
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            return self.fc(x.flatten(1))
    with pytest.raises(BadInput) as e:
        shmlearn.train(_cfg(tmp_path / "b", workers=2), model=Local())
    assert _one_line(e).startswith("model=: cannot be sent to the worker processes")
    with pytest.raises(BadInput) as e:
        shmlearn.train(_cfg(tmp_path / "c", workers=2), loss=lambda out, y: F.cross_entropy(out, y))
    assert _one_line(e).startswith("loss=: cannot be sent to the worker processes")
    assert not (tmp_path / "a" / "summary.json").exists()
    # one worker trains in this process: nothing is pickled, so the same module runs
    r = shmlearn.train(_cfg(tmp_path / "d", workers=1, samples=256), model=HoldsLambda())
    assert r.status == "completed"


@pytest.mark.parametrize("kw,want", [
    ({"model": raising_builder}, "model=: raising_builder() raised RuntimeError: out of ideas"),
    ({"model": wide_builder}, "model=: outputs have shape (2, 11) for 2 samples, but the data has 10 classes: "
                              "expected (2, 10)"),
    ({"data": "mismatched lengths"}, "data=: train_x has 1437 samples but train_y has 1436"),
    ({"data": "mismatched dtypes"}, "data=: train_y is int64 but test_y is float32; give labels of one kind "
                                    "(integers: classes, floats: targets)"),
    ({"data": "negative labels"}, "data=: train_y holds label -1 at row "),
    ({"data": "fractional labels", "task": "classification"},
     "data=: train_y holds non-integer labels ("),
], ids=["model-raises", "model-width", "lengths", "dtypes", "negative-labels", "fractional-labels"])
def test_bad_input_found_in_the_workers_is_one_line(tmp_path, pool, kw, want):
    """These are found inside the 2 workers (each builds the model and reads the data); the
    answer is the one line, not a worker's traceback or a 'rank N:' wrapper."""
    kw = dict(kw)
    task = kw.pop("task", None)
    if "data" in kw:
        trx, tr_y, tex, te_y = _digits_arrays()
        kw["data"] = {"mismatched lengths": (trx, tr_y[:-1], tex, te_y),
                      "mismatched dtypes": (trx, tr_y, tex, te_y.astype(np.float32)),
                      "negative labels": (trx, tr_y - 1, tex, te_y),
                      "fractional labels": (trx, tr_y + 0.5, tex, te_y.astype(np.float64))}[kw["data"]]
    with pytest.raises(BadInput) as e, using(pool):
        shmlearn.train(_cfg(tmp_path / "run", workers=2, task=task), **kw)
    assert _one_line(e).startswith(want) if want.endswith((" row ", " (")) else _one_line(e) == want, _one_line(e)
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("kw,start", [
    ({"task": "regression"}, "--task regression: only for your own data (data= or --dataset FILE.py:NAME); "
                             "digits knows its task"),
    ({"loader": "disk"}, "--loader disk: choose one of auto, resident, stream"),
    ({"model": "nothere.py:Net"}, "--model nothere.py:Net: file nothere.py does not exist"),
    ({"dataset": "no_such_pkg_shmlearn.data:load"}, "--dataset no_such_pkg_shmlearn.data:load: no module named "
                                                   "'no_such_pkg_shmlearn'"),
], ids=["task-with-builtin", "loader", "missing-file", "missing-package"])
def test_bad_config_is_one_line_before_any_worker_starts(tmp_path, kw, start):
    with pytest.raises(BadInput) as e:
        shmlearn.train(_cfg(tmp_path / "run", workers=2, **kw))
    assert _one_line(e).startswith(start), str(e.value)
    assert not (tmp_path / "run").exists()  # refused before --out was made


# --- the CLI: FILE.py:NAME ---------------------------------------------------------------------------

OWN_PY = """
    import numpy as np
    from torch import nn


    class Net(nn.Module):
        def __init__(self, spec):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(spec.input_shape)), 32), nn.ReLU(),
                                      nn.Linear(32, spec.num_outputs))

        def forward(self, x):
            return self.body(x)


    class Wide(Net):
        def __init__(self, spec):
            super().__init__(spec)
            self.body[-1] = nn.Linear(32, spec.num_outputs + 2)


    def broken(spec):
        raise RuntimeError("no weights here")


    def load():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(1200, 8)).astype(np.float32)
        y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + 2 * (x[:, 2] > 0)
        return x[:1000], y[:1000], x[1000:], y[1000:]


    def short_labels():
        x, y, tx, ty = load()
        return x, y[:-3], tx, ty
    """


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _shmlearn(cwd, *args, timeout=300):
    """`python -m shmlearn ...` run in `cwd` (where the user's files are); this checkout's shmlearn
    is found whether or not it is installed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "shmlearn", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.fixture
def own(tmp_path):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "own.py").write_text(textwrap.dedent(OWN_PY))
    return tmp_path


def test_cli_trains_a_model_and_data_named_by_file(own):
    r = _shmlearn(own, "train", "--model", "tmp/own.py:Net", "--dataset", "tmp/own.py:load",
                  "--samples", "4096", "--device", "cpu", "--no-progress")
    assert r.returncode == 0, r.stderr
    runs = os.listdir(own / "runs")
    assert len(runs) == 1, runs  # one folder: the reference's slashes do not nest folders
    run = own / "runs" / runs[0]
    assert runs[0].endswith("-Net-load-allreduce-w2"), runs[0]
    with open(run / "summary.json") as f:
        s = json.load(f)
    assert (s["status"], s["model"], s["dataset"], s["workers"], s["data_path"]) == \
        ("completed", "tmp/own.py:Net", "tmp/own.py:load", 2, "resident")
    assert s["test_accuracy"] > 0.7  # 4 classes, linearly separable
    config = (run / "config.yaml").read_text()
    assert "tmp/own.py:Net" in config and "tmp/own.py:load" in config


@pytest.mark.parametrize("args,line", [
    (["--model", "tmp/nothere.py:Net"], "--model tmp/nothere.py:Net: file tmp/nothere.py does not exist"),
    (["--model", "tmp/own.py:Model"], "--model tmp/own.py:Model: tmp/own.py has no 'Model' "
                                      "(it has Net, Wide, broken, load, short_labels)"),
    (["--model", "no_such_pkg_shmlearn.nets:Net"], "--model no_such_pkg_shmlearn.nets:Net: no module named "
                                                   "'no_such_pkg_shmlearn' (a file needs the .py suffix: "
                                                   "path/to/file.py:NAME)"),
    (["--model", "tmp/own.py:broken"], "--model tmp/own.py:broken: broken() raised RuntimeError: no weights here"),
    (["--model", "tmp/own.py:Wide", "--dataset", "tmp/own.py:load"],
     "--model tmp/own.py:Wide: outputs have shape (2, 6) for 2 samples, but the data has 4 classes: expected (2, 4)"),
    (["--dataset", "tmp/own.py:short_labels"], "--dataset tmp/own.py:short_labels: train_x has 1000 samples but "
                                               "train_y has 997"),
    (["--task", "regression"], "--task regression: only for your own data"),
    (["--loader", "disk"], "--loader disk: choose one of auto, resident, stream"),
], ids=["missing-file", "missing-name", "missing-package", "model-raises", "model-width", "lengths", "task", "loader"])
def test_cli_bad_input_is_exit_2_and_one_line(own, monkeypatch, capfd, args, line):
    """The CLI's main() in this process, run in the user's folder (eight fresh interpreters took
    ~25 s of two cores; test_cli_trains_a_model_and_data_named_by_file runs the program itself).
    capfd, not capsys: the three refusals found inside the 2 workers that train() spawns must
    leave no traceback on the workers' stderr either, which the test process's fd 2 carries."""
    from shmlearn.cli.main import main
    monkeypatch.chdir(own)
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    try:
        code = main(["train", *args, "--samples", "1024", "--device", "cpu", "--no-progress", "--out", "run"])
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    assert code == 2, (code, err)
    assert "Traceback" not in err + out, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"shmlearn: error: {line}"), lines[0]
    assert not (own / "run" / "summary.json").exists()


# --- 6. the default worker count fits the GPUs present ----------------------------------------------

@pytest.mark.parametrize("cuda,gpus,dedicated,want", [
    (False, 0, False, 2), (False, 0, True, 2),
    (True, 1, False, 1), (True, 1, True, 1), (True, 2, False, 2), (True, 2, True, 1),
    (True, 4, False, 2), (True, 4, True, 2), (True, 8, False, 2),
])
def test_default_workers(cuda, gpus, dedicated, want):
    assert default_workers(cuda, gpus, dedicated) == want


@pytest.mark.parametrize("gpus,world", [(1, 1), (4, 2)])
def test_train_on_cuda_picks_the_default_that_fits(tmp_path, monkeypatch, gpus, world):
    """`shmlearn train --device cuda` with no --workers: was 2 workers on a one-GPU machine,
    refused with '--workers None: 2 processes need 2 GPUs, 1 present'."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    seen = {}

    def fake_worker(cfg, env, parts=None, settled=False):
        seen.update(workers=cfg.workers, world=env.world_size)
        return train_mod.RunResult(status="completed", run_dir=cfg.out, summary={"status": "completed"})

    def fake_local(fn, args, world, *, cuda, timeout_s, backend=None, **kw):
        seen.update(workers=args[0]["workers"], world=world, cuda=cuda)
        return [({"status": "completed"}, args[0]["out"], None)]
    monkeypatch.setattr(train_mod, "run_worker", fake_worker)
    monkeypatch.setattr(train_mod, "run_local", fake_local)
    shmlearn.train(TrainConfig(device="cuda", progress=False, out=str(tmp_path / "run")))
    assert (seen["workers"], seen["world"]) == (world, world)


def test_a_run_directory_named_after_a_script_s_objects_is_one_folder():
    for model, dataset, words in [("/home/me/exp/train.py:Net", "python:ndarray arrays", "Net-ndarray-arrays"),
                                  ("tmp/own.py:Net", "pkg.data:load", "Net-load"),
                                  ("alexnet-small", "synthetic-28", "alexnet-small-synthetic-28")]:
        path = default_run_dir(TrainConfig(model=model, dataset=dataset), 2)
        folder, name = os.path.split(path)
        assert folder == "runs" and name.endswith(f"-{words}-allreduce-w2"), path
