"""SyncStrategy's flat buffers: release_grads / adopt_grads against zero_grad + accumulate."""
import copy

import pytest
import torch
from torch import nn

from shmlearn.sync import build_strategy


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.unused = nn.Linear(2, 2)  # gets no gradient
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _setup(channels_last: bool):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = build_strategy("allreduce", rank=0, world_size=1)
    s.setup(model, opt, channels_last=channels_last)
    return model, s


@pytest.mark.parametrize("channels_last", (False, True))
@pytest.mark.parametrize("autocast", (False, True))
@pytest.mark.parametrize("by", ("cat", "multi-tensor copy"))
def test_adopted_gradients_are_the_accumulated_ones_in_the_flat_buffer(channels_last, autocast, by, monkeypatch):
    model, s = _setup(channels_last)
    if by != "cat":  # what models above CAT_MAX parameters take
        monkeypatch.setattr(s, "CAT_MAX", 0)
    x = torch.randn(8, 3, 6, 6)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)

    def backward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        out.float().square().mean().backward()

    tail = s.grads_flat._base[s.grads_flat.numel():]
    assert tail.numel() >= 1
    s.zero_grad()
    backward()
    ref = s.grads_flat.clone()
    assert ref.abs().sum() > 0
    views = [p.grad for p in model.parameters()]
    for _ in range(2):  # the second time reuses the zeros kept for the unused parameter
        s.grads_flat.fill_(7.0)  # stale values everywhere, control slots included
        tail.fill_(7.0)
        s.release_grads()
        assert all(p.grad is None for p in model.parameters())
        backward()
        s.adopt_grads()
        assert torch.equal(s.grads_flat, ref)
        assert torch.equal(tail, torch.zeros_like(tail))
        assert all(p.grad is v for p, v in zip(model.parameters(), views))
        assert torch.equal(model.unused.weight.grad, torch.zeros(2, 2))


def test_adopt_then_update_is_plain_sgd():
    """Two steps through the flat buffer against the same model trained by torch alone."""
    model, s = _setup(False)
    ref = copy.deepcopy(_Net())
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(2):
        x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(i))
        s.release_grads()
        model(x).square().mean().backward()
        s.adopt_grads()
        s.optimizer.step()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_ddp_keeps_its_own_buckets():
    assert build_strategy("ddp", rank=0, world_size=1).adopts_grads is False
    assert build_strategy("allreduce", rank=0, world_size=1).adopts_grads is True


def test_the_fast_steps_flat_update_replaces_the_optimizers_step_through_update_with():
    """What the step hands the strategy (step/kernels.py): update_params runs the bound update
    instead of optimizer.step(); unbound, the optimizer steps again (plain SGD, lr 0.1)."""
    model, s = _setup(False)
    ran = []
    s.update_with(lambda: ran.append("flat"))
    s.grads_flat.fill_(1.0)
    before = s.params_flat.clone()
    s.update_params()
    assert ran == ["flat"] and torch.equal(s.params_flat, before)
    s.update_with(None)
    s.update_params()
    assert ran == ["flat"]
    torch.testing.assert_close(s.params_flat, before - 0.1)


def test_only_a_strategy_that_averages_in_buckets_takes_the_steps_buckets():
    buckets = object()  # what the step hands over: a GradBuckets (step/buckets.py)
    s = build_strategy("allreduce", rank=0, world_size=2)
    s.average_in_buckets(buckets)
    assert s.buckets is buckets
    s.average_in_buckets(None)
    assert s.buckets is None
    for name in ("ps", "weight-avg", "ddp"):
        other = build_strategy(name, rank=0, world_size=2)
        with pytest.raises(ValueError, match=f"^strategy {name} does not average its gradient in buckets$"):
            other.average_in_buckets(buckets)
        other.average_in_buckets(None)
        assert other.buckets is None
