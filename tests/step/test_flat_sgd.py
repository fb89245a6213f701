"""shmlearn/step/flat_sgd.py: SGD as one kernel over the flat buffers against torch.optim.SGD on the same
model, and what `bind` refuses. Each behaviour is checked for both backends: the Triton kernel (in
Triton's interpreter on the CPU: the `interpreted` tests) and torch's fused SGD over the flat
buffers (the CPU's update: the `_on_the_cpu` tests)."""
import copy

import pytest
import torch
from torch import nn

from shmlearn.step import flat_sgd
from shmlearn.sync import build_strategy
from triton_interp import interpreted_together as interpreted  # one interpreter process for the module


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _pair(momentum, nesterov, wd, channels_last=True):
    """(model, strategy, found_inf, update) bound to the flat kernel, and (ref, ref_opt): torch's SGD
    (single-tensor, no fused kernel) on an identical copy."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    kw = dict(lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    opt = torch.optim.SGD(model.parameters(), **kw)
    s = build_strategy("allreduce", rank=0, world_size=1)
    s.setup(model, opt, channels_last=channels_last)
    opt.param_groups[0]["lr"] = torch.tensor(0.1)  # the fast step's lr lives in a tensor
    found_inf = torch.zeros(())
    update, why = flat_sgd.bind(opt, s._trainable, s.params_flat, s.grads_flat, found_inf)
    assert why is None and update is not None
    return model, s, found_inf, update, ref, torch.optim.SGD(ref.parameters(), foreach=False, **kw)


def _grads(model, s, ref, i):
    x = torch.randn(6, 3, 5, 5, generator=torch.Generator().manual_seed(i))
    s.zero_grad()
    model(x).square().mean().backward()
    ref.zero_grad()
    ref(x).square().mean().backward()


SGD_CASES = [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 5e-4), (0.5, False, 1e-2)]


@interpreted
@pytest.mark.parametrize("momentum,nesterov,wd", SGD_CASES)
def test_flat_kernel_steps_as_torch_sgd(momentum, nesterov, wd):
    _steps_as_torch_sgd(momentum, nesterov, wd, "triton")


@pytest.mark.parametrize("momentum,nesterov,wd", SGD_CASES)
def test_flat_update_on_the_cpu_steps_as_torch_sgd(momentum, nesterov, wd):
    _steps_as_torch_sgd(momentum, nesterov, wd, "torch")


def _steps_as_torch_sgd(momentum, nesterov, wd, backend):
    assert flat_sgd._backend(torch.device("cpu")) == backend  # the backend this test means to check
    model, s, _, update, ref, ref_opt = _pair(momentum, nesterov, wd)
    for i in range(4):
        _grads(model, s, ref, i)
        update()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    if momentum:  # the state torch would hold, each buffer a view of one flat tensor, laid out as its parameter
        bufs = [s.optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
        for a, p in zip(bufs, ref.parameters()):
            torch.testing.assert_close(a, ref_opt.state[p]["momentum_buffer"], rtol=1e-6, atol=1e-7)
        assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1
        assert bufs[0].stride() == model.conv.weight.stride()  # channels_last, as the parameter


@interpreted
def test_a_set_skip_flag_leaves_weights_and_momentum_alone_even_with_nan_gradients():
    _skip_flag_leaves_everything_alone()


def test_a_set_skip_flag_leaves_weights_and_momentum_alone_on_the_cpu():
    assert flat_sgd._backend(torch.device("cpu")) == "torch"
    _skip_flag_leaves_everything_alone()


def _skip_flag_leaves_everything_alone():
    model, s, found_inf, update, _, _ = _pair(0.9, False, 1e-3)
    _grads(model, s, copy.deepcopy(model), 0)
    update()
    before = s.params_flat.clone()
    mom = s.optimizer.state[model.fc.weight]["momentum_buffer"].clone()
    s.grads_flat.fill_(float("nan"))
    found_inf.fill_(1.0)
    update()
    assert torch.equal(s.params_flat, before)
    assert torch.equal(s.optimizer.state[model.fc.weight]["momentum_buffer"], mom)


@interpreted
def test_bind_keeps_loaded_momentum_and_the_state_dict_round_trips():
    torch.manual_seed(1)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.randn_like(p)  # as a resumed checkpoint leaves them
    saved = copy.deepcopy(opt.state_dict())
    s = build_strategy("allreduce", rank=0, world_size=1)
    s.setup(model, opt, channels_last=True)
    update, why = flat_sgd.bind(opt, s._trainable, s.params_flat, s.grads_flat, torch.zeros(()))
    assert why is None
    for k, v in opt.state_dict()["state"].items():
        assert torch.equal(v["momentum_buffer"], saved["state"][k]["momentum_buffer"])


def test_bind_says_why_not_and_leaves_the_optimizer_alone():
    torch.manual_seed(0)
    model = _Net()
    params = list(model.parameters())
    flat = torch.zeros(3)
    cases = [(torch.optim.Adam(params), "not SGD"),
             (torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1), "more than one"),
             (torch.optim.SGD(params[:3], lr=0.1), "not the model's trainable"),
             (torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1), "dampening"),
             (torch.optim.SGD(params, lr=0.1, maximize=True), "maximize")]
    for opt, why in cases:
        assert why in flat_sgd.why_not(opt, params, flat)
        assert flat_sgd.bind(opt, params, flat, flat, torch.zeros(()))[0] is None
    assert flat_sgd.why_not(torch.optim.SGD(params, lr=0.1), params, flat) is None  # the CPU's update
    meta = torch.zeros(3, device="meta")
    assert "runs on CUDA and the CPU, not meta" in flat_sgd.why_not(torch.optim.SGD(params, lr=0.1), params, meta)


@interpreted
def test_a_fast_run_with_the_flat_update_is_the_run_with_torch_sgd(tmp_path, monkeypatch):
    _fast_run_is_the_torch_sgd_run(tmp_path, monkeypatch)


def test_a_fast_run_with_the_cpus_flat_update_is_the_run_with_torch_sgd(tmp_path, monkeypatch):
    assert flat_sgd._backend(torch.device("cpu")) == "torch"
    _fast_run_is_the_torch_sgd_run(tmp_path, monkeypatch)


def _fast_run_is_the_torch_sgd_run(tmp_path, monkeypatch):
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    runs = {}
    for flat in (True, False):
        if not flat:
            monkeypatch.setattr(flat_sgd, "why_not", lambda *a: "off for the test")
        runs[flat] = shmlearn.train(TrainConfig(
            model="lenet", dataset="digits", samples=512, batch_size=32, workers=1, device="cpu", progress=False,
            eval_points=1, optimizer="nesterov", weight_decay=1e-3, check_every=4, threads=1,
            out=str(tmp_path / str(flat))))
    assert runs[True].summary["update_kernel"] == "flat"
    assert runs[False].summary["update_kernel"] == "torch-fused"
    assert runs[True].summary["step_mode"] == "fast-eager"
    for a, b in zip(runs[True].model.parameters(), runs[False].model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


@interpreted
def test_early_parameters_taken_one_by_one_and_the_rest_give_the_whole_update():
    """bind(early=...): take(i, grad) for early parameters (from a bf16 gradient laid out as the
    parameter, or from an fp32 one in another layout: copied in first), then update() for the
    rest, is the one flat update over the same gradients (bit for bit here, `_same_update`); take writes its gradient
    into the buffer, and update() leaves the early ones alone (their slots start as NaN here)."""
    _early_then_rest_is_the_whole_update()


def test_early_parameters_and_the_rest_give_the_whole_update_on_the_cpu():
    assert flat_sgd._backend(torch.device("cpu")) == "torch"
    _early_then_rest_is_the_whole_update()


def _early_then_rest_is_the_whole_update():
    for early in ([0], [0, 1], [1, 2], [1], [3], [0, 2], [2]):
        model, s, _, full, _, _ = _pair(0.9, True, 1e-3)
        twin, s2, _, _, _, _ = _pair(0.9, True, 1e-3)
        part, why = flat_sgd.bind(s2.optimizer, s2._trainable, s2.params_flat, s2.grads_flat, torch.zeros(()),
                                  early=early)
        assert why is None and part.early == frozenset(early)
        at = _positions(s, early)
        for i in range(3):
            _grads(model, s, copy.deepcopy(model), i)
            s2.grads_flat.fill_(float("nan"))
            s2.grads_flat[~at] = s.grads_flat[~at]
            for k in early:
                view = s._grad_views[k]
                src = view.bfloat16() if i != 1 else view.contiguous()  # bf16 as the parameter / fp32 contiguous
                assert i != 1 or view.dim() != 4 or src.stride() != view.stride()
                view.copy_(src.float())  # the reference updates from what take is given
                part.take(k, src)
            part()
            full()
            assert torch.equal(s2.grads_flat, s.grads_flat)
            _same_update(s2.params_flat, s.params_flat, early)


def _same_update(a, b, what=None):
    """Two updates of the same weights by different calls: bit for bit in Triton's interpreter (one
    kernel, numpy's exactly rounded arithmetic); to a few ulps with torch's fused SGD, whose
    vectorised body (FMA under avx2/avx512) and scalar tail fall on different elements when the
    buffer is cut into other ranges (equal only under ATEN_CPU_CAPABILITY=default)."""
    if flat_sgd._backend(a.device) == "triton":
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")


def _positions(s, indices):
    """The flat buffer's positions of parameters `indices` (a bool mask)."""
    mask = torch.zeros(s.grads_flat.numel(), dtype=torch.bool)
    base = s.params_flat.data_ptr()
    for k in indices:
        p = s._trainable[k]
        a = (p.data_ptr() - base) // p.element_size()
        mask[a:a + p.numel()] = True
    return mask


@interpreted
def test_the_update_writes_the_weight_copy_as_it_writes_the_weights():
    """bind(copy=...): the copy starts as the weights cast to bf16 and, after every update (the
    whole one, and take's for the early parameters), holds the new weights cast, bit for bit as
    torch's cast (round to nearest even); a skipped update leaves both alone; refresh casts again
    after another writer; the weights themselves step as without a copy."""
    _update_writes_the_weight_copy()


def test_the_cpus_update_writes_the_weight_copy_as_it_writes_the_weights():
    assert flat_sgd._backend(torch.device("cpu")) == "torch"
    _update_writes_the_weight_copy()


def _update_writes_the_weight_copy():
    model, s, found_inf, plain, _, _ = _pair(0.9, True, 1e-3)
    twin, s2, found2, _, _, _ = _pair(0.9, True, 1e-3)
    copy_buf = flat_sgd.weight_copy(s2.params_flat, torch.bfloat16)
    copy_buf.fill_(float("nan"))  # bind fills it
    upd, why = flat_sgd.bind(s2.optimizer, s2._trainable, s2.params_flat, s2.grads_flat, found2, early=[0],
                             copy=copy_buf)
    assert why is None and torch.equal(copy_buf, s2.params_flat.bfloat16())
    for i in range(3):
        _grads(model, s, copy.deepcopy(model), i)
        s2.grads_flat.copy_(s.grads_flat)
        plain()
        upd.take(0, s2._grad_views[0].clone())
        upd()
        _same_update(s2.params_flat, s.params_flat)
        assert torch.equal(copy_buf, s2.params_flat.bfloat16()), i
        conv = twin.conv.weight  # a 4-D view, laid out as its parameter (channels_last)
        view = flat_sgd.copy_view(copy_buf, conv, s2.params_flat)
        assert view.stride() == conv.stride() and torch.equal(view, conv.detach().bfloat16())
    before, cast = s2.params_flat.clone(), copy_buf.clone()
    found2.fill_(1.0)
    upd.take(0, s2._grad_views[0].clone())
    upd()
    assert torch.equal(s2.params_flat, before) and torch.equal(copy_buf, cast)
    s2.params_flat.mul_(0.5)  # another writer (an average, a broadcast)
    upd.refresh()
    assert torch.equal(copy_buf, s2.params_flat.bfloat16())
    with pytest.raises(ValueError, match="params_flat's length"):
        flat_sgd.bind(s2.optimizer, s2._trainable, s2.params_flat, s2.grads_flat, found2, copy=copy_buf[1:])
    # The rounding's edges, against torch's cast bit for bit: ties to even (down and up), negative,
    # overflow to inf, a subnormal, -0; NaN (a zero gradient and no weight decay keep the weights).
    _, s3, found3, _, _, _ = _pair(0.0, False, 0.0)
    buf = flat_sgd.weight_copy(s3.params_flat, torch.bfloat16)
    upd3, _ = flat_sgd.bind(s3.optimizer, s3._trainable, s3.params_flat, s3.grads_flat, found3, copy=buf)
    edges = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.4e38, float("nan"), 2.0 ** -130, -0.0])
    with torch.no_grad():
        s3.params_flat[:edges.numel()] = edges
    s3.grads_flat.zero_()
    buf.zero_()
    upd3()
    nan = s3.params_flat.isnan()  # NaN stays NaN (its bits differ between torch's own casts)
    assert torch.equal(buf.isnan(), nan) and nan.sum() == 1
    assert torch.equal(buf.view(torch.int16)[~nan], s3.params_flat.bfloat16().view(torch.int16)[~nan])


def test_the_torch_update_leaves_the_autograd_version_of_weights_and_copy_as_the_kernel_does():
    """The update in the backward steps a weight, and writes its bf16 copy, while the step's graph
    still holds them: torch's fused SGD over the flat buffers must not move their versions (the
    Triton kernel does not), or that backward fails. And the values are written all the same."""
    from shmlearn.step import _flat_sgd_torch
    torch.manual_seed(0)
    p, g = torch.randn(10), torch.randn(10)
    copy = p.to(torch.bfloat16)
    w = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(4, requires_grad=True)
    y = (w * copy[2:6]).sum() + (v * p[2:6]).sum()  # saves a view of each buffer for the backward
    want = p - 0.1 * g
    _flat_sgd_torch.sgd_(p, g, None, torch.tensor(0.1), torch.zeros(()), momentum=0.0, dampening=0.0,
                         weight_decay=0.0, nesterov=False, copy=copy)
    y.backward()  # "modified by an inplace operation" if a version moved
    torch.testing.assert_close(p, want)
    assert torch.equal(copy, p.to(torch.bfloat16))
