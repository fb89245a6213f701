"""Hand-made run and sweep directories in the output contract (runs.py, sweep.py): the report
tests draw them in a second, without training anything."""
import json
import math
import os

import pytest
import yaml

from shmlearn.sweeps.sweep import ResultStore, pick_winners


def make_run(path, *, workers=2, batch=32, lr=0.1, status="completed", steps=60, scale=1.0, strategy="ps"):
    """A plausible run: loss falls as exp(-t), accuracy rises; `scale` stretches time. A pruned
    run stops after half its `steps` (sweep --prune), with the loss area so far."""
    os.makedirs(path, exist_ok=True)
    dt = 0.01 * scale
    metrics = [{"step": s, "samples": s * workers * batch, "time_s": s * dt,
                "loss": 2.3 * math.exp(-s / 15) + 0.05,
                "phase_s": {"data": 1e-4, "compute": 2e-3, "gather": 5e-4 * workers, "average": 1e-4 * workers,
                            "update": 3e-4, "broadcast": 4e-4 * workers}} for s in range(10, steps + 1, 10)]
    planned, steps = steps, steps // 2 if status == "pruned" else steps
    if status == "diverged":
        metrics = metrics[:2]
    metrics = [m for m in metrics if m["step"] <= steps]
    evals = [{"step": s, "time_s": s * dt, "samples": s * workers * batch, "test_loss": 2.3 * math.exp(-s / 15),
              "test_accuracy": 0.1 + 0.85 * (1 - math.exp(-s / 20))} for s in range(0, steps + 1, 20)]
    area = sum((b["time_s"] - a["time_s"]) * (a["loss"] + b["loss"]) / 2 for a, b in zip(metrics, metrics[1:]))
    summary = {"status": status, "strategy": strategy, "workers": workers, "batch_size": batch, "lr": lr,
               "model": "mlp", "dataset": "digits", "optimizer": "momentum", "samples_seen": steps * workers * batch,
               "steps": steps, "planned_steps": planned, "wall_time_s": steps * dt, "final_loss": metrics[-1]["loss"],
               "min_loss": min(m["loss"] for m in metrics),
               "loss_area": area if status in ("completed", "pruned") else None, "test_loss": evals[-1]["test_loss"],
               "test_accuracy": evals[-1]["test_accuracy"],
               "best_test_accuracy": max(e["test_accuracy"] for e in evals),
               "samples_per_s": workers * batch / dt, "phase_s": metrics[-1]["phase_s"], "device": "cpu",
               "torch_version": "2.13.0"}
    if status == "diverged":
        summary.update(diverged_step=25, diverged_rank=1)
    with open(os.path.join(path, "config.yaml"), "w") as f:
        yaml.safe_dump({"model": "mlp", "dataset": "digits", "workers": workers, "batch_size": batch, "lr": lr,
                        "strategy": strategy}, f)
    for name, rows in (("metrics.jsonl", metrics), ("eval.jsonl", evals)):
        with open(os.path.join(path, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump(summary, f)
    return summary, evals


@pytest.fixture(name="make_run")
def make_run_fixture():
    return make_run


@pytest.fixture
def fake_sweep(tmp_path):
    """workers 1,2 x batch 16,32 x lr 0.1,0.5; w1 b16 lr0.5 diverged; w1 b32 lr0.5 was
    pruned halfway, its area so far already above w1's best; w2 b16 lr0.1 never got below the
    threshold (its min loss is set to 2.0)."""
    out = tmp_path / "sweep"
    store = ResultStore(str(out / "results.jsonl"))
    os.makedirs(out / "trials")
    ids, rows = [], []
    for w in (1, 2):
        for b in (16, 32):
            for lr in (0.1, 0.5):
                tid = f"w{w}-b{b}-lr{lr}-fake"
                status = {(1, 16, 0.5): "diverged", (1, 32, 0.5): "pruned"}.get((w, b, lr), "completed")
                # the pruned run is slow (scale 10): half its steps already cost more than w1's best run
                s, evals = make_run(out / "trials" / tid, workers=w, batch=b, lr=lr, status=status,
                                    scale=10 if status == "pruned" else (1 + lr) * 32 / b / w)
                if (w, b, lr) == (2, 16, 0.1):
                    s["min_loss"] = 2.0
                rows.append({"id": tid, "status": status, "summary": s, "run_dir": f"trials/{tid}",
                             "config": {"workers": w, "batch_size": b, "lr": lr, "model": "mlp"},
                             "eval_curve": [[e["time_s"], e["test_accuracy"]] for e in evals]})
                ids.append(tid)
    best_w1 = min(r["summary"]["loss_area"] for r in rows if r["status"] == "completed" and r["config"]["workers"] == 1)
    for r in rows:
        if r["status"] == "pruned":
            assert r["summary"]["loss_area"] > best_w1  # a run is pruned only once it cannot win
            r["pruned"] = {"area_so_far": r["summary"]["loss_area"], "time_s": r["summary"]["wall_time_s"],
                           "bound_area": best_w1}
        store.append(r)
    with open(out / "sweep.json", "w") as f:
        json.dump({"command": ["shmlearn", "sweep", "--workers", "1,2"], "fixed": {"model": "mlp", "dataset": "digits"},
                   "axes": {"workers": [1, 2], "batch_size": [16, 32], "lr": [0.1, 0.5]},
                   "axis_order": ["workers", "batch_size", "lr"], "threshold": 1.8, "target_accuracy": 0.9,
                   "parallel": 2, "device": "cpu", "trials": ids}, f)
    return out


@pytest.fixture
def fake_runs(tmp_path):
    a, b = tmp_path / "run-a", tmp_path / "run-b"
    make_run(a, workers=1, batch=64, lr=0.5, strategy="allreduce")
    make_run(b, workers=4, batch=16, lr=0.1, scale=0.5)
    return a, b
