"""Where one training step's time goes: the kernels of shmlearn's step, eager, under the PyTorch
profiler, against the same step replayed from its CUDA graph (CUDA events).

    PYTHONPATH=. python benchmarks/throughput_profile.py --model alexnet-small --batch-sizes 128,1024 \
        --precision bf16 --channels-last --out profile.json

For each batch size: the number of kernels one step launches, their summed GPU time, the top
kernels by GPU time, the eager step's wall time, and the graph replay's time per step (the
median of 5 x 200 replays). A graph removes the launch gaps, so its step time approaches the
summed kernel time: what is left is the kernels themselves (the floor without fusing them).

Each kernel against its limit (issue 18, acceptance 3): the eager step is recorded once more
operator by operator (shmlearn/bench/roofline.py): each aten operator's kernels' device time,
the bytes it must move and its FLOPs, against this GPU's measured copy bandwidth and matmul rate,
so each row says how far that operator is from its floor and which limit sets it. With
--variants off,compile the step is also built with --compile: Inductor's generated Triton kernels
are listed with the bytes Inductor counts for each (torch._inductor.config.benchmark_kernel) and
the bandwidth they reached; its extern kernels (cuDNN convolutions, cuBLAS matmuls) are the
eager step's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


from shmlearn.bench.common import sync  # noqa: E402


def _inductor_gb() -> dict:
    """Triton kernel name -> GB it moves, as Inductor counted it (its generated kernels' metadata)."""
    import gc
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except Exception:  # noqa: BLE001 - no Inductor: nothing to list
        return {}
    out = {}
    for o in gc.get_objects():
        try:
            if not isinstance(o, CachingAutotuner):
                continue
        except ReferenceError:  # a dead weak proxy
            continue
        name = getattr(getattr(o, "fn", None), "__name__", None) or o.inductor_meta.get("kernel_name")
        if name and o.inductor_meta.get("kernel_num_gb") is not None:
            out[name] = float(o.inductor_meta["kernel_num_gb"])
    return out


def roofline_of(st, device, limits) -> dict:
    """The eager step, operator by operator, against the limits."""
    from shmlearn.bench.roofline import record, rows
    from shmlearn.record.timing import NULL_TIMER
    st.loader.invalidate()
    st.loader.prepare(0)
    ops = record(lambda: st.dstep.run(NULL_TIMER, False), device)
    st.dstep.expected = None
    table = rows(ops, limits)
    kernel_us = sum(r["us"] for r in table)
    floor_us = sum(r["min_us"] for r in table)
    return {"ops": table, "kernel_us": kernel_us, "floor_us": floor_us,
            "of_limit": floor_us / kernel_us if kernel_us else None}


def kernels_against_gb(top: list, gb: dict, limits) -> list:
    """Annotate Triton kernels with Inductor's bytes and the share of the bandwidth they reached."""
    for k in top:
        g = gb.get(k["name"])
        if g is not None and k["us"] > 0:
            per_call_s = k["us"] / k["count"] * 1e-6
            k["gb"] = g
            k["of_bandwidth"] = g * 1e9 / per_call_s / limits.bandwidth
    return top


def timeline_of(graph, rewind, folder: str, tag: str, replays: int = 20) -> dict:
    """`replays` replays of the step's CUDA graph under the profiler: the trace (gzipped, for
    Perfetto or chrome://tracing) goes to folder/tag.json.gz, and the analysis of its streams'
    kernels (shmlearn/bench/timeline.py) is returned."""
    import gzip
    import shutil
    from torch.profiler import ProfilerActivity, profile
    from shmlearn.bench.timeline import analyze, kernels_of_trace, phases, render, render_phases
    os.makedirs(folder, exist_ok=True)
    rewind()
    for _ in range(3):  # the profiler's own first-use costs stay out of the trace
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    raw = os.path.join(folder, f"{tag}.json")
    prof.export_chrome_trace(raw)
    kernels = kernels_of_trace(raw)
    a = analyze(kernels, steps=replays)
    try:  # forward against backward, by kernel class (a step without a loss kernel has none)
        a["phases"] = phases(kernels, steps=replays)
    except ValueError as e:
        a["phases_note"] = str(e)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(raw)
    print(f"{tag}:\n{render(a)}", flush=True)
    if "phases" in a:
        print(render_phases(a["phases"]), flush=True)
    return a


def profile_one(c, batch: int, device, variant: str = "off", limits=None, timeline: str = "") -> dict:
    from torch.profiler import ProfilerActivity, profile
    from shmlearn.bench.throughput import _Shmlearn
    from shmlearn.record.timing import NULL_TIMER
    mods = frozenset() if variant == "off" else frozenset(variant.split("+"))  # e.g. compile+triton-conv
    r = _Shmlearn(c, device, batch, 0, 1, strategy="allreduce", eager=False, local=True, mods=mods)
    st = r.stepper
    out = {"batch": batch, "variant": variant, "mode": st.mode, "compiled": st.compiled, "note": st.note}
    step = 0
    for _ in range(20):
        r.step(step)
        step += 1
    r.flush(step)
    sync(device)
    # eager: one step, profiled (the same device function the graph holds)
    st.loader.invalidate()
    st.loader.prepare(0)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            st.dstep.run(NULL_TIMER, False)
            sync(device)
        kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
        events = [e for e in prof.events() if e.device_type == kind and not e.name.startswith("op#")]
        kernels = {}
        for e in events:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        top = [{"name": n, "count": v[0], "us": round(v[1], 2)}
               for n, v in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:100]]
        if limits is not None and mods & {"compile", "compile-max"}:
            top = kernels_against_gb(top, _inductor_gb(), limits)
        for k in top:
            k["name"] = k["name"][:110]
        out.update(kernels=sum(v[0] for v in kernels.values()), kernel_us=sum(v[1] for v in kernels.values()),
                   top=top)
    except Exception as e:  # noqa: BLE001 - the timings below still say something
        out.update(kernels=-1, kernel_us=float("nan"), top=[], profile_error=f"{type(e).__name__}: {e}"[:300])
    st.dstep.expected = None  # the eager step advanced the device counters
    if limits is not None and not mods & {"compile", "compile-max"}:  # a compiled region is opaque to the log
        try:
            out["roofline"] = roofline_of(st, device, limits)
        except Exception as e:  # noqa: BLE001 - the timings below still say something
            out["roofline_error"] = f"{type(e).__name__}: {e}"[:300]
    # chunks of steps that stay inside one epoch: the device counters are reset before each
    n = min(100, st.loader.steps_per_epoch)

    def rewind():
        st.loader.invalidate()
        st.loader.prepare(0)
        st.dstep.t.fill_(0)

    ts = []
    for _ in range(5):  # eager step wall time
        rewind()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            st.dstep.run(NULL_TIMER, False)
        sync(device)
        ts.append((time.perf_counter() - t0) / n * 1e6)
    out["eager_step_us"] = statistics.median(ts)
    if st.graphs:
        from shmlearn.bench.common import replay_us
        out["graph_step_us"] = statistics.median(replay_us(st.graphs[False], n, before=rewind))
        if timeline:
            out["timeline"] = timeline_of(st.graphs[False], rewind, timeline, f"{c.model}-b{batch}-{variant}")
    out["steps_timed"] = n
    st.dstep.expected = None
    r.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="alexnet-small")
    p.add_argument("--input", default="3x32x32")
    p.add_argument("--batch-sizes", default="128,1024")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of this script")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--variants", default="off",
                   help="off (shmlearn's step) or bench throughput modifiers joined by + (compile, compile-max, "
                        "im2col, triton-conv), comma-separated: off,compile,compile+triton-conv")
    p.add_argument("--no-roofline", action="store_true", help="skip the operator-by-operator limits")
    p.add_argument("--timeline", default="", metavar="DIR",
                   help="also trace 20 graph replays: the gzipped traces go to DIR, and each result gains the "
                        "streams' analysis (main-stream gaps, overlap; shmlearn/bench/timeline.py)")
    p.add_argument("--out", default="profile.json")
    a = p.parse_args(argv)
    import torch.distributed as dist
    from shmlearn.bench.common import environment
    from shmlearn.launch.start import free_port
    from shmlearn.bench.throughput import ThroughputConfig
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    c = ThroughputConfig(model=a.model, input_shape=[int(v) for v in a.input.split("x")], device=a.device,
                         precision=a.precision, channels_last=a.channels_last)
    limits = None
    if not a.no_roofline:
        from shmlearn.bench.roofline import measure_limits
        import torch._inductor.config as inductor_config
        limits = measure_limits(device) if cuda else measure_limits(device, copy_mib=64, matmul_n=256)
        inductor_config.benchmark_kernel = True  # Inductor then records each kernel's bytes
    doc = {"env": environment("nccl" if cuda else "gloo"), "config": vars(a), "limits": vars(limits) if limits else None,
           "results": []}
    for b in (int(v) for v in a.batch_sizes.split(",")):
        for v in a.variants.split(","):
            doc["results"].append(profile_one(c, b, device, v, limits, a.timeline))
            with open(a.out, "w") as f:  # what finished survives a time limit
                json.dump(doc, f, indent=1)
    dist.destroy_process_group()
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    if limits:
        print(f"limits on {limits.device}: copy {limits.bandwidth / 1e12:.2f} TB/s, bf16 matmul "
              f"{limits.bf16_flops / 1e12:.0f} TFLOP/s, fp32 matmul {limits.fp32_flops / 1e12:.0f} TFLOP/s")
    for r in doc["results"]:
        print(f"B={r['batch']} {r['variant']} {r['mode']}: {r['kernels']} kernels, {r['kernel_us']:.1f} us of kernels; "
              f"eager step {r['eager_step_us']:.1f} us; graph step {r.get('graph_step_us', float('nan')):.1f} us")
        for k in r["top"][:25]:
            bw = f" {k['gb'] * 1e3:8.3f} MB {k['of_bandwidth']:6.1%} of bw" if "gb" in k else ""
            print(f"    {k['us']:9.1f} us {k['count']:4d}x{bw}  {k['name']}")
        rl = r.get("roofline")
        if rl:
            print(f"  operators: {rl['kernel_us']:.1f} us of kernels, floor {rl['floor_us']:.1f} us "
                  f"({rl['of_limit']:.1%} of the limits)")
            for o in rl["ops"][:25]:
                print(f"    {o['us']:9.1f} us {o['calls']:3d}x {o['bytes'] / 1e6:9.3f} MB {o['flops'] / 1e9:9.3f} GFLOP "
                      f"floor {o['min_us']:8.2f} us {o['of_limit']:6.1%} ({o['bound']})  {o['op']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
