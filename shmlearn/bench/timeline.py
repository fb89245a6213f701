"""Where a replayed step's wall time goes between its kernels: a profiler trace's kernel events,
stream by stream.

A captured step's time is not its kernels' summed time: kernels on the side streams overlap the
main one, and between two kernels of the main stream the GPU may sit idle (launch latency inside
the graph, a wait on a side stream's event, a kernel that cannot start while another holds the
SMs). `analyze` splits the traced span into what the main stream (the stream with the most
kernels, the one the step was captured on) was doing, what the others did beside it, and where
nothing ran, and lists the main stream's largest gaps with the kernels either side of them: the
critical path's waits, which a kernel-by-kernel profile cannot show.

The trace's streams are the driver's streams for the graph's branches, not the ones the step was
captured on, so "main" is only the busiest of them. `phases` does not depend on them: it cuts
each replayed step at its first loss kernel into forward and backward (with the update), and
gives each part's wall time, the time some kernel ran, and its kernels' summed time by class
(convolutions and matmuls, reductions, pointwise, update, fills and copies): where a part's
summed time exceeds its wall time, streams overlapped; where its wall time exceeds its busy time,
the GPU waited.
"""
from __future__ import annotations

import gzip
import json
from collections import Counter
from typing import Dict, Iterable, List, Sequence, Tuple

from shmlearn.errors import BadInput

Interval = Tuple[float, float]

GAP_BUCKETS_US = (1.0, 2.0, 5.0, 20.0)
"""Upper edges of the gap-size buckets (microseconds); the last bucket is everything above."""


def union(intervals: Iterable[Interval]) -> List[Interval]:
    """The sorted, disjoint union of [start, end) intervals."""
    out: List[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(intervals: Sequence[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(x: Sequence[Interval], y: Sequence[Interval]) -> List[Interval]:
    """Intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def kernels_of_trace(path: str) -> List[dict]:
    """The GPU kernel (and memset/memcpy) events of a Chrome trace that torch.profiler exported:
    name, start and duration in microseconds, and stream."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memset", "gpu_memcpy"):
            continue
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        out.append({"name": e.get("name", "?"), "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0)),
                    "stream": stream})
    return out


def analyze(kernels: Sequence[dict], steps: int = 1, top: int = 25) -> Dict:
    """Per-step split of the traced span (first kernel's start to last kernel's end, divided by
    `steps`): main stream busy, the other streams busy beside it, the other streams alone, nothing
    at all; the main stream's gaps by size, how much of them the other streams covered, and the
    `top` largest with their neighbours."""
    if not kernels:
        raise ValueError("no kernel events to analyze")
    ks = sorted(kernels, key=lambda k: (k["ts"], k["ts"] + k["dur"]))
    per_stream = Counter(k["stream"] for k in ks)
    main = per_stream.most_common(1)[0][0]
    start = ks[0]["ts"]
    end = max(k["ts"] + k["dur"] for k in ks)
    span = end - start
    main_k = [k for k in ks if k["stream"] == main]
    main_u = union((k["ts"], k["ts"] + k["dur"]) for k in main_k)
    side_u = union((k["ts"], k["ts"] + k["dur"]) for k in ks if k["stream"] != main)
    all_u = union(main_u + side_u)
    both = length(intersect(main_u, side_u))
    gaps = []
    reach = main_k[0]["ts"] + main_k[0]["dur"]
    before = main_k[0]
    for k in main_k[1:]:
        if k["ts"] > reach:
            g = (reach, k["ts"])
            gaps.append({"us": g[1] - g[0], "covered_us": length(intersect([g], side_u)),
                         "before": before["name"], "after": k["name"]})
        if k["ts"] + k["dur"] >= reach:
            reach, before = k["ts"] + k["dur"], k
    edges = (0.0,) + GAP_BUCKETS_US + (float("inf"),)
    buckets = []
    for lo, hi in zip(edges, edges[1:]):
        sel = [g for g in gaps if lo < g["us"] <= hi]
        buckets.append({"up_to_us": hi if hi != float("inf") else None, "count": len(sel) / steps,
                        "us": sum(g["us"] for g in sel) / steps})
    busy_main = length(main_u)
    busy_side = length(side_u)
    return {
        "steps": steps, "streams": {str(s): n / steps for s, n in per_stream.items()}, "main_stream": str(main),
        "kernels_per_step": len(ks) / steps, "main_kernels_per_step": len(main_k) / steps,
        "span_us_per_step": span / steps,
        "main_busy_us": busy_main / steps, "side_busy_us": busy_side / steps,
        "overlap_us": both / steps, "side_only_us": (busy_side - both) / steps,
        "idle_us": (span - length(all_u)) / steps,
        "main_gap_us": sum(g["us"] for g in gaps) / steps, "main_gaps": len(gaps) / steps,
        "main_gap_covered_us": sum(g["covered_us"] for g in gaps) / steps,
        "gap_buckets": buckets,
        "largest_gaps": [{"us": g["us"], "covered_us": g["covered_us"], "name_before": g["before"][:90],
                          "name_after": g["after"][:90]} for g in sorted(gaps, key=lambda g: -g["us"])[:top]],
    }


LOSS_MARKERS = ("log_softmax", "nll_loss", "cross_entropy", "mse_loss")
"""Substrings of the first kernel of a loss (cross-entropy's log-softmax, or MSE): where a step's
forward ends."""

KERNEL_CLASSES = (
    ("reduction", ("triton_red", "triton_per")),
    ("pointwise", ("triton_poi",)),
    ("update", ("sgd", "multi_tensor_apply", "adam")),
    ("conv/matmul", ("xmma", "implicit_gemm", "gemm", "nvjet", "cutlass", "cudnn", "conv", "splitk")),
    ("fill/copy", ("memset", "memcpy", "fill", "copy", "gather", "scatter", "index")),
    ("reduction", ("reduce", "batch_norm_collect", "welford")),
    ("pointwise", ("elementwise", "vectorized", "unrolled")),
)
"""Kernel classes by substrings of kernel names (lower case), in order, the first match winning:
Inductor's kernels by their prefix first (their names list every op fused in, convolution
backwards included). "update" holds the optimizer's kernels and torch's multi-tensor ones (the
foreach copies of gradients into a flat buffer too); the rest is "other"."""


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def _part(ks: Sequence[dict], start: float, end: float) -> Dict:
    """Wall time of [start, end), the time some kernel in it ran, and its kernels' time by class."""
    clipped = [(max(k["ts"], start), min(k["ts"] + k["dur"], end)) for k in ks]
    by_class: Counter = Counter()
    for k in ks:
        by_class[kernel_class(k["name"])] += k["dur"]
    return {"wall_us": end - start, "busy_us": length(union((a, b) for a, b in clipped if b > a)),
            "kernels": len(ks), "kernel_us": sum(k["dur"] for k in ks), "by_class_us": dict(by_class)}


def phases(kernels: Sequence[dict], steps: int, markers: Sequence[str] = LOSS_MARKERS) -> Dict:
    """Each of `steps` replayed steps cut at its first kernel whose name holds one of `markers`:
    the forward before it, the rest (loss, backward, update) after; both averaged over the steps.
    Replays of one graph run one after another with the same kernels, so step i is the i-th run of
    len(kernels) / steps kernels in start order. Raises ValueError where the trace is not that,
    or a step has no marker."""
    ks = sorted(kernels, key=lambda k: (k["ts"], k["ts"] + k["dur"]))
    if steps < 1 or not ks or len(ks) % steps:
        raise ValueError(f"{len(ks)} kernels are not {steps} replays of one step")
    n = len(ks) // steps
    parts = {"forward": [], "backward": []}
    for i in range(steps):
        step = ks[i * n:(i + 1) * n]
        cut = next((j for j, k in enumerate(step) if any(m in k["name"] for m in markers)), None)
        if cut is None:
            raise ValueError(f"step {i} has no kernel named like {', '.join(markers)}: where its forward ends is unknown")
        start, mid = step[0]["ts"], step[cut]["ts"]
        end = max(k["ts"] + k["dur"] for k in step)
        parts["forward"].append(_part(step[:cut], start, mid))
        parts["backward"].append(_part(step[cut:], mid, end))
    out = {}
    for name, got in parts.items():
        classes = sorted({c for g in got for c in g["by_class_us"]})
        out[name] = {key: sum(g[key] for g in got) / steps for key in ("wall_us", "busy_us", "kernels", "kernel_us")}
        out[name]["by_class_us"] = {c: sum(g["by_class_us"].get(c, 0.0) for g in got) / steps for c in classes}
    return out


def render_phases(p: Dict) -> str:
    lines = []
    for name, q in p.items():
        classes = ", ".join(f"{c} {us:.1f}" for c, us in sorted(q["by_class_us"].items(), key=lambda kv: -kv[1]))
        lines.append(f"  {name}: {q['wall_us']:.1f} us, a kernel running {q['busy_us']:.1f} us; {q['kernels']:.0f} kernels, "
                     f"{q['kernel_us']:.1f} us of them ({classes})")
    return "\n".join(lines)


def render(a: Dict) -> str:
    """A few lines of text for a log."""
    lines = [f"traced {a['steps']} steps: {a['span_us_per_step']:.1f} us per step, {a['kernels_per_step']:.0f} kernels "
             f"({a['main_kernels_per_step']:.0f} on the main stream)",
             f"  main stream busy {a['main_busy_us']:.1f} us; other streams busy {a['side_busy_us']:.1f} us "
             f"({a['overlap_us']:.1f} beside the main one, {a['side_only_us']:.1f} alone); nothing running "
             f"{a['idle_us']:.1f} us",
             f"  main-stream gaps: {a['main_gaps']:.0f} per step, {a['main_gap_us']:.1f} us "
             f"({a['main_gap_covered_us']:.1f} us of it with another stream running)"]
    lo = 0.0
    for b in a["gap_buckets"]:
        hi = b["up_to_us"]
        lines.append(f"    gaps {lo:g}-{hi:g} us: {b['count']:.1f}, {b['us']:.1f} us" if hi is not None
                     else f"    gaps > {lo:g} us: {b['count']:.1f}, {b['us']:.1f} us")
        lo = hi if hi is not None else lo
    for g in a["largest_gaps"][:12]:
        lines.append(f"    {g['us']:7.1f} us ({g['covered_us']:6.1f} covered) {g['name_before'][:50]} -> "
                     f"{g['name_after'][:50]}")
    return "\n".join(lines)



def register(bench_sub) -> None:
    p = bench_sub.add_parser(
        "timeline", help="read a saved trace of replayed steps: streams, gaps, forward against backward",
        description="The analysis of a Chrome trace of N replays of a step's CUDA graph "
                    "(benchmarks/throughput_profile.py --timeline writes them): streams and gaps, then each "
                    "step cut at its loss kernel into forward and backward, by kernel class.")
    p.add_argument("trace", help="a Chrome trace from torch.profiler (.json or .json.gz)")
    p.add_argument("--steps", type=int, required=True, help="how many replays of the step it holds")
    p.set_defaults(func=cmd_timeline)


def cmd_timeline(ns) -> int:
    try:
        kernels = kernels_of_trace(ns.trace)
        text = render(analyze(kernels, steps=ns.steps)) + "\n" + render_phases(phases(kernels, steps=ns.steps))
    except (OSError, ValueError) as e:
        raise BadInput(f"{ns.trace}: {e}") from None
    print(text)
    return 0
