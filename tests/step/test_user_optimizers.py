"""The user's optimizer in the fast step (step/options.py, step/modes.py): honoured or refused,
never bypassed. Each run is compared with what a user writes without shmlearn: one process, the
whole batch (the W workers' batches concatenated), the same optimizer, hooks and scheduler, torch
only. Step hooks run once a step; a subclass that overrides step() runs the classic step; Adam,
AdamW and SGD run torch's fused implementation in the fast step with the user's hyperparameters;
a NaN is never applied; RMSprop runs its foreach implementation behind the gate (more optimizers
in test_foreach_optimizers.py); one with neither, or whose step() needs a closure, is refused."""
import json
import os

import pytest
import torch

import shmlearn
import stepping
from stepping import flat as _flat, nll, run_steps
from shmlearn.config.train_config import TrainConfig
from shmlearn.data import load_dataset, normalizer
from shmlearn.data.loader import ShardedLoader
from shmlearn.step.fast import StepOptions, Stepper
from shmlearn.train.guard import Fault
from shmlearn.models import build_model
from shmlearn.step import options
from shmlearn.step.modes import GroupValues, keep_lr_tensors
from shmlearn.sync import build_strategy
from shmlearn.record.timing import PhaseTimer

B, STEPS = 8, 20
CALLS = {"pre": 0}
"""Calls of `halve_grads` in this process (the 1-worker runs train here)."""


def halve_grads(optimizer, args, kwargs):
    """A step pre-hook that changes the update (so the weights show whether it ran) and counts."""
    CALLS["pre"] += 1
    for g in optimizer.param_groups:
        for p in g["params"]:
            p.grad.mul_(0.5)


def sgd_with_hook(model):
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt.register_step_pre_hook(halve_grads)
    return opt


class ShiftedSGD(torch.optim.SGD):
    """A subclass whose step() does more than SGD's: every step adds 1e-3 to every weight."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(1e-3)


def shifted_sgd(model):
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    return ShiftedSGD(params, lr=0.1, momentum=0.9)


def adamw(model):
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)


def adam(model):
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    return torch.optim.Adam(params, lr=3e-3, weight_decay=1e-2, amsgrad=True)


def rmsprop(model):
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    return torch.optim.RMSprop(params, lr=1e-3)


def one_cycle(optimizer):
    """Changes lr and betas[0] every step (cycle_momentum), as a scheduler of a transformer recipe does."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=STEPS + 1)


def _cfg(out, workers, **kw):
    # One thread a rank, as plain_loop runs: on a loaded machine the run's own choice (the cores
    # left free, config/limits.py) could differ from the loop's, and with it the matmuls' sums;
    # Adam's normalized update then moved one weight of 50,826 by 1.4e-5 (seen in CI).
    return TrainConfig(model="mlp", dataset="digits", batch_size=B, samples=STEPS * workers * B, workers=workers,
                       eval_points=1, progress=False, out=str(out), device="cpu", threads=1, **kw)


def plain_loop(make, steps=STEPS, batch=B, hook=None, scheduler=None):
    """One process, torch only (stepping.plain_loop), on one thread as the runs (_cfg)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return stepping.plain_loop(make, steps, batch, hook=hook, scheduler=scheduler)
    finally:
        torch.set_num_threads(before)


def test_a_step_pre_hook_runs_once_a_step_in_the_fast_step(tmp_path):
    CALLS["pre"] = 0
    res = shmlearn.train(_cfg(tmp_path / "run", 1), optimizer=sgd_with_hook, loss=nll)
    s = res.summary
    assert CALLS["pre"] == STEPS
    assert s["step_mode"] == "fast-eager" and s["update_kernel"] == "torch-fused", s["step_mode"]
    assert s["step_note"].startswith("optimizer SGD has 1 step hook: the fast step calls its step() every step")
    ref = plain_loop(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), hook=halve_grads)
    torch.testing.assert_close(_flat(res.model), ref, rtol=1e-4, atol=1e-5)
    unhooked = plain_loop(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    assert (unhooked - ref).abs().max() > 1e-3, "the hook changes nothing: the test proves nothing"


def test_a_global_step_hook_keeps_the_flat_kernel_off(tmp_path):
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    CALLS["pre"] = 0
    handle = register_optimizer_step_pre_hook(halve_grads)
    try:
        res = shmlearn.train(_cfg(tmp_path / "run", 1, optimizer="momentum", lr=0.1, lr_schedule="constant"), loss=nll)
    finally:
        handle.remove()
    assert CALLS["pre"] == STEPS and res.summary["update_kernel"] == "torch-fused"
    ref = plain_loop(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), hook=halve_grads)
    torch.testing.assert_close(_flat(res.model), ref, rtol=1e-4, atol=1e-5)


def test_a_subclass_that_overrides_step_runs_classic_as_written(tmp_path):
    res = shmlearn.train(_cfg(tmp_path / "run", 1), optimizer=shifted_sgd, loss=nll)
    s = res.summary
    assert s["step_mode"] == "classic"
    assert s["step_note"] == "optimizer ShiftedSGD overrides step(): the classic step calls it as written; " \
                             "it runs the classic step"
    torch.testing.assert_close(_flat(res.model), plain_loop(shifted_sgd), rtol=1e-4, atol=1e-5)
    plain = plain_loop(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    assert (plain_loop(shifted_sgd) - plain).abs().max() > 1e-3, "the override changes nothing: the test proves nothing"


def test_a_subclass_that_keeps_step_is_not_taken_for_an_override():
    class Quiet(torch.optim.AdamW):
        pass

    p = [torch.nn.Parameter(torch.zeros(2))]
    Quiet(p)  # torch wraps step() on the class of the first instance
    assert not options.overrides_step(Quiet(p)) and options.overrides_step(ShiftedSGD(p, lr=0.1))
    assert options.optimizer_why_not(Quiet(p), torch.device("cpu")) is None


@pytest.mark.parametrize("workers", [1, 2])
def test_adam_and_adamw_run_the_fast_step_and_equal_the_plain_loop(tmp_path, workers):
    # the user's AdamW through optimizer=, the built-in Adam (amsgrad from the user's factory) by name
    runs = {"adamw": shmlearn.train(_cfg(tmp_path / "w", workers), optimizer=adamw, loss=nll),
            "adam": shmlearn.train(_cfg(tmp_path / "a", workers), optimizer=adam, loss=nll)}
    start = plain_loop(adamw, steps=0)
    for name, make in (("adamw", adamw), ("adam", adam)):
        s = runs[name].summary
        assert s["step_mode"] == "fast-eager" and s["update_kernel"] == "torch-fused", (name, s["step_mode"])
        assert "runs torch's fused implementation in the fast step (fused=True)" in s["step_note"]
        ref = plain_loop(make, batch=workers * B)
        torch.testing.assert_close(_flat(runs[name].model), ref, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name} at {workers} workers vs the plain loop: {m}")
        assert (ref - start).abs().max() > 1e-2, "training did not move the weights"


def test_builtin_adamw_by_name_runs_the_fast_step(tmp_path):
    res = shmlearn.train(_cfg(tmp_path / "run", 1, optimizer="adamw", lr=3e-3, weight_decay=0.1,
                                 lr_schedule="constant"), loss=nll)
    assert res.summary["step_mode"] == "fast-eager"
    ref = plain_loop(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1))
    torch.testing.assert_close(_flat(res.model), ref, rtol=1e-4, atol=1e-5)


def test_a_scheduler_that_changes_betas_reaches_the_fast_step(tmp_path):
    res = shmlearn.train(_cfg(tmp_path / "run", 1, scheduler_interval="step"), optimizer=adamw, scheduler=one_cycle,
                         loss=nll)
    assert res.summary["step_mode"] == "fast-eager"
    torch.testing.assert_close(_flat(res.model), plain_loop(adamw, scheduler=one_cycle), rtol=1e-4, atol=1e-5)


def test_rmsprop_runs_the_fast_step_and_says_so_in_summary(tmp_path):
    res = shmlearn.train(_cfg(tmp_path / "run", 1), optimizer=rmsprop, loss=nll)
    s = res.summary
    assert (s["step_mode"], s["update_kernel"]) == ("fast-eager", "torch-foreach")
    line = ("optimizer RMSprop runs torch's foreach implementation in the fast step (foreach=True), with its "
            "hyperparameters; a skipped step puts its weights and state back")
    with open(os.path.join(res.run_dir, "summary.json")) as f:
        assert json.load(f)["step_note"] == line
    torch.testing.assert_close(_flat(res.model), plain_loop(rmsprop), rtol=1e-4, atol=1e-5)
    assert (plain_loop(rmsprop) - plain_loop(rmsprop, steps=0)).abs().max() > 1e-3, "training did not move the weights"


def test_the_probe_finds_the_fused_optimizers_of_this_torch():
    cpu = torch.device("cpu")
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        assert options.fused_why_not(cls, cpu) is None, cls
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert options.optimizer_why_not(torch.optim.LBFGS(p), cpu) == \
        "optimizer LBFGS: its step() needs a closure (it evaluates the loss itself), which the fast step has not"
    assert "differentiable" in options.optimizer_why_not(torch.optim.Adam(p, differentiable=True), cpu)
    for cls in (torch.optim.SparseAdam, torch.optim.Muon):  # neither fused nor foreach
        assert options.optimizer_why_not(cls(p), cpu) == \
            f"optimizer {cls.__name__}: torch has no fused {cls.__name__}, and no foreach implementation to step on the device"
    for cls in (torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD):
        assert options.optimizer_why_not(cls(p), cpu) is None, cls
    assert [options.implementation(c(p), cpu) for c in (torch.optim.Adagrad, torch.optim.RMSprop)] == ["fused", "foreach"]


def _stepper(optimizer, check_every, fault=None, steps=12):
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", data.spec)
    opt = optimizer(model)
    s = build_strategy("allreduce", rank=0, world_size=1)
    s.setup(model, opt)
    loader = ShardedLoader(data.train_x, data.train_y, batch_size=16, shard=0, num_shards=1, seed=0,
                           normalize=normalizer(data, torch.device("cpu")))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / (2 * steps))  # a float lr each step
    return Stepper(model=model, strategy=s, optimizer=opt, schedule=sched, loader=loader, task="classification",
                   device=torch.device("cpu"), opts=StepOptions(check_every=check_every),
                   timer=PhaseTimer(torch.device("cpu")), rank=0, world_size=1, total_steps=steps, fault=fault)


def test_a_nan_in_the_fast_step_with_adamw_is_never_applied():
    """Loss NaN at step 6, read at step 8: the weights and AdamW's state are those after steps
    0-5, as the classic step (which stops before applying step 6) leaves them."""
    fast = _stepper(adamw, 4, fault=Fault("nan", 0, 6))
    assert fast.mode == "fast-eager"
    win = run_steps(fast, 12)
    assert win is not None and win.bad == (6, 0) and len(win.losses) == 2
    classic = _stepper(adamw, 1)
    assert classic.mode == "classic"
    run_steps(classic, 6)
    torch.testing.assert_close(fast.strategy.params_flat, classic.strategy.params_flat, rtol=1e-5, atol=1e-6)
    p = next(iter(fast.optimizer.state))
    q = next(iter(classic.optimizer.state))
    assert float(fast.optimizer.state[p]["step"]) == 6.0  # the skipped steps were not counted
    torch.testing.assert_close(fast.optimizer.state[p]["exp_avg_sq"], classic.optimizer.state[q]["exp_avg_sq"],
                               rtol=1e-5, atol=1e-8)


def test_group_values_report_what_a_scheduler_changed_besides_lr():
    opt = adamw([torch.nn.Parameter(torch.zeros(2))])
    lr = torch.tensor(3e-3)
    opt.param_groups[0]["lr"] = lr
    kept = GroupValues(opt, [lr])
    opt.param_groups[0]["lr"] = 1e-3  # an older scheduler assigns a float
    assert keep_lr_tensors(opt, kept) == [] and opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(1e-3)
    opt.param_groups[0]["betas"] = (0.7, 0.95)
    assert keep_lr_tensors(opt, kept) == ["betas"] and keep_lr_tensors(opt, kept) == []


def test_a_nan_through_the_api_with_adamw_is_diverged_at_its_step(tmp_path, monkeypatch):
    from shmlearn.errors import Diverged
    monkeypatch.setenv("SHMLEARN_FAULT", "nan:0:6")
    with pytest.raises(Diverged) as e:
        shmlearn.train(_cfg(tmp_path / "run", 1, check_every=4), optimizer=adamw, loss=nll)
    assert (e.value.step, e.value.rank) == (6, 0)
    with open(tmp_path / "run" / "summary.json") as f:
        s = json.load(f)
    assert (s["status"], s["diverged_step"], s["step_mode"]) == ("diverged", 6, "fast-eager")
    assert s["step_note"].startswith("optimizer AdamW runs torch's fused implementation")


def test_optimizer_adamw_on_the_command_line_runs_the_fast_step_and_says_so(tmp_path, monkeypatch, capfd):
    from cli_inproc import run_main
    out = tmp_path / "run"
    r = run_main(["train", "--device", "cpu", "--model", "mlp", "--dataset", "digits", "--workers", "1",
                  "--batch-size", str(B), "--samples", str(STEPS * B), "--optimizer", "adamw", "--lr", "3e-3",
                  "--weight-decay", "0.1", "--lr-schedule", "constant", "--eval-points", "1", "--no-progress",
                  "--out", str(out)], monkeypatch, capfd)
    assert r.returncode == 0, r.stderr
    assert "shmlearn: optimizer AdamW runs torch's fused implementation in the fast step (fused=True)" in r.stdout
    with open(out / "summary.json") as f:
        assert json.load(f)["step_mode"] == "fast-eager"
    ref = plain_loop(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1))
    torch.testing.assert_close(_flat(shmlearn.load_model(str(out))), ref, rtol=1e-4, atol=1e-5)
