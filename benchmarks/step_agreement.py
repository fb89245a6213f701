"""Do the fast step's variants train to the same weights? Bit for bit, on the device that runs them.

    PYTHONPATH=. python benchmarks/step_agreement.py --device cuda --model resnet18 --batch 128 \
        --steps 30 --variants allreduce:compile+serial-conv,allreduce:compile+joined-conv,allreduce:compile \
        --out agreement.json

Each variant is `bench throughput`'s shmlearn strategy with modifiers (shmlearn/bench/throughput.py
MODIFIERS), built the same way from the same seed on the same random images (bf16 autocast,
channels_last, SGD with momentum), and trained `--steps` steps through its fast step (on CUDA the
captured CUDA graph, with its eager sampled steps). cuDNN runs deterministically (no autotuning):
the variants then ask cuDNN the same questions, so what is asked apart or on another stream must
give the same bits. The first variant is the reference; each other's weights are compared to it,
bit for bit and by the largest difference, with its loss history. A race (a gradient read before
the GEMM that writes it has finished, a buffer reused while a side stream reads it) shows as
weights that differ.

Why a script and not a test: what it checks (CUDA streams inside a CUDA graph, Inductor's code on
the GPU) needs a GPU; tests/nn/test_conv_overlap.py checks the same maths on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shmlearn.bench.common import environment  # noqa: E402
from shmlearn.bench.throughput import ThroughputConfig, _build  # noqa: E402


def train(c: ThroughputConfig, variant: str, device, batch: int, steps: int):
    """(final flat weights on the host, loss per step, step mode, note) of `steps` steps."""
    runner = _build(c, variant, device, batch, 0, 1)
    losses: List[float] = []
    st = runner.stepper
    for step in range(steps):
        st.run(step)
        if st.due(step + 1) or step == steps - 1:
            win = st.read(step + 1)
            losses += win.losses
            if win.bad is not None:
                raise SystemExit(f"step_agreement: {variant}: non-finite loss at step {win.bad[0]}")
            st.update()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    weights = runner.strategy.params_flat.detach().float().cpu().clone()
    row = dict(mode=runner.mode, note=runner.note, conv_overlaps=st.conv_overlaps, deferred=st.deferred,
               update_in_backward=st.early_update, compiled=st.compiled, memsets_replaced=st.memsets_replaced)
    runner.close()
    return weights, losses, row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--input-shape", default="3x32x32")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--variants", default="allreduce:compile+serial-conv,allreduce:compile+joined-conv,"
                                          "allreduce:compile")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    shape = [int(v) for v in a.input_shape.split("x")]
    c = ThroughputConfig(model=a.model, input_shape=shape, device=a.device, batch_sizes=[a.batch],
                         precision="bf16" if device.type == "cuda" else "fp32", channels_last=True,
                         check_every=10, samples=a.batch * a.steps)
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True  # the Stepper then leaves cuDNN's autotuning off
    try:
        rows = _compare(c, a, device)
    finally:
        torch.backends.cudnn.deterministic = before
    out = dict(environment("nccl" if device.type == "cuda" else "gloo"), model=a.model, batch=a.batch,
               steps=a.steps, input_shape=shape, precision=c.precision, channels_last=True,
               cudnn_deterministic=True, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if all(r["equal_bits"] for r in rows) else 1


def _compare(c: ThroughputConfig, a, device) -> List[dict]:
    """One row per variant: its run against the first variant's."""
    rows, ref = [], None
    for v in a.variants.split(","):
        w, losses, row = train(c, v, device, a.batch, a.steps)
        if ref is None:
            ref = (v, w, losses)
        row.update(variant=v, reference=ref[0], losses=losses, final_loss=losses[-1],
                   equal_bits=bool(torch.equal(w, ref[1])), max_abs_diff=float((w - ref[1]).abs().max()),
                   losses_equal=losses == ref[2])
        rows.append(row)
        print(f"{v:45s} {row['mode']:11s} overlaps={row['conv_overlaps']:2d} deferred={row['deferred']!s:5s} "
              f"early={row['update_in_backward']!s:5s} memsets->kernels={row['memsets_replaced']:2d} "
              f"equal_bits={row['equal_bits']!s:5s} max|dw|={row['max_abs_diff']:.3g} loss={losses[-1]:.5f}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
