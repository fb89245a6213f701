"""The fast step (fast.py) on the CPU: the maths and the NaN guarantee of the classic step, the
deferred reads, resume. (The CUDA graph itself needs a GPU: the eager fast step runs the same
device function that the graph captures.)"""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inductor import ran_eagerly, skip_if_ran_eagerly, skip_unbuilt
from stepping import run_steps
from shmlearn.train import checkpoint as ckpt
from shmlearn.config.train_config import TrainConfig, validate
from shmlearn.data import load_dataset, normalizer
from shmlearn.data.augment import Augment
from shmlearn.data.loader import ShardedLoader
from shmlearn.errors import BadInput
from shmlearn.step.fast import StepOptions, Stepper, StepTuning
from shmlearn.step.graphs import Graphs
from shmlearn.train.guard import Fault
from shmlearn.launch.start import free_port
from shmlearn.models import build_model
from shmlearn.user.optim import OPTIMIZERS, build_optimizer, build_schedule
from shmlearn.sync import build_strategy
from shmlearn.record.timing import PhaseTimer
from triton_interp import interpreted_together as interpreted  # one interpreter process for the module
from procs import processes


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _bn_model(spec):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _stepper(check_every, *, fault=None, strategy="allreduce", optimizer="momentum", steps=40, model="mlp",
             rank=0, world=1, sample_every=256, avg_period=1, adopt_grads="auto", lr=0.1):
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = _bn_model(data.spec) if model == "bn" else build_model(model, data.spec)
    opt = build_optimizer(optimizer, model.parameters(), lr=lr, weight_decay=1e-3)
    s = build_strategy(strategy, rank=rank, world_size=world, avg_period=avg_period)
    s.setup(model, opt)
    loader = ShardedLoader(data.train_x, data.train_y, batch_size=16, shard=rank, num_shards=world, seed=0,
                           normalize=normalizer(data, torch.device("cpu")), augment=Augment(flip=True))
    sched = build_schedule("linear", opt, steps, 3)
    return Stepper(model=model, strategy=s, optimizer=opt, schedule=sched, loader=loader, task="classification",
                   device=torch.device("cpu"), opts=StepOptions(check_every=check_every),
                   tuning=StepTuning(sample_every=sample_every, adopt_grads=adopt_grads),
                   timer=PhaseTimer(torch.device("cpu")), rank=rank, world_size=world, total_steps=steps, fault=fault)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fast_step_equals_classic_step(optimizer):
    """Every built-in optimizer (SGD's flat kernel, torch's fused Adam, AdamW and Adagrad, the
    foreach ones behind step/gate.py) against the classic step, under a linear schedule. The
    adaptive ones at lr 1e-3: at 0.1 their steps of about lr a weight make the mlp chaotic, and
    the fused and foreach kernels' other rounding (torch's own, classic or fast alike) grows to 1e-3."""
    lr = 0.1 if optimizer in ("sgd", "momentum", "nesterov") else 1e-3
    classic, fast = _stepper(1, optimizer=optimizer, lr=lr), _stepper(6, optimizer=optimizer, lr=lr)
    assert (classic.mode, fast.mode) == ("classic", "fast-eager")
    assert run_steps(classic, 40) is None and run_steps(fast, 40) is None
    torch.testing.assert_close(fast.strategy.params_flat, classic.strategy.params_flat, rtol=1e-5, atol=1e-6)
    # the schedule drove the device-resident learning rate
    assert float(fast.optimizer.param_groups[0]["lr"]) == pytest.approx(classic.optimizer.param_groups[0]["lr"])


def test_nan_is_never_applied_and_reported_at_its_step():
    """Loss NaN at step 6, read at step 8: the weights are those after steps 0-5, exactly as the
    classic step (which stops before applying step 6) leaves them."""
    fast = _stepper(4, fault=Fault("nan", 0, 6))
    win = run_steps(fast, 12)
    assert win is not None and win.bad == (6, 0) and len(win.losses) == 2  # steps 4 and 5 were fine
    assert float(fast.found_inf) == 1.0
    classic = _stepper(1)
    run_steps(classic, 6)
    torch.testing.assert_close(fast.strategy.params_flat, classic.strategy.params_flat, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(fast.strategy.params_flat).all()


def test_each_builtin_optimizer_says_how_it_runs_the_fast_step():
    kernels = {name: _stepper(8, optimizer=name).update_kernel for name in OPTIMIZERS}
    assert kernels == dict({n: "flat" for n in ("sgd", "momentum", "nesterov")},
                           **{n: "torch-fused" for n in ("adam", "adamw", "adagrad")},
                           **{n: "torch-foreach" for n in ("rmsprop", "adamax", "adadelta", "nadam")})
    assert "runs torch's foreach implementation" in _stepper(8, optimizer="rmsprop").note


def test_new_flags_are_validated():
    for kw, flag in (({"precision": "fp16"}, "--precision fp16"), ({"cuda_graph": "on"}, "--cuda-graph on"),
                     ({"check_every": 0}, "--check-every 0"), ({"augment": "rotate"}, "--augment rotate")):
        with pytest.raises(BadInput, match=flag):
            validate(TrainConfig(**kw))


def _run(args, fault=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env["SHMLEARN_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "shmlearn", "train", *args], capture_output=True, text=True,
                          timeout=300, env=env)


BASE = ["--device", "cpu", "--dataset", "digits", "--model", "mlp", "--samples", "12800", "--batch-size", "32", "--eval-points", "2",
        "--no-progress", "--workers", "2", "--check-every", "7", "--checkpoint-every", "40"]


def _weights(out):
    step = ckpt.candidates(str(out))[0]
    return ckpt.read_file(os.path.join(ckpt.step_dir(str(out), step), "rank0.ckpt"))["model"]


def _runs_together(*calls):
    """Independent `_run(args, fault)` calls at once, their results in order: a 2-worker run leaves
    part of two cores idle (Gloo waits, start-up), so together they take less than one after the other."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(calls)) as ex:
        return list(ex.map(lambda call: _run(*call), calls))


def _in_process(args, fault=None):
    """`shmlearn train ARGS` as the CLI's main() in this process, SHMLEARN_FAULT=fault for its
    workers (they take the owner's environment at their start): its exit code."""
    from cli_inproc import LAUNCHER_PREFIXES
    from shmlearn.cli.main import main
    with pytest.MonkeyPatch.context() as m:
        for k in list(os.environ):
            if k.startswith(LAUNCHER_PREFIXES) or k in ("RANK", "WORLD_SIZE", "SHMLEARN_FAULT"):
                m.delenv(k)
        if fault:
            m.setenv("SHMLEARN_FAULT", fault)
        try:
            return main(["train", *args])
        except SystemExit as e:
            return e.code


def test_resume_with_deferred_reads_equals_uninterrupted(tmp_path):
    """The run killed at step 130 is the program (a worker's real death, the program's exit 1);
    the uninterrupted run, beside it, and the resume are main() in this process."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    p = subprocess.Popen([sys.executable, "-m", "shmlearn", "train", *BASE, "--out", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**env, "PYTHONUNBUFFERED": "1",
                                                                "SHMLEARN_FAULT": "kill:1:130"})
    try:
        assert _in_process(BASE + ["--out", str(ref)]) == 0
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1 and "rank 1" in err, err
    assert _in_process(BASE + ["--out", str(out), "--resume"]) == 0
    s = json.load(open(out / "summary.json"))
    assert (s["steps"], s["resumed_from_step"], s["step_mode"], s["check_every"]) == (200, 120, "fast-eager", 7)
    a, b = _weights(out), _weights(ref)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    # every step's loss is logged, every 10 steps, with interpolated times that never go back
    rows = [json.loads(l) for l in open(ref / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(10, 201, 10))
    assert all(b["time_s"] >= a["time_s"] for a, b in zip(rows, rows[1:]))


NAN_CASES = [("allreduce", []), ("ps", []), ("weight-avg", ["--avg-period", "3"])]


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory):
    """The test below's three runs, one after the other in this process (each the CLI's main(),
    its 3 workers forked from the forkserver; as three programs at once they were three
    interpreters and forkservers importing torch on two cores): {strategy: (exit code, --out,
    what the CLI printed to stderr)}."""
    import contextlib
    import io
    d = tmp_path_factory.mktemp("nan")
    runs = {}
    for strategy, extra in NAN_CASES:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = _in_process(["--dataset", "digits", "--samples", "12768", "--batch-size", "32", "--no-progress",
                                "--workers", "3", "--check-every", "7", "--strategy", strategy, *extra,
                                "--out", str(d / strategy)], "nan:2:17")
        runs[strategy] = (code, d / strategy, err.getvalue())
    return runs


@pytest.mark.parametrize("strategy,extra", NAN_CASES)
def test_nan_on_one_rank_stops_every_rank_at_that_step(nan_runs, strategy, extra):
    code, out, err = nan_runs[strategy]
    assert code == 3, err
    s = json.load(open(out / "summary.json"))
    assert (s["status"], s["diverged_step"], s["diverged_rank"], s["steps"]) == ("diverged", 17, 2, 17)


# --- the graph protocol, with a stand-in for the CUDA graph ---------------------------------------
# On a GPU `Graphs.graph_of(fn)` (step/graphs.py) captures fn's kernels without running them and
# replay() runs them. The stand-in keeps fn and calls it on replay: what is tested is everything around the capture
# (warm-up that must leave no trace, restored weights, BatchNorm buffers and flags, the loader's
# device counter, one graph per kind of step, eager sampled steps between replays).

class _FakeGraph:
    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


def _fake_cuda_graphs(monkeypatch):
    monkeypatch.setattr(Graphs, "side_stream", lambda self: contextlib.nullcontext())
    monkeypatch.setattr(Graphs, "graph_of", lambda self, fn: _FakeGraph(fn))


def test_graph_protocol_gives_the_eager_result(monkeypatch):
    _fake_cuda_graphs(monkeypatch)
    eager = _stepper(5, model="bn")
    graph = _stepper(5, model="bn", sample_every=4)
    graph._capture_all_ranks()
    assert graph.mode == "cuda-graph" and graph.note is None
    run_steps(eager, 40), run_steps(graph, 40)
    assert graph.graphs[False].replays == 30 and graph.timer.timed_steps == 10  # steps 0, 4, 8, ...
    torch.testing.assert_close(graph.strategy.params_flat, eager.strategy.params_flat, rtol=0, atol=0)
    for a, b in zip(graph.model.buffers(), eager.model.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_failed_capture_falls_back_to_eager_from_the_same_state(monkeypatch):
    def broken(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(Graphs, "side_stream", lambda self: contextlib.nullcontext())
    monkeypatch.setattr(Graphs, "graph_of", broken)
    eager, fell = _stepper(5, model="bn"), _stepper(5, model="bn")
    fell._capture_all_ranks()
    assert fell.mode == "fast-eager" and "capture failed (RuntimeError: operation not permitted" in fell.note
    run_steps(eager, 20), run_steps(fell, 20)
    torch.testing.assert_close(fell.strategy.params_flat, eager.strategy.params_flat, rtol=0, atol=0)


def _graph_worker(rank, world, port, out, cases):
    import pytest as _pytest  # noqa: F401 - the monkeypatch below is by hand in a spawned process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    Graphs.side_stream = lambda self: contextlib.nullcontext()
    Graphs.graph_of = lambda self, fn: _FakeGraph(fn)
    for i, (strategy, period) in enumerate(cases):
        res = []
        for graph in (False, True):
            st = _stepper(4, strategy=strategy, rank=rank, world=world, sample_every=3, avg_period=period)
            if graph:
                st._capture_all_ranks()
                assert st.mode == "cuda-graph", st.note
                assert len(st.graphs) == (2 if period > 1 else 1)
            run_steps(st, 40)
            res.append(st.strategy.params_flat.clone())
        torch.save(res, os.path.join(out, f"case{i}-rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # leave as shmlearn's workers do (launch._child): interpreter-exit teardown
    # aborted a finished worker ('terminate called without an active exception', 3 of 27 runs here)


def test_graph_protocol_on_two_processes(tmp_path):
    cases = [("allreduce", 1), ("ps", 1), ("weight-avg", 3)]
    processes(_graph_worker, (2, free_port(), str(tmp_path), cases), 2)
    for i, (strategy, period) in enumerate(cases):
        (e0, g0), (e1, g1) = (torch.load(os.path.join(tmp_path, f"case{i}-rank{r}.pt")) for r in range(2))
        torch.testing.assert_close(g0, e0, rtol=0, atol=0, msg=strategy)
        torch.testing.assert_close(g1, e1, rtol=0, atol=0, msg=strategy)
        if strategy != "weight-avg":  # weight-avg replicas differ between rounds (40 % 3 != 0)
            torch.testing.assert_close(g0, g1, rtol=0, atol=0)


def test_fast_step_does_not_warn_of_a_wrong_scheduler_order(tmp_path):
    """The fused update is a real optimizer step; torch's 'lr_scheduler.step() before
    optimizer.step()' warning would tell users the schedule is off by one, which it is not.
    It showed under ps, where a worker that is not the server never calls optimizer.step()."""
    modes = ("1", "10")  # the classic step and the fast one, run together
    ran = _runs_together(*[(["--workers", "2", "--strategy", "ps", "--check-every", check_every, "--samples", "1280",
                             "--no-progress", "--out", str(tmp_path / f"run{check_every}")],) for check_every in modes])
    for check_every, r in zip(modes, ran):
        out = tmp_path / f"run{check_every}"
        assert r.returncode == 0, r.stderr[-2000:]
        mode = json.loads((out / "summary.json").read_text())["step_mode"]
        assert mode == ("classic" if check_every == "1" else "fast-eager")
        assert "lr_scheduler.step()" not in r.stderr, r.stderr[-2000:]


def test_compiled_step_agrees_with_the_eager_step_to_bf16_tolerance_on_the_cpu(tmp_path):
    """Issue 18, acceptance 6: --compile default (Inductor's C++ kernels on the CPU) trains the
    same run as eager to bf16 tolerance, step by step, with the compile time reported apart."""
    import shmlearn
    runs = {}
    for mode in ("off", "default"):
        cfg = TrainConfig(workers=1, device="cpu", samples=32 * 30, precision="bf16", compile=mode, log_every=1,
                          eval_points=1, progress=False, out=str(tmp_path / mode))
        res = shmlearn.train(cfg)
        losses = [json.loads(line)["loss"] for line in open(tmp_path / mode / "metrics.jsonl")]
        runs[mode] = (res, losses)
    (eager, le), (comp, lc) = runs["off"], runs["default"]
    skip_if_ran_eagerly(comp.summary["step_note"])
    assert comp.summary["compile"] == "default" and comp.summary["compile_s"] > 0
    assert comp.summary["compile_read"] is True  # the batch read compiled too (its own test: tests/data)
    assert eager.summary["compile"] == "off" and eager.summary["compile_s"] is None
    assert eager.summary["compile_read"] is False
    assert len(le) == len(lc) == 30
    assert torch.allclose(torch.tensor(lc), torch.tensor(le), rtol=2e-2, atol=1e-2), (le, lc)
    for a, b in zip(comp.model.parameters(), eager.model.parameters()):
        assert torch.allclose(a, b, rtol=5e-2, atol=5e-3)


def test_a_batch_read_that_does_not_compile_runs_eagerly_and_the_run_says_so(tmp_path, monkeypatch):
    """--compile: where torch.compile fails on the loader's read (a loader Dynamo cannot take),
    the model is still compiled, the read runs eagerly, the run completes and its note says why."""
    import shmlearn
    real = torch.compile

    def compile_but_the_read(fn, *args, **kwargs):
        if getattr(fn, "__name__", "") != "next_batch":
            return real(fn, *args, **kwargs)

        def fails():
            raise RuntimeError("no kernel for this read")
        return fails
    monkeypatch.setattr(torch, "compile", compile_but_the_read)
    res = shmlearn.train(TrainConfig(workers=1, device="cpu", samples=32 * 8, precision="bf16", compile="default",
                                     eval_points=1, progress=False, out=str(tmp_path / "run")))
    s = res.summary
    skip_if_ran_eagerly(s["step_note"])
    assert s["status"] == "completed" and s["compile"] == "default" and s["compile_read"] is False
    assert "--compile: the batch read runs eagerly (RuntimeError: no kernel for this read)" in s["step_note"]


def test_adopted_and_accumulated_gradients_train_the_same_weights_and_auto_accumulates_on_the_cpu():
    """StepOptions.adopt_grads: on (the gradients taken whole, then copied into the flat buffer)
    and auto, which on the CPU zeroes the buffer and lets autograd add into its views (0 + g is
    g), give the same steps bit for bit; a value outside ADOPT_GRADS is refused."""
    steppers = {a: _stepper(4, adopt_grads=a, model="bn") for a in ("on", "auto")}
    assert steppers["on"]._adopts and not steppers["auto"]._adopts
    for st in steppers.values():
        assert run_steps(st, 12) is None
    assert torch.equal(steppers["on"].strategy.params_flat, steppers["auto"].strategy.params_flat)
    assert torch.equal(steppers["on"].hist, steppers["auto"].hist)
    with pytest.raises(BadInput, match=r"^adopt_grads 'yes': choose one of auto, on, off$"):
        _stepper(4, adopt_grads="yes")


def test_compile_flag_is_checked():
    with pytest.raises(BadInput, match=r"^--compile fast: choose one of off, default, max-autotune, auto$"):
        validate(TrainConfig(compile="fast"))


def test_compile_auto_times_both_and_every_rank_keeps_the_same_choice(tmp_path):
    import shmlearn
    res = shmlearn.train(TrainConfig(workers=2, device="cpu", samples=64 * 10, compile="auto", eval_points=1,
                                     progress=False, out=str(tmp_path / "auto")))
    s = res.summary
    skip_if_ran_eagerly(s["step_note"])
    assert s["compile"] in ("off", "default") and s["compile_s"] > 0
    assert s["step_note"].startswith("--compile auto: compiled ")
    assert s["step_note"].endswith("; compiled" if s["compile"] == "default" else "; eager")


def test_combo_kernels_auto_is_on_for_small_image_batches_on_cuda_only():
    from shmlearn.step.fast import COMBO_MAX_PIXELS, combo_kernels
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    small, large = torch.empty(128, 3, 32, 32, device="meta"), torch.empty(1024, 3, 32, 32, device="meta")
    assert combo_kernels("auto", cuda, small) and not combo_kernels("auto", cuda, large)
    assert combo_kernels("auto", cuda, torch.empty(COMBO_MAX_PIXELS, 64, device="meta"))  # batch alone, not images
    assert not combo_kernels("auto", cuda, torch.empty(COMBO_MAX_PIXELS + 1, 64, device="meta"))
    assert not combo_kernels("auto", cpu, small) and not combo_kernels("auto", cuda, None)
    assert combo_kernels("on", cpu, large) and not combo_kernels("off", cuda, small)


class _ConvNet(torch.nn.Module):
    """digits as 1x8x8 images: conv (no bias) + BatchNorm, conv (bias), linear. extra: a third
    convolution that runs only on even steps ("sometimes"), the second one twice ("twice"), or its
    weight used outside it as well ("outside")."""

    def __init__(self, extra=None):
        super().__init__()
        nn = torch.nn
        self.c1, self.b1 = nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.c2, self.fc = nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 10)
        self.c3 = nn.Conv2d(4, 4, 1)
        self.extra, self.calls = extra, 0

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x.view(-1, 1, 8, 8))))
        x = torch.relu(self.c2(x))
        if self.extra == "twice":
            x = torch.relu(self.c2(x))
        if self.extra == "outside":  # c2's weight used outside its module as well
            x = x + torch.nn.functional.conv2d(x, self.c2.weight, padding=1)
        if self.extra == "sometimes":
            self.calls += 1
            if self.calls % 2:
                x = x + self.c3(x)
        return self.fc(x.flatten(1))


def _early_stepper(monkeypatch, mode, *, extra=None, compile="off", nan_at=None, steps=10, strategy="allreduce",
                   rank=0, world=1, avg_period=1, weight_copy="auto", precision=None):
    """A fast Stepper on the CPU with every convolution in shmlearn's backward op (conv_overlap's
    CUDA check lifted; its split then runs in line) and the flat SGD kernel (interpreter).
    monkeypatch None: lift the check for good (in a spawned worker)."""
    from shmlearn.nn import conv_overlap
    if monkeypatch is None:
        conv_overlap.usable = lambda device: None
    else:
        monkeypatch.setattr(conv_overlap, "usable", lambda device: None)
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = _ConvNet(extra)
    opt = build_optimizer("nesterov", model.parameters(), lr=0.05, weight_decay=1e-3)
    s = build_strategy(strategy, rank=rank, world_size=world, avg_period=avg_period)
    s.setup(model, opt, channels_last=compile != "off")
    loader = ShardedLoader(data.train_x, data.train_y, batch_size=16, shard=rank, num_shards=world, seed=0,
                           normalize=normalizer(data, torch.device("cpu")))
    count = {"n": 0}

    def loss(out, y):  # the loss of step nan_at is NaN
        count["n"] += 1
        value = torch.nn.functional.cross_entropy(out, y)
        return value * float("nan") if count["n"] == (nan_at or 0) + 1 and nan_at is not None else value
    opts = StepOptions(check_every=4, conv_overlap="all", update_in_backward=mode, compile=compile,
                       precision=precision or ("bf16" if compile != "off" else "fp32"), channels_last=compile != "off",
                       weight_copy=weight_copy)
    return Stepper(model=model, strategy=s, optimizer=opt, schedule=build_schedule("linear", opt, steps, 3),
                   loader=loader, task="classification", device=torch.device("cpu"), opts=opts,
                   tuning=StepTuning(adopt_grads="on"),  # as on CUDA, where the update in the backward runs
                   timer=PhaseTimer(torch.device("cpu")), rank=rank, world_size=world, total_steps=steps,
                   loss=loss if nan_at is not None else None)


def _steps(kw):
    """Steps for a bit-for-bit case: 6 (the reads at 4 and 6 exercise the deferred read and the
    last step's); a NaN at step 6 is found by the read at 8."""
    return 8 if "nan_at" in kw else 6


@interpreted
def test_update_in_backward_is_the_update_after_it_bit_for_bit(monkeypatch):
    """Each convolution's SGD step inside the backward (its op hands its gradient to the flat
    kernel) against the whole flat update after the backward: the same weights, momentum and
    buffers, bit for bit, eagerly in fp32, compiled in bf16 channels_last, with a convolution that
    runs every other step only (a zero-gradient step, as the flat update gives it); a NaN loss
    sets the skip flag before the backward, so the run stops at it with the weights before it.
    6 steps (reads at 4 and 6; 8 with the NaN at step 6, found by the read at 8)."""
    unbuilt = None
    for kw in ({}, {"extra": "sometimes"}, {"compile": "default"}, {"nan_at": 6}):
        early, late = _early_stepper(monkeypatch, "on", **kw), _early_stepper(monkeypatch, "off", **kw)
        if any(ran_eagerly(st.note) for st in (early, late)):  # the other cases still run (tests/inductor.py)
            unbuilt = early.note or late.note
            continue
        assert early.early_update and early.update_kernel == "flat" and len(early._slots) == 3
        assert not late.early_update and not late._slots
        wins = [run_steps(st, _steps(kw)) for st in (early, late)]
        if "nan_at" in kw:
            assert wins[0].bad == wins[1].bad == (6, 0)
        for a, b in ((early.strategy.params_flat, late.strategy.params_flat),
                     (early.strategy.grads_flat, late.strategy.grads_flat),
                     (early.strategy.flat_update._m, late.strategy.flat_update._m)):
            assert torch.equal(a, b), kw
        for a, b in zip(early.model.buffers(), late.model.buffers()):
            assert torch.equal(a, b), kw
    if unbuilt:
        skip_unbuilt(f"the compiled case ({unbuilt})")


@interpreted
def test_update_in_backward_refuses_a_convolution_run_twice_or_a_weight_used_outside_it(monkeypatch):
    for extra, message in (("twice", "convolution c2 ran more than once"),
                           ("outside", "c2's parameters get gradients from outside the module")):
        st = _early_stepper(monkeypatch, "on", extra=extra)
        before = st.strategy.params_flat.clone()
        with pytest.raises(RuntimeError, match=message):
            run_steps(st, 2)
        if extra == "outside":  # caught before any update was applied? no: eagerly, in the first step
            assert not torch.equal(before, st.strategy.params_flat)


def test_update_in_backward_on_says_why_it_cannot_run(monkeypatch):
    from shmlearn.step import flat_sgd
    monkeypatch.setattr(flat_sgd, "why_not", lambda *a: "no flat update here")  # e.g. CUDA without Triton
    with pytest.raises(BadInput, match=r"^--update-in-backward on: the update is not the flat SGD kernel "
                                       r"\(no flat update here\)$"):
        _early_stepper(monkeypatch, "on")
    auto = _early_stepper(monkeypatch, "auto")
    assert not auto.early_update and all(getattr(m, "grad_slot", -1) == -1 for m in auto.model.modules())
    st = _stepper(4)  # the mlp: no convolution
    with pytest.raises(BadInput, match="--update-in-backward on: no convolution runs shmlearn's backward op"):
        Stepper(model=st.model, strategy=st.strategy, optimizer=st.optimizer, schedule=st.schedule, loader=st.loader,
                task="classification", device=torch.device("cpu"), timer=st.timer, rank=0, world_size=1,
                total_steps=40, opts=StepOptions(check_every=4, update_in_backward="on"),
                tuning=StepTuning(adopt_grads="on"))


@interpreted
def test_the_weight_copy_gives_the_steps_of_autocasts_cast_bit_for_bit(monkeypatch):
    """--weight-copy: the update writes the convolutions' bf16 weights and the forward reads them
    instead of casting: the same weights, gradients and momentum as the step that casts, bit for
    bit (6 steps: reads at 4 and 6; 8 through a NaN at 6), with the update in the backward (whose
    input-gradient GEMM reads the copy that the update then writes) and after it, eagerly in bf16
    and compiled, and through a NaN step; at the end the copy holds the weights cast; the model,
    closed, casts again."""
    unbuilt = None
    for kw in ({"precision": "bf16"}, {"compile": "default"}, {"compile": "default", "mode": "off"},
               {"precision": "bf16", "nan_at": 6}):
        mode = kw.pop("mode", "on")
        runs = {c: _early_stepper(monkeypatch, mode, weight_copy=c, **kw) for c in ("on", "off")}
        if any(ran_eagerly(st.note) for st in runs.values()):  # the other cases still run (tests/inductor.py)
            unbuilt = runs["on"].note or runs["off"].note
            continue
        assert runs["on"].weight_copy and not runs["off"].weight_copy
        assert runs["on"].early_update == (mode == "on")
        wins = {c: run_steps(st, _steps(kw)) for c, st in runs.items()}
        if "nan_at" in kw:
            assert wins["on"].bad == wins["off"].bad == (6, 0)
        on, off = runs["on"], runs["off"]
        for a, b in ((on.strategy.params_flat, off.strategy.params_flat),
                     (on.strategy.grads_flat, off.strategy.grads_flat),
                     (on.strategy.flat_update._m, off.strategy.flat_update._m)):
            assert torch.equal(a, b), kw
        assert torch.equal(on.strategy.flat_update.copy, on.strategy.params_flat.bfloat16()), kw
        held = [m for m in on.model.modules() if "weight_copy" in m.__dict__]
        assert len(held) == 3
        on.close()
        assert not any("weight_copy" in m.__dict__ for m in on.model.modules())
    if unbuilt:
        skip_unbuilt(f"the compiled cases ({unbuilt})")


def test_weight_copy_on_says_why_it_cannot_run(monkeypatch):
    with pytest.raises(BadInput, match="--weight-copy on: --precision fp32: the forward casts no weights"):
        _early_stepper(monkeypatch, "auto", weight_copy="on", precision="fp32")
    assert not _early_stepper(monkeypatch, "auto", precision="fp32").weight_copy
    from shmlearn.step import flat_sgd
    monkeypatch.setattr(flat_sgd, "why_not", lambda *a: "no flat update here")  # e.g. CUDA without Triton
    with pytest.raises(BadInput, match=r"^--weight-copy on: the update is not the flat SGD kernel "
                                       r"\(no flat update here\)$"):
        _early_stepper(monkeypatch, "auto", weight_copy="on", precision="bf16")
    with pytest.raises(BadInput, match="--weight-copy maybe: choose one of auto, on, off"):
        validate(TrainConfig(weight_copy="maybe"))


def _copy_worker(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    for strategy, mode in (("weight-avg", "on"), ("ps", "off"), ("allreduce", "off")):
        for c in ("on", "off"):
            st = _early_stepper(None, mode, strategy=strategy, rank=rank, world=world, avg_period=3,
                                precision="bf16", weight_copy=c)
            assert st.weight_copy == (c == "on")
            run_steps(st, 7)
            res[strategy, c] = st.strategy.params_flat.clone()
            if c == "on":
                res[strategy, "copy"] = st.strategy.flat_update.copy.clone()
    torch.save(res, os.path.join(out, f"copy-rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # as _graph_worker


@interpreted
def test_the_weight_copy_follows_every_writer_of_the_weights_on_two_processes(tmp_path):
    """The weights written other than by the update (weight-avg's averages every 3 steps, the
    parameter server's broadcast to its workers) leave the copy cast again (params_written):
    with copies, 7 steps of each strategy (averages at 3 and 6, a step past) on two Gloo processes
    end on the weights of the step that casts, bit for bit (a stale copy read by a forward would
    change them), and each rank's copy holds its weights cast."""
    processes(_copy_worker, (2, free_port(), str(tmp_path)), 2)
    for r in range(2):
        res = torch.load(os.path.join(tmp_path, f"copy-rank{r}.pt"))
        for strategy in ("weight-avg", "ps", "allreduce"):
            assert torch.equal(res[strategy, "on"], res[strategy, "off"]), (r, strategy)
            assert torch.equal(res[strategy, "copy"], res[strategy, "on"].bfloat16()), (r, strategy)


def _early_worker(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = []
    for mode in ("on", "off"):
        st = _early_stepper(None, mode, strategy="weight-avg", rank=rank, world=world, avg_period=3)
        assert st.early_update == (mode == "on")
        run_steps(st, 7)
        res.append(st.strategy.params_flat.clone())
    try:
        _early_stepper(None, "on", strategy="allreduce", rank=rank, world=world)
        res.append("no error")
    except BadInput as e:
        res.append(str(e))
    torch.save(res, os.path.join(out, f"early-rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # as _graph_worker


@interpreted
def test_update_in_backward_under_weight_averaging_on_two_processes(tmp_path):
    """weight-avg updates each replica from its own gradient: in the backward, its two workers end
    where the update after the backward leaves them (7 steps, averaging every 3: two rounds and
    a step past the last), bit for bit; allreduce at 2 workers cannot and says so."""
    processes(_early_worker, (2, free_port(), str(tmp_path)), 2)
    for r in range(2):
        early, late, refusal = torch.load(os.path.join(tmp_path, f"early-rank{r}.pt"))
        assert torch.equal(early, late), r
        assert "strategy allreduce at 2 workers updates from other ranks' gradients" in refusal


def test_sample_period_keeps_eager_steps_within_one_percent():
    from shmlearn.step.fast import SAMPLE_EVERY, sample_period
    # ResNet-34 at batch 128 on an H100: 36 ms eager against 3.8 ms replayed: (9.47 - 1) / 1% = 847
    assert sample_period(36e-3, 3.8e-3) == 1024
    # an eager step little slower than its replay: the shortest period
    assert sample_period(4.0e-3, 3.8e-3) == SAMPLE_EVERY == 256
    # launch-bound: 4 ms eager against 0.22 ms replayed needs 1718 -> 2048
    assert sample_period(4e-3, 0.22e-3) == 2048
    # the cap, and nothing measured
    assert sample_period(10.0, 1e-6) == 65536
    assert sample_period(0.0, 0.0) == SAMPLE_EVERY
    for eager, replay in ((36e-3, 3.8e-3), (4e-3, 0.22e-3), (1e-3, 1e-3)):
        n = sample_period(eager, replay)
        assert (eager - replay) / (n * replay) <= 0.01 and (n == 256 or (eager - replay) / (n // 2 * replay) > 0.01)
