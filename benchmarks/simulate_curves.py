"""Regenerate the committed `shmlearn simulate` outputs the README quotes (issue 7, item 4):
alexnet-small and resnet34 on an 8-GPU NVLink node and a 100 Gb/s cluster, to 1024 workers,
and the 2-core CPU validation. Each is one `shmlearn simulate` command, printed as it runs;
the inputs are the committed measurements under results/.

    python benchmarks/simulate_curves.py
"""
from __future__ import annotations

import os
import subprocess
import sys

RES = os.path.relpath(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results"))
STRATS = "allreduce,ps,weight-avg,ddp"
NET_100G = ["--net-bw", "11.25", "--net-latency-us", "20", "--net-name", "100 Gb/s cluster"]


def commands():
    for model in ("alexnet-small", "resnet34"):
        compute = ["--compute", f"{RES}/simulate-compute-h200-{model}.json", "--strategies", STRATS]
        yield f"simulate-{model}-nvlink", ["--comm", f"{RES}/comm-nccl-h200.json", *compute,
                                           "--measured", f"{RES}/simulate-measured-h200.json"]
        yield f"simulate-{model}-100g", [*NET_100G, *compute]
    yield "simulate-alexnet-small-cpu", ["--comm", f"{RES}/comm-gloo-cpu.json",
                                         "--comm-after-compute", f"{RES}/comm-gloo-cpu-after-compute.json",
                                         "--compute", f"{RES}/simulate-compute-cpu-alexnet-small.json",
                                         "--slots", "2",
                                         "--strategies", "allreduce,ps,ps-dedicated,weight-avg",
                                         "--measured", f"{RES}/simulate-measured-cpu.json"]


def main() -> int:
    for name, args in commands():
        cmd = [sys.executable, "-m", "shmlearn", "simulate", *args, "--out", os.path.join(RES, name)]
        print("$ shmlearn simulate", " ".join(cmd[4:]),
              flush=True)
        if subprocess.run(cmd).returncode != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
