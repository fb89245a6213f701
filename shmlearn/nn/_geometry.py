"""Block geometry shared by conv_pool.py and its Triton kernels (_conv_pool_triton.py), so that
the kernel module need not import the module that defers importing it."""
from __future__ import annotations


def unfolds(cin: int) -> bool:
    """Whether a block with cin input channels reads a row-unfolded copy of its input
    (_conv_pool_triton.prepare): when a pixel's channels are not whole 16-value chunks (the
    image's 1 or 3); else the kernels read x itself."""
    return cin % 16 != 0
