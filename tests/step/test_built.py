"""Issue 52, GPU cold start: under auto a fused kernel runs only where it is built on this machine
for the run's shapes, or where the run is long enough to build it (step/built.py,
step/kernels.py KernelChoice._defer_unbuilt); evaluation runs torch's ops, so it builds nothing of
its own. The decisions are made on the CPU here: the device is never touched (the record's key is
replaced, as only CUDA has one)."""
import json
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shmlearn.nn import choice, conv_pool, mlp_head
from shmlearn.step import built
from shmlearn.step.kernels import KernelChoice


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


def _fused_choice(model, conv_pool_mode="auto"):
    """A KernelChoice part-built: the model's block converted to the fused kernel, as choose()
    leaves it on a GPU that can run it."""
    conv_pool.convert(model, "triton")
    kc = object.__new__(KernelChoice)
    kc.model, kc.device = model, torch.device("cpu")
    kc.opts = types.SimpleNamespace(conv_pool=conv_pool_mode, mlp_head="auto")
    kc.kernels = [choice.Choice("0 (conv 3->8 3x3)", "conv-pool", "triton", None)]
    return kc


class _Loader:
    def batch(self, i):
        return torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMLEARN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(built, "key", lambda layers, shape, dtype, device: "k-" + "-".join(map(str, shape)))
    return tmp_path


def test_a_short_run_without_a_build_takes_torchs_ops_and_says_why(cache):
    model = _model()
    kc = _fused_choice(model)
    key, deferred = kc._defer_unbuilt(_Loader(), torch.float32, total_steps=898)
    assert (key, deferred) == (None, ["conv-pool"])
    assert type(model[0]) is nn.Conv2d and type(model[2]) is nn.MaxPool2d  # back on torch's modules
    c = kc.kernels[0]
    assert c.path == "torch" and "not built on this device" in c.why and "898 steps" in c.why


def test_a_built_kernel_or_a_long_run_or_a_forced_kernel_keeps_the_fused_path(cache):
    model = _model()
    kc = _fused_choice(model)
    assert kc._defer_unbuilt(_Loader(), torch.float32, total_steps=built.BUILD_MIN_STEPS) == ("k-4-3-8-8", [])
    assert type(model[0]) is conv_pool.ConvReluPool2d

    forced = _fused_choice(_model(), conv_pool_mode="triton")
    assert forced._defer_unbuilt(_Loader(), torch.float32, total_steps=10) == ("k-4-3-8-8", [])
    assert forced.kernels[0].path == "triton"

    built.mark_built("k-4-3-8-8", {"kernels": ["conv-pool"]})
    assert json.loads((cache / "kernels" / "k-4-3-8-8.json").read_text()) == {"kernels": ["conv-pool"]}
    again = _fused_choice(_model())
    assert again._defer_unbuilt(_Loader(), torch.float32, total_steps=10) == ("k-4-3-8-8", [])
    assert again.kernels[0].path == "triton"


def test_the_record_is_per_key_and_a_cache_that_cannot_be_written_loses_only_the_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMLEARN_CACHE_DIR", str(tmp_path / "c"))
    assert not built.is_built("a") and not built.is_built(None)
    built.mark_built("a", {})
    assert built.is_built("a") and not built.is_built("b")
    (tmp_path / "ro").write_text("a file where the folder should be")
    monkeypatch.setenv("SHMLEARN_CACHE_DIR", str(tmp_path / "ro"))
    built.mark_built("a", {})  # no exception: the run goes on
    assert not built.is_built("a")


def test_no_key_off_cuda():
    assert built.key(["conv-pool x"], (4, 3, 8, 8), torch.float32, torch.device("cpu")) is None


def test_evaluation_runs_torchs_ops_and_never_the_fused_kernels(monkeypatch):
    """model.eval(): the fused modules compute with torch's ops (the kernels' op would raise here)."""
    model = _model()
    ref = [F.max_pool2d(F.relu(model[0](x)), 2) for x in [torch.randn(5, 3, 8, 8)]]
    conv_pool.convert(model, "triton")

    def no_kernel(*a, **k):
        raise AssertionError("the fused kernel ran in evaluation")
    monkeypatch.setattr(conv_pool, "_ops", no_kernel)
    model.eval()
    torch.manual_seed(1)
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        got = model[2](model[1](model[0](x)))
    assert torch.equal(got, F.max_pool2d(F.relu(F.conv2d(x, model[0].weight, model[0].bias, padding=1)), 2))
    assert ref[0].shape == got.shape

    head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    mlp_head.convert(head, "triton")
    monkeypatch.setattr(mlp_head, "mlp_head", no_kernel)
    head.eval()
    h = torch.randn(3, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(h)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.linear(F.relu(F.linear(h, head[0].weight, head[0].bias)), head[2].weight, head[2].bias)
    assert torch.equal(out, want)


# -- the flat SGD update (flat_sgd.py): its Triton kernel under the same rule --------------------

CUDA = torch.device("cuda", 0)  # never touched: update_backend only passes it to the (replaced) key


def test_a_short_run_updates_with_torchs_fused_sgd_until_the_kernel_is_built(cache):
    backend, k, note = built.update_backend(("triton", "torch"), "momentum=True", 150_000, torch.float32, CUDA,
                                            total_steps=898)
    assert (backend, k) == ("torch", None) and "not built on this device" in note
    # A run long enough builds it, and leaves nothing recorded until the kernel ran (the caller marks).
    backend, k, note = built.update_backend(("triton", "torch"), "momentum=True", 150_000, torch.float32, CUDA,
                                            total_steps=built.BUILD_MIN_STEPS)
    assert backend == "triton" and k == "k-150000" and note is None and not built.is_built(k)
    built.mark_built(k, {"kernel": "flat-sgd"})
    # Built: every later run of the variant and layout takes the kernel, however short.
    assert built.update_backend(("triton", "torch"), "momentum=True", 150_000, torch.float32, CUDA,
                                total_steps=10)[:2] == ("triton", "k-150000")
    # Another layout is another build.
    assert built.update_backend(("triton", "torch"), "momentum=True", 150_001, torch.float32, CUDA,
                                total_steps=10)[0] == "torch"


def test_the_cpu_has_one_update_and_no_record(cache):
    assert built.update_backend(("torch",), "momentum=True", 100, torch.float32, torch.device("cpu"),
                                total_steps=10) == ("torch", None, None)
    assert not list(cache.iterdir())


def test_bind_takes_the_backend_it_is_given_and_both_give_torchs_sgd():
    """flat_sgd.bind(backend=torch) over the flat buffers steps as torch.optim.SGD does (the path a
    short GPU run takes; on the CPU it is the only one)."""
    from shmlearn.step import flat_sgd
    torch.manual_seed(0)
    ref = nn.Linear(5, 3)
    mine = nn.Linear(5, 3)
    mine.load_state_dict(ref.state_dict())
    params = list(mine.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    grads = torch.zeros_like(flat)
    at = 0
    for p in params:  # the parameters as views of one flat buffer, as sync/base.py lays them out
        n = p.numel()
        p.data = flat[at:at + n].view_as(p)
        at += n
    opt = torch.optim.SGD(params, lr=torch.tensor(0.1), momentum=0.9, weight_decay=1e-3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    update, why = flat_sgd.bind(opt, params, flat, grads, torch.zeros(()), backend="torch")
    assert why is None and not update.ran
    x = torch.randn(7, 5)
    for _ in range(3):
        ref_opt.zero_grad()
        F.mse_loss(ref(x), torch.zeros(7, 3)).backward()
        ref_opt.step()
        gs = torch.autograd.grad(F.mse_loss(mine(x), torch.zeros(7, 3)), params)
        grads.copy_(torch.cat([g.reshape(-1) for g in gs]))
        update()
    assert update.ran
    for a, b in zip(ref.parameters(), params):
        torch.testing.assert_close(a.detach(), b.detach())


def test_a_short_unbuilt_run_does_not_compile_to_check_kernels_it_will_not_run(cache, monkeypatch):
    """The fit check compiles each kernel (fit.py); a short run on a machine without the build
    would then leave the kernels to torch anyway: no check. Once built, the check runs (from
    Triton's cache) before the kernels are kept."""
    from shmlearn.step import kernels as step_kernels
    checks = []
    monkeypatch.setattr(conv_pool, "block_why_not",
                        lambda conv, dtype, device, check_fit=True: checks.append(check_fit) or None)
    opts = types.SimpleNamespace(conv_pool="auto", mlp_head="auto")
    cuda = torch.device("cuda", 0)  # never touched: the check is replaced, the key too (fixture)
    model = _model()
    got = step_kernels.choose(model, "triton", "off", opts, torch.float32, cuda, _Loader(), total_steps=898)
    assert checks == [False] and [c.path for c in got] == ["triton"]  # chosen unchecked; deferral comes next
    assert type(model[0]) is nn.Conv2d  # and not converted: that would define the kernels' ops
    checks.clear()
    built.mark_built(step_kernels.build_key(got, _Loader(), torch.float32, cuda), {"kernel": "conv-pool"})
    model = _model()
    got = step_kernels.choose(model, "triton", "off", opts, torch.float32, cuda, _Loader(), total_steps=898)
    assert checks == [False, True] and [c.path for c in got] == ["triton"]  # built here: checked, then kept
    assert type(model[0]) is conv_pool.ConvReluPool2d
    checks.clear()
    forced = types.SimpleNamespace(conv_pool="triton", mlp_head="auto")
    step_kernels.choose(_model(), "triton", "off", forced, torch.float32, cuda, _Loader(), total_steps=898)
    assert checks == [True]  # a forced kernel is always checked
    checks.clear()
    step_kernels.choose(_model(), "triton", "off", opts, torch.float32, cuda, _Loader(),
                        total_steps=built.BUILD_MIN_STEPS)
    assert checks == [True]  # a long run builds: checked


def test_a_sweeps_trial_builds_nothing_however_long_but_runs_what_is_built(cache):
    """A sweep's trials run the same ops: none builds under auto (built.sweep_trial), where the
    batch-16 trials of the seed's grid, long enough alone, each built for 74 s (issue 52)."""
    long = built.BUILD_MIN_STEPS * 2
    with built.sweep_trial():
        kc = _fused_choice(_model())
        assert kc._defer_unbuilt(_Loader(), torch.float32, total_steps=long) == (None, ["conv-pool"])
        assert "a sweep's trials build none" in kc.kernels[0].why
        assert built.update_backend(("triton", "torch"), "momentum=True", 150_000, torch.float32, CUDA,
                                    total_steps=long)[0] == "torch"
        forced = _fused_choice(_model(), conv_pool_mode="triton")
        assert forced._defer_unbuilt(_Loader(), torch.float32, total_steps=10) == ("k-4-3-8-8", [])
        built.mark_built("k-4-3-8-8", {"kernels": ["conv-pool"]})
        again = _fused_choice(_model())
        assert again._defer_unbuilt(_Loader(), torch.float32, total_steps=10) == ("k-4-3-8-8", [])
        assert again.kernels[0].path == "triton"
    # Outside the trial, the rule is the run's length again.
    assert built.update_backend(("triton", "torch"), "momentum=True", 150_000, torch.float32, CUDA,
                                total_steps=long)[0] == "triton"


def test_a_sweep_runs_its_trials_through_trial_main_which_marks_them(monkeypatch):
    from shmlearn.sweeps import trials
    from shmlearn.train import entry
    assert trials.trial_main is entry.trial_main
    seen = []
    monkeypatch.setattr(entry, "rank_main", lambda env, cfg, prune_key=None: seen.append((built._in_sweep, prune_key)))
    entry.trial_main(None, {}, "p")
    assert seen == [(True, "p")] and built._in_sweep is False


def test_the_environment_can_always_or_never_build(cache, monkeypatch):
    args = (("triton", "torch"), "momentum=True", 150_000, torch.float32, CUDA)
    monkeypatch.setenv(built.BUILDS_ENV, "always")
    assert built.update_backend(*args, total_steps=10)[0] == "triton"
    with built.sweep_trial():
        assert built.update_backend(*args, total_steps=10)[0] == "triton"
    monkeypatch.setenv(built.BUILDS_ENV, "never")
    assert built.update_backend(*args, total_steps=built.BUILD_MIN_STEPS)[0] == "torch"
    monkeypatch.setenv(built.BUILDS_ENV, "auto")
    assert built.update_backend(*args, total_steps=built.BUILD_MIN_STEPS)[0] == "triton"

