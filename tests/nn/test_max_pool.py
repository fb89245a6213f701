"""--max-pool reduce against torch's max_pool2d and adaptive_max_pool2d (shmlearn/nn/max_pool.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inductor import needs_build
from shmlearn.config.train_config import TrainConfig, validate
from shmlearn.errors import BadInput
from shmlearn.nn.max_pool import ReduceAdaptiveMaxPool2d, ReduceMaxPool2d, convert, qualifies, resolve

LAYOUTS = (torch.contiguous_format, torch.channels_last)


def _pool_pair(pool: nn.Module, x: torch.Tensor):
    """(reduce's output and input gradient, torch's), for the same upstream gradient."""
    ref = copy.deepcopy(pool)
    convert(pool, "reduce")
    assert type(pool) in (ReduceMaxPool2d, ReduceAdaptiveMaxPool2d)
    outs = []
    for m in (pool, ref):
        xi = x.detach().clone().requires_grad_(True)
        y = m(xi)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float32).to(y.dtype)
        y.backward(g)
        outs.append((y, xi.grad))
    return outs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("hw,k", (((8, 8), 2), ((7, 7), 2), ((6, 9), 3), ((5, 8), (1, 2))))
def test_window_pool_is_max_pool2d_forward_and_backward(layout, dtype, hw, k):
    """Distinct values within every window: no ties, so the gradients must match exactly too; odd
    sizes drop their last row and column as floor mode does."""
    n, c = 3, 5
    # Integers below 256 (exact in bf16): 37 * position mod 256 differs between any two
    # positions less than 256 apart, so within every window; a random shift per plane.
    pos = torch.arange(hw[0] * hw[1]).reshape(1, 1, *hw)
    shift = torch.randint(0, 256, (n, c, 1, 1), generator=torch.Generator().manual_seed(0))
    x = ((pos * 37 + shift) % 256).to(dtype).contiguous(memory_format=layout)
    (y, gx), (yr, gr) = _pool_pair(nn.MaxPool2d(k), x)
    assert y.shape == yr.shape
    assert torch.equal(y, yr)
    assert torch.equal(gx, gr)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_global_pool_is_adaptive_max_pool2d(layout):
    x = torch.randn(4, 6, 5, 7, generator=torch.Generator().manual_seed(2)).contiguous(memory_format=layout)
    (y, gx), (yr, gr) = _pool_pair(nn.AdaptiveMaxPool2d(1), x)
    assert y.shape == yr.shape == (4, 6, 1, 1)
    assert torch.equal(y, yr) and torch.equal(gx, gr)
    (y, gx), (yr, gr) = _pool_pair(nn.AdaptiveMaxPool2d((1, 1)), x)
    assert torch.equal(y, yr) and torch.equal(gx, gr)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ties_give_the_gradient_to_the_first_maximum_as_torch_does(layout):
    """Many equal values (small integers): the first maximum of each window in row-major order
    gets the whole gradient, as max_pool2d's kernels give it."""
    x = torch.randint(0, 3, (2, 3, 6, 8), generator=torch.Generator().manual_seed(5)).float()
    x = x.contiguous(memory_format=layout)
    for pool in (nn.MaxPool2d(2), nn.MaxPool2d((3, 2)), nn.AdaptiveMaxPool2d(1)):
        (y, gx), (yr, gr) = _pool_pair(pool, x)
        assert torch.equal(y, yr)
        assert torch.equal(gx, gr), type(pool)


def test_a_recomputed_input_cannot_make_the_gradient_nan():
    """The backward uses the forward's positions, not x == max: an x that differs in the
    backward (Inductor may recompute it in another precision) still gives finite gradients.
    Here the saved positions are reused for a different input of the same shape."""
    from shmlearn.nn.max_pool import _WindowMax
    w = torch.randn(4, 5, 4, requires_grad=True)
    y = _WindowMax.apply(w)
    with torch.no_grad():
        w.add_(torch.randn_like(w))  # the window's values change after the forward
    y.sum().backward()
    assert torch.isfinite(w.grad).all()
    assert torch.equal(w.grad.sum(-1), torch.ones(4, 5))


@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_fashion_net_compiled_in_bf16_has_finite_gradients_equal_to_torch_pools():
    """The case that diverged with amax: conv-BatchNorm-GELU blocks, 7x7 maps cropped by a 2x2
    pool, a global max-pool; compiled under bf16 autocast, against the same net with torch's pools
    (and eagerly in fp32: a compile of the whole net in fp32 as well doubled the test's ~35 s, and
    test_inductor_compiles_the_reductions_and_agrees checks the compiled fp32 reductions)."""
    from shmlearn.data.base import DataSpec
    from shmlearn.models import build_model
    torch.manual_seed(0)
    spec = DataSpec("fashion-mnist", "classification", (1, 28, 28), 10)
    ref = build_model("fashion-net", spec).to(memory_format=torch.channels_last)
    m = copy.deepcopy(ref)
    assert convert(m, "reduce") == 4
    x = torch.randn(16, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (16,))
    for bf16 in (False, True):
        for net in (m, ref):
            net.zero_grad()
        for net in (torch.compile(m, dynamic=False) if bf16 else m, ref):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = net(x)
            F.cross_entropy(out.float(), y).backward()
        got = torch.cat([p.grad.flatten() for p in m.parameters()])
        want = torch.cat([p.grad.flatten() for p in ref.parameters()])
        assert torch.isfinite(got).all()
        if bf16:  # compiled and eager bf16 round differently: the same direction and size (cosine
            # 0.9894 on a 2-core AMD EPYC with avx2, above 0.99 on the CPUs before it: the rounding
            # differs with the vector code torch's CPU kernels take)
            assert F.cosine_similarity(got, want, dim=0) > 0.98
            assert abs(got.norm() / want.norm() - 1) < 0.02
        else:
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_only_exact_cases_convert_and_conversion_goes_both_ways():
    keep = [nn.MaxPool2d(3, 2), nn.MaxPool2d(2, padding=1), nn.MaxPool2d(2, dilation=2),
            nn.MaxPool2d(2, ceil_mode=True), nn.MaxPool2d(2, return_indices=True), nn.AdaptiveMaxPool2d(2),
            nn.AdaptiveMaxPool2d(1, return_indices=True), nn.AvgPool2d(2)]
    assert not any(qualifies(m) for m in keep)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.MaxPool2d(2), *keep[:2], nn.MaxPool2d((2, 2), stride=2),
                          nn.AdaptiveMaxPool2d(1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert convert(model, "reduce") == 3
    assert [type(m) for m in model] == [nn.Conv2d, ReduceMaxPool2d, nn.MaxPool2d, nn.MaxPool2d, ReduceMaxPool2d,
                                        ReduceAdaptiveMaxPool2d]
    assert convert(model, "global") == 1
    assert [type(m) for m in model] == [nn.Conv2d, nn.MaxPool2d, nn.MaxPool2d, nn.MaxPool2d, nn.MaxPool2d,
                                        ReduceAdaptiveMaxPool2d]
    assert convert(model, "aten") == 0
    assert [type(m) for m in model] == [nn.Conv2d, nn.MaxPool2d, nn.MaxPool2d, nn.MaxPool2d, nn.MaxPool2d,
                                        nn.AdaptiveMaxPool2d]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    with pytest.raises(ValueError):
        convert(model, "auto")


def test_auto_is_global_exactly_when_compiled():
    assert resolve("auto", True) == "global" and resolve("auto", False) == "aten"
    assert resolve("aten", True) == "aten" and resolve("reduce", False) == "reduce"


@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_inductor_compiles_the_reductions_and_agrees():
    torch.manual_seed(4)
    m = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.GELU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                      nn.MaxPool2d(2), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    ref = copy.deepcopy(m)
    assert convert(m, "reduce") == 3
    x = torch.randn(4, 2, 12, 12).contiguous(memory_format=torch.channels_last)
    out = torch.compile(m, dynamic=False)(x)
    out.square().sum().backward()
    r = ref(x)
    r.square().sum().backward()
    torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


def test_max_pool_flag_is_checked():
    with pytest.raises(BadInput, match=r"^--max-pool fused: choose one of aten, global, reduce, auto$"):
        validate(TrainConfig(max_pool="fused"))


def test_summary_says_how_the_pools_ran(tmp_path):
    """lenet's two 2x2 pools: reduce converts both, auto without --compile leaves them; the run
    with reduce pools is the same training run (no ties in float32 here: same losses)."""
    import json

    import shmlearn
    losses = {}
    for mode in ("auto", "reduce"):
        res = shmlearn.train(TrainConfig(model="lenet", dataset="digits", workers=1, device="cpu", samples=640,
                                         max_pool=mode, log_every=1, eval_points=1, eval_at_start="off", progress=False,
                                         deterministic=True, out=str(tmp_path / mode)))
        s = res.summary
        assert (s["max_pool"], s["max_pools"]) == (("aten", 0) if mode == "auto" else ("reduce", 2))
        losses[mode] = [json.loads(line)["loss"] for line in open(tmp_path / mode / "metrics.jsonl")]
    assert len(losses["auto"]) == 20
    assert losses["auto"] == pytest.approx(losses["reduce"], rel=1e-5, abs=1e-6)
