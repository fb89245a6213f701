"""Whether a Triton kernel can run on a GPU: what it needs (shared memory per block, threads),
read from Triton's own compiled metadata, against what the device has.

Why: a kernel's tiles are chosen for one GPU and one dtype. An fp32 tile of the conv-pool weight
gradient, pipelined over three stages, needs 408 KB of shared memory where an H100 block may use
227 KB, a consumer card 99 KB and a V100 96 KB (bf16: 20 KB). Triton says so only when the kernel
is launched, inside a run. Here the kernel is compiled ahead of the launch for the device's
architecture (`triton.compile` of the kernel's source: no GPU needed, so the CPU tests ask the
same question of a V100, an A100 or an H100), its metadata read, and a kernel whose every
candidate configuration is too big, or that this architecture cannot compile (bf16 dots before
sm_80), is not chosen: the layer runs torch's ops, and the run says why.

Compiles are cached in memory here and on disk by Triton (its cache key: source, options,
target), so the launch that follows reuses the work where the specialisation matches.

Imported where Triton is (the kernels' own modules, or a test): it imports triton.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What one block of a kernel may use on a GPU."""
    name: str
    cc: Tuple[int, int]
    """Compute capability (major, minor): the architecture Triton compiles for."""
    shared_per_block: int
    """Shared memory one block may use (the opt-in maximum), bytes."""
    threads_per_block: int = 1024

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"


KNOWN = {
    "v100": DeviceLimits("Tesla V100", (7, 0), 98304),
    "t4": DeviceLimits("Tesla T4", (7, 5), 65536),
    "a100": DeviceLimits("A100", (8, 0), 166912),
    "rtx3090": DeviceLimits("GeForce RTX 3090", (8, 6), 101376),
    "rtx4090": DeviceLimits("GeForce RTX 4090", (8, 9), 101376),
    "h100": DeviceLimits("H100", (9, 0), 232448),
}
"""Published limits of GPUs users of this field run (CUDA's occupancy tables), for tests and
for `SHMLEARN_GPU_LIMITS=<name>` (a run on one GPU asking what another could run)."""

_OVERRIDE: Optional[DeviceLimits] = None


def limits(device: torch.device) -> DeviceLimits:
    """The limits of a CUDA device (torch's device properties; Triton's driver where torch does
    not report the opt-in shared memory). SHMLEARN_GPU_LIMITS=v100|a100|... (KNOWN) or an
    override set by `override` takes their place."""
    if _OVERRIDE is not None:
        return _OVERRIDE
    named = os.environ.get("SHMLEARN_GPU_LIMITS")
    if named:
        if named not in KNOWN:
            raise ValueError(f"SHMLEARN_GPU_LIMITS={named!r}: one of {', '.join(KNOWN)}")
        return KNOWN[named]
    return _device_limits(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_limits(index: int) -> DeviceLimits:
    p = torch.cuda.get_device_properties(index)
    shared = int(getattr(p, "shared_memory_per_block_optin", 0) or 0)
    if not shared:
        from triton.runtime import driver
        shared = int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    return DeviceLimits(p.name, (p.major, p.minor), shared)


class override:
    """with fit.override(fit.KNOWN["v100"]): every choice made inside is made for that GPU."""

    def __init__(self, lim: Optional[DeviceLimits]):
        self.lim = lim

    def __enter__(self):
        global _OVERRIDE
        self.prev, _OVERRIDE = _OVERRIDE, self.lim
        return self.lim

    def __exit__(self, *exc):
        global _OVERRIDE
        _OVERRIDE = self.prev


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration of a kernel: its tile constexprs and launch options."""
    constexprs: Tuple[Tuple[str, object], ...]
    num_warps: int = 4
    num_stages: Optional[int] = None
    """None: Triton's default for the architecture."""

    @staticmethod
    def of(num_warps: int = 4, num_stages: Optional[int] = None, **constexprs) -> "Candidate":
        return Candidate(tuple(sorted(constexprs.items())), num_warps, num_stages)

    @property
    def kwargs(self) -> Dict[str, object]:
        return dict(self.constexprs)

    def launch(self) -> Dict[str, object]:
        """Keyword arguments for kernel[grid](...): the constexprs and the launch options."""
        out = dict(self.constexprs, num_warps=self.num_warps)
        if self.num_stages is not None:
            out["num_stages"] = self.num_stages
        return out


def _tt(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
            torch.int32: "i32", torch.int64: "i64", torch.float64: "fp64"}[dtype]


@functools.lru_cache(maxsize=None)
def shared_bytes(fn, pointers: Tuple[Tuple[str, torch.dtype], ...], constexprs: Tuple[Tuple[str, object], ...],
                 num_warps: int, num_stages: Optional[int], cc: Tuple[int, int]) -> int:
    """The shared memory (bytes) one block of `fn` uses when compiled for compute capability cc
    with these constexprs; pointers names each pointer argument's element dtype, every other
    non-constexpr argument is taken as a 32-bit integer. Raises what Triton raises where it
    cannot compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    ptr = dict(pointers)
    const = dict(constexprs)
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ptr:
            sig[name] = "*" + _tt(ptr[name])
        else:
            sig[name] = "i32"
    opts = {"num_warps": num_warps}
    if num_stages is not None:
        opts["num_stages"] = num_stages
    compiled = triton.compile(ASTSource(fn, signature=sig, constexprs=const),
                              target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32), options=opts)
    return int(compiled.metadata.shared)


def why_not(fn, pointers: Dict[str, torch.dtype], constexprs: Dict[str, object], cand: Candidate,
            lim: DeviceLimits) -> Optional[str]:
    """None if `fn` with the fixed constexprs and candidate `cand` runs on a device with limits
    `lim`, else why not (one clause)."""
    if cand.num_warps * 32 > lim.threads_per_block:
        return f"{cand.num_warps * 32} threads a block, the device allows {lim.threads_per_block}"
    try:
        need = shared_bytes(fn, tuple(sorted(pointers.items())), tuple(sorted({**constexprs, **cand.kwargs}.items())),
                            cand.num_warps, cand.num_stages, lim.cc)
    except Exception as e:  # noqa: BLE001 - whatever Triton cannot compile for this architecture
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:160]
        return f"Triton cannot compile it for {lim.arch} ({type(e).__name__}: {first})"
    if need > lim.shared_per_block:
        return f"needs {need} bytes of shared memory a block, {lim.name} has {lim.shared_per_block}"
    return None


def pick(fn, pointers: Dict[str, torch.dtype], constexprs: Dict[str, object], candidates: Sequence[Candidate],
         lim: DeviceLimits) -> Tuple[Optional[Candidate], Optional[str]]:
    """(the first candidate that runs, None), or (None, why the last one did not)."""
    why = "no candidate"
    for cand in candidates:
        why = why_not(fn, pointers, constexprs, cand, lim)
        if why is None:
            return cand, None
    return None, why


def interpreted() -> bool:
    """Triton's CPU interpreter (the tests): no device limits apply."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def first(items: Iterable[Optional[str]]) -> Optional[str]:
    """The first reason of several (None if every check passed)."""
    for why in items:
        if why:
            return why
    return None


__all__ = ["DeviceLimits", "KNOWN", "limits", "override", "Candidate", "shared_bytes", "why_not", "pick",
           "interpreted", "first"]
