"""What cuDNN's timing costs a sweep trial, and what it buys, by how many algorithms it tries
(issue 52: each new batch shape cost a GPU process 0.3-0.75 s of timing, results/gpu-2026-11-29-s27/).

torch.backends.cudnn.benchmark_limit caps the algorithms cuDNN's timing tries per convolution and
shape (torch's default 10; 0: every one). Each setting runs in a fresh process (cuDNN keeps its
choices per process), interleaved with the others `--repeats` times. A process trains one
untimed run first (batch 100: CUDA context, cuBLAS, the kernels' first load), then the seed grid's
batch sizes one after the other, as a sweep's GPU worker meets them: one 1-GPU `shmlearn.train`
each, in the process (alexnet-small, Fashion-MNIST, 307,200 samples, lr 0.1, every default).
`heuristics` is --cudnn-benchmark off (no timing at all).

    python benchmarks/cudnn_limit.py --data-dir data/fashion-mnist --out cudnn-limit.json

Per setting and batch size: setup_time_s (the run's entry to its first step, the step's capture
and cuDNN's timing included), wall_time_s (training), samples/s; median and spread over repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BATCHES = (16, 32, 64, 128, 256, 512)
SETTINGS = ("heuristics", "1", "2", "3", "5", "10")


def one(setting: str, data_dir: str, samples: int, out: str, device: str) -> None:
    import torch
    import shmlearn
    if setting != "heuristics":
        torch.backends.cudnn.benchmark_limit = int(setting)  # the step leaves torch's setting alone
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in (100, *BATCHES):
            cfg = shmlearn.TrainConfig(
                model="alexnet-small", dataset="fashion-mnist", data_dir=data_dir, device=device, workers=1,
                batch_size=batch, lr=0.1, samples=samples if batch != 100 else 25600, eval_points=1,
                cudnn_benchmark="off" if setting == "heuristics" else "on",
                out=os.path.join(tmp, f"b{batch}"), progress=False)
            t0 = time.perf_counter()
            res = shmlearn.train(cfg)
            elapsed = time.perf_counter() - t0
            s = res.summary
            rows.append({"batch": batch, "status": res.status, "elapsed_s": elapsed,
                         "setup_time_s": s.get("setup_time_s"), "wall_time_s": s.get("wall_time_s"),
                         "eval_time_s": s.get("eval_time_s"), "samples_per_s": s.get("samples_per_s"),
                         "limit": torch.backends.cudnn.benchmark_limit,
                         "benchmark": torch.backends.cudnn.benchmark})
    with open(out, "w") as f:
        json.dump(rows, f)


def stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--samples", type=int, default=307_200)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--one-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one(a.one, a.data_dir, a.samples, a.one_out, a.device)
        return 0
    import torch
    settings = a.settings.split(",")
    runs = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            order = settings[r % len(settings):] + settings[:r % len(settings)]  # rotate: no setting always first
            for s in order:
                path = os.path.join(tmp, f"{s}-{r}.json")
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, __file__, "--one", s, "--one-out", path, "--data-dir", a.data_dir,
                                    "--samples", str(a.samples), "--device", a.device, "--out", "-"], capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"{s} repeat {r}: exit {p.returncode}\n{p.stderr[-3000:]}", flush=True)
                    continue
                with open(path) as f:
                    rows = json.load(f)
                runs[s].append({"process_s": time.perf_counter() - t0, "rows": rows})
                print(f"{s:>10} r{r}: " + " ".join(f"b{x['batch']} {x['setup_time_s']:.2f}+{x['wall_time_s']:.2f}"
                                                     for x in rows), flush=True)
    table = {}
    for s, rs in runs.items():
        per = {}
        for b in BATCHES:
            got = [x for r in rs for x in r["rows"] if x["batch"] == b]
            per[str(b)] = {k: stats([x[k] for x in got]) for k in
                           ("setup_time_s", "wall_time_s", "eval_time_s", "samples_per_s", "elapsed_s")}
        per["sum"] = {k: stats([sum(x[k] for x in r["rows"] if x["batch"] != 100) for r in rs])
                      for k in ("setup_time_s", "wall_time_s", "elapsed_s")}
        table[s] = per
    doc = {"benchmark": "cudnn_limit", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
           "samples": a.samples, "repeats": a.repeats, "settings": settings, "table": table, "runs": runs}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\n{'setting':>10} {'setup sum':>10} {'train sum':>10} {'trials sum':>11}  per batch: setup / samples/s")
    for s, per in table.items():
        if per["sum"]["setup_time_s"] is None:
            continue
        print(f"{s:>10} {per['sum']['setup_time_s']['median']:>10.2f} {per['sum']['wall_time_s']['median']:>10.2f} "
              f"{per['sum']['elapsed_s']['median']:>11.2f}  " +
              " ".join(f"{b}:{per[str(b)]['setup_time_s']['median']:.2f}/{per[str(b)]['samples_per_s']['median']:.0f}"
                       for b in BATCHES if per[str(b)]['setup_time_s']))
    return 0


if __name__ == "__main__":
    sys.exit(main())
