"""`shmlearn bench throughput`: training steps per second of shmlearn's step against what a user
would write instead, in the same run, on the same device (docs/architecture.md, Style 7; seed 004).

For each worker count W (one fresh process group: Gloo on CPU processes, NCCL with one process
per GPU) and each per-worker batch B, every variant trains the same model (same seed) with the
same optimizer (SGD, momentum 0.9) on random uint8 images of the model's input shape:

  plain        the eager loop a user writes: a device-resident float dataset indexed by a
               random permutation, zero_grad(set_to_none), forward, cross-entropy, backward,
               step; same precision and memory format as shmlearn's (--precision,
               --channels-last). With W > 1 every rank runs it alone: no communication.
  plain-fp32   the same loop in fp32, contiguous (what most code does).
  graph        the plain step captured by hand in one CUDA graph, the torch docs' "whole
               network capture" recipe: a static input (the batch's indices into the device
               dataset; the gather is in the graph), warm-up on a side stream, torch.cuda.graph
               around zero_grad, forward, loss, backward and step (SGD fused: one kernel), then
               copy the next indices and replay. CUDA only: on the CPU the row says skipped.
  compile      the plain loop with torch.compile(model, mode="reduce-overhead"): Inductor's
               kernels in its own CUDA graphs (cudagraph trees); the loss and SGD stay eager.
  compile-max  the same with mode="max-autotune". On the CPU both run mode default (the
               modes' CUDA graphs do not apply there) and their rows say so.
  ddp          torch DistributedDataParallel around the plain loop (W > 1).
  ddp-compile  the same DDP model under torch.compile (mode default: Dynamo splits the graph at
               DDP's buckets so each bucket's all-reduce overlaps the backward), fused SGD: what
               a skilled user picks at W > 1 (W > 1).
  local        shmlearn's step with no communication (each rank its own world; W > 1): the
               ceiling for any strategy.
  <strategy>   shmlearn's step (fast.py) exactly as `shmlearn train` runs it: device loader,
               the chosen step mode (CUDA graph on CUDA unless --cuda-graph off), the loss read
               every --check-every steps. Modifiers after a colon, joined by +: `eager` forces
               --cuda-graph off; `noise` measures the gradient noise scale as --noise-scale does
               (noise.py: every noise.default_every(W) steps, the default --noise-every),
               `noise1` at every step (--noise-every 1); `compile` is --compile default and `compile-max` --compile
               max-autotune (Inductor's kernels inside the step's one CUDA graph), e.g.
               `allreduce:compile`, `allreduce:eager+compile`; not both compile and compile-max.
With W > 1 the baselines other than ddp and ddp-compile run on every rank alone (no communication).

Method: each variant is built, warmed up (its CUDA graph captured, cuDNN autotuned), then timed
`repeats` times. A repeat: synchronize the device, barrier, perf_counter, `steps` steps,
synchronize, perf_counter; its time is the slowest rank's. `steps` is chosen from ten steps
timed after the warm-up so a repeat lasts about --seconds (the same on every rank); for
shmlearn's steps replayed from a CUDA graph, a whole number of their `sample_every` periods
(one eager, phase-timed step each) where that stays within 10x --seconds
(`steps_per_repeat`), so every repeat pays the same share of those eager steps. Compiling and capturing happen while a
variant is built (compile and compile-max run 3 steps there: Inductor compiles forward and
backward, its CUDA graphs are recorded), so `setup_s` (build + warm-up, slowest rank) holds
them and no timed repeat does. Reported: median and spread (min, quartiles, max) of steps/s and
samples/s (all workers' samples), ratios to plain, ddp and the same variant at one worker, and
for shmlearn's variants (and local) `ratio_to_best_baseline`: against the best median samples/s
of plain, graph, compile and compile-max at the same W and B (`best_baseline` names it).

`--sync-models resnet34` adds, for W > 1, the gradient sync alone: shmlearn's average of the
flat gradient buffer (what every allreduce step does) against a bare all_reduce of the same
number of bytes, both as nccl-tests bus bandwidth (2(W-1)/W x bytes / time).

The parts: the variants, MODIFIERS, config and its check (bench/throughput_variants.py), the
runner of each variant (bench/throughput_runners.py), the timing on one rank
(bench/throughput_rank.py); here the whole benchmark over worker counts, the ratios, the
table and the command line.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any, Dict, List

from shmlearn.bench.common import RANK_TIMEOUT_S, environment, parse_int_list
from shmlearn.bench.throughput_rank import _worker, steps_per_repeat  # noqa: F401 - steps_per_repeat: tests
from shmlearn.bench.throughput_runners import _Shmlearn, _build  # noqa: F401 - benchmarks/ import them from here
from shmlearn.bench.throughput_variants import (BASELINES, BEST_OF, DDP, MODIFIERS, ThroughputConfig,  # noqa: F401
                                                _variants, check, step_options, strategy_names)
from shmlearn.record import safe_write
from shmlearn.errors import BadInput, WorkerFailed
from shmlearn.launch.pool import run_local
from shmlearn.sync import registry


# --- the whole benchmark -----------------------------------------------------------------------

def run(c: ThroughputConfig, *, log=print) -> Dict[str, Any]:
    check(c)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (shared hosts; KINDS.md)
    doc: Dict[str, Any] = {"benchmark": "throughput", "schema": 1,
                           "env": environment("nccl" if c.device == "cuda" else "gloo"),
                           "config": asdict(c), "results": [], "sync": []}
    for w in c.workers:
        t0 = time.perf_counter()
        try:
            rows = run_local(_worker, (asdict(c),), w, cuda=c.device == "cuda", timeout_s=RANK_TIMEOUT_S)[0]
        except WorkerFailed as e:  # keep the other worker counts' results
            rows = [{"workers": w, "batch": 0, "variant": "*", "error": str(e)}]
        doc["results"].extend(r for r in rows if "variant" in r)
        doc["sync"].extend(r for r in rows if "sync_model" in r)
        log(f"bench throughput: W={w}: {len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    _ratios(doc["results"])
    doc["env"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return doc


def _ratios(rows: List[dict]) -> None:
    """vs_plain, vs_ddp (same W and B) and scaling (same variant at W=1, same B) of median
    samples/s; for shmlearn's variants, ratio_to_best_baseline (BEST_OF, same W and B)."""
    def med(w, b, v):
        for r in rows:
            if (r["workers"], r["batch"], r["variant"]) == (w, b, v) and "samples_per_s" in r:
                return r["samples_per_s"]["median"]
        return None
    for r in rows:
        if "samples_per_s" not in r:
            continue
        x = r["samples_per_s"]["median"]
        if r["variant"] == "local" or r["variant"] not in BASELINES:
            best = max(((med(r["workers"], r["batch"], v), v) for v in BEST_OF
                        if med(r["workers"], r["batch"], v)), default=None)
            if best:
                r["ratio_to_best_baseline"], r["best_baseline"] = x / best[0], best[1]
        for key, ref in (("vs_plain", med(r["workers"], r["batch"], "plain")),
                         ("vs_ddp", med(r["workers"], r["batch"], "ddp")),
                         ("vs_local", med(r["workers"], r["batch"], "local")),
                         ("scaling", med(1, r["batch"], r["variant"] if r["variant"] not in DDP + ("local",)
                                         else registry.DEFAULT))):
            if ref and not (key == "scaling" and r["workers"] == 1):
                r[key] = x / ref
        best_ddp = max((m for m in (med(r["workers"], r["batch"], v) for v in DDP) if m), default=None)
        if best_ddp and r["variant"] not in DDP:
            r["vs_best_ddp"] = x / best_ddp


def table(doc: Dict[str, Any]) -> str:
    e = doc["env"]
    vw = max([25] + [len(r["variant"]) + 1 for r in doc["results"]])  # modifiers make long names
    lines = [f"bench throughput: {doc['config']['model']} {'x'.join(map(str, doc['config']['input_shape']))}, "
             f"{e['device']} x{max(doc['config']['workers'])}, torch {e['torch_version']}, "
             f"precision {doc['config']['precision']}{', channels_last' if doc['config']['channels_last'] else ''}, "
             f"{doc['config']['repeats']} repeats, {e['date']}",
             f"{'W':>2} {'B':>5} {'variant':<{vw}}{'mode':<11}{'ms/step':>9}{'steps/s':>10}{'samples/s':>12}"
             f"{'p25-p75 samples/s':>22}{'vs plain':>9}{'vs ddp':>8}{'vs local':>9}{'scaling':>8}"
             f"{'vs best':>8}{'setup s':>9}"]

    def f(r, k):
        return f"{r[k]:.2f}" if k in r else "-"
    for r in doc["results"]:
        if "samples_per_s" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r.get('error', '?')}"
            lines.append(f"{r['workers']:>2} {r['batch']:>5} {r['variant']:<{vw}}{why}")
            continue
        sp, st = r["samples_per_s"], r["steps_per_s"]
        lines.append(f"{r['workers']:>2} {r['batch']:>5} {r['variant']:<{vw}}{r.get('mode', ''):<11}"
                     f"{1e3 / st['median']:>9.3f}{st['median']:>10.1f}{sp['median']:>12.0f}"
                     f"{sp['p25']:>11.0f}-{sp['p75']:<10.0f}{f(r, 'vs_plain'):>9}{f(r, 'vs_ddp'):>8}"
                     f"{f(r, 'vs_local'):>9}{f(r, 'scaling'):>8}{f(r, 'ratio_to_best_baseline'):>8}"
                     f"{r.get('setup_s', 0):>9.1f}")
    notes = [f"{r['workers']} {r['batch']} {r['variant']}: {r['note']}" for r in doc["results"] if r.get("note")]
    if any("ratio_to_best_baseline" in r for r in doc["results"]):
        lines.append(f"vs best: median samples/s over the best of {', '.join(BEST_OF)} at the same W and B; "
                     "setup s: build + warm-up (compiling, capturing), not timed")
    lines += [f"note (W B variant): {n}" for n in notes]
    for s in doc.get("sync", []):
        lines.append(f"gradient sync {s['sync_model']} W={s['workers']} {s['bytes'] / 2**20:.1f} MiB: shmlearn "
                     f"{s['shmlearn']['time_s']['median'] * 1e3:.3f} ms ({s['shmlearn']['busbw_GBps']:.1f} GB/s busbw), "
                     f"bare all_reduce {s['bare_all_reduce']['time_s']['median'] * 1e3:.3f} ms "
                     f"({s['bare_all_reduce']['busbw_GBps']:.1f} GB/s): {100 * s['ratio']:.1f}%")
    return "\n".join(lines)


# --- command line ------------------------------------------------------------------------------



def config_from_args(ns) -> ThroughputConfig:
    try:
        shape = [int(v) for v in ns.input.lower().split("x")]
    except ValueError:
        raise BadInput(f"--input {ns.input}: expected CxHxW, e.g. 3x32x32") from None
    split = lambda s: [v for v in s.split(",") if v.strip()]  # noqa: E731
    return ThroughputConfig(model=ns.model, input_shape=shape, classes=ns.classes, device=ns.device,
                            batch_sizes=parse_int_list(ns.batch_sizes, flag="--batch-sizes"),
                            workers=parse_int_list(ns.workers, flag="--workers"),
                            strategies=split(ns.strategies), baselines=split(ns.baselines),
                            avg_period=ns.avg_period, precision=ns.precision, channels_last=ns.channels_last,
                            cuda_graph=ns.cuda_graph, check_every=ns.check_every, repeats=ns.repeats,
                            seconds=ns.seconds, warmup_steps=ns.warmup_steps, threads=ns.threads,
                            samples=ns.samples,
                            sync_models=split(ns.sync_models))


def cmd_throughput(ns) -> int:
    c = config_from_args(ns)
    doc = run(c)
    with safe_write.cli_output("bench throughput"):  # a full disk, a read-only folder: one line
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        safe_write.write_json(ns.out, doc, indent=1)
    print(f"wrote {ns.out}")
    print(table(doc))
    return 0
