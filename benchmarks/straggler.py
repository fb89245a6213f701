"""One slow worker: the synchronous parameter server falls to its pace, async-ps keeps going
(issue 17, acceptance 3).

    python benchmarks/straggler.py --device cpu --out results/straggler/cpu.json
    python benchmarks/straggler.py --device cuda --out results/straggler/h100.json

W workers and a dedicated server; the straggler is worker 1, slowed by SHMLEARN_FAULT=slow:1:MS
(guard.Fault: it sleeps MS ms before each gradient's sync), with MS = (k - 1) x the unslowed
step time measured first, so it computes at 1/k of a normal worker's pace. Strategies, each
run with and without the straggler, interleaved, --runs times, each a fresh `shmlearn train`:
  * ps --ps-dedicated (synchronous: every step waits for every worker);
  * async-ps --staleness 0 (the same, bit for bit);
  * async-ps --staleness S for each S in --staleness.
samples/s is the run's summary (training seconds only: start-up and evaluation excluded). Each
async-ps row also gets simulate's prediction of the straggler run (`predict`). The
ideal for an asynchronous server is (W - 1 + 1/k) / W of the unslowed rate (the straggler still
contributes 1/k); a synchronous one gets 1/k. On GPUs every process shares the one GPU through
--backend gloo (a one-GPU machine holds a server and three workers that way).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from shmlearn.bench.common import environment, stats  # noqa: E402


def _train(args, out, fault=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SHMLEARN_FAULT", None)
    if fault:
        env["SHMLEARN_FAULT"] = fault
    cmd = [sys.executable, "-m", "shmlearn", "train", "--no-progress", "--out", out, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"straggler: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def predict(res: dict) -> None:
    """Beside each async-ps row: simulate's replay of the server's rules (async_ps.simulate_protocol)
    with this run's own times: a clean update's seconds as every worker's cycle, plus the injected
    delay for the straggler (rank 1). Prediction against measurement of the histogram and rate."""
    from shmlearn.sync.async_ps import simulate_protocol
    w, b = res["workers"], int(res["common_flags"].split("--batch-size ")[1].split()[0])
    for name, r in res["results"].items():
        if not name.startswith("async-ps S="):
            continue
        s = int(name.split("=")[1])
        cycle = w * b / r["samples_per_s_clean"]["median"]
        steps = sum(sum(h.values()) for h in r["staleness_histogram_straggler"].values()) // w
        t, lags, dropped = simulate_protocol([cycle + res["delay_ms"] / 1000] + [cycle] * (w - 1), 0.0, s, steps)
        r["predicted_straggler"] = {"samples_per_s": steps * w * b / t, "dropped_gradients": dropped,
                                    "staleness_histogram": {str(k): {str(g): n for g, n in sorted(c.items())}
                                                            for k, c in lags.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None, help="default: mlp on cpu, alexnet-small on cuda")
    ap.add_argument("--dataset", default=None, help="default: digits on cpu, fashion-mnist on cuda")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=None, help="default 64 on cpu, 256 on cuda")
    ap.add_argument("--steps", type=int, default=300, help="server updates per run")
    ap.add_argument("--slow", type=float, default=3.0, help="k: the straggler runs at 1/k pace")
    ap.add_argument("--staleness", default="2,4")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="straggler.json")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    model = a.model or ("alexnet-small" if cuda else "mlp")
    dataset = a.dataset or ("fashion-mnist" if cuda else "digits")
    batch = a.batch_size or (256 if cuda else 64)
    w = a.workers
    common = ["--device", a.device, "--model", model, "--dataset", dataset, "--workers", str(w),
              "--batch-size", str(batch), "--samples", str(a.steps * w * batch), "--eval-points", "1",
              "--lr", "0.02", "--lr-schedule", "constant"]
    if a.data_dir:
        common += ["--data-dir", a.data_dir]
    if cuda:
        common += ["--backend", "gloo"]
    else:
        common += ["--threads", "1"]
    configs = {"ps-dedicated": ["--strategy", "ps", "--ps-dedicated"],
               "async-ps S=0": ["--strategy", "async-ps", "--staleness", "0"]}
    for s in a.staleness.split(","):
        configs[f"async-ps S={s}"] = ["--strategy", "async-ps", "--staleness", s]

    env = environment("nccl" if cuda else "gloo")
    env["backend"] = "gloo"
    res = {"environment": env, "command": " ".join([os.path.relpath(sys.argv[0], os.getcwd()), *sys.argv[1:]]),
           "common_flags": " ".join(common), "workers": w, "slow_factor": a.slow, "runs": a.runs,
           "ideal_async_ratio": (w - 1 + 1 / a.slow) / w, "sync_ratio": 1 / a.slow}
    with tempfile.TemporaryDirectory() as tmp:
        # The unslowed step time sets the straggler's delay: (k - 1) steps' worth per gradient.
        probe = [_train(common + configs["ps-dedicated"], os.path.join(tmp, f"probe{i}")) for i in range(2)]
        step_s = min(p["wall_time_s"] / p["steps"] for p in probe)
        delay_ms = max(1, round((a.slow - 1) * step_s * 1000))
        res.update(step_s=step_s, delay_ms=delay_ms, fault=f"slow:1:{delay_ms}")
        rows = {name: {"clean": [], "straggler": [], "accuracy": [], "histogram": None, "gradients": None}
                for name in configs}
        for i in range(a.runs):
            for name, flags in configs.items():
                for kind, fault in (("clean", None), ("straggler", res["fault"])):
                    s = _train(common + flags, os.path.join(tmp, f"{name}-{kind}-{i}".replace(" ", "_")), fault)
                    rows[name][kind].append(s["samples_per_s"])
                    if kind == "straggler":
                        rows[name]["accuracy"].append(s["test_accuracy"])
                        rows[name]["histogram"] = s.get("staleness_histogram")
                        rows[name]["gradients"] = s.get("gradients_per_worker")
                    print(f"{name:14s} {kind:9s} run {i}: {s['samples_per_s']:9.0f} samples/s, "
                          f"accuracy {s['test_accuracy']:.4f}", flush=True)
    out = {}
    for name, r in rows.items():
        clean, slow = stats(r["clean"]), stats(r["straggler"])
        out[name] = {"samples_per_s_clean": clean, "samples_per_s_straggler": slow,
                     "ratio": slow["median"] / clean["median"],
                     "test_accuracy_straggler": stats(r["accuracy"]),
                     "staleness_histogram_straggler": r["histogram"],
                     "gradients_per_worker_straggler": r["gradients"]}
        print(f"{name:14s} clean {clean['median']:9.0f}  straggler {slow['median']:9.0f} samples/s  "
              f"ratio {out[name]['ratio']:.2f}", flush=True)
    res["results"] = out
    predict(res)
    print(f"ideal: async {res['ideal_async_ratio']:.2f}, synchronous {res['sync_ratio']:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
