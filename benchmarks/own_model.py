"""Your own model against the built-in one: torchvision's ResNet-18, passed to shmlearn.train as a
model (a builder function), against shmlearn's registered resnet18 of the same architecture
(CIFAR stem: 3x3 conv at stride 1, no max-pool), through the same fast step, in one pool worker,
interleaved run by run.

    python benchmarks/own_model.py --device cuda --out results/own_model/h100.json

Issue 16 asks: within 5% of the built-in's samples/s. Each run trains --samples samples on
synthetic-32 (3x32x32, 10 classes; built in, no files), bf16 and channels_last; samples/s is the
run's summary (training seconds only; start-up, capture and evaluation excluded). Median and
spread over --runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from torch import nn  # noqa: E402

from shmlearn.bench.common import environment, stats  # noqa: E402
from shmlearn.config.train_config import TrainConfig  # noqa: E402


def torchvision_resnet18(spec):
    """torchvision's ResNet-18 with the CIFAR stem shmlearn's resnet18 uses for 32x32 images."""
    import torchvision
    m = torchvision.models.resnet18(num_classes=spec.num_outputs)
    m.conv1 = nn.Conv2d(spec.input_shape[0], 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def shmlearn_resnet18(spec):
    """The control: the built-in architecture, passed in as a user's builder (ratio ~1)."""
    from shmlearn.models import build_model
    return build_model("resnet18", spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=204800)
    ap.add_argument("--batch-sizes", default="128,512")
    ap.add_argument("--user", choices=("torchvision", "shmlearn"), default="torchvision",
                    help="the model passed in: torchvision's ResNet-18, or (control) shmlearn's own builder")
    ap.add_argument("--out", default="own_model.json")
    a = ap.parse_args()
    import shmlearn
    from shmlearn.launch.pool import Pool, using

    cuda = a.device == "cuda"
    res = {"environment": environment("nccl" if cuda else "gloo"), "runs": a.runs, "samples": a.samples,
           "user_model": a.user, "command": "python " + " ".join(sys.argv), "rows": []}
    tmp = tempfile.mkdtemp(prefix="own-model-")
    with Pool(1, cuda=cuda) as pool, using(pool):
        for b in [int(x) for x in a.batch_sizes.split(",")]:
            base = dict(model="resnet18", dataset="synthetic-32", workers=1, device=a.device, batch_size=b,
                        samples=a.samples, precision="bf16", channels_last=True, eval_points=1,
                        lr=0.05, progress=False)
            sps = {"builtin": [], "torchvision": []}
            modes = {}
            for r in range(a.runs + 1):  # run 0 of each warms up (imports, autotuning, allocator)
                for name in ("builtin", "torchvision"):
                    cfg = TrainConfig(**base, out=os.path.join(tmp, f"b{b}-{name}-{r}"))
                    user = torchvision_resnet18 if a.user == "torchvision" else shmlearn_resnet18
                    out = shmlearn.train(cfg, model=user if name == "torchvision" else None)
                    modes[name] = out.summary.get("step_mode")
                    if r:
                        sps[name].append(out.summary["samples_per_s"])
            row = {"batch_size": b, "step_mode": modes,
                   "samples_per_s": {k: stats(v) for k, v in sps.items()},
                   "ratio": stats(sps["torchvision"])["median"] / stats(sps["builtin"])["median"]}
            res["rows"].append(row)
            print(f"batch {b}: built-in {row['samples_per_s']['builtin']['median']:.0f}/s, torchvision "
                  f"{row['samples_per_s']['torchvision']['median']:.0f}/s, ratio {row['ratio']:.3f} "
                  f"({modes})", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
