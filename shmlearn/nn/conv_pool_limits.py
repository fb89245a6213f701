"""Which conv + ReLU + max-pool blocks shmlearn's fused kernels run: the largest tiles a program
holds, and whether a block's input is read in place or through an unfolded copy.

Its own module because both sides ask it: conv_pool.py, which chooses per block whether the kernel
applies, and _conv_pool_triton.py, which prepares and launches the kernels (and imports Triton, so
conv_pool.py imports it only on first use).
"""
from __future__ import annotations

MAX_OUT = 128
"""Largest out_channels: a program holds all of them (two fp32 tiles of BLOCK_Q x out_channels)."""
MAX_UNFOLDED_ROW = 64
"""Largest kw x cin of a block read unfolded (cin not a multiple of 16): its window, kh rows of
up to 64 values each (zero-filled to a power of two), is one tile."""
MAX_WINDOW = 512
"""Largest kh x (unfolded row) of such a block: a [BLOCK_Q, window] tile in registers."""


def unfolds(cin: int) -> bool:
    """Whether a block with cin input channels reads a row-unfolded copy of its input
    (_conv_pool_triton.prepare): when a pixel's channels are not whole 16-value chunks (the
    image's 1 or 3); else the kernels read x itself."""
    return cin % 16 != 0


def supported(cin: int, kh: int, kw: int) -> bool:
    """Whether the kernels run a block with this input and kernel size."""
    if not unfolds(cin):
        return True
    row = max(16, 1 << (kw * cin - 1).bit_length())  # the unfolded row, a power of two >= 16
    return kw * cin <= MAX_UNFOLDED_ROW and kh * row <= MAX_WINDOW
