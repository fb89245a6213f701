"""fashion-net is benchmarks/fashion_tta.py's fashion_net: the same layers in the same order, the
same parameter shapes and count, and from the same seed the same initial weights and outputs
(so the recipes in recipes/ train the network the benchmark measured)."""
import os
import sys

import torch
from torch import nn

from shmlearn.data.base import DataSpec
from shmlearn.models import build_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import fashion_tta  # noqa: E402

FMNIST = DataSpec("fashion-mnist", "classification", (1, 28, 28), 10)


def test_same_layers_parameters_and_count_as_the_benchmark():
    ours, theirs = build_model("fashion-net", FMNIST), fashion_tta.fashion_net()
    assert [type(m) for m in ours] == [type(m) for m in theirs]
    assert [repr(m) for m in ours] == [repr(m) for m in theirs]  # kernel sizes, padding, bias, pools
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]
    assert sum(p.numel() for p in ours.parameters()) == 390_890


def test_same_seed_same_weights_and_outputs():
    torch.manual_seed(7)
    ours = build_model("fashion-net", FMNIST)
    torch.manual_seed(7)
    theirs = fashion_tta.fashion_net()
    for (n, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_follows_channels_and_classes():
    model = build_model("fashion-net", DataSpec("c", "classification", (3, 32, 32), 100))
    assert model[0].in_channels == 3 and model[-1].out_features == 100
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    assert isinstance(model[-1], nn.Linear) and model[-1].in_features == 256
