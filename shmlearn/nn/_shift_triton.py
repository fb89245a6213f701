"""Triton kernels for the in-place ShiftRight / ShiftLeft realignment (paper 002, section 4).

Imported lazily by shmlearn.nn.folded_linear, only when a CUDA tensor is shifted and Triton is
installed; nothing else in shmlearn needs Triton.

The scheme is the paper's: one program per row, rows run in parallel in no fixed order, so a
row's writes may land on elements that another row has not read yet (write-after-read).
  ShiftRight: row i moves forward by i+1 elements. Rows above it write everything below
              position i*(cols+1), which covers row i's first min(i, cols) elements.
  ShiftLeft:  row i moves back by i+1 elements. Rows below it write everything from
              (i+1)*cols on, which covers row i's last min(i+1, cols) elements (none for the
              last row).
Launch 1 (`*_save`) copies exactly those elements into a helper buffer; the launch boundary is
the grid-wide barrier. Launch 2 (`*_move`) then reads the endangered elements from the helper
and the rest from the matrix, and writes every row to its new home. Helper row r starts at
tri(r) = sum_{k<r} min(k, cols) (rows(rows-1)/2 elements in all when rows <= cols + 1, as in
the paper's Eq. 4.2.1). Inside one row the move still overlaps itself (element c goes to c+i+1),
so each chunk is read by all threads, then a CTA barrier, then written; ShiftRight walks a
row's chunks last to first and ShiftLeft first to last, so a chunk's writes land only on
chunks already read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SMALL_BLOCK, BIG_BLOCK = 128, 1024  # two block sizes only: each is one more compile per kernel


@triton.jit
def _tri(r, cols):
    """sum_{k<r} min(k, cols): where helper row r starts (int64)."""
    return tl.where(r <= cols + 1, r * (r - 1) // 2,
                    cols * (cols + 1) // 2 + (r - cols - 1) * cols)


@triton.jit
def _row(rows, REVERSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if REVERSE:  # tests only: launch order reversed, so that the other set of hazards fires
        row = rows - 1 - row
    return row


@triton.jit(do_not_specialize=["rows", "cols"])
def _right_save(mat, helper, rows, cols, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    row = _row(rows, REVERSE)
    n = tl.minimum(row, cols)  # row's first n elements lie under the new homes of rows above
    src = mat + row * cols
    dst = helper + _tri(row, cols)
    for start in range(0, n, BLOCK):
        c = start + tl.arange(0, BLOCK)
        m = c < n
        tl.store(dst + c, tl.load(src + c, mask=m), mask=m)


@triton.jit(do_not_specialize=["rows", "cols"])
def _right_move(mat, helper, rows, cols, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    row = _row(rows, REVERSE)
    n = tl.minimum(row, cols)
    saved_at = helper + _tri(row, cols)
    src = mat + row * cols
    dst = mat + row * (cols + 1)
    chunks = tl.cdiv(cols, BLOCK)
    for k in range(0, chunks):
        c = (chunks - 1 - k) * BLOCK + tl.arange(0, BLOCK)  # last chunk first
        inrow = c < cols
        saved = c < n
        v = tl.load(saved_at + c, mask=inrow & saved)
        v = tl.where(saved, v, tl.load(src + c, mask=inrow & ~saved))
        tl.debug_barrier()  # all threads have read this chunk before any thread overwrites it
        tl.store(dst + 1 + c, v, mask=inrow)
    tl.store(dst, 1.0)  # the leading column of ones (cast to the element type)


@triton.jit(do_not_specialize=["rows", "cols"])
def _left_save(mat, helper, rows, cols, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    row = _row(rows, REVERSE)
    n = tl.where(row < rows - 1, tl.minimum(row + 1, cols), 0)  # last n lie under rows below
    src = mat + row * (cols + 1) + 1 + (cols - n)
    dst = helper + _tri(row + 1, cols)
    for start in range(0, n, BLOCK):
        c = start + tl.arange(0, BLOCK)
        m = c < n
        tl.store(dst + c, tl.load(src + c, mask=m), mask=m)


@triton.jit(do_not_specialize=["rows", "cols"])
def _left_move(mat, helper, rows, cols, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    row = _row(rows, REVERSE)
    n = tl.where(row < rows - 1, tl.minimum(row + 1, cols), 0)
    first = cols - n  # data column of the first saved element
    saved_at = helper + _tri(row + 1, cols) - first
    src = mat + row * (cols + 1) + 1
    dst = mat + row * cols
    for start in range(0, cols, BLOCK):  # first chunk first
        c = start + tl.arange(0, BLOCK)
        inrow = c < cols
        saved = c >= first
        v = tl.load(saved_at + c, mask=inrow & saved)
        v = tl.where(saved, v, tl.load(src + c, mask=inrow & ~saved))
        tl.debug_barrier()  # all threads have read this chunk before any thread overwrites it
        tl.store(dst + c, v, mask=inrow)


def helper_size(rows: int, cols: int) -> int:
    """Elements the helper needs: sum over rows of min(row, cols) (Python twin of _tri)."""
    r = rows
    if r <= cols + 1:
        return r * (r - 1) // 2
    return cols * (cols + 1) // 2 + (r - cols - 1) * cols


def _launch(save, move, buf, rows, cols, helper, reverse):
    if rows == 0:
        return buf
    need = helper_size(rows, cols)
    if helper is None:
        helper = buf.new_empty(max(need, 1))  # caching allocator: no cudaMalloc after the first
    elif helper.numel() < need or helper.dtype != buf.dtype or helper.device != buf.device:
        raise ValueError(f"helper must hold {need} elements of {buf.dtype} on {buf.device}")
    block = SMALL_BLOCK if cols <= SMALL_BLOCK else BIG_BLOCK
    warps = 4 if block == SMALL_BLOCK else 8
    for kernel in (save, move):  # two launches: the boundary is the grid-wide barrier
        kernel[(rows,)](buf, helper, rows, cols, BLOCK=block, REVERSE=reverse,
                        num_warps=warps, num_stages=1)
    return buf


def shift_right(buf: torch.Tensor, rows: int, cols: int, helper=None, reverse=False):
    return _launch(_right_save, _right_move, buf, rows, cols, helper, reverse)


def shift_left(buf: torch.Tensor, rows: int, cols: int, helper=None, reverse=False):
    return _launch(_left_save, _left_move, buf, rows, cols, helper, reverse)
