"""benchmarks/kernels.py: the alternatives it times compute what the layer computes."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import kernels  # noqa: E402


@pytest.mark.parametrize("case", list(kernels.CASES))
def test_every_variant_agrees_with_the_plain_layer(case):
    r = kernels.run_case(case, 4, torch.device("cpu"))
    assert r["outputs_agree"], case


def test_a_wrong_variant_is_caught():
    good = (torch.ones(4, 3), torch.ones(4))
    assert kernels.agree([good, (torch.ones(4, 3), torch.ones(4))])
    assert not kernels.agree([good, (torch.ones(4, 3), torch.full((4,), 1.5))])
    # a padded weight gradient must be zero on the padding
    assert not kernels.agree([good, (torch.cat([torch.ones(4, 3), torch.ones(4, 1)], 1), torch.ones(4))])
    assert kernels.agree([good, (torch.cat([torch.ones(4, 3), torch.zeros(4, 1)], 1), torch.ones(4))])


def test_the_floors_count_the_bytes_of_each_layer():
    # 2x2 pool of 1x1x4x4 bf16: read 16 + write 4 (forward), read 4 + read 16 + write 16 (backward)
    assert kernels.max_pool_bytes(1, c=1, hw=4) == 2 * (16 + 4 + 4 + 16 + 16)
    assert kernels.bias_grad_bytes(1, c=1, hw=4) == 2 * 16 + 4
