"""When the convolutions' weight GEMMs run on past their backward (step/kernels.py may_defer)."""
import torch

from shmlearn.step.kernels import may_defer


def test_a_compiled_fp32_step_joins_its_weight_gemms_before_the_backward_returns():
    """The compiled fp32 backward reads the weights' gradients on the main stream itself, so
    their GEMMs are not deferred there (kernels.may_defer); bf16 and eager steps still defer."""
    cuda = torch.device("cuda", 0)  # never touched
    assert not may_defer(True, True, cuda, "default", "fp32")
    assert not may_defer(True, True, cuda, "max-autotune", "fp32")
    assert may_defer(True, True, cuda, "default", "bf16")
    assert may_defer(True, True, cuda, "off", "fp32")
    assert not may_defer(False, True, cuda, "off", "fp32")  # DDP: gradients accumulate into .grad
    assert not may_defer(True, True, torch.device("cpu"), "off", "fp32")
