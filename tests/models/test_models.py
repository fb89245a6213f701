"""Every model builds on every shape it claims, gives raw scores of the right shape, trains
(backward reaches every parameter), and refuses shapes it cannot run on with a BadInput."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.errors import BadInput
from shmlearn.models import MODELS, build_model

IMAGES = {
    "digits": DataSpec("digits", "classification", (1, 8, 8), 10),
    "fmnist": DataSpec("fmnist", "classification", (1, 28, 28), 10),
    "cifar": DataSpec("cifar", "classification", (3, 32, 32), 10),
    "tiny": DataSpec("tiny", "classification", (3, 64, 64), 200),
}
VECTORS = {
    "step": DataSpec("step", "binary", (1,), 1),          # seed 002 §3 single neuron
    "line": DataSpec("line", "regression", (1,), 1),      # seed 003 §2 y = Wx + b
    "features": DataSpec("features", "classification", (20,), 3),
}
FLAT_MODELS = ("neuron", "linreg", "softmax", "mlp")
IMAGE_MODELS = tuple(m for m in MODELS if m not in FLAT_MODELS)
FC_LAYERS = {"neuron": 1, "linreg": 1, "softmax": 1, "mlp": 3, "lenet": 2,
             "alexnet-small": 3, "alexnet": 3, "resnet18": 1, "resnet34": 1, "fashion-net": 1}

# resnet34 is resnet18 with more blocks per stage: its full-resolution CIFAR-stem runs cost
# seconds each, so it is run only through the cheaper ImageNet stem (64x64 enters at 16x16).
CASES = ([(m, s) for m in FLAT_MODELS for s in list(VECTORS) + list(IMAGES)]
         + [(m, s) for m in IMAGE_MODELS if m != "resnet34" for s in IMAGES]
         + [("resnet34", "tiny")])


@pytest.mark.parametrize("name,spec_name", CASES)
def test_output_shape_and_backward(name, spec_name):
    spec = {**IMAGES, **VECTORS}[spec_name]
    torch.manual_seed(0)
    model = build_model(name, spec)
    x = torch.randn(2, *spec.input_shape)  # batch 2: BatchNorm needs > 1 value per channel
    out = model(x)
    assert out.shape == (2, spec.num_outputs)
    out.square().sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", MODELS)
def test_no_dropout_so_training_is_deterministic(name):
    spec = IMAGES["digits"]
    model = build_model(name, spec).train()
    assert not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())
    x = torch.randn(2, *spec.input_shape)
    torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)


class MarkedLinear(nn.Linear):
    """Stands in for the bias-folded layer of nn/folded_linear.py."""


class OutputSavingLinear(nn.Linear):
    """A substituted layer whose backward needs its own output (tanh saves it): an in-place
    ReLU after it would make backward raise."""

    def forward(self, x):
        return torch.tanh(super().forward(x))


@pytest.mark.parametrize("name", MODELS)
def test_substituted_linear_may_save_its_output(name):
    model = build_model(name, IMAGES["digits"], linear=OutputSavingLinear)
    model(torch.randn(2, 1, 8, 8)).sum().backward()


@pytest.mark.parametrize("name", MODELS)
def test_linear_class_builds_every_fully_connected_layer(name):
    model = build_model(name, IMAGES["digits"], linear=MarkedLinear)
    fcs = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(fcs) == FC_LAYERS[name]
    assert all(type(m) is MarkedLinear for m in fcs)


def test_alexnet_small_parameter_count_matches_seed_001():
    convs = [(3, 32), (32, 32), (32, 64)]              # 5x5 kernels, one bias per map
    fcs = [(64 * 4 * 4, 64), (64, 32), (32, 10)]       # 32 -> 16 -> 8 -> 4 after three pools
    expected = (sum(5 * 5 * cin * cout + cout for cin, cout in convs)
                + sum(fin * fout + fout for fin, fout in fcs))
    assert expected == 147_338
    model = build_model("alexnet-small", IMAGES["cifar"])
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("spec_name,fc0_in", [("cifar", 1024), ("fmnist", 576), ("digits", 64)])
def test_alexnet_small_fc0_follows_input_size(spec_name, fc0_in):
    model = build_model("alexnet-small", IMAGES[spec_name])
    assert next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features == fc0_in


def test_alexnet_small_matches_functional_reference():
    """Same weights through a hand-written F.* forward: pins stride 1, pad 2, ReLU, 2x2 pool."""
    torch.manual_seed(0)
    model = build_model("alexnet-small", IMAGES["cifar"])
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    fcs = [m for m in model.modules() if isinstance(m, nn.Linear)]
    x = torch.randn(3, 3, 32, 32)
    h = x
    for c in convs:
        h = F.max_pool2d(F.relu(F.conv2d(h, c.weight, c.bias, stride=1, padding=2)), 2)
    h = h.flatten(1)
    h = F.relu(F.linear(h, fcs[0].weight, fcs[0].bias))
    h = F.relu(F.linear(h, fcs[1].weight, fcs[1].bias))
    ref = F.linear(h, fcs[2].weight, fcs[2].bias)
    torch.testing.assert_close(model(x), ref)


@pytest.mark.parametrize("spec_name,kernel,stride", [("cifar", 3, 1), ("fmnist", 3, 1),
                                                     ("tiny", 7, 2)])
def test_resnet_stem_depends_on_image_size(spec_name, kernel, stride):
    stem = next(m for m in build_model("resnet18", IMAGES[spec_name]).modules()
                if isinstance(m, nn.Conv2d))
    assert stem.kernel_size == (kernel, kernel) and stem.stride == (stride, stride)


def test_resnet_depths():
    def blocks(name):
        return sum(type(m).__name__ == "BasicBlock"
                   for m in build_model(name, IMAGES["digits"]).modules())
    assert blocks("resnet18") == 8 and blocks("resnet34") == 16


def test_unknown_model_is_bad_input():
    with pytest.raises(BadInput, match=r"^--model foo: unknown model; choose one of neuron, "):
        build_model("foo", IMAGES["digits"])


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_image_model_on_vectors_is_bad_input(name):
    with pytest.raises(BadInput, match=rf"^--model {name}: .*--dataset features .*\(20,\)"):
        build_model(name, VECTORS["features"])


@pytest.mark.parametrize("name,side", [("lenet", 3), ("alexnet-small", 7), ("alexnet", 4)])
def test_image_too_small_is_bad_input(name, side):
    spec = DataSpec("tinyimg", "classification", (1, side, side), 10)
    with pytest.raises(BadInput, match=rf"^--model {name}: --dataset tinyimg has {side}x{side}"):
        build_model(name, spec)
