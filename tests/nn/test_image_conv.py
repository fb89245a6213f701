"""shmlearn/nn/image_conv.py against torch.nn.functional.conv2d (im2col, and the Triton kernels in
Triton's interpreter), and --image-conv against the same run without it."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inductor import needs_build
from shmlearn.nn.image_conv import ImageConv2d, convert, im2col_conv2d, qualifies
from triton_interp import interpreted_together as interpreted  # one interpreter process for the module


def _matches_conv2d(conv, x, cout, k, stride, padding, bias, tol):
    """conv(x, w, b, stride, padding) against F.conv2d: output (channels_last), weight and bias
    gradients; tol: (rtol, atol) of the output, the gradients get 10x the atol."""
    cin = x.shape[1]
    w = torch.randn(cout, cin, k, k, requires_grad=True)
    b = torch.randn(cout, requires_grad=True) if bias else None
    ref = F.conv2d(x, w, b, stride, padding)
    g = torch.randn_like(ref)
    ref.backward(g)
    want = [w.grad.clone()] + ([b.grad.clone()] if bias else [])
    w.grad = None
    if bias:
        b.grad = None
    out = conv(x, w, b, stride, padding)
    out.backward(g)
    assert out.shape == ref.shape and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, ref, rtol=tol[0], atol=tol[1])
    for got, exp in zip([w.grad] + ([b.grad] if bias else []), want):
        torch.testing.assert_close(got, exp, rtol=tol[0], atol=10 * tol[1])


@pytest.mark.parametrize("cin,k,stride,padding,bias", [(3, 5, 1, 2, True), (1, 3, 1, 1, False),
                                                        (3, 3, 2, 1, True), (3, 7, 2, 3, False), (2, 3, 1, 0, True)])
@pytest.mark.parametrize("channels_last", [True, False])
def test_forward_and_weight_gradients_match_conv2d(cin, k, stride, padding, bias, channels_last):
    torch.manual_seed(0)
    x = torch.randn(3, cin, 11, 13)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    _matches_conv2d(im2col_conv2d, x, 6, k, stride, padding, bias, (1e-5, 1e-5))


def test_under_bf16_autocast_it_gathers_bf16_and_matches_to_bf16_tolerance():
    torch.manual_seed(1)
    x = torch.randn(4, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    conv = nn.Conv2d(3, 8, 5, padding=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = conv(x)
        out = im2col_conv2d(x, conv.weight, conv.bias, 1, 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_convert_switches_only_the_convs_it_computes_exactly_and_keeps_the_parameters():
    m = nn.Sequential(nn.Conv2d(3, 16, 5, padding=2), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),  # 144 > 128
                      nn.Conv2d(3, 4, 3, groups=1, dilation=2), nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(1, 4, 3))
    before = copy.deepcopy(m.state_dict())
    assert convert(m) == 2
    assert [type(c) is ImageConv2d for c in m if isinstance(c, nn.Conv2d)] == [True, False, False, False, True]
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items()) and before.keys() == m.state_dict().keys()
    assert not qualifies(nn.Conv2d(3, 4, 3, padding="same"))


def test_an_input_that_needs_its_gradient_takes_conv2ds_own_path():
    torch.manual_seed(2)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    ref = F.conv2d(x, conv.weight, conv.bias, 1, 1)
    convert(conv)
    out = conv(x)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    assert x.grad is not None and x.grad.shape == x.shape


@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_inductor_compiles_it_and_agrees():
    torch.manual_seed(3)
    m = nn.Sequential(nn.Conv2d(3, 8, 5, padding=2), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    ref = copy.deepcopy(m)
    convert(m)
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    out = torch.compile(m, dynamic=False)(x)
    out.sum().backward()
    r = ref(x)
    r.sum().backward()
    torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m[0].weight.grad, ref[0].weight.grad, rtol=1e-4, atol=1e-4)


def test_training_with_im2col_is_the_same_run(tmp_path):
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    runs = []
    for flag in (False, True):
        res = shmlearn.train(TrainConfig(model="alexnet-small", dataset="digits", samples=512, workers=1,
                                         image_conv="im2col" if flag else "cudnn", device="cpu", progress=False, deterministic=True,
                                         out=str(tmp_path / f"run{int(flag)}")))
        runs.append(res)
    assert runs[1].summary["image_convs"] == 1 and runs[0].summary["image_convs"] == 0
    assert runs[1].summary["image_conv"] == "im2col"
    a = [p.detach() for p in runs[0].model.parameters()]
    b = [p.detach() for p in runs[1].model.parameters()]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert runs[1].summary["test_accuracy"] == pytest.approx(runs[0].summary["test_accuracy"], abs=0.01)


# --- --image-conv triton: the same kernels a GPU runs, in Triton's interpreter on the CPU -----------

@pytest.mark.parametrize("cin,k,stride,padding,cout,bias", [(3, 5, 1, 2, 32, True), (1, 3, 1, 1, 20, False),
                                                             (3, 3, 2, 1, 64, True), (2, 7, 2, 3, 8, True)])
@interpreted
def test_triton_kernels_match_conv2d_forward_and_weight_and_bias_gradients(cin, k, stride, padding, cout, bias):
    from shmlearn.nn.image_conv import triton_conv2d
    torch.manual_seed(4)
    x = torch.randn(3, cin, 13, 11).contiguous(memory_format=torch.channels_last)
    _matches_conv2d(triton_conv2d, x, cout, k, stride, padding, bias, (1e-4, 1e-4))


@interpreted
def test_triton_kernels_under_autocast_read_and_write_its_dtype():
    # float16, not bfloat16: the interpreter runs kernels in numpy, which has no bfloat16 (its
    # emulation gave 1e10s where the GPU computes); the dtype plumbing is the same.
    from shmlearn.nn.image_conv import triton_conv2d
    torch.manual_seed(5)
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    conv = nn.Conv2d(3, 16, 5, padding=2)
    with torch.autocast("cpu", dtype=torch.float16):
        out = triton_conv2d(x, conv.weight, conv.bias, 1, 2)
    ref = F.conv2d(x.half().float(), conv.weight.half().float(), conv.bias.half().float(), 1, 2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    out.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32 and conv.weight.grad.abs().sum() > 0


@interpreted
def test_a_run_with_the_triton_kernels_is_the_same_run(tmp_path):
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    from triton_interp import small_digits
    # 2 steps of 8 (the second on weights the kernels' gradients moved) and one evaluation of 8
    # test samples: each interpreted kernel call costs seconds on two cores (32 steps of 32 and two
    # evaluations of digits' 360 test samples took ~2 minutes); the kernels are checked above
    data = small_digits(8)
    runs = [shmlearn.train(TrainConfig(model="alexnet-small", samples=16, batch_size=8, workers=1,
                                       image_conv=mode, device="cpu", progress=False, deterministic=True,
                                       eval_at_start="off", out=str(tmp_path / mode)), data=data) for mode in ("cudnn", "triton")]
    assert runs[1].summary["steps"] == 2
    assert runs[1].summary["image_convs"] == 1 and runs[1].summary["image_conv"] == "triton"
    for x, y in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-4, atol=1e-5)


def test_triton_on_a_cpu_outside_the_interpreter_is_refused_in_one_line(tmp_path, monkeypatch):
    import shmlearn
    from shmlearn.config.train_config import TrainConfig
    from shmlearn.errors import BadInput
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BadInput, match="--image-conv triton: Triton's kernels run on CUDA devices, not cpu"):
        shmlearn.train(TrainConfig(dataset="digits", model="alexnet-small", samples=256, workers=1, device="cpu",
                                   image_conv="triton", progress=False, out=str(tmp_path / "r")))
    with pytest.raises(BadInput, match="--image-conv fast: choose one of cudnn, im2col, triton"):
        shmlearn.train(TrainConfig(dataset="digits", image_conv="fast", progress=False, out=str(tmp_path / "s")))


@interpreted
@needs_build  # skips where Inductor cannot build its C++ (tests/inductor.py)
def test_inductor_compiles_around_the_triton_kernels_and_agrees():
    torch.manual_seed(6)
    m = nn.Sequential(nn.Conv2d(3, 16, 5, padding=2), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 4))
    ref = copy.deepcopy(m)
    assert convert(m, "triton") == 1
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    out = torch.compile(m, dynamic=False)(x)
    out.sum().backward()
    r = ref(x)
    r.sum().backward()
    torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m[0].weight.grad, ref[0].weight.grad, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(m[0].bias.grad, ref[0].bias.grad, rtol=1e-4, atol=1e-3)


def test_the_triton_ops_count_a_convolutions_flops():
    from torch.utils.flop_counter import FlopCounterMode
    from shmlearn.nn.image_conv import _ops
    _ops()  # defines the ops (on first use)
    x = torch.empty(2, 3, 8, 8, device="meta")
    w = torch.empty(16, 3, 5, 5, device="meta")
    with FlopCounterMode(display=False) as fc:
        torch.ops.shmlearn.image_conv2d(x, w, None, [1, 1], [2, 2])
        torch.ops.shmlearn.image_conv2d_weight_grad(x, torch.empty(2, 16, 8, 8, device="meta"), [16, 3, 5, 5],
                                                    [1, 1], [2, 2])
    assert fc.get_total_flops() == 2 * (2 * 2 * 16 * 8 * 8 * 3 * 5 * 5)


def test_importing_the_module_or_training_with_cudnn_imports_no_triton():
    # Importing shmlearn.step.fast and converting to im2col defines no Triton op (flop_counter, and with
    # it Triton, load only for --image-conv triton).
    import subprocess
    import sys
    code = ("import sys, torch, shmlearn.step.fast, shmlearn.nn.image_conv as m, torch.nn as nn; "
            "m.convert(nn.Sequential(nn.Conv2d(3, 4, 3)), 'im2col'); "
            "print('triton' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr


def test_auto_is_im2col_exactly_in_a_compiled_cuda_step_and_convert_goes_back():
    from shmlearn.nn.image_conv import resolve
    assert resolve("auto", True, "cuda") == "im2col"
    assert resolve("auto", False, "cuda") == resolve("auto", True, "cpu") == "cudnn"
    assert resolve("triton", False, "cpu") == "triton"
    m = nn.Sequential(nn.Conv2d(3, 8, 5, padding=2), nn.ReLU(), nn.Conv2d(8, 64, 3))  # the second: K 72 <= 128
    state = {k: v.clone() for k, v in m.state_dict().items()}
    assert convert(m, "im2col") == 2 and type(m[0]) is ImageConv2d
    assert convert(m, "cudnn") == 0 and type(m[0]) is nn.Conv2d and type(m[2]) is nn.Conv2d
    assert "image_conv" not in m[0].__dict__
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())
    with pytest.raises(ValueError):
        convert(m, "auto")
