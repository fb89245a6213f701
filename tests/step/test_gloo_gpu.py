"""Ranks on GPUs that talk over Gloo (--backend gloo: two ranks sharing one GPU) run the fast step
eagerly without trying to capture it: Gloo's collectives run on the host, outside a CUDA graph
(step/graphs.py collectives_why_not). The capture used to be tried, fail, and print a line that
read like an error ("CUDA graph capture failed ... running eagerly")."""
import json
import os
import subprocess
import sys

import pytest
import torch

from shmlearn.step import graphs

ENV = dict({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
           PYTHONPATH=os.pathsep.join(sys.path))


class _Strategy:
    group = None

    def __init__(self, world_size):
        self.world_size = world_size


@pytest.mark.parametrize("world, backend, why", [(1, "gloo", False), (2, "nccl", False), (2, "gloo", True)])
def test_only_gloo_between_ranks_keeps_the_step_out_of_a_graph(monkeypatch, world, backend, why):
    monkeypatch.setattr(graphs.dist, "get_backend", lambda group=None: backend)
    got = graphs.collectives_why_not(_Strategy(world))
    assert (got is not None) == why and (got is None or "Gloo" in got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["allreduce", "ps", "weight-avg"])
def test_two_ranks_sharing_a_gpu_over_gloo_run_eagerly_and_say_why(tmp_path, strategy):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "shmlearn", "train", "--device", "cuda", "--workers", "2",
                        "--backend", "gloo", "--dataset", "digits", "--model", "mlp", "--strategy", strategy,
                        "--samples", "4096", "--eval-points", "1", "--no-progress", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(ENV, CUDA_VISIBLE_DEVICES="0"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "capture failed" not in r.stdout + r.stderr, r.stdout + r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["step_mode"] == "fast-eager" and "over Gloo" in (s["step_note"] or ""), s["step_note"]
    assert s["collectives"] == "gloo" and s["test_accuracy"] > 0.8
