"""shmlearn/nn/im2col.py against torch.nn.functional.conv2d, and --im2col against the same run
without it."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shmlearn.nn.im2col import Im2colConv2d, convert, im2col_conv2d, qualifies


@pytest.mark.parametrize("cin,k,stride,padding,bias", [(3, 5, 1, 2, True), (1, 3, 1, 1, False),
                                                        (3, 3, 2, 1, True), (3, 7, 2, 3, False), (2, 3, 1, 0, True)])
@pytest.mark.parametrize("channels_last", [True, False])
def test_forward_and_weight_gradients_match_conv2d(cin, k, stride, padding, bias, channels_last):
    torch.manual_seed(0)
    x = torch.randn(3, cin, 11, 13)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(6, cin, k, k, requires_grad=True)
    b = torch.randn(6, requires_grad=True) if bias else None
    ref = F.conv2d(x, w, b, stride, padding)
    g = torch.randn_like(ref)
    ref.backward(g)
    want = [w.grad.clone()] + ([b.grad.clone()] if bias else [])
    w.grad = None
    if bias:
        b.grad = None
    out = im2col_conv2d(x, w, b, stride, padding)
    out.backward(g)
    assert out.shape == ref.shape and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, exp in zip([w.grad] + ([b.grad] if bias else []), want):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-4)


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
    assert [type(c) is Im2colConv2d for c in m if isinstance(c, nn.Conv2d)] == [True, False, False, False, True]
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
    from shmlearn.config import TrainConfig
    runs = []
    for flag in (False, True):
        res = shmlearn.train(TrainConfig(model="alexnet-small", dataset="digits", samples=2048, workers=1,
                                         im2col=flag, device="cpu", progress=False, deterministic=True,
                                         out=str(tmp_path / f"run{int(flag)}")))
        runs.append(res)
    assert runs[1].summary["im2col_convs"] == 1 and runs[0].summary["im2col_convs"] == 0
    a = [p.detach() for p in runs[0].model.parameters()]
    b = [p.detach() for p in runs[1].model.parameters()]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert runs[1].summary["test_accuracy"] == pytest.approx(runs[0].summary["test_accuracy"], abs=0.01)
