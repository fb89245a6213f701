"""Where a warm sweep trial's overhead goes (issue 52: "a trial that reuses a warm pool costs no more
than 50 ms beyond its training and evaluation"; on GPUs it was 55-75 ms, results/gpu-2026-11-29-s27/).

One process trains the same 1-worker run `--runs` times with `shmlearn.train` (the one-worker path
trains in the calling process, as a pool worker trains a trial: run_worker > run_rank), the
first `--warm` untimed: shapes, cuDNN's timing and the kernels are then warm, as in a pool that
has run a trial of this batch size. The rest run under cProfile; the script prints the unprofiled
runs' overhead (the call's wall time - training - evaluation) and the profile's largest entries, and
writes both as JSON.

    python benchmarks/trial_profile.py --device cuda --data-dir data/fashion-mnist --out trial-profile.json
    python benchmarks/trial_profile.py --device cpu --dataset digits --model mlp --data-dir "" \
        --batch-size 32 --samples 8192 --eval-points 3 --published --out trial-profile-cpu.json

--published writes each run's files as a sweep's trial does (record/runs.py `published`: no fsync,
which the sweep does before it publishes the folder). Not a sweep trial's whole path: train() here
also takes the folder's lock and builds and leaves a one-rank group, which a pool's trial does not
(phased.py in results/trial-overhead-cpu-2026-11-29/runs.tar.gz times a real sweep's workers).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


PHASES = ("shmlearn.train.entry:train", "shmlearn.train.rank:run_rank", "shmlearn.train.loop:Loop.__init__",
          "shmlearn.step.fast:Stepper.__init__", "shmlearn.step.kernels:KernelChoice.__init__",
          "shmlearn.step.fast:Stepper._setup_fast", "shmlearn.step.fast:Stepper._capture_all_ranks",
          "shmlearn.step.graphs:Graphs._capture", "shmlearn.step.graphs:Graphs.graph_of",
          "shmlearn.step.graphs:Graphs._replay_s", "torch.cuda.graphs:graph.__exit__",
          "torch.cuda.graphs:CUDAGraph.instantiate", "shmlearn.step.graph_memsets:memsets_to_kernels",
          "shmlearn.train.loop:Loop._evaluate", "shmlearn.train.loop:Loop._finish",
          "shmlearn.record.runs:RunDir.__init__", "shmlearn.record.runs:write_results",
          "shmlearn.record.runs:RunDir.write_trace", "shmlearn.record.runs:summarize")
"""Functions whose wall time each run adds up (--phases): module:qualified name."""


def time_phases(names, totals):
    """Wrap each function in `names` so that its calls' wall time adds into totals[name]
    (nested calls of one function count once)."""
    import functools
    import importlib
    for name in names:
        mod_name, qual = name.split(":")
        try:
            owner = importlib.import_module(mod_name)
            *path, attr = qual.split(".")
            for part in path:
                owner = getattr(owner, part)
            fn = getattr(owner, attr)
        except (ImportError, AttributeError) as e:
            print(f"phase {name}: not found ({e})", flush=True)
            continue
        depth = [0]

        def wrapped(*args, __fn=fn, __name=name, __depth=depth, **kwargs):
            __depth[0] += 1
            t0 = time.perf_counter()
            try:
                return __fn(*args, **kwargs)
            finally:
                __depth[0] -= 1
                if __depth[0] == 0:
                    totals[__name] += time.perf_counter() - t0
        functools.update_wrapper(wrapped, fn)
        setattr(owner, attr, wrapped)
        if isinstance(owner, type(sys)):  # a module-level function: also where it was imported by name
            for m in list(sys.modules.values()):
                if m is not None and m is not owner and getattr(m, attr, None) is fn:
                    setattr(m, attr, wrapped)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--model", default="alexnet-small")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--samples", type=int, default=12_800)
    ap.add_argument("--eval-points", type=int, default=5)
    ap.add_argument("--warm", type=int, default=3, help="untimed runs first")
    ap.add_argument("--plain", type=int, default=8, help="then timed runs without the profiler")
    ap.add_argument("--profiled", type=int, default=8, help="then runs under cProfile")
    ap.add_argument("--published", action="store_true", help="write the files as a sweep trial does (no fsync)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch
    import shmlearn
    import shmlearn.train.entry  # noqa: F401 - what the phases name, imported before they are wrapped
    import shmlearn.train.rank  # noqa: F401
    import shmlearn.step.fast  # noqa: F401
    import shmlearn.step.graph_memsets  # noqa: F401
    from shmlearn.record.runs import published
    totals = defaultdict(float)
    time_phases(PHASES, totals)
    phases = []
    prof = cProfile.Profile()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.warm + a.plain + a.profiled):
            cfg = shmlearn.TrainConfig(model=a.model, dataset=a.dataset, data_dir=a.data_dir, device=a.device,
                                       workers=1, batch_size=a.batch_size, lr=0.05, samples=a.samples,
                                       eval_points=a.eval_points, out=os.path.join(tmp, f"r{i}"), progress=False)
            timed, profiled = i >= a.warm, i >= a.warm + a.plain
            if profiled:
                prof.enable()
            totals.clear()
            t0 = time.perf_counter()
            with published() if a.published else contextlib.nullcontext():
                res = shmlearn.train(cfg)
            elapsed = time.perf_counter() - t0
            if profiled:
                prof.disable()
            if timed and not profiled:
                phases.append(dict(totals))
            s = res.summary
            over = elapsed - (s.get("wall_time_s") or 0) - (s.get("eval_time_s") or 0) - (s.get("checkpoint_time_s") or 0)
            rows.append({"run": i, "timed": timed, "profiled": profiled, "status": res.status, "elapsed_s": elapsed, "overhead_s": over,
                         "setup_time_s": s.get("setup_time_s"), "wall_time_s": s.get("wall_time_s"),
                         "eval_time_s": s.get("eval_time_s")})
            print(f"run {i:>2}{' (profiled)' if profiled else ''}: {elapsed:.3f} s, overhead {over * 1e3:.1f} ms, "
                  f"setup {s.get('setup_time_s', 0) * 1e3:.1f} ms, train {s.get('wall_time_s', 0):.3f} s, "
                  f"eval {s.get('eval_time_s', 0) * 1e3:.1f} ms", flush=True)
    n = sum(r["profiled"] for r in rows)
    text = {}
    for order, count in (("cumulative", 70), ("tottime", 40)) if n else ():
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(order).print_stats(count)
        text[order] = buf.getvalue()
        print(f"\n== by {order} (over {n} profiled runs; cProfile slows Python-heavy code)\n{buf.getvalue()}")
    over = [r["overhead_s"] for r in rows if r["timed"] and not r["profiled"]]
    phase_ms = {k: statistics.median([p.get(k, 0.0) for p in phases]) * 1e3 for k in PHASES} if phases else {}
    print("\n== median ms per unprofiled run, by function (nested calls of one counted once)")
    for k, v in phase_ms.items():
        print(f"{v:>9.2f}  {k}")
    doc = {"benchmark": "trial_profile", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(a),
           "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "python": sys.version.split()[0], "n_plain": len(over), "n_profiled": n,
           "overhead_s": {"median": statistics.median(over), "min": min(over), "max": max(over)} if over else None,
           "rows": rows, "phase_ms": phase_ms, "profile": text}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
