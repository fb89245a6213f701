"""shmlearn/nn/conv_pool.py: the fused conv + ReLU + 2x2 max-pool kernels (in Triton's interpreter on
the CPU) against F.conv2d -> F.relu -> F.max_pool2d, and --conv-pool against the same run without it."""
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inductor import needs_build
from shmlearn.nn.conv_pool import ConvReluPool2d, FusedMaxPool2d, FusedReLU, blocks, convert
from triton_interp import interpreted_together as interpreted

# The interpreted tests share one process (triton_interp.interpreted_together; a process of its own
# each cost ~3 s of imports apiece, 15 s of the module's 38). Between them _fresh_kernel_settings
# puts back the module settings a test changes, as a process of its own had.


@pytest.fixture(autouse=True)
def _fresh_kernel_settings():
    """In the interpreter's process: the kernels' module settings back as imported after each test."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from shmlearn.nn import _conv_pool_triton as kernels, conv_pool
    saved = kernels.INTERPRET_STACK, conv_pool.BACKWARD
    yield
    kernels.INTERPRET_STACK, conv_pool.BACKWARD = saved


def _reference(x, w, b, padding):
    return F.max_pool2d(F.relu(F.conv2d(x, w, b, 1, padding)), 2)


def _check(x, w, b, padding, tol, exact=False):
    """Output and every gradient (weight, bias, and x's when it needs one) of the fused op against
    the three torch ops; tol (rtol, atol) of the output, gradients 10x the atol. exact: an
    integer output gradient (with integer inputs, every sum is exact in fp32)."""
    from shmlearn.nn.conv_pool import conv_relu_pool2d
    out = conv_relu_pool2d(x, w, b, padding)
    ref = _reference(x, w, b, padding)
    assert out.shape == ref.shape and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, ref, rtol=tol[0], atol=tol[1])
    wrt = [t for t in (w, b, x) if t is not None and t.requires_grad]
    g = torch.randint_like(ref, -3, 4) if exact else torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, wrt, g), torch.autograd.grad(ref, wrt, g)):
        torch.testing.assert_close(got, want, rtol=tol[0], atol=10 * tol[1])


@interpreted
def test_fused_kernels_match_conv_relu_pool_forward_and_every_gradient():
    torch.manual_seed(0)
    # (batch, cin, h, w, cout, k, padding, x needs a gradient, bias): the image's 3-channel 5x5
    # conv (weight-gradient kernel), a later 32-channel one (3x3: a row of 96 in 3 chunks of 32,
    # 48 pooled rows in blocks of 32, a tail; cuDNN's input gradient; 5x5 cost the interpreter ~3x
    # the loop rounds of the same code, ~6 s of this test on 2 cores), odd sizes (floor mode drops
    # a row and a column), 1 channel, no padding, no bias, 8 channels (unfolded rows of 24 in 32),
    # and 16 channels with no input gradient (read in place, gradients by cuDNN's path).
    cases = [(2, 3, 12, 12, 32, 5, 2, False, True), (3, 32, 8, 8, 64, 3, 1, True, True),
             (2, 5, 9, 11, 20, 3, 1, True, True), (2, 1, 7, 9, 16, 3, 0, False, False),
             (1, 4, 6, 6, 8, 3, 1, False, True), (2, 8, 6, 6, 16, 3, 1, True, True),
             (2, 16, 7, 7, 8, 3, 1, False, True)]
    from shmlearn.nn import _conv_pool_triton as kernels, conv_pool
    # the forward's two forms (the autotuner picks one per shape on a GPU) and the later blocks'
    # two backwards (shmlearn's kernels, or the full gradient and cuDNN's: conv_pool.BACKWARD)
    for stack, backward in ((False, "triton"), (True, "cudnn")):
        kernels.INTERPRET_STACK, conv_pool.BACKWARD = stack, backward
        for n, cin, h, w, cout, k, p, xg, bias in cases:
            x = torch.randn(n, cin, h, w).contiguous(memory_format=torch.channels_last).requires_grad_(xg)
            wt = torch.randn(cout, cin, k, k)
            if stack:  # the layout a channels_last run gives the weights (the image's dw is written in it)
                wt = wt.contiguous(memory_format=torch.channels_last)
            b = torch.randn(cout, requires_grad=True) if bias else None
            _check(x, wt.requires_grad_(), b, p, (1e-4, 1e-4))


@interpreted
def test_ties_and_windows_relu_cut_get_the_gradient_torch_gives_them():
    # Small integers: every sum is exact in fp32, so whole windows tie (the first position in
    # window order gets the gradient, as max_pool2d gives it) and many maxima are <= 0 (no
    # gradient through ReLU); both paths of the backward, bit for bit.
    from shmlearn.nn import _conv_pool_triton as kernels, conv_pool
    torch.manual_seed(1)
    for stack, xg, backward in ((False, False, "cudnn"), (False, True, "triton"), (True, False, "cudnn"),
                                (True, True, "cudnn")):
        kernels.INTERPRET_STACK, conv_pool.BACKWARD = stack, backward
        cin = 16 if xg else 3  # a later block (x read in place) and the image (unfolded)
        x = torch.randint(-1, 2, (2, cin, 16, 16)).float().contiguous(memory_format=torch.channels_last)
        x.requires_grad_(xg)
        w = torch.randint(-1, 2, (8, cin, 3, 3)).float().requires_grad_()
        b = torch.full((8,), -2.0 if cin == 3 else -6.0, requires_grad=True)
        ref = _reference(x, w, b, 1)
        windows = F.unfold(F.conv2d(x, w, b, 1, 1).detach().flatten(0, 1).unsqueeze(1), 2, stride=2)
        ties = ((windows == windows.amax(1, keepdim=True)).sum(1) > 1) & (windows.amax(1) > 0)
        assert (ref == 0).float().mean() > 0.2 and ties.sum() >= 10  # the test sees both
        _check(x, w, b, 1, (0, 0), exact=True)


@interpreted
def test_under_autocast_it_reads_and_writes_the_autocast_dtype():
    # float16, not bfloat16: the interpreter has no bfloat16 (as in test_image_conv.py)
    from shmlearn.nn.conv_pool import conv_relu_pool2d
    torch.manual_seed(2)
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    conv = nn.Conv2d(3, 16, 5, padding=2)
    with torch.autocast("cpu", dtype=torch.float16):
        out = conv_relu_pool2d(x, conv.weight, conv.bias, 2)
    ref = _reference(x.half().float(), conv.weight.half().float(), conv.bias.half().float(), 2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    out.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32 and conv.weight.grad.abs().sum() > 0


@interpreted
@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_inductor_compiles_around_the_fused_kernels_and_agrees():
    torch.manual_seed(3)
    m = nn.Sequential(nn.Conv2d(3, 8, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                      nn.Flatten(), nn.Linear(16 * 2 * 2, 4))
    ref = copy.deepcopy(m)
    assert convert(m, "triton") == 2
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    out = torch.compile(m, dynamic=False)(x)
    out.sum().backward()
    r = ref(x)
    r.sum().backward()
    torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-3)


@interpreted
def test_a_run_with_the_fused_blocks_is_the_same_run(tmp_path):
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    from triton_interp import small_digits
    # 2 steps of 8 (the second on weights the kernels' gradients moved) and one evaluation of 8
    # test samples: each interpreted kernel call costs seconds on two cores (4 steps of 32 and two
    # evaluations of digits' 360 test samples took ~2 minutes); the kernels are checked above
    data = small_digits(8)
    runs = [shmlearn.train(TrainConfig(model="alexnet-small", samples=16, batch_size=8, workers=1,
                                       conv_pool=mode, image_conv="cudnn", device="cpu", progress=False, eval_points=1,
                                       eval_at_start="off", deterministic=True, out=str(tmp_path / mode)), data=data)
            for mode in ("off", "triton")]
    assert runs[1].summary["conv_pools"] == 3 and runs[1].summary["conv_pool"] == "triton"
    assert runs[0].summary["conv_pools"] == 0 and runs[0].summary["conv_pool"] == "off"
    assert runs[1].summary["steps"] == 2
    for x, y in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-4, atol=1e-5)


def test_convert_fuses_only_the_blocks_it_computes_exactly_and_keeps_the_parameters():
    m = nn.Sequential(
        nn.Conv2d(3, 8, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),                   # fused
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3),                   # 3x3 pool
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2),         # stride 2
        nn.Conv2d(8, 8, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),                   # not ReLU
        nn.Sequential(nn.Conv2d(8, 200, 1), nn.ReLU(), nn.MaxPool2d(2)),             # 200 > MAX_OUT
        nn.Sequential(nn.Conv2d(208, 8, 1), nn.ReLU(), nn.MaxPool2d(2, 2)),          # nested: fused
        nn.Sequential(nn.Conv2d(24, 8, 5), nn.ReLU(), nn.MaxPool2d(2)))              # 24 x 5 > 64, 24 % 16
    before = copy.deepcopy(m.state_dict())
    assert convert(m, "triton") == 2
    assert [type(k) for k in m[0:3]] == [ConvReluPool2d, FusedReLU, FusedMaxPool2d]
    assert [type(k) for k in m[13]] == [ConvReluPool2d, FusedReLU, FusedMaxPool2d]
    assert all(type(k) in (nn.Conv2d, nn.ReLU, nn.MaxPool2d, nn.GELU) for k in m[3:12])
    assert before.keys() == m.state_dict().keys()
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert convert(m, "off") == 0 and len(blocks(m)) == 2
    assert [type(k) for k in m[0:3]] == [nn.Conv2d, nn.ReLU, nn.MaxPool2d]
    with pytest.raises(ValueError, match="resolve auto first|one of off, triton"):
        convert(m, "auto")


def test_an_unbatched_input_runs_the_three_ops():
    torch.manual_seed(4)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    ref = copy.deepcopy(m)
    convert(m, "triton")
    x = torch.randn(3, 6, 6)
    torch.testing.assert_close(m(x), ref(x))


def test_bad_conv_pool_values_and_a_cpu_outside_the_interpreter_are_refused_in_one_line(tmp_path, monkeypatch):
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    from shmlearn.errors import BadInput
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytest.importorskip("triton")
    with pytest.raises(BadInput, match="--conv-pool triton: Triton's kernels run on CUDA devices, not cpu"):
        shmlearn.train(TrainConfig(dataset="digits", model="alexnet-small", samples=128, workers=1, device="cpu",
                                   conv_pool="triton", progress=False, out=str(tmp_path / "r")))
    with pytest.raises(BadInput, match="--conv-pool fused: choose one of off, triton, auto"):
        shmlearn.train(TrainConfig(dataset="digits", conv_pool="fused", progress=False, out=str(tmp_path / "s")))


def test_auto_fuses_on_cuda_only():
    from shmlearn.nn.conv_pool import resolve
    assert resolve("auto", torch.device("cpu")) == "off"
    assert resolve("off", torch.device("cuda")) == "off" and resolve("triton", torch.device("cpu")) == "triton"
