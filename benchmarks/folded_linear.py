"""Forward+backward time of FoldedLinear against nn.Linear and a separate matmul + bias add.

    PYTHONPATH=. python benchmarks/folded_linear.py --out results

Variants, all computing y = x W^T + b and the gradients of x, W and b (a layer inside a net):
  linear           nn.Linear (F.linear: cuBLAS(Lt) addmm with the bias fused in the epilogue)
  mm+add           x @ W^T, then + b as its own kernel (what one writes by hand)
  folded           FoldedLinear (default impl): [1 | x] @ [b | W]^T, autograd differentiates
                   the cat and the product (2 products back, dX sliced out of an n x in+1 one)
  folded-function  the same with a custom autograd.Function (dX from the strided view of W)
  aligned-fold     not the paper's layout: [x | 1 | 0..] @ [W | b | 0..]^T, width padded to a
                   multiple of 8 so that every GEMM operand is 16-byte aligned (AlignedFold)
Shapes: the FC layers of alexnet-small on CIFAR (1024->64, 64->32, 32->10), of the mlp
(784->256, 256->128, 128->10) and a large 4096->4096 layer; batch 128 and 1024; fp32 and bf16.
Each case is timed eagerly (what a training loop sees, launch overhead included) and as a
replayed CUDA graph (GPU work alone), with CUDA events after a warm-up: REPEATS runs of enough
iterations for ~TARGET_MS each, variants interleaved within each run; median and spread of the
runs. Inputs are random (never zeros). Also times the ShiftRight/ShiftLeft round trip against
torch.cat, and profiles one small and one large case to show which kernels each variant runs.
Writes folded_linear.json and folded_linear.md into --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def import_folded():
    """shmlearn.nn.folded_linear alone: if shmlearn/__init__ pulls in half-written subpackages,
    stand in empty package modules so that only our files load."""
    sys.path.insert(0, str(ROOT))
    try:
        import shmlearn.nn.folded_linear as fl
        return fl
    except Exception as e:  # noqa: BLE001 - any failure of the other packages' imports
        print(f"[import] plain import failed ({e!r}); loading shmlearn/nn alone", file=sys.stderr)
        for name in list(sys.modules):
            if name == "shmlearn" or name.startswith("shmlearn."):
                del sys.modules[name]
        for name, path in (("shmlearn", ROOT / "shmlearn"), ("shmlearn.nn", ROOT / "shmlearn/nn")):
            mod = types.ModuleType(name)
            mod.__path__ = [str(path)]
            sys.modules[name] = mod
        import shmlearn.nn.folded_linear as fl
        return fl


fl = import_folded()

SHAPES = [("alexnet-small fc0", 1024, 64), ("alexnet-small fc1", 64, 32),
          ("alexnet-small fc2", 32, 10), ("mlp fc0", 784, 256), ("mlp fc1", 256, 128),
          ("mlp fc2", 128, 10), ("large", 4096, 4096)]
BATCHES = (128, 1024)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("linear", "mm+add", "folded", "folded-function", "aligned-fold")
SHIFT_SHAPES = [(128, 1024), (1024, 784), (1024, 4096)]
REPEATS = 5
TARGET_MS = 20.0


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def clock(fn, iters: int, device: str) -> float:
    """Mean microseconds per call of fn over iters calls (CUDA events on the GPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def measure(fns: dict, device: str, repeats: int, target_ms: float) -> dict:
    """{name: [us per call, one per run]}; runs interleave the variants so drift hits all."""
    iters = {}
    for name, fn in fns.items():
        for _ in range(3):  # warm-up: compilation, cuBLAS handles and heuristics, allocator
            fn()
        est = clock(fn, 5, device)
        iters[name] = max(10, min(5000, int(target_ms * 1e3 / max(est, 1e-3))))
    runs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(clock(fn, iters[name], device))
    return {name: {"median_us": statistics.median(r), "min_us": min(r), "max_us": max(r),
                   "spread_pct": 100 * (max(r) - min(r)) / statistics.median(r),
                   "iters": iters[name], "runs_us": r} for name, r in runs.items()}


def graphed(step):
    """A CUDA graph of step(): warm up on a side stream, capture, return its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g, g.replay


# ---------------------------------------------------------------------------------------------
# the layer variants
# ---------------------------------------------------------------------------------------------

class AlignedFold(nn.Module):
    """Not the paper's layout: the same fold with the bias LAST and the width padded, so
    x1 = [x | 1 | 0..0] and Wf = [W | b | 0..0] of width in+1 rounded up to `multiple` (8 bf16 =
    16 bytes). Every GEMM operand then starts 16-byte aligned with an aligned leading dimension,
    which the paper's [1 | x] (leading dimension in+1) never has. Here to test that hypothesis."""

    def __init__(self, lin: nn.Linear, multiple: int = 8):
        super().__init__()
        fin = lin.in_features
        self.fin, self.width = fin, -(-(fin + 1) // multiple) * multiple
        folded = lin.weight.new_zeros(lin.out_features, self.width)
        with torch.no_grad():
            folded[:, :fin] = lin.weight
            folded[:, fin] = lin.bias
        self.folded = nn.Parameter(folded)
        self.tail = None  # (n, width-in): a column of ones then zeros, made once per batch size

    def forward(self, x):
        if self.tail is None or self.tail.shape[0] != x.shape[0]:
            self.tail = x.new_zeros(x.shape[0], self.width - self.fin)
            self.tail[:, 0] = 1
        return torch.cat([x, self.tail], 1).mm(self.folded.t())


def make_variants(fin: int, fout: int, dtype, device):
    """{name: (forward fn, its parameters, grads of the parameters -> (dW, db))}, all holding
    the same weights."""
    lin = nn.Linear(fin, fout, device=device, dtype=dtype)
    w = lin.weight.detach().clone().requires_grad_(True)
    b = lin.bias.detach().clone().requires_grad_(True)
    fold = fl.FoldedLinear.from_linear(lin, impl="autograd")
    fold_fn = fl.FoldedLinear.from_linear(lin, impl="function")
    aligned = AlignedFold(lin)
    pair = lambda g: (g[0], g[1])  # noqa: E731
    paper = lambda g: (g[0][:, 1:], g[0][:, 0])  # noqa: E731
    last = lambda g: (g[0][:, :fin], g[0][:, fin])  # noqa: E731
    return {"linear": (lin, [lin.weight, lin.bias], pair),
            "mm+add": (lambda x: torch.matmul(x, w.t()) + b, [w, b], pair),
            "folded": (fold, [fold.folded], paper),
            "folded-function": (fold_fn, [fold_fn.folded], paper),
            "aligned-fold": (aligned, [aligned.folded], last)}


def step_fn(forward, params, x, dy):
    def step():  # forward + backward of a layer inside a net: dX, dW and db, no accumulation
        return torch.autograd.grad(forward(x), [x, *params], dy)
    return step


def max_rel_error(variants, x, dy) -> dict:
    """Each variant's worst relative error (output, dX, dW, db) against nn.Linear."""
    def outs(name):
        fwd, params, split = variants[name]
        y = fwd(x)
        g = torch.autograd.grad(y, [x, *params], dy)
        return [y.detach(), g[0], *split(g[1:])]
    ref = outs("linear")
    err = {}
    for name in variants:
        got = outs(name)
        err[name] = max(((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
                        for a, r in zip(got, ref))
    return err


def bench_layers(device, repeats, target_ms, shapes, batches, dtypes, graphs):
    cases = []
    for label, fin, fout in shapes:
        for n in batches:
            for dname in dtypes:
                dtype = DTYPES[dname]
                torch.manual_seed(0)
                variants = make_variants(fin, fout, dtype, device)
                x = torch.randn(n, fin, device=device, dtype=dtype, requires_grad=True)
                dy = torch.randn(n, fout, device=device, dtype=dtype)
                steps = {name: step_fn(f, p, x, dy) for name, (f, p, _) in variants.items()}
                case = {"layer": label, "in": fin, "out": fout, "batch": n, "dtype": dname,
                        "rel_err_vs_linear": max_rel_error(variants, x, dy),
                        "eager": measure(steps, device, repeats, target_ms)}
                if graphs:
                    try:
                        held = {name: graphed(s) for name, s in steps.items()}
                        case["graph"] = measure({k: v[1] for k, v in held.items()}, device,
                                                repeats, target_ms)
                        del held
                    except Exception as e:  # noqa: BLE001 - keep the eager numbers
                        print(f"[graph] {label} n={n} {dname}: {e!r}", file=sys.stderr)
                        graphs = False
                cases.append(case)
                med = {m: {k: v["median_us"] for k, v in case[m].items()}
                       for m in ("eager", "graph") if m in case}
                print(f"{label:18s} {fin:5d}->{fout:<5d} n={n:<5d} {dname}  " + "  ".join(
                    f"{m}: " + " ".join(f"{k}={v:.1f}" for k, v in d.items())
                    for m, d in med.items()), flush=True)
                if device == "cuda":
                    torch.cuda.empty_cache()
    return cases


# ---------------------------------------------------------------------------------------------
# ShiftRight + ShiftLeft against cat + copy
# ---------------------------------------------------------------------------------------------

def bench_shifts(device, repeats, target_ms, shapes, dtypes):
    out = []
    for rows, cols in shapes:
        for dname in dtypes:
            dtype = DTYPES[dname]
            a = torch.randn(rows, cols, device=device).to(dtype)
            buf = torch.randn(rows * (cols + 1), device=device).to(dtype)
            buf[:rows * cols] = a.flatten()
            helper = torch.empty(max(fl.helper_size(rows, cols), cols), device=device, dtype=dtype)
            fns = {}
            backends = ["torch"] + (["triton"] if device == "cuda" and fl.triton_available() else [])
            for be in backends:
                def rt(be=be):
                    fl.shift_right_(buf, rows, cols, helper=helper, backend=be)
                    fl.shift_left_(buf, rows, cols, helper=helper, backend=be)
                fns[f"shift_{be}"] = rt

            def cat_copy():
                a1 = torch.cat([torch.ones(rows, 1, device=device, dtype=dtype), a], 1)
                return a1[:, 1:].contiguous()
            fns["cat+copy"] = cat_copy
            res = measure(fns, device, repeats, target_ms)
            ok = torch.equal(buf[:rows * cols], a.flatten())  # round trips left A as it was
            moved = 2 * rows * cols * a.element_size() * 2  # each way reads A and writes A
            for v in res.values():
                v["GB_per_s"] = moved / (v["median_us"] * 1e3)
            out.append({"rows": rows, "cols": cols, "dtype": dname, "roundtrip_exact": ok,
                        "helper_elems": fl.helper_size(rows, cols), "results": res})
            print(f"shift {rows}x{cols} {dname} exact={ok} " + " ".join(
                f"{k}={v['median_us']:.1f}us" for k, v in res.items()), flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# profile: which kernels each variant runs
# ---------------------------------------------------------------------------------------------

def profile_case(fin, fout, n, dname, device, iters=20):
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    dtype = DTYPES[dname]
    variants = make_variants(fin, fout, dtype, device)
    x = torch.randn(n, fin, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(n, fout, device=device, dtype=dtype)
    result = {"in": fin, "out": fout, "batch": n, "dtype": dname, "iters": iters, "variants": {}}
    for name, (f, p, _) in variants.items():
        step = step_fn(f, p, x, dy)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
        kernels = []
        for e in prof.key_averages():
            dev = str(getattr(e, "device_type", ""))
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
            if "CUDA" in dev and t > 0:
                kernels.append({"kernel": e.key[:110], "per_iter": e.count / iters,
                                "us_per_iter": t / iters})
        kernels.sort(key=lambda k: -k["us_per_iter"])
        result["variants"][name] = {
            "kernels": kernels,
            "kernel_launches_per_iter": sum(k["per_iter"] for k in kernels),
            "gpu_us_per_iter": sum(k["us_per_iter"] for k in kernels)}
    return result


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def environment(device) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": sys.version.split()[0], "device": device}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        env["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
            env["driver"] = env["nvidia_smi"].split(",")[1].strip()
        except Exception as e:  # noqa: BLE001
            env["nvidia_smi"] = f"unavailable: {e!r}"
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


def cell(v: dict) -> str:
    return f"{v['median_us']:.1f} ±{v['spread_pct']:.0f}%"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# FoldedLinear benchmark", "",
             f"{env.get('gpu', env['device'])}, driver {env.get('driver', '-')}, torch "
             f"{env['torch']}, CUDA {env.get('cuda', '-')}, Triton {env.get('triton', '-')}, "
             f"TF32 matmul {env.get('tf32_matmul', '-')}, {env['date']}.", "",
             f"Forward + backward (dX, dW, db) of one layer, microseconds per step: median of "
             f"{report['repeats']} runs (each ~{report['target_ms']:.0f} ms of back-to-back "
             f"steps), ± (max-min)/median. 'folded/linear' < 1 means FoldedLinear is faster.", ""]
    for mode, title in (("eager", "Eager (launch overhead included)"),
                        ("graph", "CUDA graph replay (GPU work only)")):
        if not all(mode in c for c in report["layers"]):
            continue
        lines += [f"## {title}", "",
                  "| layer | in->out | batch | dtype | nn.Linear | mm+add | folded | "
                  "folded-function | aligned-fold | folded/linear |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in report["layers"]:
            m = c[mode]
            ratio = m["folded"]["median_us"] / m["linear"]["median_us"]
            lines.append(f"| {c['layer']} | {c['in']}->{c['out']} | {c['batch']} | {c['dtype']} | "
                         + " | ".join(cell(m[v]) for v in VARIANTS) + f" | {ratio:.2f} |")
        lines.append("")
    if report.get("shifts"):
        lines += ["## ShiftRight + ShiftLeft round trip vs cat + copy", "",
                  "In place (torch scheme, Triton kernels) against out of place "
                  "(`torch.cat([1, A])` then `[:, 1:].contiguous()`); microseconds, and GB/s "
                  "counting each way as reading and writing A once.", "",
                  "| rows x cols | dtype | " + " | ".join(report["shifts"][0]["results"]) + " |",
                  "|---|---|" + "---|" * len(report["shifts"][0]["results"])]
        for s in report["shifts"]:
            lines.append(f"| {s['rows']}x{s['cols']} | {s['dtype']} | " + " | ".join(
                f"{v['median_us']:.1f} ({v['GB_per_s']:.0f} GB/s)" for v in s["results"].values())
                + " |")
        lines.append("")
    for p in report.get("profiles", []):
        lines += [f"## Profile: {p['in']}->{p['out']}, batch {p['batch']}, {p['dtype']} "
                  f"(eager, per step)", ""]
        for name, v in p["variants"].items():
            lines += [f"**{name}**: {v['kernel_launches_per_iter']:.0f} kernels, "
                      f"{v['gpu_us_per_iter']:.1f} us of GPU time per step", "",
                      "| kernel | per step | us per step |", "|---|---|---|"]
            lines += [f"| `{k['kernel']}` | {k['per_iter']:.0f} | {k['us_per_iter']:.2f} |"
                      for k in v["kernels"]]
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results", help="folder for the JSON and MD")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="smoke test: two shapes, 2 short runs")
    args = ap.parse_args(argv)
    device = args.device
    repeats, target = (2, 2.0) if args.quick else (REPEATS, TARGET_MS)
    shapes = SHAPES[1:2] + SHAPES[3:4] if args.quick else SHAPES
    batches = BATCHES[:1] if args.quick else BATCHES
    dtypes = list(DTYPES)
    graphs = device == "cuda"
    t0 = time.time()
    report = {"environment": environment(device), "repeats": repeats, "target_ms": target}
    report["layers"] = bench_layers(device, repeats, target, shapes, batches, dtypes, graphs)
    report["shifts"] = bench_shifts(device, repeats, target,
                                    SHIFT_SHAPES[:1] if args.quick else SHIFT_SHAPES, dtypes)
    if device == "cuda":
        report["profiles"] = []
        for case in ((64, 32, 128, "fp32"), (4096, 4096, 1024, "bf16")):
            try:
                report["profiles"].append(profile_case(*case, device))
            except Exception as e:  # noqa: BLE001 - the timings stand without it
                print(f"[profile] {case}: {e!r}", file=sys.stderr)
    report["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "folded_linear.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (out / "folded_linear.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
