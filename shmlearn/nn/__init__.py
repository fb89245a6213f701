"""Layers of our own. Imports nothing from other shmlearn subpackages, so that
`import shmlearn.nn.folded_linear` works on its own (benchmarks, the GPU machine)."""
from shmlearn.nn.folded_linear import (FoldedLinear, fold_linears, folded_matmul, helper_size,
                                       shift_left_, shift_right_, triton_available)

__all__ = ["FoldedLinear", "fold_linears", "folded_matmul", "helper_size", "shift_left_",
           "shift_right_", "triton_available"]
