"""The GPU evidence of issue 5 in one command: each part in its own process with its own time
limit (a part that fails or hangs costs only itself), JSON and logs into one folder, a summary
printed last.

    PYTHONPATH=. python benchmarks/throughput_suite.py --out $OUT --workers 1,2 --data-dir data/fashion-mnist

Parts: env (nvidia-smi, torch), profile (benchmarks/throughput_profile.py), throughput (`shmlearn
bench throughput`, bf16 + channels_last, plain/plain-fp32/DDP/local baselines, resnet34 sync),
tta (benchmarks/fashion_tta.py), train (a short `shmlearn train` on the GPU: the loop itself).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def part(name, cmd, out, limit):
    """Run one part; its output goes to OUT/NAME.txt (few files: the device tool returns 8)."""
    t0 = time.time()
    log = os.path.join(out, f"{name}.txt")
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"== {name}: rc={rc} in {time.time() - t0:.0f} s (limit {limit} s)", flush=True)
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--data-dir", default="data/fashion-mnist")
    p.add_argument("--parts", default="env,profile,throughput,tta,train")
    p.add_argument("--tta-recipes", default="fast,long")
    p.add_argument("--limits", default="15,45,150,140,40", help="seconds per part, in --parts order")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    py = sys.executable
    limits = dict(zip(a.parts.split(","), (int(v) for v in a.limits.split(","))))
    cmds = {
        "env": ["bash", "-c", "nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch; print(torch.__version__, "
                              "torch.version.cuda, torch.cuda.device_count(), torch.cuda.nccl.version())'"],
        "profile": [py, os.path.join(HERE, "throughput_profile.py"), "--batch-sizes", "128,1024", "--precision",
                    "bf16", "--channels-last", "--out", os.path.join(a.out, "profile.json")],
        "throughput": [py, "-m", "shmlearn", "bench", "throughput", "--device", "cuda", "--model", "alexnet-small",
                       "--workers", a.workers, "--batch-sizes", "128,1024",
                       "--strategies", "allreduce,ps,weight-avg,allreduce:eager",
                       "--baselines", "plain,plain-fp32,ddp,local", "--avg-period", "8", "--precision", "bf16",
                       "--channels-last", "--repeats", "5", "--seconds", "0.2", "--sync-models", "resnet34",
                       "--out", os.path.join(a.out, "throughput.json")],
        "tta": [py, os.path.join(HERE, "fashion_tta.py"), "--data-dir", a.data_dir, "--device", "cuda",
                "--workers", a.workers, "--recipes", a.tta_recipes, "--seeds", "5",
                "--out", os.path.join(a.out, "tta.json")],
        "train": [py, "-m", "shmlearn", "train", "--device", "cuda", "--dataset", "synthetic", "--model",
                  "alexnet-small", "--workers", "1", "--batch-size", "128", "--epochs", "3", "--precision", "bf16",
                  "--channels-last", "--augment", "flip,translate:2", "--checkpoint-every", "100",
                  "--no-progress", "--out", "/tmp/shmlearn-train-run"],
    }
    for name in a.parts.split(","):
        part(name, cmds[name], a.out, limits.get(name, 60))
        if name == "train" and os.path.exists("/tmp/shmlearn-train-run/summary.json"):
            with open(os.path.join(a.out, "train.txt"), "a") as f:  # no extra file: 8 come back
                f.write("\nsummary.json:\n" + open("/tmp/shmlearn-train-run/summary.json").read())
    # the tables, last
    for name in ("env", "profile", "throughput", "tta", "train"):
        log = os.path.join(a.out, f"{name}.txt")
        if os.path.exists(log):
            text = open(log).read().splitlines()
            print(f"---- {name} (last lines of {name}.txt)")
            print("\n".join(text[-(12 if name == "env" else 34):]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
