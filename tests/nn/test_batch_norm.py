"""--batch-norm triton (shmlearn/nn/batch_norm.py): the one-kernel statistics against float64 sums,
and the module against torch's BatchNorm (outputs, gradients, running statistics), eagerly and
compiled, in Triton's interpreter on the CPU; on a GPU, compiled in bf16 and replayed from a
CUDA graph."""
import copy

import pytest
import torch
from torch import nn

from shmlearn.config import TrainConfig, validate
from shmlearn.errors import BadInput
from shmlearn.nn import batch_norm as bn
from triton_interp import interpreted_together as interpreted


def _rows(x):
    return (x.permute(0, 2, 3, 1) if x.dim() == 4 else x).reshape(-1, x.shape[1]).double()


@interpreted
@pytest.mark.parametrize("shape,loc", [((8, 70, 5, 3), 0.0), ((4, 3, 7, 7), 1000.0), ((33, 64), 5.0),
                                       ((2, 130, 9, 9), -3.0), ((3, 5, 1, 1), 0.5)])
def test_stats_kernel_against_float64(shape, loc):
    """Mean and 1/std (biased variance) to fp32 rounding, also far from zero (the shifted sums) and
    for channel counts and row counts that are not multiples of the blocks; the running
    statistics' momentum update with the unbiased variance; the counters left at zero."""
    from shmlearn.nn import _batch_norm_triton as kernels
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 2 + loc
    rows = _rows(x)
    c = shape[1]
    counter = torch.zeros(64, dtype=torch.int32)
    rm, rv = torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5
    rm0, rv0 = rm.double().clone(), rv.double().clone()
    mean, invstd = kernels.stats(rows.float().contiguous(), counter, rm, rv, 0.1, 1e-5)
    assert kernels.plan(rows.shape[0], c, x.device)[1] >= 1
    ref_mean, ref_var = rows.mean(0), rows.var(0, unbiased=False)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-6, atol=1e-6 * (1 + abs(loc)))
    torch.testing.assert_close(invstd.double(), (ref_var + 1e-5).rsqrt(), rtol=2e-5, atol=0)
    torch.testing.assert_close(rm.double(), 0.9 * rm0 + 0.1 * ref_mean, rtol=1e-6, atol=1e-6 * (1 + abs(loc)))
    torch.testing.assert_close(rv.double(), 0.9 * rv0 + 0.1 * rows.var(0, unbiased=True), rtol=2e-5, atol=1e-6)
    assert counter.abs().sum() == 0


class _Net(nn.Module):
    """conv-BN-ReLU, conv-BN + residual-ReLU, a BatchNorm1d head: each pattern the models use."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.fc, self.bn3 = nn.Linear(16, 5), nn.BatchNorm1d(5)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)) + h)
        return self.bn3(self.fc(h.mean((2, 3))))


def _pair():
    torch.manual_seed(0)
    ref = _Net()
    for m in ref.modules():
        if isinstance(m, nn.BatchNorm2d):  # not the identity affine: its gradients must show
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-1, 1)
    ref = ref.to(memory_format=torch.channels_last)
    model = copy.deepcopy(ref)
    assert bn.convert(model, "triton") == 3
    return model, ref


def _train_both(model, ref, fwd, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for i in range(steps):
        x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(i)).contiguous(
            memory_format=torch.channels_last)
        outs = []
        for f, o in ((fwd, opt), (ref, ref_opt)):
            o.zero_grad()
            y = f(x)
            y.square().mean().backward()
            outs.append(y.detach())
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
        opt.step()
        ref_opt.step()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@interpreted
def test_module_trains_as_torch_batch_norm():
    """Three SGD steps: outputs, every parameter's gradient, then weights, running statistics and
    num_batches_tracked as torch's BatchNorm gives them; eval mode is torch's own."""
    model, ref = _pair()
    _train_both(model, ref, model)
    model.eval(), ref.eval()
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
    assert all(bn._pages[m._stats_slot[0]].abs().sum() == 0 for m in model.modules() if hasattr(m, "_stats_slot"))


@interpreted
def test_compiled_module_trains_as_torch_batch_norm():
    """The same under torch.compile (Inductor on the CPU; the kernel in the interpreter): the custom
    op's in-place running statistics and its gradient formula survive functionalization."""
    model, ref = _pair()
    _train_both(model, ref, torch.compile(model, dynamic=False), steps=2)


def test_what_stays_torch():
    """_fits refuses what the kernel does not compute (torch's BatchNorm runs instead)."""
    model, _ = _pair()
    m = model.bn1
    x = torch.randn(2, 16, 4, 4)
    assert bn._fits(m, x.contiguous(memory_format=torch.channels_last))
    assert not bn._fits(m, x)  # NCHW-contiguous
    assert not bn._fits(m, torch.randn(1, 16, 1, 1))  # one value per channel: torch refuses it
    assert not bn._fits(model.bn3, torch.randn(4, 5, 7))  # BatchNorm1d over sequences
    assert bn._fits(model.bn3, torch.randn(bn.MAX_ROWS, 5))
    assert not bn._fits(model.bn3, torch.randn(bn.MAX_ROWS + 1, 5))  # large: Inductor's own is at bandwidth
    m.eval()
    assert not bn._fits(m, x.contiguous(memory_format=torch.channels_last))
    m.train()
    m.momentum = None  # a cumulative average
    assert not bn._fits(m, x.contiguous(memory_format=torch.channels_last))


def test_convert_both_ways_keeps_state():
    model, ref = _pair()
    assert type(model.bn1) is bn.StatsBatchNorm2d and type(model.bn3) is bn.StatsBatchNorm1d
    assert list(model.state_dict()) == list(ref.state_dict())
    assert bn.convert(model, "aten") == 0
    assert type(model.bn1) is nn.BatchNorm2d and type(model.bn3) is nn.BatchNorm1d
    with pytest.raises(ValueError, match="resolve auto first"):
        bn.convert(model, "auto")


def test_resolve_and_refusals():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert bn.resolve("auto", compiled=True, device=cpu) == "aten"
    assert bn.resolve("auto", compiled=False, device=cuda) == "aten"
    assert bn.resolve("aten", compiled=True, device=cuda) == "aten"
    if bn.usable(cuda) is None:
        assert bn.resolve("auto", compiled=True, device=cuda) == "triton"
    with pytest.raises(BadInput, match=r"^--batch-norm fused: choose one of aten, triton, auto$"):
        validate(TrainConfig(batch_norm="fused"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_bf16_in_a_graph():
    """On a GPU: the compiled model in bf16 autocast, replayed from a CUDA graph, against torch's
    BatchNorm run the same way (bf16 tolerance), and the counters zero after the replays."""
    model, ref = _pair()
    model, ref = model.cuda(), ref.cuda()
    assert bn.convert(model, "triton") == 3  # the counters on the GPU now
    x = torch.randn(64, 3, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last)

    def run(m):
        f = torch.compile(m, dynamic=False)

        def step():
            for p in m.parameters():
                p.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = f(x)
            y.float().square().mean().backward()
            return y
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = step()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        return y.float(), [p.grad.float() for p in m.parameters()], m.state_dict()

    (y, grads, state), (ry, rgrads, rstate) = run(model), run(ref)
    torch.testing.assert_close(y, ry, rtol=0.05, atol=0.05)
    for g, r in zip(grads, rgrads):
        torch.testing.assert_close(g, r, rtol=0.05, atol=max(0.05 * r.abs().max().item(), 1e-4))
    for k in state:
        torch.testing.assert_close(state[k].float(), rstate[k].float(), rtol=0.02, atol=0.02, msg=k)
    assert all(bn._pages[m._stats_slot[0]].abs().sum() == 0 for m in model.modules() if hasattr(m, "_stats_slot"))
