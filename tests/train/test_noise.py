"""--noise-scale against the exact gradient noise scale (issue 19, acceptance 1).

The reference: every training sample's gradient at the run's weights (torch.func), their mean G
and population covariance Sigma, B_simple = tr(Sigma) / |G|^2. The runs train at lr 1e-12 (frozen
weights), so every step's estimate is of the same B_simple; W real Gloo processes, as in
tests/sync/test_equivalence.py. Steps per worker count keep the estimate's spread well under the
10% bound (docs/noise-scale.md: ~3% relative SD for the mlp at 1 worker and 2000 steps; 2.0% for
either model at 4 workers and 200 steps: the bound is 5 SD there, as for softmax at 1 worker).
"""
import itertools
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.func import functional_call, grad, vmap

from shmlearn.cli.main import main
from shmlearn.config.train_config import TrainConfig
from shmlearn.data import load_dataset, normalizer
from shmlearn.launch.start import DistEnv, free_port
from shmlearn.train.noise import NoiseTracker, estimate
from shmlearn.train.entry import run_worker
from procs import processes

B = 32
# Every run below sets threads=1: a 1-worker run's default is every core (2 here), and a second
# intra-op thread on these tiny batches only waits on the first (the 4 x 2000 steps of `runs` at
# W=1 took ~3 CPU minutes with 2 threads on the shared 2-core machine, ~10 s with 1). 2+ workers
# get 1 thread each on 2 cores anyway.
STEPS = {1: 2000, 2: 1000, 4: 200}
MODELS = ("softmax", "mlp")
# (strategy, extra config): the fast step (losses read every 10 steps) and the classic loop
CASES = [("allreduce", {}), ("ps", {"check_every": 1})]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _cfg(out, workers, model, strategy, **kw):
    return TrainConfig(threads=1, model=model, dataset="digits", strategy=strategy, optimizer="sgd", lr=1e-12,
                       lr_schedule="constant", batch_size=B, samples=STEPS[workers] * workers * B,
                       workers=workers, eval_points=1, progress=False, noise_scale=True, noise_every=1,
                       out=str(out), **kw)


_exact = {}
"""exact_b_simple's results by the weights they were computed at (their bytes): at lr 1e-12 every
run of a model ends on the same float32 weights, its initial ones, and the mlp's per-sample
gradients (1437 x 50k, in float64) took seconds apiece."""


def exact_b_simple(model: torch.nn.Module):
    """(tr(Sigma), |G|^2) over digits' training set, from per-sample gradients at model's weights."""
    key = (type(model), tuple((k, tuple(v.shape), v.detach().cpu().numpy().tobytes())
                              for k, v in model.state_dict().items()))
    if key not in _exact:
        _exact[key] = _exact_b_simple(model)
    return _exact[key]


def _exact_b_simple(model: torch.nn.Module):
    d = load_dataset("digits", None, seed=0)
    x, y = normalizer(d, torch.device("cpu"))(d.train_x), d.train_y
    params = {k: v.detach().cpu() for k, v in model.named_parameters()}
    model = model.cpu()

    def loss(p, xi, yi):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    per = torch.cat([v.reshape(len(x), -1) for v in g.values()], 1).double()
    mean = per.mean(0)
    return ((per - mean) ** 2).sum(1).mean().item(), mean.dot(mean).item()


def _worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                  launcher="local", master_port=port)
    for model in MODELS:
        for strategy, extra in CASES:
            res = run_worker(_cfg(os.path.join(tmp, f"{model}-{strategy}"), world, model, strategy, **extra), env)
            if rank == 0:
                torch.save(res.model.state_dict(), os.path.join(tmp, f"{model}-{strategy}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # as tests/sync/test_equivalence.py: skip the interpreter-exit teardown


def _solo_worker(i, tmp):
    """The 1-worker runs of MODELS[i], in a process of their own (not in a process group)."""
    torch.set_num_threads(1)
    model = MODELS[i]
    for strategy, extra in CASES:
        env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="local",
                      master_port=free_port())
        res = run_worker(_cfg(os.path.join(tmp, f"{model}-{strategy}"), 1, model, strategy, **extra), env)
        torch.save(res.model.state_dict(), os.path.join(tmp, f"{model}-{strategy}.pt"))
    os._exit(0)  # as _worker


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"w{w}")
def runs(request, tmp_path_factory):
    world = request.param
    tmp = str(tmp_path_factory.mktemp(f"noise-w{world}"))
    if world == 1:  # one process a model, each a world of its own: two cores, one intra-op thread each
        processes(_solo_worker, (tmp,), len(MODELS))
    else:
        processes(_worker, (world, free_port(), tmp), world)
    return world, tmp


@pytest.mark.parametrize("model", MODELS)
def test_b_simple_matches_per_sample_gradients(runs, model):
    world, tmp = runs
    from shmlearn.data import load_dataset as ld
    from shmlearn.models import build_model
    found = {}
    for strategy, _ in CASES:
        s = json.load(open(os.path.join(tmp, f"{model}-{strategy}", "summary.json")))
        assert s["status"] == "completed" and s["workers"] == world
        net = build_model(model, ld("digits", None, seed=0).spec)
        net.load_state_dict(torch.load(os.path.join(tmp, f"{model}-{strategy}.pt")))
        trace, g2 = exact_b_simple(net)
        exact = trace / g2
        got = s["gradient_noise_scale"]
        print(f"{model} {strategy} W={world}: B_simple {got:.2f}, exact {exact:.2f} ({got / exact - 1:+.1%})")
        assert abs(got / exact - 1) < 0.10, (model, strategy, world, got, exact)
        # the two unknowns separately, not only their ratio
        ns = s["noise_scale"]
        assert abs(ns["trace_mean"] / trace - 1) < 0.10 and abs(ns["g2_mean"] / g2 - 1) < 0.10
        assert ns["b_small"] == (B / 2 if world == 1 else B) and ns["b_big"] == world * B
        assert ns["n_train"] == 1437 and ns["steps"] == STEPS[world]
        rows = [json.loads(line) for line in open(os.path.join(tmp, f"{model}-{strategy}", "metrics.jsonl"))]
        logged = [r["noise_scale"] for r in rows if "noise_scale" in r]
        assert len(logged) == len(rows) == STEPS[world] // 10
        last = logged[-1]
        assert last["b_simple"] == pytest.approx(last["trace"] / last["g2"])
        assert s["gradient_noise_scale_final"] == pytest.approx(last["b_simple"])
        assert [p[0] for p in s["gradient_noise_scale_trajectory"]] == [r["step"] for r in rows]
        found[strategy] = got
    # allreduce (fast step) and ps (classic loop) read the same batches: the same estimate
    assert found["allreduce"] == pytest.approx(found["ps"], rel=1e-4)


def test_estimate_is_unbiased_for_sampling_without_replacement():
    """Exact expectations over every subset of a small population give back tr(Sigma) and |G|^2."""
    torch.manual_seed(0)
    pop = torch.randn(7, 3, dtype=torch.float64) + torch.tensor([0.5, -1.0, 0.2], dtype=torch.float64)
    n = len(pop)
    G = pop.mean(0)
    trace, g2 = ((pop - G) ** 2).sum(1).mean().item(), G.dot(G).item()

    def expected_sq(b):
        subsets = list(itertools.combinations(range(n), b))
        return sum(pop[list(s)].mean(0).pow(2).sum().item() for s in subsets) / len(subsets)

    for bs, bb in [(1, 2), (2, 4), (3, 6), (2, 7)]:
        g2_hat, tr_hat = estimate(expected_sq(bs), expected_sq(bb), bs, bb, n)
        assert g2_hat == pytest.approx(g2, rel=1e-12) and tr_hat == pytest.approx(trace, rel=1e-12)
    # an infinite pool: the paper's form, E|g_b|^2 = |G|^2 + tr(Sigma) / b
    g2_hat, tr_hat = estimate(g2 + trace / 4, g2 + trace / 16, 4, 16)
    assert (g2_hat, tr_hat) == pytest.approx((g2, trace), rel=1e-12)


def test_tracker_takes_the_ratio_of_separate_moving_averages():
    t = NoiseTracker(b_small=8, b_big=32, n_train=None)
    values = [(2.0, 1.0), (5.0, 1.5), (3.0, 1.2)]
    pairs = [estimate(s, b, 8, 32) for s, b in values]
    for i, (s, b) in enumerate(values):
        t.add(i + 1, s, b)
    w = [0.01 * 0.99 ** 2, 0.01 * 0.99, 0.01]  # EMA weights of steps 1..3 (bias-corrected below)
    norm = 1 - 0.99 ** 3
    eg2 = sum(wi * p[0] for wi, p in zip(w, pairs)) / norm
    etr = sum(wi * p[1] for wi, p in zip(w, pairs)) / norm
    assert t.last["b_simple"] == pytest.approx(etr / eg2)
    s = t.summary()
    assert s["gradient_noise_scale"] == pytest.approx(sum(p[1] for p in pairs) / sum(p[0] for p in pairs))


@pytest.mark.parametrize("check_every", [10, 1], ids=["fast", "classic"])
def test_half_batches_train_as_the_whole_batch(tmp_path, check_every):
    """At one worker the batch is computed as two halves: the same gradient, so the same weights."""
    out = {}
    for on in (False, True):
        cfg = TrainConfig(threads=1, model="mlp", dataset="digits", optimizer="momentum", lr=0.1, batch_size=B,
                          samples=60 * B, workers=1, eval_points=1, progress=False, noise_scale=on,
                          noise_every=1, check_every=check_every, out=str(tmp_path / f"ns-{on}"))
        env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="local",
                      master_port=free_port())
        res = run_worker(cfg, env)
        out[on] = (torch.cat([p.detach().reshape(-1) for p in res.model.parameters()]), res.summary)
    assert torch.allclose(out[True][0], out[False][0], rtol=1e-4, atol=1e-6)
    assert out[True][1]["final_loss"] == pytest.approx(out[False][1]["final_loss"], rel=1e-4)
    assert out[True][1]["gradient_noise_scale"] > 0 and "gradient_noise_scale" not in out[False][1]
    # the report draws B_simple for the run that measured it, and no such figure for the other
    from shmlearn.report import write_report
    for on in (False, True):
        write_report([str(tmp_path / f"ns-{on}")])
        assert (tmp_path / f"ns-{on}" / "figures" / "noise-scale.png").exists() == on


@pytest.mark.parametrize("argv, says", [
    (["--strategy", "weight-avg", "--workers", "2"], "--noise-scale: --strategy weight-avg has no averaged gradient"),
    (["--strategy", "ddp", "--workers", "1"], "--noise-scale: --strategy ddp at 1 worker keeps its gradients outside"),
    (["--strategy", "async-ps", "--workers", "2"], "--noise-scale: --strategy async-ps has no averaged gradient"),
    (["--workers", "1", "--batch-size", "33"], "--batch-size 33 is not even"),
    (["--noise-every", "0"], "--noise-every 0: expected a whole number from 1"),
])
def test_bad_layouts_are_refused_in_one_line(tmp_path, capsys, argv, says):
    code = main(["train", "--noise-scale", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "r"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1


DDP_EVERY = 3
"""The DDP and dedicated-server tests measure every 3rd step of 80: 27 measurements."""


def _ddp_worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                  launcher="local", master_port=port)
    for strategy in ("allreduce", "ddp"):
        cfg = TrainConfig(threads=1, model="mlp", dataset="digits", strategy=strategy, optimizer="momentum", lr=0.05,
                          batch_size=B, samples=80 * world * B, workers=world, eval_points=1, progress=False,
                          noise_scale=True, noise_every=DDP_EVERY, check_every=1, out=os.path.join(tmp, strategy))
        run_worker(cfg, env)
    # a dedicated server and 1 worker: the worker's half batches ride in the gather to the server
    cfg = TrainConfig(threads=1, model="mlp", dataset="digits", strategy="ps", ps_dedicated=True, optimizer="momentum",
                      lr=0.05, batch_size=B, samples=80 * B, eval_points=1, progress=False, noise_scale=True,
                      noise_every=DDP_EVERY, out=os.path.join(tmp, "ps-dedicated-w1"))
    run_worker(cfg, env)
    dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """_ddp_worker's three runs on 2 Gloo processes, once for the two tests that read them."""
    tmp = tmp_path_factory.mktemp("ddp")
    processes(_ddp_worker, (2, free_port(), str(tmp)), 2)
    return tmp


def test_dedicated_server_measures_its_one_workers_half_batches(ddp_runs, tmp_path):
    cfg = TrainConfig(threads=1, model="mlp", dataset="digits", strategy="allreduce", optimizer="momentum", lr=0.05,
                      batch_size=B, samples=80 * B, workers=1, eval_points=1, progress=False, noise_scale=True,
                      noise_every=DDP_EVERY, out=str(tmp_path / "allreduce-w1"))
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="local", master_port=free_port())
    ref = run_worker(cfg, env).summary
    ps = json.load(open(ddp_runs / "ps-dedicated-w1" / "summary.json"))
    assert ps["workers"] == 1 and ps["noise_scale"]["b_small"] == B / 2 and ps["noise_scale"]["steps"] == 27
    assert ps["gradient_noise_scale"] == pytest.approx(ref["gradient_noise_scale"], rel=1e-4)


def test_ddp_measures_what_allreduce_measures(ddp_runs):
    """DDP's communication hook carries the same scalar through its bucket all-reduce, on the
    measured steps only (every 3rd): on the same batches and weights it reports allreduce's
    estimates, step by step."""
    a, d = (json.load(open(ddp_runs / s / "summary.json")) for s in ("allreduce", "ddp"))
    assert d["gradient_noise_scale"] == pytest.approx(a["gradient_noise_scale"], rel=1e-4)
    assert d["noise_scale"]["steps"] == a["noise_scale"]["steps"] == 27  # steps 0, 3, ..., 78
    for (sa, ba), (sd, bd) in zip(a["gradient_noise_scale_trajectory"], d["gradient_noise_scale_trajectory"]):
        assert sa == sd and bd == pytest.approx(ba, rel=1e-3)
    rows = [json.loads(line) for line in open(ddp_runs / "ddp" / "metrics.jsonl")]
    assert [r["noise_scale"]["measured_step"] for r in rows] == [r["step"] - (r["step"] - 1) % 3 for r in rows]


# --- --noise-every: measure every K-th step only ---------------------------------------------------
EVERY = 3
"""Not a divisor of the loss reads' 10 steps: measured steps fall anywhere in a read's window."""
EVERY_STEPS = 40
EVERY_CASES = [("allreduce", {}), ("ps", {"check_every": 1})]  # the fast step and the classic loop


def _every_cfg(out, workers, strategy, every, **kw):
    return TrainConfig(threads=1, model="mlp", dataset="digits", strategy=strategy, optimizer="sgd", lr=1e-12,
                       lr_schedule="constant", batch_size=B, samples=EVERY_STEPS * workers * B, workers=workers,
                       eval_points=1, log_every=1, progress=False, noise_scale=True, noise_every=every,
                       out=str(out), **kw)


def _every_worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                  launcher="local", master_port=port)
    for strategy, extra in EVERY_CASES:
        for every in (1, EVERY):
            run_worker(_every_cfg(os.path.join(tmp, f"{strategy}-k{every}"), world, strategy, every, **extra), env)
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.parametrize("world", [1, 2], ids=["w1", "w2"])
def test_every_kth_step_measures_what_every_step_measures_there(tmp_path, world):
    """At frozen weights a run measuring every 3rd step records, at steps 1, 4, 7, ... (1-based),
    the squared norms that a run measuring every step records there; its tracker takes exactly
    those ceil(40 / 3) = 14 measurements, with the per-measurement decay 0.99**3."""
    if world == 1:
        for strategy, extra in EVERY_CASES:
            for every in (1, EVERY):
                env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="local",
                              master_port=free_port())
                run_worker(_every_cfg(tmp_path / f"{strategy}-k{every}", 1, strategy, every, **extra), env)
    else:
        processes(_every_worker, (world, free_port(), str(tmp_path)), world)
    for strategy, _ in EVERY_CASES:
        rows = {k: [json.loads(line) for line in open(tmp_path / f"{strategy}-k{k}" / "metrics.jsonl")]
                for k in (1, EVERY)}
        every_step = {r["step"]: r["noise_scale"] for r in rows[1]}
        assert all(ns["measured_step"] == step for step, ns in every_step.items())
        measured = [r for r in rows[EVERY] if r["noise_scale"]["measured_step"] == r["step"]]
        assert [r["step"] for r in measured] == list(range(1, EVERY_STEPS + 1, EVERY))
        for r in rows[EVERY]:  # between measurements a row repeats the last one
            assert r["noise_scale"]["measured_step"] == r["step"] - (r["step"] - 1) % EVERY
        ref = NoiseTracker(B / 2 if world == 1 else B, world * B, 1437, every=EVERY)
        for r in measured:
            got, want = r["noise_scale"], every_step[r["step"]]
            assert (got["small_sq"], got["big_sq"]) == pytest.approx((want["small_sq"], want["big_sq"]), rel=1e-5)
            ref.add(r["step"], want["small_sq"], want["big_sq"])
            # the moving averages (their ratio is undefined while |G|^2's is not positive)
            assert (got["g2"], got["trace"]) == pytest.approx((ref.last["g2"], ref.last["trace"]), rel=1e-4)
        s = json.load(open(tmp_path / f"{strategy}-k{EVERY}" / "summary.json"))
        want = ref.summary()
        assert s["noise_scale"]["steps"] == len(measured) == 14 and s["noise_scale"]["every"] == EVERY
        assert s["noise_scale"]["ema_decay"] == pytest.approx(0.99 ** EVERY)
        assert s["gradient_noise_scale"] == pytest.approx(want["gradient_noise_scale"], rel=1e-4)


def test_tracker_decays_per_measurement_with_a_floor():
    """Every K steps the averages forget as much per measurement as K steps did (time constant ~100
    steps), but at most 10% per measurement (a few measurements are not forgotten at once)."""
    assert NoiseTracker(8, 32, None, every=1).decay == 0.99
    assert NoiseTracker(8, 32, None, every=5).decay == pytest.approx(0.99 ** 5)
    assert NoiseTracker(8, 32, None, every=50).decay == 0.9
    t = NoiseTracker(8, 32, None, every=50)
    values = [(2.0, 1.0), (5.0, 1.5)]
    for i, (sm, bg) in enumerate(values):
        t.add(1 + 50 * i, sm, bg)
    (g1, t1), (g2, t2) = (estimate(sm, bg, 8, 32) for sm, bg in values)
    norm = 1 - 0.9 ** 2
    assert t.last["b_simple"] == pytest.approx((0.1 * 0.9 * t1 + 0.1 * t2) / (0.1 * 0.9 * g1 + 0.1 * g2))
    assert t.last["g2"] == pytest.approx((0.1 * 0.9 * g1 + 0.1 * g2) / norm)


def _bn_mlp():
    """An mlp with BatchNorm: its loss depends on which samples share a forward, so a step that
    computes its batch as two halves has a different loss than the whole batch's."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 10))


@pytest.mark.parametrize("check_every", [10, 1], ids=["fast", "classic"])
def test_unmeasured_steps_compute_the_whole_batch(tmp_path, check_every):
    """At 1 worker only a measured step is split in two halves: with BatchNorm (batch statistics)
    and frozen weights, every other step's loss is the loss of a run without --noise-scale,
    and each measured step's differs (so a split would show)."""
    from shmlearn.train.entry import train
    losses = {}
    for on in (False, True):
        cfg = TrainConfig(threads=1, model="mlp", dataset="digits", optimizer="sgd", lr=1e-12, lr_schedule="constant",
                          batch_size=B, samples=20 * B, workers=1, eval_points=1, log_every=1, progress=False,
                          noise_scale=on, noise_every=4, check_every=check_every, out=str(tmp_path / f"ns-{on}"))
        train(cfg, model=_bn_mlp())
        losses[on] = [json.loads(line)["loss"] for line in open(tmp_path / f"ns-{on}" / "metrics.jsonl")]
    assert len(losses[True]) == len(losses[False]) == 20
    for step, (got, plain) in enumerate(zip(losses[True], losses[False])):
        if step % 4:
            assert got == pytest.approx(plain, rel=1e-6), step
        else:
            assert got != pytest.approx(plain, rel=1e-4), step


class _FakeGraph:
    """As tests/step/test_fast.py's stand-in for a CUDA graph: keeps fn, calls it on replay."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


def test_graph_mode_replays_the_measuring_graph_on_measured_steps_only(tmp_path, monkeypatch):
    """The CUDA-graph protocol on the CPU, with a stand-in graph: one graph for plain steps and one
    for measuring steps (each captured as its kind runs), replayed by the step number; the run
    gives the eager run's losses and measurements."""
    import contextlib

    from shmlearn.step.fast import Stepper
    from shmlearn.step.graphs import Graphs
    steppers = []
    setup = Stepper._setup_fast

    def setup_and_capture(self, fused=True):
        setup(self, fused)
        if self.strategy.noise is not None:
            self._capture_all_ranks()
            steppers.append(self)

    rows = {}
    for graphed in (False, True):
        with monkeypatch.context() as m:
            if graphed:
                m.setattr(Graphs, "side_stream", lambda self: contextlib.nullcontext())
                m.setattr(Graphs, "graph_of", lambda self, fn: _FakeGraph(fn))
                m.setattr(Stepper, "_setup_fast", setup_and_capture)
                m.setattr(Stepper, "close", lambda self: None)  # a GPU's synchronize; keeps the graphs
            cfg = TrainConfig(threads=1, model="mlp", dataset="digits", optimizer="momentum", lr=0.05, batch_size=B,
                              samples=40 * B, workers=1, eval_points=1, log_every=1, progress=False,
                              noise_scale=True, noise_every=EVERY, out=str(tmp_path / f"g-{graphed}"))
            env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="local",
                          master_port=free_port())
            run_worker(cfg, env)
        rows[graphed] = [json.loads(line) for line in open(tmp_path / f"g-{graphed}" / "metrics.jsonl")]
    (st,) = steppers
    assert set(st.graphs) == {False, (False, True)}
    # step 0 runs eagerly (phase timing, sample_every); then 13 measured steps and 26 others
    assert (st.graphs[(False, True)].replays, st.graphs[False].replays) == (13, 26)
    assert [r["loss"] for r in rows[True]] == pytest.approx([r["loss"] for r in rows[False]], rel=1e-6)
    for a, b in zip(rows[True], rows[False]):
        assert a["noise_scale"]["measured_step"] == b["noise_scale"]["measured_step"]
        assert (a["noise_scale"]["small_sq"], a["noise_scale"]["big_sq"]) == \
            pytest.approx((b["noise_scale"]["small_sq"], b["noise_scale"]["big_sq"]), rel=1e-6)
