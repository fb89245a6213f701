"""apply_init: 'default' keeps torch's init; 'uniform:A' puts every parameter in [-A, A]."""
import pytest
import torch

from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput
from shmlearn.models import apply_init, build_model, parse_init

CIFAR = DataSpec("cifar", "classification", (3, 32, 32), 10)


@pytest.mark.parametrize("name", ["alexnet-small", "resnet18", "neuron"])
def test_uniform_puts_every_parameter_in_range(name):
    torch.manual_seed(0)
    model = build_model(name, CIFAR)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    a = 0.05
    assert apply_init(model, f"uniform:{a}") is model
    for pname, p in model.named_parameters():
        assert p.abs().max() <= a, pname
        assert p.numel() == 1 or p.min() < p.max(), f"{pname} is constant"
        # U[-A, A] has std A/sqrt(3); a loose bound still catches a forgotten tensor
        if p.numel() >= 64:
            assert p.abs().max() > a / 2 and 0.4 * a < p.std() < 0.8 * a, pname
    for k, v in model.named_buffers():  # BatchNorm running statistics are not parameters
        torch.testing.assert_close(v, buffers[k], rtol=0, atol=0)


def test_default_leaves_torch_init():
    torch.manual_seed(0)
    model = build_model("lenet", CIFAR)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_init(model, "default")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_uniform_is_reproducible_under_a_seed():
    nets = []
    for _ in range(2):
        torch.manual_seed(1)
        nets.append(apply_init(build_model("mlp", CIFAR), "uniform:0.1"))
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_parse_init():
    assert parse_init("default") is None
    assert parse_init("uniform:0.05") == 0.05
    assert parse_init("uniform:1e-3") == 1e-3


@pytest.mark.parametrize("bad", ["", "x", "uniform", "uniform:", "uniform:0", "uniform:-0.1",
                                 "uniform:abc", "uniform:nan", "uniform:inf", "normal:0.05",
                                 "Default", "uniform:0.05:1"])
def test_bad_init_is_bad_input(bad):
    model = build_model("neuron", CIFAR)
    msg = f"--init {bad}: expected 'default' or 'uniform:A' with A > 0"
    with pytest.raises(BadInput) as e:
        apply_init(model, bad)
    assert str(e.value) == msg
