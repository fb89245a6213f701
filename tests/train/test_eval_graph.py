"""The test pass's full batches replayed from a CUDA graph (train/eval_graph.py): on a GPU, every
evaluation's numbers bit for bit those of the eager pass (--deterministic: two runs train the same
bits), for several passes a run and for a model
with batch norm; a forward that cannot be captured in evaluation evaluates eagerly, says so in
summary.json, and gives the same numbers; no graph where the step runs eagerly (the CPU)."""
import json
import subprocess
import sys

import pytest
import torch

RUNS = """
import json, sys
import torch
from torch import nn
import shmlearn
from shmlearn.train import loop

class SyncsInEval(nn.Module):
    '''digits' MLP whose evaluation forward reads a number to the host (cannot be captured).'''
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    def forward(self, x):
        if not self.training and float(x.sum()) != float(x.sum()):
            raise RuntimeError("NaN input")
        return self.net(x)

out, model = sys.argv[1], sys.argv[2]
got = {}
for graph in ("on", "off"):
    if graph == "off":
        loop.for_step = lambda *a, **k: None
    cfg = shmlearn.TrainConfig(model="lenet" if model == "lenet" else "mlp", dataset="digits", device="cuda",
                               workers=1, samples=3200, batch_size=32, eval_batch_size=64, eval_points=3,
                               progress=False, out=f"{out}/{graph}", deterministic=True)
    torch.manual_seed(0)
    res = shmlearn.train(cfg, model=SyncsInEval() if model == "syncs" else None)
    evals = [json.loads(l) for l in open(f"{out}/{graph}/eval.jsonl")]
    losses = [json.loads(l)["loss"] for l in open(f"{out}/{graph}/metrics.jsonl")]
    got[graph] = {"evals": [(e["step"], e["test_loss"], e["test_accuracy"]) for e in evals], "losses": losses,
                  "mode": res.summary["step_mode"], "notes": res.summary["kernel_notes"]}
print(json.dumps(got))
"""


def _runs(tmp_path, model: str) -> dict:
    p = subprocess.run([sys.executable, "-c", RUNS, str(tmp_path), model], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replayed_test_passes_give_the_eager_passes_numbers_bit_for_bit(tmp_path):
    got = _runs(tmp_path, "lenet")
    on, off = got["on"], got["off"]
    assert on["mode"] == off["mode"] == "cuda-graph"
    assert len(on["evals"]) >= 4  # several passes: the later ones replay from their first batch
    assert on["evals"] == off["evals"]
    assert on["losses"] == off["losses"]
    assert not any("evaluation runs eagerly" in n for n in on["notes"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_forward_that_cannot_be_captured_in_evaluation_evaluates_eagerly_and_says_so(tmp_path):
    got = _runs(tmp_path, "syncs")
    on, off = got["on"], got["off"]
    assert on["mode"] == "cuda-graph"  # training captured: the host read is evaluation's only
    assert any("evaluation runs eagerly: its CUDA graph capture failed" in n for n in on["notes"]), on["notes"]
    assert on["evals"] == off["evals"]


def test_no_graph_where_the_step_runs_eagerly(tmp_path, monkeypatch):
    import shmlearn
    from shmlearn.train import eval_graph

    made = []
    monkeypatch.setattr(eval_graph.EvalGraph, "__init__", lambda self, *a, **k: made.append(1))
    res = shmlearn.train(shmlearn.TrainConfig(model="mlp", dataset="digits", device="cpu", workers=1, samples=640,
                                              eval_points=2, eval_batch_size=64, progress=False,
                                              out=str(tmp_path / "cpu")))
    assert res.status == "completed" and made == []
