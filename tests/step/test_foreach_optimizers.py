"""The fast step for torch.optim optimizers without a fused implementation that reads the skip
flag (issue 51): RMSprop, NAdam, RAdam, Adamax, Adadelta, ASGD, Rprop, Adafactor run torch's
foreach implementation behind step/gate.py's FlagGate; Adagrad runs its fused one on the CPU.

References: the gate against a twin optimizer stepped by torch alone (a skipped step is one the
twin never takes; the weights and the state of a skipped step are the bytes before it), and whole
runs at 1 and 2 Gloo workers against the plain single-process loop on the concatenated batch."""
import json
import os
import types
import warnings

import pytest
import torch
import torch.distributed as dist

import stepping
from procs import processes
from stepping import flat, nll, run_steps
from shmlearn.config.train_config import TrainConfig
from shmlearn.launch.start import DistEnv, free_port
from shmlearn.step.gate import FlagGate
from shmlearn.sync.base import flatten_parameters
from shmlearn.train.entry import run_worker
from shmlearn.user.parts import Parts

B, STEPS = 8, 20


def _params(model):
    return model.parameters() if isinstance(model, torch.nn.Module) else model


FACTORIES = {  # hyperparameters away from the defaults where the defaults would hide a mistake
    # eps 1e-4: at torch's 1e-8, g / (sqrt(v) + eps) of a weight whose gradient is rounding noise
    # (~1e-9) is of order 0.1, so the 2-worker average's other rounding moved such weights by 4e-5
    # in 20 steps, in the classic step as in the fast one (centered: the gate's tests below)
    "rmsprop": lambda m: torch.optim.RMSprop(_params(m), lr=1e-3, momentum=0.9, eps=1e-4, weight_decay=1e-3),
    "nadam": lambda m: torch.optim.NAdam(_params(m), lr=3e-3, weight_decay=1e-2, decoupled_weight_decay=True),
    "adagrad": lambda m: torch.optim.Adagrad(_params(m), lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
    "radam": lambda m: torch.optim.RAdam(_params(m), lr=3e-3),
    "adamax": lambda m: torch.optim.Adamax(_params(m), lr=3e-3),
    "adadelta": lambda m: torch.optim.Adadelta(_params(m), lr=1.0, rho=0.8),
    "asgd": lambda m: torch.optim.ASGD(_params(m), lr=0.05, t0=5),
    "rprop": lambda m: torch.optim.Rprop(_params(m), lr=1e-3),
    "adafactor": lambda m: torch.optim.Adafactor(_params(m), lr=1e-2),
}
FUSED_ON_CPU = {"adagrad"}
"""torch 2.13 has a fused Adagrad on the CPU that reads the flag itself."""
RUNS = {1: [("allreduce", n) for n in FACTORIES],
        2: [("allreduce", n) for n in FACTORIES] + [("ps", "rmsprop"), ("ps", "nadam"), ("ps", "adagrad")]}
"""Per worker count, the (strategy, optimizer) runs of one process group."""


def _cfg(out, workers, strategy):
    return TrainConfig(model="mlp", dataset="digits", strategy=strategy, batch_size=B, samples=STEPS * workers * B,
                       workers=workers, eval_points=1, eval_at_start="off", progress=False, save_model=False,
                       out=str(out), threads=1)


def _worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                  launcher="local", master_port=port)
    for strategy, name in RUNS[world]:
        parts = Parts(optimizer=FACTORIES[name], loss=nll)
        cfg = parts.labelled(_cfg(os.path.join(tmp, f"{strategy}-{name}"), world, strategy))
        res = run_worker(cfg, env, parts=parts)
        torch.save(flat(res.model), os.path.join(tmp, f"{strategy}-{name}-rank{rank}.pt"))
        if rank == 0:
            with open(os.path.join(tmp, f"{strategy}-{name}.json"), "w") as f:
                json.dump(res.summary, f)
    dist.destroy_process_group()
    os._exit(0)  # as shmlearn's workers leave (launch._child)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"w{w}")
def runs(request, tmp_path_factory):
    world = request.param
    tmp = str(tmp_path_factory.mktemp(f"foreach-w{world}"))
    processes(_worker, (world, free_port(), tmp), world)
    return world, tmp


@pytest.mark.parametrize("name", list(FACTORIES))
def test_each_optimizer_in_the_fast_step_equals_the_plain_loop(runs, name):
    world, tmp = runs
    start = stepping.plain_loop(FACTORIES[name], 0, B)
    ref = stepping.plain_loop(FACTORIES[name], STEPS, world * B)
    assert (ref - start).abs().max() > 1e-3, "training did not move the weights: the test proves nothing"
    for strategy, n in RUNS[world]:
        if n != name:
            continue
        with open(os.path.join(tmp, f"{strategy}-{name}.json")) as f:
            s = json.load(f)
        kind = "fused" if name in FUSED_ON_CPU else "foreach"
        assert (s["status"], s["step_mode"], s["update_kernel"]) == ("completed", "fast-eager", f"torch-{kind}"), s
        assert s["step_note"].startswith(f"optimizer {type(FACTORIES[name]([torch.zeros(1)])).__name__} runs torch's "
                                         f"{kind} implementation in the fast step ({kind}=True)")
        ranks = [torch.load(os.path.join(tmp, f"{strategy}-{name}-rank{r}.pt")) for r in range(world)]
        for r in range(1, world):
            torch.testing.assert_close(ranks[r], ranks[0], rtol=0, atol=1e-6, msg=f"{strategy}: rank {r} differs")
        torch.testing.assert_close(ranks[0], ref, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name} under {strategy} at {world} workers vs the plain loop: {m}")


# -- the gate alone, against torch's own step ------------------------------------------------------
CENTERED = lambda m: torch.optim.RMSprop(_params(m), lr=1e-3, momentum=0.9, centered=True)  # noqa: E731
GATED = [n for n in FACTORIES if n not in FUSED_ON_CPU] + ["adagrad-foreach", "rmsprop-centered"]
"""Every optimizer above through the gate (Adagrad too, as it runs on CUDA where torch has no fused
one), and RMSprop with all its state (centered: grad_avg)."""


def _model():
    torch.manual_seed(0)  # a conv (channels_last weights, so channels_last state) and a linear layer
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(12, 2))


def _make(name, params):
    return CENTERED(params) if name == "rmsprop-centered" else FACTORIES[name.split("-")[0]](params)


def _state(opt):
    return [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
            for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("name", GATED)
def test_the_gate_skips_to_the_byte_and_otherwise_steps_as_torch(name):
    """Gated: the strategy's flat weights (channels_last), torch's foreach step, the flag set on
    steps 0, 2 and 5 with NaN gradients. Twin: the same optimizer and gradients, stepped by torch
    only on the other steps. A skipped step leaves the weights and the state byte for byte."""
    model, twin = _model(), _model()
    pflat, gflat = flatten_parameters(model, channels_last=True)
    opt, ref = _make(name, model.parameters()), _make(name, twin.parameters())
    for group in opt.param_groups + ref.param_groups:
        group["foreach"] = True
        if "fused" in group:
            group["fused"] = False
    found_inf = torch.zeros(())
    gate = FlagGate(opt, found_inf, pflat)
    assert gate.pairs[0][0].data_ptr() == pflat.data_ptr() and len(gate.pairs) == 1 + len(gate.flats)
    gen = torch.Generator().manual_seed(1)
    for step, skip in enumerate([1, 0, 1, 0, 0, 1, 0, 0]):
        grads = [torch.randn(p.shape, generator=gen) for p in twin.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad.copy_(g)
        if skip:
            gflat[0] = float("nan")
        before_w, before_s = pflat.clone(), _state(opt)
        found_inf.fill_(skip)
        opt.step()
        if skip:
            assert torch.equal(pflat, before_w), f"step {step}: the weights moved"
            for a, b in zip(_state(opt), before_s):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"step {step}: state moved"
            continue
        for p, g in zip(twin.parameters(), grads):
            p.grad = g
        ref.step()
        assert not torch.equal(pflat, before_w), f"step {step}: the weights did not move"
    torch.testing.assert_close(flat(model), flat(twin), rtol=1e-6, atol=1e-7)
    for a, b in zip(_state(opt), _state(ref)):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=f"state {k}")
    gate.remove()
    assert "step" not in vars(opt)


def test_the_gate_keeps_a_schedulers_wrapper_and_gives_it_back():
    model = _model()
    pflat, _ = flatten_parameters(model)
    opt = FACTORIES["rmsprop"](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    theirs = vars(opt)["step"]
    gate = FlagGate(opt, torch.zeros(()), pflat)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns if step() looks overridden after the scheduler or not called
        for _ in range(3):
            opt.step()
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    gate.remove()
    assert vars(opt)["step"] is theirs


def test_the_state_made_before_the_first_step_is_torchs_first_step():
    """make_state (inside the gate) creates the lazy state with torch's initial values: one step
    from there equals torch's own first step (NAdam's mu_product starts at 1, Adamax's exp_inf at
    0, ASGD's eta at lr: a zero-gradient step would have moved each)."""
    for name in ("nadam", "adamax", "asgd"):
        model, twin = _model(), _model()
        pflat, gflat = flatten_parameters(model)
        opt, ref = _make(name, model.parameters()), _make(name, twin.parameters())
        FlagGate(opt, torch.zeros(()), pflat)
        assert all(len(opt.state[p]) for p in model.parameters()), name
        assert torch.equal(flat(model), flat(twin)), f"{name}: making the state moved the weights"
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad.copy_(torch.full_like(p, 0.3))
            q.grad = torch.full_like(q, 0.3)
        opt.step()
        ref.step()
        torch.testing.assert_close(flat(model), flat(twin), rtol=1e-6, atol=1e-7, msg=name)


def test_a_nan_in_the_fast_step_with_rmsprop_is_never_applied():
    """Loss NaN at step 6, read at step 8: the weights and RMSprop's state are those after steps
    0-5, as the classic step (which stops before applying step 6) leaves them."""
    from shmlearn.train.guard import Fault
    from test_user_optimizers import _stepper
    make = CENTERED
    fast = _stepper(make, 4, fault=Fault("nan", 0, 6))
    assert fast.mode == "fast-eager" and fast.update_kernel == "torch-foreach"
    win = run_steps(fast, 12)
    assert win is not None and win.bad == (6, 0) and len(win.losses) == 2
    classic = _stepper(make, 1)
    assert classic.mode == "classic"
    run_steps(classic, 6)
    torch.testing.assert_close(fast.strategy.params_flat, classic.strategy.params_flat, rtol=1e-5, atol=1e-6)
    for p, q in zip(fast.strategy._trainable, classic.strategy._trainable):
        a, b = fast.optimizer.state[p], classic.optimizer.state[q]
        assert float(a["step"]) == float(b["step"]) == 6.0  # the skipped steps were not counted
        for k in ("square_avg", "momentum_buffer", "grad_avg"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-8, msg=k)
    fast.close()  # the user's optimizer loses the gate: step() is the scheduler's wrapper of torch's again
    assert not isinstance(vars(fast.optimizer)["step"], types.MethodType), "the optimizer keeps the gate after the run"



def test_a_gated_optimizers_checkpoint_loads_into_a_plain_one(tmp_path):
    """The state lives in the gate's flat buffers as views: torch.save keeps each buffer once, and a
    fresh optimizer (a resumed run's, before its gate) loads the same values."""
    model = _model()
    pflat, gflat = flatten_parameters(model)
    opt = CENTERED(model.parameters())
    FlagGate(opt, torch.zeros(()), pflat)
    for k in range(3):
        gflat.copy_(torch.linspace(-1, 1, len(gflat)) * (k + 1))
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fresh = CENTERED(_model().parameters())
    fresh.load_state_dict(torch.load(tmp_path / "opt.pt"))
    for a, b in zip(_state(opt), _state(fresh)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert float(_state(fresh)[0]["step"]) == 3.0
    assert os.path.getsize(tmp_path / "opt.pt") < 4 * 4 * len(gflat) + 8192  # 3 state tensors a weight, once each
