"""The user's whole recipe (issue 41): their optimizer, scheduler and loss through every strategy.

W real Gloo processes train STEPS steps of B samples each with the user's optimizer (AdamW with
two parameter groups) and scheduler; a plain single-process torch loop (model, optimizer,
scheduler and loss written out, no shmlearn strategy, no Stepper) trains STEPS steps on the
concatenated batches of W*B samples. The final weights must agree to float tolerance.
"""
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stepping

from shmlearn.config.train_config import TrainConfig
from shmlearn.errors import BadInput
from shmlearn.launch.start import DistEnv, free_port
from shmlearn.user.parts import Parts
from shmlearn.train.entry import run_worker

B, STEPS, WORLD = 8, 20, 2


def adamw_groups(model):
    """Two parameter groups: the first layer's weight at one lr, everything else at another with
    weight decay."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": params[:1], "lr": 0.01},
                              {"params": params[1:], "lr": 0.003, "weight_decay": 0.1}])


def sgd(model):
    return torch.optim.SGD([{"params": list(model.parameters())[:1], "lr": 0.2},
                            {"params": list(model.parameters())[1:], "lr": 0.1}], momentum=0.5)


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=6, gamma=0.5)


OPTIMIZERS = {"adamw": adamw_groups, "sgd": sgd}
CASES = [  # (strategy, optimizer, extra config, step mode it must report)
    ("allreduce", "adamw", {}, "fast-eager"),  # torch's fused AdamW in the fast step
    ("ps", "adamw", {}, "fast-eager"),
    ("ddp", "adamw", {}, "classic"),
    ("weight-avg", "sgd", {"avg_period": 1}, "fast-eager"),  # torch SGD: the fast step (fused) runs it
    # the classic step asked for, and the fast step asked for
    ("allreduce", "adamw", {"check_every": 1}, "classic"),
    ("allreduce", "sgd", {"check_every": 6}, "fast-eager"),
]


def _cfg(out, workers, batch, strategy="allreduce", **kw):
    return TrainConfig(model="mlp", dataset="digits", strategy=strategy, batch_size=batch,
                       samples=STEPS * workers * batch, workers=workers, eval_points=1, progress=False,
                       scheduler_interval="step", out=str(out), **kw)


def _worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                  launcher="local", master_port=port)
    for i, (strategy, opt, extra, _) in enumerate(CASES):
        parts = Parts(optimizer=OPTIMIZERS[opt], scheduler=step_lr, loss=stepping.nll)
        cfg = parts.labelled(_cfg(os.path.join(tmp, f"run{i}"), world, B, strategy, **extra))
        res = run_worker(cfg, env, parts=parts)
        torch.save((stepping.flat(res.model), res.summary["step_mode"]), os.path.join(tmp, f"case{i}-rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # as shmlearn's workers leave (launch._child)


def plain_loop(opt: str, steps: int = STEPS, batch: int = WORLD * B) -> torch.Tensor:
    """What a user writes without shmlearn (stepping.plain_loop), with OPTIMIZERS[opt] and step_lr."""
    return stepping.plain_loop(OPTIMIZERS[opt], steps, batch, scheduler=step_lr)


def test_user_optimizer_and_scheduler_match_a_plain_single_process_loop(tmp_path):
    mp.spawn(_worker, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    refs = {opt: plain_loop(opt) for opt in OPTIMIZERS}
    start = plain_loop("sgd", steps=0)
    for i, (strategy, opt, extra, mode) in enumerate(CASES):
        ranks = [torch.load(os.path.join(tmp_path, f"case{i}-rank{r}.pt")) for r in range(WORLD)]
        for r in range(1, WORLD):
            torch.testing.assert_close(ranks[r][0], ranks[0][0], rtol=0, atol=1e-6, msg=f"{strategy}: rank {r} differs")
        torch.testing.assert_close(ranks[0][0], refs[opt], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{strategy}/{opt} {extra} vs the plain loop: {m}")
        assert ranks[0][1] == mode, f"{strategy}/{opt} {extra}: step_mode {ranks[0][1]}"
        assert (ranks[0][0] - start).abs().max() > 1e-2, "training did not move the weights"


def test_scheduler_steps_per_epoch_by_default():
    from shmlearn.user.recipe import EveryN
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = EveryN(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), every=3)
    lrs = []
    for _ in range(7):
        opt.step()
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert TrainConfig().scheduler_interval == "epoch"


@pytest.mark.parametrize("kw, start", [
    ({"optimizer": "Adadelta", "optimizer_args": "lrr=1"}, "--optimizer Adadelta --optimizer-args lrr=1: TypeError"),
    ({"optimizer": "Nope"}, "--optimizer Nope: choose one of"),
    ({"optimizer": "Adam", "momentum": 0.9}, "--momentum: belongs to the built-in optimizers"),
    ({"optimizer": "Adam", "lr_schedule": "cosine"}, "--lr-schedule: belongs to the built-in optimizers"),
    ({"optimizer": "sgd", "optimizer_args": "lr=1"}, "--optimizer-args lr=1: for a torch.optim class"),
    ({"scheduler": "StepLR"}, "--scheduler StepLR: TypeError"),
    ({"scheduler": "ReduceLROnPlateau", "scheduler_args": "mode=sideways"},
     "--scheduler ReduceLROnPlateau --scheduler-args mode=sideways: ValueError"),
    ({"scheduler": "SequentialLR"}, "--scheduler SequentialLR: choose"),
    ({"optimizer": "LBFGS"}, "--optimizer LBFGS: LBFGS.step() needs a closure"),
    ({"scheduler_args": "gamma=0.5"}, "--scheduler-args gamma=0.5: needs --scheduler"),
    ({"scheduler": "StepLR", "scheduler_args": "step_size=1", "scheduler_interval": "hour"},
     "--scheduler-interval hour: choose"),
    ({"loss": "nofile.py:f"}, "--loss nofile.py:f: file nofile.py does not exist"),
    ({"loss": "python:function"}, "--loss python:function: this run's loss was passed from Python"),
    ({"optimizer": "python:partial"}, "--optimizer python:partial: this run's optimizer was passed from Python"),
    # the data's files are looked for before any worker starts, too
    ({"dataset": "mnist"}, "--data-dir: mnist needs a --data-dir"),
    ({"dataset": "fashion-mnist", "data_dir": "/nonexistent-shmlearn"}, "--data-dir /nonexistent-shmlearn: no such"),
    ({"dataset": "cifar10"}, "--data-dir: cifar10 needs a --data-dir"),
])
def test_a_bad_recipe_is_one_line_before_any_worker_starts(tmp_path, kw, start):
    import time
    import shmlearn
    t0 = time.perf_counter()
    with pytest.raises(BadInput) as e:
        shmlearn.train(TrainConfig(workers=2, samples=640, out=str(tmp_path / "run"), **kw))
    assert time.perf_counter() - t0 < 2.0  # no worker was started
    assert str(e.value).startswith(start), str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_args_parse_as_yaml_values():
    from shmlearn.user.recipe import parse_args
    assert parse_args("lr=1.0,betas=[0.9, 0.99],amsgrad=true,name=x", "--o") == {
        "lr": 1.0, "betas": (0.9, 0.99), "amsgrad": True, "name": "x"}
    assert parse_args(None, "--o") == {}


def test_an_object_that_cannot_be_recorded_is_labelled_so(tmp_path):
    from shmlearn.user.parts import label
    assert label(functools.partial(torch.optim.AdamW, lr=0.1)) == "python:partial"
    assert label(torch.optim.AdamW).endswith(":AdamW")
    assert label(step_lr).endswith("test_recipe:step_lr") or label(step_lr).endswith("test_recipe.py:step_lr")


def test_optimizer_args_read_numbers_as_python_writes_them():
    """YAML 1.1 reads 1e-3 (no dot) as text; f'lr={1e-5}' writes 1e-05."""
    from shmlearn.user.recipe import parse_args
    assert parse_args("lr=1e-3,eps=1e-08,betas=[0.9, 0.99],name=adam", "--optimizer-args") == \
        {"lr": 1e-3, "eps": 1e-8, "betas": (0.9, 0.99), "name": "adam"}
