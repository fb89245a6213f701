"""Each kernel of a step against the limit of the hardware it runs on (a roofline, op by op).

A training step launches a few dozen kernels. How far the step is from its floor is the sum, over
them, of how far each is from its own: a kernel cannot finish before it has moved its bytes at the
memory bandwidth, nor before it has done its arithmetic at the peak FLOP rate. So for every aten
operator the step dispatches this records

* the bytes it must read and write at least: every tensor argument read once (its storage, so a
  broadcast view counts what is really there), every output and every argument the operator's
  schema marks as written, written once;
* its FLOPs, from torch.utils.flop_counter's formulas (matmuls, convolutions forward and backward,
  attention); elementwise work is left at 0: such kernels are bound by memory long before;
* the device time of the kernels it launched, from the PyTorch profiler: each operator runs inside
  a profiler range of its own (`record_function`), and its kernels are summed from that range's
  subtree, so attribution does not depend on kernel names or on launch order.

`Limits` holds the hardware's numbers: the datasheet where the device is known, and what this
process measures (a large copy, a large bf16 and fp32 matmul), which is what a kernel can really
reach. `rows` then gives, per operator, min time = max(bytes / bandwidth, FLOPs / peak) and the
fraction of it that the kernels achieved.

The recording is a TorchDispatchMode, so it sees the operators after autograd, the backward's
included (the mode follows the autograd engine onto its threads), exactly as they reach the
kernels. A torch.compile'd region is opaque to it; benchmarks/throughput_profile.py lists that
region's Triton kernels with Inductor's own byte counts instead.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shmlearn.bench.common import sync

SPEC = {
    # name substring: (bytes/s of HBM, bf16 dense tensor FLOP/s, fp32 FLOP/s without tensor cores)
    "H100 80GB HBM3": (3.35e12, 989e12, 67e12),
    "H100 PCIe": (2.0e12, 756e12, 51e12),
    "H200": (4.8e12, 989e12, 67e12),
    "A100": (2.0e12, 312e12, 19.5e12),
}
"""NVIDIA's datasheet figures (dense, no sparsity), for the record beside what is measured."""

_NO_KERNEL = frozenset({"view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "unsqueeze",
                        "squeeze", "reshape", "detach", "alias", "slice", "select", "split", "unbind",
                        "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
                        "new_empty_strided", "_to_copy_meta"})
"""Operators that only make views or allocate: no bytes move."""
_GATHERS = frozenset({"index", "index_select", "gather", "embedding", "take"})
"""Operators that read only the rows they pick from their first argument: it counts as much as
the output, not its whole storage (a batch picked from the dataset on the device)."""


def _bytes(t: torch.Tensor) -> int:
    """What a read or write of t moves at least: its elements, but no more than its storage holds
    (an expanded view reads each stored element once)."""
    n = t.numel() * t.element_size()
    with contextlib.suppress(Exception):
        n = min(n, t.untyped_storage().nbytes())
    return n


@dataclass
class Op:
    index: int
    name: str
    read: int
    written: int
    flops: int
    dtype: str
    """The dtype the FLOPs run in (the first floating input's): which peak applies."""
    device_us: float = 0.0

    @property
    def bytes(self) -> int:
        return self.read + self.written


@dataclass
class OpLog(TorchDispatchMode):
    """Record every operator dispatched while active, each inside a profiler range `op#i`."""
    ops: List[Op] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else str(func)
        if name in _NO_KERNEL or name.startswith("_record_function"):
            return func(*args, **kwargs)
        i = len(self.ops)
        with torch.profiler.record_function(f"op#{i}"):
            out = func(*args, **kwargs)
        self.ops.append(self._account(i, name, func, args, kwargs, out))
        return out

    @staticmethod
    def _account(i: int, name: str, func, args, kwargs, out) -> Op:
        seen = set()
        read = written = 0
        flat_in, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat_in if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for j, t in enumerate(tensors):
            key = (t.data_ptr(), t.numel(), t.dtype) if t.numel() else id(t)
            if key not in seen:
                seen.add(key)
                if j == 0 and name in _GATHERS and outs:
                    read += min(_bytes(t), sum(_bytes(o) for o in outs))
                else:
                    read += _bytes(t)
        # Arguments the schema marks as written (in-place and out= operators, fused optimizers).
        with contextlib.suppress(Exception):
            for a, v in zip(func._schema.arguments, args):
                if a.alias_info is not None and a.alias_info.is_write:
                    for t in tree_flatten(v)[0]:
                        if isinstance(t, torch.Tensor):
                            written += _bytes(t)
        in_ptrs = {t.data_ptr() for t in tensors}
        for t in outs:
            if t.data_ptr() not in in_ptrs:  # not an in-place result
                written += _bytes(t)
        flops = 0
        reg = _flop_registry()
        packet = getattr(func, "_overloadpacket", None)
        if packet in reg:
            with contextlib.suppress(Exception):
                flops = int(reg[packet](*args, **kwargs, out_val=out))
        floats = [t.dtype for t in tensors if t.is_floating_point()]
        dtype = str(floats[0]).replace("torch.", "") if floats else "-"
        return Op(i, name, read, written, flops, dtype)


def _flop_registry() -> Dict[Any, Any]:
    from torch.utils.flop_counter import flop_registry
    return flop_registry


def attribute(prof, ops: List[Op]) -> List[Op]:
    """Fill each op's device_us from a profile taken while the OpLog recorded (the kernels of its
    `op#i` range's subtree; on a CPU, the range's own CPU time, there being no kernels)."""
    by_index = {o.index: o for o in ops}

    def kernel_us(e) -> float:
        return sum(k.duration for k in getattr(e, "kernels", [])) + sum(kernel_us(c) for c in e.cpu_children)

    for e in prof.events():
        if e.name.startswith("op#") and e.device_type == torch.autograd.DeviceType.CPU:
            o = by_index.get(int(e.name[3:]))
            if o is not None:
                us = kernel_us(e)
                o.device_us += us if us > 0 or prof.use_device else e.cpu_time_total
    return ops


@dataclass
class Limits:
    device: str
    bandwidth: float
    """bytes/s a large device-to-device copy reached here (read + write counted)."""
    bf16_flops: float
    fp32_flops: float
    """FLOP/s a large matmul reached here, in bf16 and in fp32 (TF32 if torch allows it)."""
    spec: Optional[tuple] = None
    """(bytes/s, bf16 FLOP/s, fp32 FLOP/s) from the datasheet, where known."""

    def peak(self, dtype: str) -> float:
        return self.bf16_flops if dtype in ("bfloat16", "float16") else self.fp32_flops

    def min_s(self, op: Op) -> float:
        return max(op.bytes / self.bandwidth, op.flops / self.peak(op.dtype) if op.flops else 0.0)


def _timed(fn, device, n: int) -> float:
    """Seconds per call: warmed up, synchronized, the median of 5 runs of n calls."""
    fn()
    runs = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(device)
        runs.append((time.perf_counter() - t0) / n)
    return sorted(runs)[2]


def measure_limits(device: torch.device, *, copy_mib: int = 1024, matmul_n: int = 8192) -> Limits:
    """This device's reachable bandwidth and matmul rates, measured (random data, not zeros)."""
    def copy_rate() -> float:
        src = torch.rand(copy_mib << 18, device=device)  # float32: MiB * 2^18 elements
        dst = torch.empty_like(src)
        return 2 * src.numel() * src.element_size() / _timed(lambda: dst.copy_(src), device,
                                                             20 if device.type == "cuda" else 2)

    def matmul_rate(dt) -> float:
        a = torch.randn(matmul_n, matmul_n, device=device, dtype=dt)
        b = torch.randn(matmul_n, matmul_n, device=device, dtype=dt)
        return 2 * matmul_n ** 3 / _timed(lambda: a @ b, device, 20 if device.type == "cuda" else 1)

    bandwidth = copy_rate()  # each measurement's tensors are freed before the next
    rates = {dt: matmul_rate(dt) for dt in (torch.bfloat16, torch.float32)}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = next((v for k, v in SPEC.items() if k in name), None)
    return Limits(name, bandwidth, rates[torch.bfloat16], rates[torch.float32], spec)


def rows(ops: List[Op], limits: Limits) -> List[Dict[str, Any]]:
    """Per operator name (summed over its calls), slowest first: time, bytes, FLOPs, the floor
    and what fraction of it the kernels achieved; the bound says which limit sets the floor."""
    groups: Dict[str, Dict[str, Any]] = {}
    for o in ops:
        if o.device_us <= 0:
            continue
        g = groups.setdefault(o.name, {"op": o.name, "calls": 0, "us": 0.0, "bytes": 0, "flops": 0,
                                       "min_us": 0.0, "mem_us": 0.0})
        g["calls"] += 1
        g["us"] += o.device_us
        g["bytes"] += o.bytes
        g["flops"] += o.flops
        g["min_us"] += limits.min_s(o) * 1e6
        g["mem_us"] += o.bytes / limits.bandwidth * 1e6
    out = []
    for g in sorted(groups.values(), key=lambda g: -g["us"]):
        g["of_limit"] = g["min_us"] / g["us"] if g["us"] else None
        g["bound"] = "memory" if g["mem_us"] >= g["min_us"] - 1e-12 else "compute"
        g["us"], g["min_us"] = round(g["us"], 2), round(g["min_us"], 3)
        del g["mem_us"]
        out.append(g)
    return out


def record(step_fn, device: torch.device) -> List[Op]:
    """Run step_fn once under the OpLog and the profiler; its operators with their device time."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    log = OpLog()
    with profile(activities=acts) as prof:
        with log:
            step_fn()
        sync(device)
    return attribute(prof, log.ops)
