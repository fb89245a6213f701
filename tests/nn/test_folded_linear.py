"""FoldedLinear and the in-place ShiftRight / ShiftLeft against out-of-place references."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import shmlearn.nn.folded_linear as fl
from shmlearn.nn.folded_linear import (FoldedLinear, fold_linears, folded_matmul, helper_size,
                                       shift_left_, shift_right_)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# 1 row, 1 column, rows > cols, rows < cols, square, wide, large; then random shapes
SHAPES = [(1, 1), (1, 37), (37, 1), (50, 20), (20, 50), (33, 33), (3, 1500), (1000, 700)]
_rng = random.Random(8)
SHAPES += [(_rng.randint(1, 300), _rng.randint(1, 300)) for _ in range(6)]


def right_ref(a: torch.Tensor) -> torch.Tensor:
    """Out-of-place ShiftRight: [1 | A], flattened."""
    return torch.cat([torch.ones(a.shape[0], 1, dtype=a.dtype, device=a.device), a], 1).flatten()


def loaded(a: torch.Tensor, extra: int = 0) -> torch.Tensor:
    """A buffer of rows*(cols+1)+extra random values with A in its first rows*cols."""
    rows, cols = a.shape
    buf = torch.randn(rows * (cols + 1) + extra, device=a.device).to(a.dtype)
    buf[:rows * cols] = a.flatten()
    return buf


def check_roundtrip(rows, cols, dtype, device, **kw):
    a = torch.randn(rows, cols, device=device).to(dtype)
    buf = loaded(a, extra=5)
    tail = buf[rows * (cols + 1):].clone()
    assert shift_right_(buf, rows, cols, **kw) is buf
    assert torch.equal(buf[:rows * (cols + 1)], right_ref(a))
    assert torch.equal(buf[rows * (cols + 1):], tail)  # nothing written past the matrix
    shift_left_(buf, rows, cols, **kw)
    assert torch.equal(buf[:rows * cols], a.flatten())
    # ShiftLeft on its own, from a buffer laid out as [1 | A]
    aug = right_ref(a).clone()
    shift_left_(aug, rows, cols, **kw)
    assert torch.equal(aug[:rows * cols], a.flatten())


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_shifts_cpu_match_reference(rows, cols):
    check_roundtrip(rows, cols, torch.float32, "cpu")


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 5), (5, 7), (64, 3), (1000, 700)])
def test_shifts_cpu_small_helper(rows, cols):
    """A staging helper of a few rows forces many blocks, so block boundaries are exercised."""
    check_roundtrip(rows, cols, torch.float32, "cpu", helper=torch.empty(3 * cols + 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int32])
def test_shifts_cpu_dtypes(dtype):
    rows, cols = 41, 29
    a = (torch.randn(rows, cols) * 100).to(dtype)
    buf = loaded(a)
    shift_right_(buf, rows, cols)
    assert torch.equal(buf, right_ref(a))
    shift_left_(buf, rows, cols)
    assert torch.equal(buf[:rows * cols], a.flatten())


def test_shift_validates_arguments():
    with pytest.raises(ValueError, match="rows \\* \\(cols \\+ 1\\)"):
        shift_right_(torch.zeros(6), 2, 3)  # needs 8
    with pytest.raises(ValueError, match="1-D"):
        shift_left_(torch.zeros(4, 2), 2, 3)
    with pytest.raises(ValueError, match="backend"):
        shift_right_(torch.zeros(8), 2, 3, backend="cuda")
    if not CUDA:
        with pytest.raises(RuntimeError, match="triton"):
            shift_right_(torch.zeros(8), 2, 3, backend="triton")


def test_helper_size_is_the_triangle():
    for rows in range(0, 30):
        for cols in range(0, 12):
            assert helper_size(rows, cols) == sum(min(r, cols) for r in range(rows))
    assert helper_size(100, 200) == 100 * 99 // 2  # the paper's rows(rows-1)/2


@needs_cuda
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_shifts_cuda_match_reference(rows, cols):
    check_roundtrip(rows, cols, torch.float32, "cuda")           # Triton where installed
    check_roundtrip(rows, cols, torch.float32, "cuda", backend="torch")


@needs_cuda
@pytest.mark.parametrize("rows,cols", [(37, 1), (20, 50), (50, 20), (1000, 700), (257, 3000)])
@pytest.mark.parametrize("reverse", [False, True])
def test_shifts_triton_both_launch_orders(rows, cols, reverse):
    """Rows launched in ascending order make ShiftRight's hazards fire (rows above overwrite
    the heads of rows below); descending order makes ShiftLeft's fire. Both must pass."""
    st = pytest.importorskip("shmlearn.nn._shift_triton")
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(rows, cols, device="cuda").to(dtype)
        buf = loaded(a)
        st.shift_right(buf, rows, cols, reverse=reverse)
        torch.cuda.synchronize()
        assert torch.equal(buf, right_ref(a))
        st.shift_left(buf, rows, cols, reverse=reverse)
        assert torch.equal(buf[:rows * cols], a.flatten())
    helper = torch.empty(helper_size(rows, cols), device="cuda")
    buf = loaded(a.float())
    shift_right_(buf, rows, cols, helper=helper, backend="triton")
    assert torch.equal(buf, right_ref(a.float()))


# ---------------------------------------------------------------------------------------------
# FoldedLinear
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["function", "autograd"])
@pytest.mark.parametrize("n,fin,fout", [(1, 1, 1), (128, 1024, 64), (7, 64, 32), (33, 5, 300)])
def test_folded_matches_linear(impl, n, fin, fout):
    torch.manual_seed(n + fin + fout)
    lin = nn.Linear(fin, fout, dtype=torch.float64)
    fold = FoldedLinear.from_linear(lin, impl=impl)
    x = torch.randn(n, fin, dtype=torch.float64)
    dy = torch.randn(n, fout, dtype=torch.float64)
    xl, xf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yl, yf = lin(xl), fold(xf)
    yl.backward(dy)
    yf.backward(dy)
    torch.testing.assert_close(yf, yl)
    torch.testing.assert_close(xf.grad, xl.grad)
    torch.testing.assert_close(fold.folded.grad[:, 1:], lin.weight.grad)
    torch.testing.assert_close(fold.folded.grad[:, 0], lin.bias.grad)


def test_folded_float32_and_leading_dims():
    torch.manual_seed(0)
    lin = nn.Linear(48, 24)
    fold = FoldedLinear.from_linear(lin)
    x = torch.randn(3, 5, 48)
    torch.testing.assert_close(fold(x), lin(x))
    assert fold(x).shape == (3, 5, 24)


def test_folded_without_bias():
    lin = nn.Linear(9, 4, bias=False)
    fold = FoldedLinear.from_linear(lin)
    assert fold.bias is None and fold.folded.shape == (4, 9)
    x = torch.randn(6, 9)
    torch.testing.assert_close(fold(x), lin(x))


def test_folded_is_a_drop_in():
    fold = FoldedLinear(10, 3)
    assert isinstance(fold, nn.Linear)
    assert [n for n, _ in fold.named_parameters()] == ["folded"]
    assert fold.folded.shape == (3, 11) and fold.weight.shape == (3, 10) and fold.bias.shape == (3,)
    # init code written for nn.Linear writes through the views
    nn.init.uniform_(fold.weight, -0.05, 0.05)
    nn.init.constant_(fold.bias, 0.5)
    assert torch.all(fold.folded[:, 0] == 0.5) and fold.folded[:, 1:].abs().max() <= 0.05
    # nn.Linear's state dict loads, and the conversions round-trip
    lin = nn.Linear(10, 3)
    fold.load_state_dict(lin.state_dict())
    assert torch.equal(fold.weight, lin.weight) and torch.equal(fold.bias, lin.bias)
    back = fold.to_linear()
    assert torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias)
    net = fold_linears(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)))
    assert isinstance(net[0], FoldedLinear) and isinstance(net[2], FoldedLinear)


def test_folded_under_cpu_autocast():
    torch.manual_seed(1)
    lin = nn.Linear(32, 16)
    fold = FoldedLinear.from_linear(lin)
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yl, yf = lin(x), fold(x)
    assert yf.dtype == yl.dtype == torch.bfloat16
    torch.testing.assert_close(yf.float(), yl.float(), rtol=2e-2, atol=2e-2)
    yf.float().sum().backward()
    assert fold.folded.grad.dtype == torch.float32


def mlp(linear: type) -> nn.Module:
    """Built the way shmlearn.models builds nets: the layer class is an argument."""
    return nn.Sequential(nn.Flatten(), linear(20, 32), nn.ReLU(), linear(32, 16), nn.ReLU(),
                         linear(16, 4))


@pytest.mark.parametrize("impl", ["function", "autograd"])
def test_training_matches_linear(impl):
    """20 SGD steps (momentum, weight decay) from the same init give the same losses and weights."""
    torch.manual_seed(2)
    ref = mlp(nn.Linear)
    folded = mlp(lambda i, o: FoldedLinear(i, o, impl=impl))
    folded.load_state_dict(ref.state_dict())  # nn.Linear keys load into FoldedLinear
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=4e-3)
            for m in (ref, folded)]
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        x = torch.randn(64, 4, 5, generator=g)
        t = torch.randint(0, 4, (64,), generator=g)
        losses = []
        for model, opt in zip((ref, folded), opts):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), t)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)
    for i in (1, 3, 5):
        torch.testing.assert_close(folded[i].weight, ref[i].weight, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(folded[i].bias, ref[i].bias, rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_folded_cuda_matches_linear(dtype, tol):
    torch.manual_seed(4)
    lin = nn.Linear(784, 256, device="cuda", dtype=dtype)
    for impl in ("function", "autograd"):
        fold = FoldedLinear.from_linear(lin, impl=impl)
        x = torch.randn(128, 784, device="cuda", dtype=dtype)
        dy = torch.randn(128, 256, device="cuda", dtype=dtype)
        xl, xf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        lin.zero_grad()
        yl, yf = lin(xl), fold(xf)
        yl.backward(dy)
        yf.backward(dy)
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
        assert rel(yf, yl) < tol
        assert rel(xf.grad, xl.grad) < tol
        assert rel(fold.folded.grad[:, 1:], lin.weight.grad) < tol
        assert rel(fold.folded.grad[:, 0], lin.bias.grad) < tol


def test_ones_cache_is_per_device_and_dtype():
    a = fl._ones_column(3, torch.zeros(1, dtype=torch.float64))
    b = fl._ones_column(300, torch.zeros(1, dtype=torch.float64))
    assert a.shape == (3, 1) and b.shape == (300, 1) and a.dtype == torch.float64
    assert torch.all(b == 1)
    assert folded_matmul(torch.randn(2, 3), torch.randn(4, 4)).shape == (2, 4)
