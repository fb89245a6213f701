"""Check `shmlearn simulate` against the 4-GPU points of issue 9, from committed JSON only.

Measured: `shmlearn bench throughput` on 4x H200 (results/throughput-h200x4.json,
throughput-resnet34-h200x4.json): the fast step (CUDA graph, bf16, channels_last, losses read
every 50 steps) at 1, 2 and 4 GPUs. Compute source: the 1-GPU row of the same run (no
communication at W=1). Network: the alpha-beta fit of a bare NCCL `bench comm`, either the clean
2-GPU run (comm-nccl-h200.json: predicting 4 GPUs from it extrapolates in W) or the 4-GPU run
(comm-nccl-h200x4.json: measured while sweep trials shared the GPUs, so its small-message
latencies are inflated). Writes results/simulate-x4-validation.{json,md}. Each row is
what this command prints:

    shmlearn simulate --comm results/comm-nccl-h200.json \\
        --compute results/throughput-h200x4.json --batch 128 \\
        --measured results/throughput-h200x4.json --check-every 50 [--allreduce-algo tree]

    python benchmarks/x4_validation.py
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RES = os.path.join(os.path.dirname(HERE), "results")
sys.path.insert(0, os.path.dirname(HERE))

from shmlearn.analysis.simulate.main import simulate  # noqa: E402

SOURCES = [("throughput-h200x4.json", 128), ("throughput-h200x4.json", 1024), ("throughput-resnet34-h200x4.json", 128)]
COMMS = [("2-GPU fit (clean)", "comm-nccl-h200.json"), ("4-GPU fit (GPUs shared)", "comm-nccl-h200x4.json")]


def rows(comm: str, fname: str, batch: int, algo: str):
    doc = simulate(comm=os.path.join(RES, comm), compute=os.path.join(RES, fname), batch=batch,
                   measured=[os.path.join(RES, fname)], check_every=50, allreduce_algo=algo,
                   strategies=["allreduce", "ps", "weight-avg"], avg_period=8)
    return [v for v in doc["validation"] if not (algo == "tree" and v["strategy"] == "ps")]


def main() -> int:
    out, lines = [], ["| model | batch | comm fit | all-reduce form | strategy | W | measured ms | predicted ms | error |",
                      "|---|---|---|---|---|---|---|---|---|"]
    for fname, batch in SOURCES:
        for label, comm in COMMS:
            for algo in ("ring", "tree"):
                for v in rows(comm, fname, batch, algo):
                    model = v["name"].split()[0]
                    out.append({"model": model, "batch": batch, "comm": comm, "allreduce_algo": algo,
                                **{k: v[k] for k in ("strategy", "workers", "measured_step_s", "predicted_step_s", "error")}})
                    lines.append(f"| {model} | {batch} | {label} | {algo} | {v['strategy']} | {v['workers']} | "
                                 f"{v['measured_step_s'] * 1e3:.3f} | {v['predicted_step_s'] * 1e3:.3f} | {v['error']:+.1%} |")
    md = "\n".join(lines) + "\n"
    print(md)
    with open(os.path.join(RES, "simulate-x4-validation.json"), "w") as f:
        json.dump({"what": __doc__.split("\n")[0], "rows": out}, f, indent=1)
    with open(os.path.join(RES, "simulate-x4-validation.md"), "w") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
