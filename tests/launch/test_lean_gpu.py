"""launch/lean.py on GPUs (issue 52, warm start): the program's pools of GPU workers that compile
nothing (a `train` of 2+ GPUs, a sweep, an experiment) fork from a forkserver that imported torch
alone, their workers never import torch._dynamo before their first job, and every strategy trains
as a user's script's run (full pool, Dynamo imported) does. Needs a GPU (with one, the two ranks
share it over Gloo); skipped elsewhere."""
import json
import os
import subprocess
import sys

import pytest
import torch
from pool_runs import POOL_RUN

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TWO = torch.cuda.is_available() and torch.cuda.device_count() >= 2
ENV = dict({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SHMLEARN_FORKSERVER")},
           PYTHONPATH=os.pathsep.join(sys.path), CUDA_VISIBLE_DEVICES="0,1" if TWO else "0")
SHARED = [] if TWO else ["--backend", "gloo"]
"""On one GPU, both ranks on it: NCCL refuses that, Gloo shares it."""


def _run(program: bool, out: str, extra: list, full: bool = False) -> str:
    argv = ["train", "--device", "cuda", "--workers", "2", "--dataset", "digits", "--model", "mlp", "--samples",
            "8192", "--eval-points", "1", "--no-progress", "--out", out, *extra, *SHARED]
    return POOL_RUN.format(program=program, full=full, argv=argv, out=out)


def _py(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("extra", [[], ["--strategy", "ps"], ["--strategy", "weight-avg"], ["--strategy", "ddp"],
                                   ["--optimizer", "adam", "--lr", "0.003"]], ids=lambda e: "-".join(e) or "default")
def test_the_programs_gpu_pool_run_is_lean_and_trains_as_a_scripts(tmp_path, extra):
    lean = _py(_run(True, str(tmp_path / "lean"), extra))
    full = _py(_run(False, str(tmp_path / "full"), extra, full=True))
    assert lean["rc"] == full["rc"] == 0
    assert lean["workers"] == [["forkserver", False], ["forkserver", False]], lean["workers"]
    assert all(d for _, d in full["workers"]), full["workers"]
    assert lean["strategy"] == full["strategy"]
    # GPU kernels may pick other algorithms from one process to the next: a tolerance, not bits
    assert lean["final_loss"] == pytest.approx(full["final_loss"], rel=1e-3, abs=1e-5)
    assert abs(lean["test_accuracy"] - full["test_accuracy"]) <= 0.02


def test_the_programs_gpu_sweep_is_lean(tmp_path):
    out = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "-m", "shmlearn", "sweep", "--device", "cuda", "--dataset", "digits",
                        "--model", "mlp", "--workers", "1,2" if TWO else "1", "--batch-size", "32", "--lr", "0.1", "--samples",
                        "4096", "--eval-points", "1", "--no-report", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    timing = json.loads((out / "timing.json").read_text())
    assert timing["startup"] and all(s["start"] == "forkserver" and not s["dynamo"] for s in timing["startup"])
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == (2 if TWO else 1) and all(r["summary"]["test_accuracy"] > 0.8 for r in rows)
