"""--compile of a model made of repeated blocks (a transformer's layers) block by block, where the
gradient average runs in buckets during the backward (step/buckets.py).

Why: compiled whole, the model's backward is one AOTAutograd graph that hands every gradient over
at its end, so every bucket's all-reduce starts then and nothing overlaps (the GPT-style LM of
benchmarks/user_workloads.py scaled 1.85x at two H200s compiled, 1.91x eager with buckets:
benchmarks/results/h200x4-2026-11-28). Compiled one block at a time, as torchtitan and PyTorch's
regional-compilation recipe do, each block's backward is a graph of its own: its gradients are
ready when it ends, and their bucket crosses the link while the blocks before it run theirs.
What stays eager: the embedding, the head and the loss (the blocks hold most of the work).

The blocks are compiled in place (`nn.Module.compile`: the state_dict keys do not change), all
through one code object; Dynamo compiles the block once and reuses it for every instance where it
inlines nn.Module calls (`inline_inbuilt_nn_modules`, on by default from torch 2.5); older torch
would compile each instance and stop at its cache limit, so the model is compiled whole there.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch
from torch import nn

MIN_BLOCKS = 4
"""At least this many blocks of one class in one container: a transformer's layers; a ResNet's
stages (2-3 blocks each, or 6 of ResNet-50's third holding a third of its weights) stay whole."""
MIN_SHARE = 0.5
"""...holding at least this share of the model's parameters."""


def repeated_blocks(model: nn.Module) -> List[nn.Module]:
    """The model's largest run of repeated blocks (children of one ModuleList or Sequential, all of
    one class, MIN_BLOCKS or more, holding MIN_SHARE of the parameters or more), or [] where it
    has none or this torch cannot compile them as one (see the docstring)."""
    if torch.__version__ < "2.5":  # TorchVersion compares with a string
        return []
    total = sum(p.numel() for p in model.parameters())
    best: List[nn.Module] = []
    best_n = 0
    for m in model.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < MIN_BLOCKS:
            continue
        kids = list(m)
        if len({type(k) for k in kids}) != 1:
            continue
        n = sum(p.numel() for k in kids for p in k.parameters())
        if n > best_n:
            best, best_n = kids, n
    return best if total and best_n >= MIN_SHARE * total else []


class Regions:
    """The blocks compiled in place with the step's mode and options; `eager()` runs them eagerly
    for a while (auto's timing), `off()` for good (eager won, or Inductor could not build)."""

    def __init__(self, blocks: List[nn.Module], *, mode, options):
        self.blocks = blocks
        for b in blocks:
            b.compile(mode=mode, options=options, dynamic=False)
        self.impls = [b._compiled_call_impl for b in blocks]

    def __len__(self) -> int:
        return len(self.blocks)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        for b in self.blocks:
            b._compiled_call_impl = None
        try:
            yield
        finally:
            for b, impl in zip(self.blocks, self.impls):
                b._compiled_call_impl = impl

    def off(self) -> None:
        for b in self.blocks:
            b._compiled_call_impl = None

    def describe(self) -> str:
        return f"{len(self.blocks)} {type(self.blocks[0]).__name__} blocks"


def eager_of(regions: "Regions | None", fn):
    """fn, with the blocks eager while it runs (the forward: its backward follows the graph the
    forward recorded), for timing eager against compiled."""
    if regions is None:
        return fn

    def run(*args):
        with regions.eager():
            return fn(*args)
    return run


__all__ = ["repeated_blocks", "Regions", "eager_of", "MIN_BLOCKS", "MIN_SHARE"]
