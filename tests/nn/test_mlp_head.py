"""shmlearn/nn/mlp_head.py: the fused classifier head (Triton's interpreter on the CPU, fp16
autocast: numpy has no bf16) against the same nn.Sequential run by torch, and --mlp-head."""
import copy

import pytest
import torch
from torch import nn

from inductor import needs_build
from shmlearn.nn.mlp_head import FusedHeadLinear, FusedHeadReLU, MLPHead, convert, heads
from triton_interp import interpreted_together as interpreted  # one interpreter process for the module


def _head(sizes, bias=True):
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b, bias=bias), nn.ReLU()]
    return nn.Sequential(nn.Flatten(), *layers[:-1])


def _agree(m, x, tol=(2e-3, 2e-3)):
    """m (converted) against a torch copy under fp16 autocast: output, x's gradient and every
    parameter's gradient; returns how many times the fused kernels ran."""
    ref = copy.deepcopy(m)
    convert(ref, "off")
    from shmlearn.nn import _mlp_head_triton as kernels
    calls = []
    fwd, bwd = kernels.forward, kernels.backward
    kernels.forward = lambda *a, **k: (calls.append("f"), fwd(*a, **k))[1]
    kernels.backward = lambda *a, **k: (calls.append("b"), bwd(*a, **k))[1]
    try:
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        outs = []
        for net, xi in zip((m, ref), xs):
            with torch.autocast("cpu", dtype=torch.float16):
                outs.append(net(xi))
        g = torch.randn_like(outs[0].float()).to(outs[0].dtype)
        for o in outs:
            o.backward(g)
    finally:
        kernels.forward, kernels.backward = fwd, bwd
    assert outs[0].dtype == outs[1].dtype == torch.float16
    torch.testing.assert_close(outs[0], outs[1], rtol=tol[0], atol=tol[1])
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=tol[0], atol=tol[1])
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol[0], atol=10 * tol[1])
    return calls


@interpreted
@pytest.mark.parametrize("sizes,bias,batch", [((1024, 64, 32, 10), True, 40),   # alexnet-small's head
                                              ((100, 24, 12), False, 17),        # 2 layers, no bias
                                              ((70, 128, 84, 5), True, 33)])     # widths not powers of two
def test_fused_head_matches_torch_forward_and_every_gradient(sizes, bias, batch):
    torch.manual_seed(sum(sizes))
    m = _head(sizes, bias)
    assert convert(m, "triton") == 1
    x = torch.randn(batch, sizes[0]).half().float()  # values fp16 holds exactly: only the sums' order differs
    assert _agree(m, x) == ["f", "b"]


@interpreted
@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_inductor_compiles_around_the_fused_head_and_agrees():
    torch.manual_seed(2)
    m = _head((48, 32, 16, 10))
    ref = copy.deepcopy(m)
    assert convert(m, "triton") == 1
    x = torch.randn(8, 48)
    with torch.autocast("cpu", dtype=torch.float16):
        out = torch.compile(m, dynamic=False)(x)
        r = ref(x)
    out.float().sum().backward()
    r.float().sum().backward()
    torch.testing.assert_close(out, r, rtol=2e-3, atol=2e-3)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-3, atol=2e-2)


def test_fp32_and_more_than_two_dimensions_run_torch_s_ops():
    torch.manual_seed(0)
    m = _head((12, 8, 4))
    ref = copy.deepcopy(m)
    convert(m, "triton")
    x = torch.randn(3, 12)
    assert torch.equal(m(x), ref(x))  # fp32: the same torch ops, bit for bit
    x3 = torch.randn(2, 3, 12)
    with torch.autocast("cpu", dtype=torch.float16):  # 3-D: torch's ops even under autocast
        assert torch.equal(m[1](x3), ref[1:](x3))


def test_convert_fuses_only_qualifying_chains_both_ways_and_keeps_the_parameters():
    m = nn.Sequential(nn.Flatten(), nn.Linear(50, 200), nn.ReLU(),  # 200 wide: not fused, the chain starts after it
                      nn.Linear(200, 64), nn.ReLU(inplace=True), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10),
                      nn.Sequential(nn.Linear(10, 8), nn.GELU(), nn.Linear(8, 4)),  # GELU: not ReLU
                      nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8),
                                    nn.ReLU(), nn.Linear(8, 2)))  # 4 Linears: the last 3 are fused
    state = copy.deepcopy(m.state_dict())
    found = heads(m)
    assert [len(c) for c in found] == [5, 5]
    assert found[0][0] is m[3] and found[1][0] is m[9][2]
    assert convert(m, "triton") == 2
    assert type(m[3]) is MLPHead and type(m[1]) is nn.Linear and type(m[9][0]) is nn.Linear
    assert [type(k) for k in list(m)[4:8]] == [FusedHeadReLU, FusedHeadLinear, FusedHeadReLU, FusedHeadLinear]
    assert type(m[8][0]) is nn.Linear
    assert m.state_dict().keys() == state.keys()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in state.items())
    assert convert(m, "off") == 0
    assert all(type(k) in (nn.Flatten, nn.Linear, nn.ReLU, nn.Sequential) for k in m)
    assert "_fused_rest" not in m[3].__dict__


def test_mlp_head_flag_is_checked_and_triton_is_refused_off_cuda():
    from shmlearn.config.train_config import TrainConfig, validate
    from shmlearn.errors import BadInput
    from shmlearn.nn.mlp_head import usable
    with pytest.raises(BadInput, match=r"^--mlp-head fused: choose one of off, triton, auto$"):
        validate(TrainConfig(mlp_head="fused"))
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert usable(torch.device("cpu")).startswith("--mlp-head triton: Triton's kernels run on CUDA devices")


@interpreted
def test_a_run_counts_its_fused_heads(tmp_path):
    """On the CPU in fp32 the head runs torch's ops (auto is off there); triton asked for in fp32
    leaves it to torch too (the kernels are bf16/fp16 only), says so in summary.json's kernels,
    and the run is the same run."""
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    runs = [shmlearn.train(TrainConfig(model="alexnet-small", dataset="digits", samples=64, workers=1,  # 2 steps
                                       mlp_head=mode, device="cpu", progress=False, eval_points=1, eval_at_start="off",
                                       deterministic=True, out=str(tmp_path / mode))) for mode in ("off", "triton")]
    assert (runs[0].summary["mlp_heads"], runs[1].summary["mlp_heads"]) == (0, 0)
    assert runs[1].summary["mlp_head"] == "triton"
    assert [k for k in runs[1].summary["kernels"] if k["kernel"] == "mlp-head"] == [
        {"layer": "10 (head 64->64->32->10)", "kernel": "mlp-head", "path": "torch",
         "why": "float32: the fused head runs in bf16 or fp16 only"}]
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(a, b)


@interpreted
def test_converted_modules_trace_as_one_graph_inside_autocast():
    """fast.py compiles the forward and the loss as one function, autocast inside: a graph break
    there (the custom ops defined while Dynamo traces) would leave the rest of the forward eager."""
    import torch._dynamo
    from shmlearn.nn import conv_pool
    torch._dynamo.reset()
    m = nn.Sequential(nn.Conv2d(3, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                      nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))
    assert conv_pool.convert(m, "triton") == 1 and convert(m, "triton") == 1

    def loss(x, y):
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            out = m(x)
        return torch.nn.functional.cross_entropy(out.float(), y)

    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    e = torch._dynamo.explain(loss)(x, torch.tensor([0, 1, 2, 3]))
    assert (e.graph_count, e.graph_break_count) == (1, 0), [b.reason[:200] for b in e.break_reasons]
